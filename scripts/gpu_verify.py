"""One prepared GPU verification run: the GPU tests, the full self-check, the GPU benchmark.

On a machine with an NVIDIA GPU, from the repository root, after the set-up of the README::

    python scripts/gpu_verify.py                       # reports in gpu_verify/
    python scripts/gpu_verify.py --out DIR --slow      # also the tests marked slow (2**31 elements)
    python scripts/gpu_verify.py --build --jobs 4 --skip self-check   # a short lease, as it comes

``--build`` first builds the extensions in place (``setup.py build_ext --inplace``, the CUDA one
for this machine's GPU) with the torch already installed, for a machine that cannot install
anything; ``--jobs N`` runs the GPU tests in N processes (pytest-xdist).

Steps, each in a process of its own with a time limit, in this order:

1. ``environment``: python, torch, CUDA, triton, the devices, and which fusedopt backends load
   (with the reason for each one that does not);
2. ``gpu tests``: ``pytest -m "gpu and not slow"`` over the test files that carry the ``gpu``
   marker (tests/test_triton.py and tests/test_triton_lowp.py compiled for the GPU,
   tests/test_cuda_gpu.py); every failure named by its test id and message, every skip reason
   counted;
3. ``self-check``: ``python -m fusedopt check`` in its full mode (every case set, every backend
   on every device, then the speed table), its rows read from ``--json``; a failed row names
   the device, backend, optimizer, dtype and case;
4. ``benchmark``: ``bench/bench_triton_gpu.py --json`` (triton, cuda and eager step times and
   GB/s beside torch's fused AdamW and a device-to-device copy, in interleaved rounds);
5. ``low-precision benchmark``: ``bench/low_precision.py --device cuda --no-peers`` (fp32, bf16
   and 8-bit state on the BERT-base shapes beside fused AdamW, with each row's host and kernel
   time per step), then the same with ``--resident`` (a set that stays in the GPU's L2: a row
   that takes as long per element there as on BERT-base is bound by latency or instructions,
   not by memory traffic), their tables in the output tail.

It writes ``report.json`` and ``report.md`` into the output folder (default ``gpu_verify/``),
with each step's status (passed, failed, skipped, error, timeout), its reason, its time, its
command and the tail of its output. Without a CUDA device the steps that need one (the GPU tests
and the benchmark) are reported as "skipped: no CUDA device"; the environment and the
self-check run (on the CPU). No step is left out silently: a step that does not run says why.

Exit status: 0 when no step failed (skipped steps included), 1 otherwise; with ``--require-gpu``
a step skipped for want of a device counts as failed.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the steps' process-group runner is the build tests'
from build_cache import run  # noqa: E402
# The files holding tests marked ``gpu`` (pytest -m gpu selects them inside these files).
GPU_TEST_FILES = ["tests/test_triton.py", "tests/test_triton_lowp.py", "tests/test_cuda_gpu.py"]
NO_DEVICE = "no CUDA device"
TAIL_LINES = 60


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment() -> dict:
    """Versions, devices and the backends of this process (importing triton is left to the steps:
    Note [lazy import] in fusedopt/backends/triton_backend.py)."""
    import torch

    sys.path.insert(0, str(ROOT))
    import fusedopt
    from fusedopt import backends

    cuda = torch.cuda.is_available()
    env = dict(python=platform.python_version(), platform=platform.platform(),
               torch=torch.__version__, torch_cuda=torch.version.cuda,
               triton=_version("triton"), fusedopt=fusedopt.__version__, commit=_git_commit(),
               cuda_available=cuda,
               devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
               if cuda else [],
               TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET"))
    loaded = {}
    for name in backends._REGISTRY:
        be = backends.get_backend(name)
        loaded[name] = "loads" if be is not None else f"does not load: {backends.load_error(name)}"
    env["backends"] = loaded
    return env


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, float]:
    """``(returncode or None on timeout, stdout+stderr, seconds)``; a timeout stops the command
    with every process it started (the build's compilers, pytest's xdist workers)."""
    t0 = time.perf_counter()
    try:
        p = run(cmd, timeout, cwd=ROOT, env=env)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        return None, e.stdout + e.stderr, time.perf_counter() - t0


def _without_interpreter() -> dict:
    """This environment without TRITON_INTERPRET: the steps compile the Triton kernels for the
    GPU where there is one (on the CPU, the self-check then leaves triton out and says so)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _step(name: str, **fields) -> dict:
    return dict(name=name, status=fields.pop("status"), reason=fields.pop("reason", ""), **fields)


def _command(cmd: list) -> str:
    """A command (a list of str) or several run one after the other (a list of them) as text."""
    return " && ".join(map(shlex.join, cmd)) if cmd and isinstance(cmd[0], list) else \
        shlex.join(cmd)


def _skipped(name: str, reason: str, command: list) -> dict:
    return _step(name, status="skipped", reason=reason, command=_command(command), seconds=0.0)


def _finished(name: str, cmd: list, rc: int | None, out: str, seconds: float,
              timeout: float, tail_lines: int = TAIL_LINES, **fields) -> dict:
    status = fields.pop("status", "passed" if rc == 0 else "failed")
    reason = fields.pop("reason", "" if rc in (0, None) else f"exit status {rc}")
    if rc is None:
        status, reason = "timeout", f"stopped after {timeout:.0f} s"
    return _step(name, status=status, reason=reason, command=_command(cmd), returncode=rc,
                 seconds=round(seconds, 1), output_tail=_tail(out, tail_lines), **fields)


# ------------------------------------------------------------------------------ the steps
def parse_junit(path: Path) -> dict:
    """Counts, failures (test id and message) and skip reasons (with counts) of a JUnit file."""
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    failures, skips = [], {}
    if not path.exists():
        return dict(counts=counts, failures=failures, skips=skips)
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            tag = "failure" if "failure" in kinds else "error"
            counts["failed" if tag == "failure" else "errors"] += 1
            msg = kinds[tag].get("message") or (kinds[tag].text or "").strip()
            failures.append(dict(test=test_id, kind=tag, message=_tail(msg, 8)))
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reason = kinds["skipped"].get("message") or "no reason given"
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return dict(counts=counts, failures=failures, skips=skips)


def build(cuda: bool, timeout: float) -> dict:
    """``setup.py build_ext --inplace`` for this machine (its GPU's architecture, its cores)."""
    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 1))
    if cuda and "TORCH_CUDA_ARCH_LIST" not in env:
        import torch
        env["TORCH_CUDA_ARCH_LIST"] = "{}.{}".format(*torch.cuda.get_device_capability())
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    rc, out, seconds = _run(cmd, timeout, env)
    errors = ROOT / "fusedopt" / "_build_errors.txt"
    fields = {}
    if rc == 0 and errors.exists():  # setup.py records a failed extension and goes on
        fields = dict(status="failed", reason=errors.read_text().strip().splitlines()[0])
    return _finished("build", cmd, rc, out, seconds, timeout, **fields)


def gpu_tests(out_dir: Path, cuda: bool, slow: bool, timeout: float, jobs: int = 1) -> dict:
    junit = out_dir / "gpu_tests.xml"
    marker = "gpu" if slow else "gpu and not slow"
    workers = ["-n", str(jobs)] if jobs > 1 else ["-p", "no:xdist"]
    cmd = [sys.executable, "-m", "pytest", "-m", marker, *workers, "-q", "-rfEs",
           "-p", "no:cacheprovider", f"--junitxml={junit}", *GPU_TEST_FILES]
    if not cuda:
        return _skipped("gpu tests", NO_DEVICE, cmd)
    rc, out, seconds = _run(cmd, timeout, _without_interpreter())
    parsed = parse_junit(junit)
    c = parsed["counts"]
    extra = {}
    if rc is not None and rc not in (0, 1):  # 2-5: interrupted, internal or usage error
        extra = dict(status="error", reason=f"pytest exit status {rc}")
    elif rc == 0 and c["passed"] == 0:
        extra = dict(status="failed", reason="no GPU test ran (every one skipped or deselected)")
    if not slow:
        extra["note"] = "tests marked slow were deselected (--slow runs them)"
    return _finished("gpu tests", cmd, rc, out, seconds, timeout, **extra,
                     summary=f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
                             f"{c['skipped']} skipped", **parsed)


def self_check(out_dir: Path, extra_args: list[str], timeout: float) -> dict:
    path = out_dir / "check.json"
    cmd = [sys.executable, "-m", "fusedopt", "check", "--json", str(path), *extra_args]
    rc, out, seconds = _run(cmd, timeout, _without_interpreter())
    fields = {}
    if path.exists():
        data = json.loads(path.read_text())
        rows = data["rows"]
        tally = {}
        for r in rows:
            tally[r["status"]] = tally.get(r["status"], 0) + 1
        fields = dict(
            mode=data["mode"],
            summary=f"{data['mode']} mode: "
                    + ", ".join(f"{n} {s}" for s, n in sorted(tally.items()))
                    + f" ({len(rows)} rows)",
            failures=[dict(test=f"{r['device']} {r['backend']} {r['kind']} {r['dtype']} "
                                f"{r['case']}", kind=r["status"],
                           message=r["detail"] or f"error {r['error']} > tolerance "
                                                  f"{r['tolerance']} ({r['rule']})")
                      for r in rows if r["status"] in ("FAIL", "ERROR")],
            skips={f"{r['device']} {r['backend']}: {r['detail']}": 1
                   for r in rows if r["status"] == "skip"},
            not_checked=data["not_checked"], problems=data["problems"])
    elif rc is not None:
        fields = dict(status="error", reason=f"exit status {rc} and no {path.name} written")
    return _finished("self-check", cmd, rc, out, seconds, timeout, **fields)


def benchmark(out_dir: Path, cuda: bool, timeout: float) -> dict:
    path = out_dir / "bench.json"
    cmd = [sys.executable, "bench/bench_triton_gpu.py", "--json", str(path)]
    if not cuda:
        return _skipped("benchmark", NO_DEVICE, cmd)
    rc, out, seconds = _run(cmd, timeout, _without_interpreter())
    fields = {}
    if path.exists():
        data = json.loads(path.read_text())
        fields = dict(results=data.get("results", []), bench_environment=data.get("environment"),
                      summary=f"{len(data.get('results', []))} rows")
    elif rc == 0:
        fields = dict(status="error", reason=f"no {path.name} written")
    return _finished("benchmark", cmd, rc, out, seconds, timeout, **fields)


def lowp_benchmark(cuda: bool, timeout: float) -> dict:
    bert = [sys.executable, "bench/low_precision.py", "--device", "cuda", "--no-peers"]
    cmds = [bert, [*bert, "--resident"]]
    if not cuda:
        return _skipped("low-precision benchmark", NO_DEVICE, cmds)
    rc, outs, seconds = 0, [], 0.0
    for cmd in cmds:  # the resident run after a failed or stopped one too: it may tell why
        one_rc, out, one_seconds = _run(cmd, timeout, _without_interpreter())
        outs.append(f"$ {shlex.join(cmd)}\n{_tail(out)}")
        seconds += one_seconds
        rc = one_rc if rc == 0 else rc
    return _finished("low-precision benchmark", cmds, rc, "\n".join(outs), seconds, timeout,
                     tail_lines=len(cmds) * (TAIL_LINES + 1))


# ------------------------------------------------------------------------------ the report
def markdown(report: dict) -> str:
    env, nan = report["environment"], float("nan")
    lines = ["# fusedopt GPU verification", "",
             f"{report['started']}, {report['seconds']:.0f} s: "
             f"**{'PASS' if report['ok'] else 'FAIL'}**",
             "", "| | |", "|---|---|"]
    for key in ("python", "torch", "torch_cuda", "triton", "fusedopt", "commit", "devices",
                "platform"):
        lines.append(f"| {key} | {env.get(key)} |")
    for name, state in env.get("backends", {}).items():
        lines.append(f"| backend {name} | {state.replace('|', '/')} |")
    lines += ["", "| step | status | time | summary |", "|---|---|---|---|"]
    for s in report["steps"]:
        status = s["status"] + (f": {s['reason']}" if s.get("reason") else "")
        lines.append(f"| {s['name']} | {status.replace('|', '/')} | {s.get('seconds', 0):.0f} s "
                     f"| {s.get('summary', '')} |")
    for s in report["steps"]:
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        if s.get("command"):
            lines += [f"`{s['command']}`", ""]
        if s.get("reason"):
            lines += [f"Reason: {s['reason']}", ""]
        if s.get("note"):
            lines += [f"Note: {s['note']}", ""]
        if s.get("failures"):
            lines += ["", "Failures:", ""]
            lines += [f"- `{f['test']}` ({f['kind']}): "
                      + (f["message"].splitlines() or [""])[0] for f in s["failures"]]
        if s.get("skips"):
            lines += ["", "Skipped, by reason:", ""]
            lines += [f"- {n} x {reason}" for reason, n in s["skips"].items()]
        if s.get("not_checked") or s.get("problems"):
            lines.append("")
        for item in s.get("not_checked", []):
            lines.append(f"- not checked: {item['backend']} on {item['device']}: {item['reason']}")
        for p in s.get("problems", []):
            lines.append(f"- problem: {p}")
        if s.get("results"):
            lines += ["", "| kind | workload | backend | median ms | GB/s |",
                      "|---|---|---|---|---|"]
            lines += [f"| {r.get('kind')} | {r.get('workload')} | {r.get('backend')} | "
                      f"{r.get('ms_median', nan):.3f} | {r.get('gbps', nan):.0f} |"
                      for r in s["results"]]
        if s.get("output_tail"):
            lines += ["", "<details><summary>output (tail)</summary>", "", "```",
                      s["output_tail"], "```", "</details>"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_verify",
                    help="folder of the reports (default %(default)s)")
    ap.add_argument("--slow", action="store_true", help="also the GPU tests marked slow")
    ap.add_argument("--check-args", default="",
                    help="more arguments of `python -m fusedopt check` (default: none, the full "
                         "mode), e.g. \"--quick --no-speed\"")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["gpu tests", "self-check", "benchmark", "low-precision benchmark"],
                    help="leave a step out (reported as skipped: asked to)")
    ap.add_argument("--build", action="store_true",
                    help="first build the extensions in place with the installed torch")
    ap.add_argument("--jobs", type=int, default=1, help="processes for the GPU tests")
    ap.add_argument("--require-gpu", action="store_true",
                    help="count a step skipped for want of a CUDA device as failed")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds each step may run (default %(default)s)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()

    steps = []
    if args.build:  # before the environment step, which loads the backends into this process
        import torch
        print("build ...", flush=True)
        steps.append(build(torch.cuda.is_available(), args.timeout))
        print(f"build: {steps[-1]['status']} {steps[-1]['reason']}", flush=True)
    env = environment()
    cuda = bool(env["cuda_available"])
    print(f"environment: {json.dumps(env)}", flush=True)
    steps.append(_step("environment", status="passed", seconds=0.0, command="(in process)",
                       summary=f"torch {env['torch']}, CUDA devices: {len(env['devices'])}"))
    plan = [("gpu tests", lambda: gpu_tests(out_dir, cuda, args.slow, args.timeout, args.jobs)),
            ("self-check", lambda: self_check(out_dir, shlex.split(args.check_args),
                                              args.timeout)),
            ("benchmark", lambda: benchmark(out_dir, cuda, args.timeout)),
            ("low-precision benchmark", lambda: lowp_benchmark(cuda, args.timeout))]
    for name, run in plan:
        if name in args.skip:
            steps.append(_step(name, status="skipped", reason="asked to (--skip)", command="",
                               seconds=0.0))
        else:
            print(f"{name} ...", flush=True)
            try:
                steps.append(run())
            except Exception as e:  # noqa: BLE001 - a broken step is reported, the others run
                steps.append(_step(name, status="error", reason=f"{type(e).__name__}: {e}",
                                   command="", seconds=0.0))
        s = steps[-1]
        print(f"{name}: {s['status']}" + (f": {s['reason']}" if s["reason"] else "")
              + (f" ({s['summary']})" if s.get("summary") else ""), flush=True)

    def bad(s: dict) -> bool:
        return s["status"] in ("failed", "error", "timeout") or (
            args.require_gpu and s["status"] == "skipped" and s["reason"] == NO_DEVICE)

    report = dict(started=started, seconds=round(time.perf_counter() - t0, 1),
                  command=shlex.join([sys.executable, *sys.argv]), environment=env,
                  ok=not any(bad(s) for s in steps), steps=steps)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "report.md").write_text(markdown(report))
    print(f"{'PASS' if report['ok'] else 'FAIL'}: {out_dir / 'report.md'}, "
          f"{out_dir / 'report.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
