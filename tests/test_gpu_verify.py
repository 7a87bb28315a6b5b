"""scripts/gpu_verify.py, the prepared GPU verification run, dry-run on the CPU: what needs no
device runs (the environment, the self-check), the rest is reported as "skipped: no CUDA device";
its report names every failure (a test id, or a self-check row's device, backend and case)."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_verify.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_verify", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the run takes minutes: run "
                    "`python scripts/gpu_verify.py` itself")
def test_dry_run_on_the_cpu_writes_both_reports(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path),
                          "--check-args", "--quick --no-speed --backend eager"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["environment", "gpu tests", "self-check", "benchmark",
                           "low-precision benchmark"]
    for name in ("gpu tests", "benchmark", "low-precision benchmark"):
        assert (steps[name]["status"], steps[name]["reason"]) == ("skipped", "no CUDA device")
        assert steps[name]["command"]  # what it would have run
    assert steps["low-precision benchmark"]["command"].endswith("--no-peers --resident")
    check = steps["self-check"]
    assert check["status"] == "passed" and check["mode"] == "quick" and not check["failures"]
    assert re.fullmatch(r"quick mode: (\d+) pass \(\1 rows\)", check["summary"]), check["summary"]
    assert report["ok"] and report["environment"]["cuda_available"] is False
    md = (tmp_path / "report.md").read_text()
    assert "**PASS**" in md and md.count("skipped: no CUDA device") == 3
    assert "gpu tests: skipped: no CUDA device" in out.stdout


def test_require_gpu_fails_a_run_without_a_device(tmp_path, monkeypatch):
    mod = _module()
    monkeypatch.setattr(mod, "environment", lambda: dict(
        cuda_available=False, devices=[], torch=torch.__version__, backends={}))
    argv = ["--out", str(tmp_path), "--skip", "self-check"]
    assert mod.main(argv) == 0
    assert mod.main(argv + ["--require-gpu"]) == 1
    steps = json.loads((tmp_path / "report.json").read_text())["steps"]
    assert [s["status"] for s in steps] == ["passed", "skipped", "skipped", "skipped", "skipped"]
    assert steps[2]["reason"] == "asked to (--skip)"


def test_failures_are_named_in_the_report(tmp_path, monkeypatch):
    """A failed GPU test by its id and message, a failed self-check row by its device, backend,
    optimizer, dtype and case; every skip reason counted."""
    mod = _module()
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_triton" name="test_a"/>'
        '<testcase classname="tests.test_triton" name="test_b[lamb]">'
        '<failure message="AssertionError: kernel lamb_pass2_kernel differs">trace</failure>'
        '</testcase>'
        '<testcase classname="tests.test_cuda_gpu" name="test_c">'
        '<skipped message="needs 17 GiB of free GPU memory"/></testcase>'
        '</testsuite></testsuites>')

    def fake_run(cmd, timeout, env=None):
        if "check" in cmd:
            rows = [dict(device="cuda:0", backend="triton", kind="lamb", dtype="bf16",
                         case="decoupled", status="FAIL", error=0.5, tolerance=1e-5, rule="rel",
                         detail=""),
                    dict(device="cuda:0", backend="cuda", kind="lars", dtype="fp32",
                         case="default", status="pass", error=1e-7, tolerance=1e-5, rule="rel",
                         detail="")]
            (tmp_path / "check.json").write_text(json.dumps(dict(
                mode="full", ok=False, rows=rows, not_checked=[], problems=[])))
            return 1, "correctness: FAIL", 1.0
        return 1, "1 failed, 1 passed, 1 skipped", 2.0

    monkeypatch.setattr(mod, "_run", fake_run)
    tests = mod.gpu_tests(tmp_path, True, False, 60)
    check = mod.self_check(tmp_path, [], 60)
    assert tests["status"] == "failed" and tests["counts"] == dict(passed=1, failed=1, errors=0,
                                                                   skipped=1)
    assert tests["failures"][0]["test"] == "tests.test_triton::test_b[lamb]"
    assert tests["skips"] == {"needs 17 GiB of free GPU memory": 1}
    assert check["status"] == "failed" and check["mode"] == "full"
    assert check["failures"] == [dict(test="cuda:0 triton lamb bf16 decoupled", kind="FAIL",
                                      message="error 0.5 > tolerance 1e-05 (rel)")]
    md = mod.markdown(dict(started="now", seconds=3.0, ok=False, environment={},
                           steps=[tests, check]))
    assert "**FAIL**" in md
    assert "`tests.test_triton::test_b[lamb]` (failure): AssertionError: kernel lamb_pass2" in md
    assert "`cuda:0 triton lamb bf16 decoupled` (FAIL)" in md
    assert "1 x needs 17 GiB of free GPU memory" in md


def test_a_step_that_times_out_is_reported(tmp_path, monkeypatch):
    mod = _module()
    monkeypatch.setattr(mod, "_run", lambda cmd, timeout, env=None: (None, "partial", timeout))
    step = mod.benchmark(tmp_path, True, 5)
    assert (step["status"], step["reason"]) == ("timeout", "stopped after 5 s")


def test_build_and_jobs_reach_their_commands(tmp_path, monkeypatch):
    """--build runs setup.py build_ext --inplace first and reports it; a failed extension recorded
    by setup.py fails the step; --jobs hands pytest-xdist its workers."""
    mod = _module()
    ran = []

    def fake_run(cmd, timeout, env=None):
        ran.append((cmd, env))
        return 0, "", 0.1

    monkeypatch.setattr(mod, "_run", fake_run)
    step = mod.build(False, 10)
    assert ran[-1][0][1:] == ["setup.py", "build_ext", "--inplace"]
    assert "MAX_JOBS" in ran[-1][1]
    errors = tmp_path / "fusedopt" / "_build_errors.txt"
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    assert step["status"] == "passed" and mod.build(False, 10)["status"] == "passed"
    errors.parent.mkdir()
    errors.write_text("fusedopt._cuda: CompileError: nvcc failed\n")
    failed = mod.build(False, 10)
    assert failed["status"] == "failed" and "nvcc failed" in failed["reason"]
    mod.gpu_tests(tmp_path, True, False, 10, jobs=4)
    assert ran[-1][0][ran[-1][0].index("-n") + 1] == "4"
    mod.gpu_tests(tmp_path, True, False, 10)
    assert "no:xdist" in ran[-1][0]
