"""The Triton kernels compiled for real GPUs (sm_80 and sm_90), on a host without one.

Triton's compiler needs no GPU, but it must not be in interpreter mode, which the other Triton
tests choose for this process (tests/test_triton.py, tests/conftest.py) before triton is first
imported. So the compiling happens in a process of its own, tests/triton_compile.py, started
without ``TRITON_INTERPRET``; it reports every result as JSON. Nothing here imports triton.

What is compiled is derived from the launcher (Note [derived specializations] in
tests/triton_compile.py): the real step function drives the real Triton backend over every
dtype, master, GradScaler and hyper-parameter input, and its launches are recorded instead of
run. Every specialization those steps launch is compiled, for both architectures (Note
[selection]); ``python tests/triton_compile.py --select all --count`` drives the whole product
of the step inputs instead and finds the same set.

The report of a run that passed is kept in pytest's cache (tests/build_cache.py), keyed by every
input of the helper: its own source, fusedopt's Python sources, the installed triton (which
brings its ptxas and cuobjdump) and torch, the Python version and the TRITON_* environment. A
second run with unchanged inputs reads it instead of compiling (about 90 % of the time is
Triton's compiler and ptxas, the rest the recording); a failed run is never kept.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from build_cache import Cache, Hasher, run

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "tests" / "triton_compile.py"
ARCHS = {80, 90}
# far above the builds' time on a slow machine beside the other test worker (docs/triton_kernels.md,
# "Regenerating", has the times): a limit is a hang detector, not a budget
TIMEOUT_S = 2400

pytestmark = [pytest.mark.build,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed")]


def _describe(r: dict) -> str:
    """A specialization as its kernel, architecture and the arguments that select code."""
    args = ", ".join(f"{k}={v.split(' ')[0]}" for k, v in r["args"].items()
                     if k.isupper() or not v.startswith("fp64"))
    return f"{r['name']} sm_{r['arch']} ({args})"


def _inputs_key(full: bool) -> str:
    """A hash of everything the helper's report depends on."""
    return (Hasher("triton_compile" if full else "triton_compile sample").files("helper", [HELPER])
            .files("fusedopt", (ROOT / "fusedopt").rglob("*.py"))
            .dist("triton").dist("torch").dist("numpy").environment().hexdigest())


@pytest.fixture(scope="module")
def full(request) -> bool:
    """``--full`` (the exhaustive tier): every specialization; else the sample of
    ``triton_compile.in_sample``."""
    return request.config.getoption("--full")


@pytest.fixture(scope="module")
def report(request, tmp_path_factory, full):
    cache = Cache(request.config, "triton_compile")
    key = _inputs_key(full)
    if (entry := cache.lookup(key)) is not None:
        print(f"\ntests/triton_compile.py: report of an earlier run with the same inputs ({entry})")
        return json.loads((entry / "report.json").read_text())
    out = tmp_path_factory.mktemp("triton_compile") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        p = run([sys.executable, str(HELPER), "--json", str(out), *([] if full else ["--sample"])],
                TIMEOUT_S, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"tests/triton_compile.py took over {TIMEOUT_S} s and was stopped with its "
                    f"compiler processes:\n{e.stdout[-4000:]}\n{e.stderr[-8000:]}")
    if not out.exists():
        pytest.fail(f"tests/triton_compile.py failed (exit {p.returncode}):\n"
                    f"{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    # only a run that passed (every build, no spills, full coverage) whose inputs did not change
    # while it ran
    if p.returncode == 0 and _inputs_key(full) == key:
        cache.store(key, lambda d: shutil.copyfile(out, d / "report.json"))
    return json.loads(out.read_text())


def test_the_launcher_reaches_every_kernel_and_flag(report):
    """Every ``*_kernel`` is launched, every bool constexpr both ways, every dtype constexpr with
    several dtypes, every optional tensor both given and None; and ``prepare`` compiles exactly
    the specializations that the step then launches."""
    assert report["summary"]["coverage_problems"] == []


def test_nothing_found_is_left_out(report, full):
    """With ``--full`` the run compiles every specialization the steps launch; without, their
    sample (aligned tables, params and grads of one dtype), which keeps every kernel,
    architecture, state format, master and dtype of the full set."""
    summary = report["summary"]
    assert summary["sample"] is not full
    assert summary["sample_missing"] == []
    assert summary["selected"] == len(report["results"])
    if full:
        assert summary["selected"] == summary["specializations"]
    else:
        assert 0 < summary["selected"] < summary["specializations"]


def test_every_specialization_compiles(report):
    """Failures grouped by kernel and error, each with its architectures and a first example."""
    groups: dict[tuple, list] = {}
    for r in report["results"]:
        if "error" in r:
            lines = r["error"].strip().splitlines()
            groups.setdefault((r["name"], lines[0], lines[-1]), []).append(r)
    failed = [f"{name}: {len(rs)} builds (sm_{', sm_'.join(sorted({str(r['arch']) for r in rs}))})"
              f": {first}\n    {last}\n    e.g. {_describe(rs[0])}"
              for (name, first, last), rs in sorted(groups.items())]
    n = sum(map(len, groups.values()))
    assert not failed, f"{n} of {len(report['results'])} builds failed:\n" + "\n".join(failed)


def test_no_spills(report):
    built = [r for r in report["results"] if "error" not in r]
    spills = [f"{_describe(r)}: {r['regs']} registers, {r['stack_frame']} B stack frame, "
              f"{r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads"
              for r in built if r["spill_stores"] or r["spill_loads"]]
    assert built
    assert not spills, f"{len(spills)} of {len(built)} builds spill:\n" + "\n".join(spills)


def test_both_architectures_and_consistent_reports(report):
    """Each specialization is built for sm_80 and for sm_90 (PTX targets ``sm_80`` and
    ``sm_90a``), and the registers of the binary agree with those ``ptxas -v`` reports."""
    archs: dict[tuple, set] = {}
    for r in report["results"]:
        archs.setdefault((r["name"], tuple(sorted(r["args"].items()))), set()).add(r["arch"])
    assert all(a == ARCHS for a in archs.values())
    built = [r for r in report["results"] if "error" not in r]
    assert {r["ptx_target"] for r in built} <= {"sm_80", "sm_90a"}
    assert [_describe(r) for r in built if r["regs"] != r["ptxas_regs"]] == []


def test_whole_tiles_of_full_state_move_sixteen_bytes_per_access(report):
    """Note [whole tiles] in fusedopt/kernels/common.py: every build over full state for aligned
    tables (the norms of ``sq_norms`` too) has a loop, the one over the tiles inside every row,
    that loads 16 bytes to an instruction (``LDG.E.128``): a per-element mask there would split
    them into one element each."""
    built = [r for r in report["results"] if "error" not in r
             and r["args"]["ALIGNED"] == "True" and r["args"].get("LOWP") != "True"]
    assert {r["name"] for r in built} == {"lamb_pass1_kernel", "lamb_pass2_kernel",
                                          "lars_pass1_kernel", "lars_pass2_kernel",
                                          "sq_norms_kernel"}
    scalar = [_describe(r) for r in built if not any(loop.get("LDG.E.128") for loop in r["loops"])]
    assert not scalar, f"{len(scalar)} of {len(built)} builds:\n" + "\n".join(scalar)


def test_whole_tiles_of_8bit_state_move_eight_codes_per_access(report):
    """Note [whole tiles] in fusedopt/kernels/common.py: every pass over low-precision state
    (``LOWP``) built for aligned tables reads the 8-bit codes of the tiles that lie inside every
    row eight to an instruction (``LDG.E.64``), and pass 1 and LARS's pass 2, which store them,
    write them so (``STG.E.64``): a mask with a term per element would split them into one byte
    each."""
    lowp = {"lamb_pass1_kernel": ("LDG.E.64", "STG.E.64"), "lamb_pass2_kernel": ("LDG.E.64",),
            "lars_pass2_kernel": ("LDG.E.64", "STG.E.64")}
    built = [r for r in report["results"] if "error" not in r and r["name"] in lowp
             and r["args"]["ALIGNED"] == "True" and r["args"]["LOWP"] == "True"]
    assert {r["name"] for r in built} == set(lowp)
    scalar = [_describe(r) for r in built
              if not any(all(loop.get(form) for form in lowp[r["name"]]) for loop in r["loops"])]
    assert not scalar, f"{len(scalar)} of {len(built)} builds:\n" + "\n".join(scalar)
