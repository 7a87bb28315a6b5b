"""python -m fusedopt check: the self-check passes here, fails on a backend that computes a wrong
result, prints its speed table, and checks Triton under the interpreter."""
from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys

import pytest
import torch

import fusedopt
from fusedopt import backends
from fusedopt.__main__ import main as cli_main
from fusedopt import testing
from fusedopt.tools import check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPP = "cpp" in fusedopt.available_backends()


def _env(triton_interpret: bool) -> dict:
    """The environment of a check in a subprocess. conftest.py sets TRITON_INTERPRET=1 on machines
    without CUDA; the check then also runs Triton on the CPU, which only the Triton test wants."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def _rows(stdout: str, device: str = "cpu") -> list[list[str]]:
    """The table rows of one device, as cells: device, backend, opt, dtype, case, result, ..."""
    names = tuple(backends._REGISTRY)
    return [cells for cells in map(str.split, stdout.splitlines())
            if len(cells) >= 6 and cells[0] == device and cells[1] in names]


def test_cli_quick_passes_with_eager_and_cpp_rows():
    proc = subprocess.run([sys.executable, "-m", "fusedopt", "check", "--quick", "--no-speed"],
                          cwd=ROOT, env=_env(False), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "device" in out and "result" in out and "tolerance" in out
    rows = [r for r in _rows(out)]
    seen = {r[1] for r in rows}
    assert "eager" in seen and ("cpp" in seen or not CPP)
    # one row per pair of fusedopt.testing's quick set, per backend
    quick = [(c.kind.upper(), d.name, c.name) for c, d in testing.CASE_SETS["quick"].pairs]
    for name in seen:
        assert [(r[2], r[3], r[4]) for r in rows if r[1] == name] == quick
    assert all(r[5] == "pass" for r in rows), out
    assert "correctness: PASS" in out
    assert check.COVERAGE in out  # what the rows prove, and what they leave to the GPU tests


class CorruptAfterPass2:
    """A backend that runs another one and then scales every stored param by 1.05 after pass 2:
    a wrong result (beyond bf16 rounding too) that the check must report."""

    def __init__(self, inner):
        self._inner = inner
        self.name = inner.name

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def pass2(self, kind, b, *args):
        self._inner.pass2(kind, b, *args)
        torch._foreach_mul_(b.params, 1.05)


@pytest.fixture
def corrupt_cpp():
    if not CPP:
        pytest.skip(f"the cpp backend is not available: {backends.load_error('cpp')}")
    original = backends.get_backend("cpp")
    yield {"cpp": CorruptAfterPass2(original)}
    assert backends.get_backend("cpp") is original  # the check put the registered one back


def test_run_fails_every_row_of_a_corrupted_backend(corrupt_cpp):
    out = io.StringIO()
    report = check.run(["cpu"], ["eager", "cpp"], quick=True, speed=False, out=out,
                       backend_objects=corrupt_cpp)
    assert not report.ok
    by_backend = {name: [r for r in report.rows if r.backend == name] for name in ("eager", "cpp")}
    assert by_backend["eager"] and all(r.status == "pass" for r in by_backend["eager"])
    assert by_backend["cpp"] and all(r.status == "FAIL" for r in by_backend["cpp"]), out.getvalue()
    assert "correctness: FAIL" in out.getvalue()


def test_main_exits_nonzero_on_a_corrupted_backend(corrupt_cpp, capsys):
    rc = check.main(["--quick", "--no-speed", "--device", "cpu", "--backend", "cpp"],
                    backend_objects=corrupt_cpp)
    assert rc != 0
    rows = [r for r in _rows(capsys.readouterr().out)]
    assert rows and all(r[1] == "cpp" and r[5] == "FAIL" for r in rows)


class RaiseInPass1(CorruptAfterPass2):
    def pass1(self, *args):
        raise RuntimeError("kernel launch failed")


def test_a_backend_that_raises_gives_error_rows(corrupt_cpp):
    out = io.StringIO()
    report = check.run(["cpu"], ["cpp"], quick=True, speed=False, out=out,
                       backend_objects={"cpp": RaiseInPass1(corrupt_cpp["cpp"]._inner)})
    assert not report.ok
    assert report.rows and all(r.status == "ERROR" for r in report.rows)
    assert "RuntimeError: kernel launch failed" in out.getvalue()


def test_a_backend_that_runs_nowhere_fails(capsys):
    rc = cli_main(["check", "--device", "cpu", "--backend", "cuda", "--no-speed"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "not checked: cuda" in out and "could run on none of the devices" in out


def test_bad_device_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        check.main(["--device", "tpu"])
    assert e.value.code == 2
    assert "expected cpu, cuda or cuda:N" in capsys.readouterr().err


def test_2x_eager_rule_allows_one_ulp_of_rounding_the_other_way():
    ref = [torch.tensor([1.00025], dtype=torch.float64)]
    eager = [torch.tensor([1.0], dtype=torch.float64)]  # fp16 neighbours: 1.0 and 1 + 2**-10
    atol = testing.ROUNDING_ATOL[torch.float16]
    other_way = [torch.tensor([1.0 + 2 ** -10], dtype=torch.float64)]
    excess, slack, count = testing.excess_over_eager(other_way, eager, ref, atol, torch.float16)
    assert slack == 2 ** -10 and 0 < excess <= slack and count == 0
    two_ulps = [torch.tensor([1.0 + 2 ** -9], dtype=torch.float64)]
    excess, slack, count = testing.excess_over_eager(two_ulps, eager, ref, atol, torch.float16)
    assert excess > slack and count == 1


def test_a_nan_is_never_within_rounding_or_tolerance():
    ref = [torch.tensor([1.0, 2.0], dtype=torch.float64)]
    nan = [torch.tensor([1.0, float("nan")], dtype=torch.float64)]
    excess, _, count = testing.excess_over_eager(nan, ref, ref, 1e-3, torch.float16)
    assert excess == float("inf") and count == 1
    assert testing.max_rel_err(nan, ref) == float("inf")


def test_speed_table_columns(capsys):
    names = [n for n in ("eager", "cpp") if n in fusedopt.available_backends()]
    check.speed_table(torch.device("cpu"), names, shapes=[(1000,)] * 4, rounds=2)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("optimizer"))
    assert header.split() == ["optimizer", "ms/step", "IQR", "GB/s", "of", "bw"]
    for name in names:
        assert f"fusedopt LAMB [{name}]" in out and f"fusedopt LARS [{name}]" in out
    assert "torch AdamW(fused=True)" in out or "torch AdamW(foreach=True)" in out
    assert "in-place bandwidth" in out


def test_usage_lists_check(capsys):
    assert cli_main(["--help"]) == 0
    assert "check" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs compiled on this machine's GPU")
def test_triton_rows_under_the_interpreter():
    proc = subprocess.run(
        [sys.executable, "-m", "fusedopt", "check", "--device", "cpu", "--backend", "triton",
         "--no-speed"],
        cwd=ROOT, env=_env(True), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [r for r in _rows(proc.stdout)]
    assert rows and all(r[1] == "triton" and r[5] == "pass" for r in rows), proc.stdout
    assert {r[2] for r in rows} == {"LAMB", "LARS"}
    assert "Triton's interpreter" in proc.stdout


def test_a_torch_that_refuses_grads_of_another_dtype_skips_those_rows(monkeypatch):
    """torch before 2.10 refuses a bf16 grad for an fp32 param: the row says so as a skip, not an
    ERROR that would fail the whole check."""
    from fusedopt import testing

    monkeypatch.setattr(testing, "_takes_grad_of_another_dtype", lambda: False)
    case = next(c for c in testing.OPTION_CASES if c.kind == "lamb")
    r = testing.run_case(case, "eager", "cpu", testing.dtype_case("fp32,grad=bf16"), "quick")
    assert r.status == "skip" and "refuses a torch.bfloat16 grad" in r.detail
    assert testing.run_case(case, "eager", "cpu", testing.dtype_case("fp32"), "quick").status == "pass"
