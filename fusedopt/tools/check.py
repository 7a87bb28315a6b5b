"""Self-check: every backend on every device of this machine against the float64 reference.

    python -m fusedopt check                  # all devices, all backends that can run, then speed
    python -m fusedopt check --quick          # a reduced case set
    python -m fusedopt check --backend cuda --device cuda:0 --no-speed

For every device (the CPU and each CUDA device), every backend that can run there, LAMB and LARS,
it steps a ``FusedLAMB`` / ``FusedLARS`` for a few steps on a set of params and compares the result
with :mod:`fusedopt.reference` (docs/math.md in float64, one tensor at a time) fed the
same initial values and gradients. Every case has two param groups (the second with
``weight_decay=0, adapt=False``), a 0-size tensor, a 1-element tensor, odd sizes, tensors of
several dimensions, a tensor spanning several chunks of every fused backend, a zero weight (the
zero-norm rule) and a zero gradient. The option cases vary each option of the math; the
low-precision storage cases (bf16 and fp16 params, with and without fp32 master weights, fp32
params with bf16 grads and bf16 params with fp32 grads) run the default options and a mix of them.
The cases, the rules below and their tolerances are :mod:`fusedopt.testing`'s, which the test suite
runs too (its "full" set, on the eager and C++ backends: tests/test_parity.py).

Triton on CPU tensors runs only under its interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported), which executes every operation of every program in Python, about a millisecond
each: there it runs a reduced set (small tensors, fewer cases and steps).

A short speed table per device follows (``--no-speed`` skips it): ms per ``step()`` and GB/s by
the bytes model of :mod:`fusedopt.tools.bench` for the fusedopt backends checked there, beside
torch's ``AdamW`` (fused where the device supports it, else foreach) and apex's ``FusedLAMB`` when
apex imports, with the in-place bandwidth of ``a.add_(c, alpha=s)`` measured in the same rounds.

The exit status is 0 when every row passed and 1 otherwise (a failed row, a backend that raised,
or a ``--backend`` that could run on none of the devices).

The rules of the ``rule`` column are :data:`fusedopt.testing.RULES` (``--help`` prints them).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

import fusedopt
from fusedopt import backends as _backends
from fusedopt import testing
from fusedopt.testing import one_line as _one_line

# --------------------------------------------------------------------------------- the cases
# The cases, the rules and their tolerances are fusedopt.testing's (what the test suite runs):
# its case sets "full", "quick" and "interpreted", judged by testing.run_case.


def case_set(device: torch.device, backend: str, quick: bool) -> testing.CaseSet:
    if backend == "triton" and device.type == "cpu":
        return testing.CASE_SETS["interpreted"]
    return testing.CASE_SETS["quick" if quick else "full"]


@dataclass
class Report:
    rows: list[testing.CaseResult] = field(default_factory=list)
    # (device, backend, why) of the backends that did not run on a device
    not_checked: list[tuple[str, str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # failures that are not rows

    @property
    def failures(self) -> list[testing.CaseResult]:
        return [r for r in self.rows if r.failed]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems


# ------------------------------------------------------------------------------- the report

COLUMNS = (("device", 7), ("backend", 7), ("opt", 4), ("dtype", 21), ("case", 19),
           ("result", 6), ("error", 9), ("tolerance", 9), ("rule", 8))


def _format(values) -> str:
    cells = []
    for (_, width), v in zip(COLUMNS, values):
        cells.append(f"{v:>{width}s}" if width == 9 else f"{v:<{width}s}")
    return "  ".join(cells).rstrip()


def format_row(r: testing.CaseResult) -> str:
    num = (lambda x: "" if x is None else ("inf" if math.isinf(x) and x > 0 else f"{x:.2e}"))
    line = _format((r.device, r.backend, r.kind.upper(), r.dtype, r.case, r.status, num(r.error),
                    num(r.tolerance), r.rule))
    if r.status in ("ERROR", "skip") or (r.failed and r.detail):
        line += f"  {r.detail}"
    return line


def _header() -> str:
    return _format(name for name, _ in COLUMNS)


# ------------------------------------------------------------------------------- devices

def machine_devices() -> list[torch.device]:
    """The CPU and every CUDA device."""
    cuda = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] + cuda


def parse_devices(names: Iterable[str]) -> list[torch.device]:
    """``cpu``, ``cuda`` (every CUDA device) or ``cuda:N``; raises ValueError for others."""
    out: list[torch.device] = []
    for name in names:
        if name == "cuda":
            if torch.cuda.device_count() == 0:
                raise ValueError(f"--device cuda: no CUDA device is available (torch "
                                 f"{torch.__version__}, torch.version.cuda={torch.version.cuda})")
            out += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
            continue
        if name != "cpu" and not re.fullmatch(r"cuda:\d+", name):
            raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N")
        dev = torch.device(name)
        if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
        out.append(dev)
    return list(dict.fromkeys(out))


def _why_not(name: str, device: torch.device) -> str | None:
    be = _backends.get_backend(name)
    if be is None:
        return f"not available in this process: {_backends.load_error(name)}"
    return be.unavailable_reason(device, torch.float32, torch.float32)


@contextlib.contextmanager
def _substituted(objects: Mapping[str, _backends.Backend] | None):
    """While active, ``backend=name`` resolves to ``objects[name]`` (see ``run``)."""
    saved = {name: _backends.set_backend(name, be) for name, be in (objects or {}).items()}
    try:
        yield
    finally:
        for name, be in saved.items():
            _backends.set_backend(name, be)


@contextlib.contextmanager
def _quiet_interpreter(device: torch.device, backend: str):
    """Triton's interpreter evaluates masked-off lanes too (0/0 for a 0-size tensor's trust
    ratio), which numpy reports as RuntimeWarnings about values that are then discarded."""
    with warnings.catch_warnings():
        if backend == "triton" and device.type == "cpu":
            warnings.filterwarnings("ignore", r"(invalid value|divide by zero|overflow)",
                                    RuntimeWarning)
        yield


# ------------------------------------------------------------------------------------ run

def run(devices: Iterable[str | torch.device] | None = None, backends: Iterable[str] | None = None,
        *, quick: bool = False, speed: bool = True, out=None,
        backend_objects: Mapping[str, _backends.Backend] | None = None,
        speed_shapes=None, speed_rounds: int | None = None) -> Report:
    """Runs the check and prints its tables to ``out`` (default: stdout); returns the report.

    ``devices``: default every device of the machine. ``backends``: names to check (default all
    registered ones that can run). ``backend_objects`` (for testing the check itself): backend
    objects that ``backend=name`` resolves to during the run instead of the registered ones, e.g.
    one that corrupts a result, which the check must then report as failed.
    ``speed_shapes`` / ``speed_rounds``: the speed tables' param shapes and rounds (defaults per
    device type, see ``speed_table``).
    """
    out = out or sys.stdout

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    devs = parse_devices(map(str, devices)) if devices is not None else machine_devices()
    requested = list(dict.fromkeys(backends)) if backends is not None else None
    names = requested or list(_backends._REGISTRY)
    report = Report()
    t0 = time.perf_counter()
    with _substituted(backend_objects):
        plan: list[tuple[torch.device, str]] = []
        for dev in devs:
            for name in names:
                why = _why_not(name, dev)
                if why is None:
                    plan.append((dev, name))
                else:
                    report.not_checked.append((str(dev), name, why))
        for name in requested or []:
            if not any(n == name for _, n in plan):
                report.problems.append(f"--backend {name} could run on none of the devices "
                                       f"({', '.join(map(str, devs))})")
        say(f"fusedopt {fusedopt.__version__} self-check: torch {torch.__version__}, devices "
            f"{', '.join(map(str, devs))}")
        say("each case: two param groups (the second with weight_decay=0, adapt=False), a 0-size "
            "tensor, 1 element, odd sizes,")
        say("a multi-chunk tensor, a zero weight and a zero gradient, stepped several times and "
            "compared with")
        say("the float64 reference (fusedopt/reference.py); the rules: python -m fusedopt check "
            "--help")
        for line in _not_checked_lines(report.not_checked, plan):
            say(line)
        for dev, name in plan:
            note = case_set(dev, name, quick).note
            if note:
                say(f"note: {note}{_interpreter_chunks() if name == 'triton' else ''}")
        if any(name == "triton" and dev.type == "cuda" for dev, name in plan):
            say("note: triton compiles each kernel specialization (flags, dtypes) on its first use "
                "and keeps it in Triton's cache, so a first run takes longer")
        say()
        say(_header())
        cache = testing.RunCache()  # inputs, references and eager runs, shared by the rows
        for dev, name in plan:
            cases = case_set(dev, name, quick)
            for case, dtype in cases.pairs:
                with _quiet_interpreter(dev, name):
                    row = testing.run_case(case, name, dev, dtype, cases, cache)
                report.rows.append(row)
                say(format_row(row))
        say()
        summary = {}
        for r in report.rows:
            s = summary.setdefault((r.device, r.backend),
                                   {"pass": 0, "FAIL": 0, "ERROR": 0, "skip": 0})
            s[r.status] += 1
        for (dev, name), s in summary.items():
            say(f"{dev} {name}: {s['pass']} passed, {s['FAIL']} failed, {s['ERROR']} errors"
                + (f", {s['skip']} skipped (dtypes it or this torch does not take)" if s["skip"] else ""))
        for p in report.problems:
            say(f"problem: {p}")
        say(f"correctness: {'PASS' if report.ok else 'FAIL'} ({len(report.rows)} rows, "
            f"{time.perf_counter() - t0:.1f} s)")
        say(COVERAGE)
        if speed:
            for dev in devs:
                names_here = [n for d, n in plan if d == dev]
                timed = [n for n in names_here if not (n == "triton" and dev.type == "cpu")]
                say()
                if len(timed) < len(names_here):
                    say(f"speed on {dev}: triton is not timed (Triton's interpreter runs there)")
                if not timed:
                    continue
                try:
                    speed_table(dev, timed, shapes=speed_shapes, rounds=speed_rounds, out=out)
                except Exception as e:  # noqa: BLE001 - the speed table never fails the check
                    say(f"speed on {dev}: not measured: {_one_line(e)}")
    return report


# What the rows above prove and what they leave to other checks (printed after them).
COVERAGE = ("covered: every option case and dtype of each backend on each device, several "
            "steps against the float64 reference, tensors of up to a few chunks, aligned; "
            "not covered here: misaligned tensors, tensors over 128 chunks, GradScaler and "
            "found_inf, a tensor lr, low-precision state, CUDA-graph capture, host syncs, "
            "bit-for-bit reruns (scripts/gpu_verify.py runs the GPU tests that cover them)")


def _not_checked_lines(not_checked, plan) -> list[str]:
    """Why backends that run on none of the devices did not: once for a backend that does not
    load, else per device. A backend that runs on some device is not listed for the devices of
    other types that it refuses (cpp on a GPU, cuda on the CPU)."""
    running = {name for _, name in plan}
    lines = []
    for name in dict.fromkeys(n for _, n, _ in not_checked):
        if name in running:
            continue
        if _backends.get_backend(name) is None:
            lines.append(f"not checked: {name}: not available in this process: "
                         f"{_backends.load_error(name)}")
        else:
            lines += [f"not checked: {name} on {dev}: {why}"
                      for dev, n, why in not_checked if n == name]
    return lines


def _interpreter_chunks() -> str:
    """The Triton kernels' chunk size under the interpreter, for the note on its reduced set."""
    try:
        from ..kernels import tables
    except Exception:  # noqa: BLE001 - the note goes without it
        return ""
    return f" (chunks of {tables.CHUNK_SIZE:,} elements there)"


# ------------------------------------------------------------------------------ speed

def _apex_lamb():
    try:
        from apex.optimizers import FusedLAMB
    except Exception:  # noqa: BLE001 - apex missing or built against another torch
        return None
    return FusedLAMB


def _adamw(params, device):
    """torch's AdamW: fused where the device has the fused kernel, else foreach."""
    try:
        return "torch AdamW(fused=True)", torch.optim.AdamW(params, fused=True)
    except (RuntimeError, ValueError):
        return "torch AdamW(foreach=True)", torch.optim.AdamW(params, foreach=True)


def speed_table(device: torch.device, backend_names: list[str], *, shapes=None,
                rounds: int | None = None, out=None) -> None:
    """Times ``step()`` of LAMB and LARS on each backend beside torch's AdamW (and apex's
    FusedLAMB on CUDA when apex imports), interleaved with the in-place bandwidth yardstick, and
    prints the table of :func:`fusedopt.tools.bench.print_table` (GB/s by its bytes model).

    Default params: BERT-base (110M elements) on CUDA; on the CPU one BERT-shaped layer of width
    512 with a 2,000-word vocabulary (4.7M elements, 19 MB a list in fp32: larger than the
    caches once the state is counted), so that a row takes a few hundred ms there."""
    from contextlib import redirect_stdout

    from . import bench

    out = out or sys.stdout
    device = torch.device(device)
    if shapes is None:
        shapes = (bench.bert_base_shapes() if device.type == "cuda"
                  else bench.bert_base_shapes(layers=1, vocab=2000, hidden=512, ffn=2048))
    rounds = rounds or (20 if device.type == "cuda" else 5)
    numel = sum(torch.Size(s).numel() for s in shapes)
    params = bench.make_params(shapes, device)
    a, c = torch.randn(numel, device=device), torch.randn(numel, device=device)
    # label -> (bytes model key, step, phase); phase 1: optimizers that allocate param-sized
    # temporaries every step, timed apart from the others (see fusedopt.tools.bench)
    rows: dict[str, tuple] = {bench.YARDSTICK: (12, lambda: a.add_(c, alpha=1e-3), 0)}
    for name in backend_names:
        phase = int(name == "eager")
        rows[f"fusedopt LAMB [{name}]"] = (
            bench.BYTES_PER_ELEMENT["lamb"], fusedopt.FusedLAMB(params, backend=name).step, phase)
        rows[f"fusedopt LARS [{name}]"] = (
            bench.BYTES_PER_ELEMENT["lars"],
            fusedopt.FusedLARS(params, lr=0.1, weight_decay=1e-4, backend=name).step, phase)
    label, adamw = _adamw(params, device)
    rows[label] = (bench.BYTES_PER_ELEMENT["adamw"], adamw.step, 0)
    apex_lamb = _apex_lamb() if device.type == "cuda" else None
    if apex_lamb is not None:
        # the settings under which it computes fusedopt's default LAMB: apex clips by
        # global_norm / max_grad_norm whenever the norm exceeds it, so 0 would divide every grad
        # by inf; inf never clips. Its bytes: a grad-norm pass (4), stage 1 reading g, w, m, v and
        # writing m, v, u (28), the norms of w and u (8), stage 2 reading w, u, writing w (12).
        rows["apex FusedLAMB"] = (52, apex_lamb(params, eps=1e-6, weight_decay=0.01,
                                                max_grad_norm=float("inf"),
                                                use_nvlamb=True).step, 0)
    broken = []
    for k, (_, fn, _) in list(rows.items()):
        try:
            fn()  # one untimed step: a candidate that raises is reported, not timed
        except Exception as e:  # noqa: BLE001
            broken.append(f"{k}: not timed, its step raised {_one_line(e)}")
            del rows[k]
    times: dict[str, list[float]] = {}
    for phase in (0, 1):
        fns = {k: fn for k, (_, fn, ph) in rows.items() if ph == phase}
        if phase == 0 or fns:
            times.update(bench.interleave(fns, device, rounds, warmup=1))
    results = [bench.Result(k, rows[k][0], t) for k, t in times.items()]
    with redirect_stdout(out):
        bench.print_table(f"speed on {device}", len(shapes), numel, results)
        print("GB/s: bytes per element of fusedopt.tools.bench's model (LAMB 40, LARS 28, "
              "AdamW 28) x elements / median step; of bw: that over the in-place bandwidth "
              "(12 B/element)", flush=True)
        for line in broken:
            print(line, flush=True)
        if device.type == "cuda" and apex_lamb is None:
            print("apex FusedLAMB: not timed (apex does not import)", flush=True)


# ------------------------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None, *,
         backend_objects: Mapping[str, _backends.Backend] | None = None) -> int:
    """``python -m fusedopt check``; returns the exit status (0: every row passed).
    ``backend_objects``: as for :func:`run` (for testing the check itself)."""
    ap = argparse.ArgumentParser(prog="python -m fusedopt check",
                                 description=f"{__doc__}\n{testing.RULES}",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a reduced set: fewer shapes, cases, dtypes and steps")
    ap.add_argument("--backend", action="append", choices=list(_backends._REGISTRY),
                    metavar="NAME", help="check only this backend (repeatable): "
                    + ", ".join(_backends._REGISTRY))
    ap.add_argument("--device", action="append", metavar="DEV",
                    help="check only this device (repeatable): cpu, cuda (every CUDA device) "
                         "or cuda:N; default: the CPU and every CUDA device")
    ap.add_argument("--no-speed", action="store_true", help="skip the speed tables")
    ap.add_argument("--json", metavar="PATH",
                    help="also write the rows, the backends not checked and the problems to PATH "
                         "(scripts/gpu_verify.py reads it)")
    args = ap.parse_args(argv)
    try:
        devices = parse_devices(args.device) if args.device else None
    except ValueError as e:
        ap.error(str(e))
    report = run(devices, args.backend, quick=args.quick, speed=not args.no_speed,
                 backend_objects=backend_objects)
    if args.json:
        write_json(report, args.json, quick=args.quick)
    return 0 if report.ok else 1


def report_dict(report: Report, *, quick: bool = False) -> dict:
    """The report as JSON-ready data: every row (device, backend, optimizer, dtype, case, status,
    error, tolerance, rule, detail), the backends not checked with the reason, the problems."""
    return dict(
        mode="quick" if quick else "full", ok=report.ok, torch=torch.__version__,
        fusedopt=fusedopt.__version__,
        rows=[dict(device=r.device, backend=r.backend, kind=r.kind, dtype=r.dtype, case=r.case,
                   status=r.status, error=_json_float(r.error),
                   tolerance=_json_float(r.tolerance), rule=r.rule,
                   detail=r.detail) for r in report.rows],
        not_checked=[dict(device=d, backend=b, reason=why) for d, b, why in report.not_checked],
        problems=list(report.problems))


def _json_float(x):
    """A number as strict JSON holds it (inf and nan as strings)."""
    return x if x is None or math.isfinite(x) else str(x)


def write_json(report: Report, path: str, *, quick: bool = False) -> None:
    import json

    with open(path, "w") as f:
        json.dump(report_dict(report, quick=quick), f, indent=1, allow_nan=False, default=str)


if __name__ == "__main__":
    sys.exit(main())
