"""python -m fusedopt check: the self-check passes here, fails on a backend that computes a wrong
result, prints its speed table, and checks Triton under the interpreter."""
from __future__ import annotations

import dataclasses
import importlib.util
import io
import math
import os
import re
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


PROTOCOL = {r.name for r in check.PROTOCOL_ROWS}
#: the protocol rows of a backend on the CPU, in table order (tensor_lr:cpu runs on GPUs only)
CPU_PROTOCOL = [(kind, "fp32", name) for kind in ("LAMB", "LARS")
                for name in ("misaligned:grads", "misaligned:all", "large", "grad_scale",
                             "grad_scale+clip", "found_inf", "tensor_lr")]


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
    # one row per pair of fusedopt.testing's quick set, per backend, then the protocol rows
    quick = [(c.kind.upper(), d.name, c.name) for c, d in testing.CASE_SETS["quick"].pairs]
    for name in seen:
        assert [(r[2], r[3], r[4]) for r in rows if r[1] == name and r[4] not in PROTOCOL] == quick
        assert [(r[2], r[3], r[4]) for r in rows if r[1] == name and r[4] in PROTOCOL] == \
            CPU_PROTOCOL
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
    assert [(r[2], r[3], r[4]) for r in rows if r[4] in PROTOCOL] == CPU_PROTOCOL
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


# ------------------------------------------------------------------------------ protocol rows
# The rows for misaligned and large tensors, GradScaler and a tensor lr: each passes on the CPU
# backends and fails, naming the backend and the row, on a backend with the fault it is there for.

class Wrapped:
    """A backend that runs another one (its attributes are the other's unless overridden)."""

    def __init__(self, inner):
        self._inner = inner
        self.name = inner.name

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


class IgnoresFoundInf(Wrapped):
    """Steps as if GradScaler had found no inf: an overflowed step writes its NaNs."""

    def pass1(self, kind, b, h, hyper, grad_mult, found_inf):
        return self._inner.pass1(kind, b, h, hyper, grad_mult, None)

    def pass2(self, kind, b, h, hyper, sums, grad_mult, found_inf):
        return self._inner.pass2(kind, b, h, hyper, sums, grad_mult, None)


class UnscalesOnlyWhenClipping(Wrapped):
    """Applies the grad multiplier only when the group clips: without clipping it reads
    GradScaler's scaled grads as they are."""

    def pass1(self, kind, b, h, hyper, grad_mult, found_inf):
        return self._inner.pass1(kind, b, h, hyper,
                                 grad_mult if h.max_grad_norm is not None else None, found_inf)

    def pass2(self, kind, b, h, hyper, sums, grad_mult, found_inf):
        return self._inner.pass2(kind, b, h, hyper, sums,
                                 grad_mult if h.max_grad_norm is not None else None, found_inf)


class ReadsMisalignedGradsFromTheBoundary(Wrapped):
    """Reads a grad that is not 16-byte aligned from the 16-byte boundary below it (an aligned
    vector load of a misaligned pointer, rounded down)."""

    @staticmethod
    def _rounded_down(g):
        off = g.data_ptr() % 16
        if not g.numel() or not off:
            return g
        start = g.storage_offset() - off // g.element_size()
        return torch.as_strided(g, g.shape, g.stride(), start)

    def bind(self, b, check):
        # the step's grads as the backend takes them (a native handle keeps them from here on)
        b.grads = [self._rounded_down(g) for g in b.grads]
        return self._inner.bind(b, check)


class KeepsTheFirstTensorLr(Wrapped):
    """Reads a tensor lr once, at its first step, and keeps that value (a scheduler's in-place
    changes are lost)."""

    def __init__(self, inner):
        super().__init__(inner)
        self._first = {}  # id -> (the tensor, kept alive so that its id stays its own; the value)

    def _hyper(self, h):
        if not isinstance(h.lr, torch.Tensor):
            return h
        _, value = self._first.setdefault(id(h.lr), (h.lr, h.lr.clone()))
        return dataclasses.replace(h, lr=value)

    def pass1(self, kind, b, h, *args):
        return self._inner.pass1(kind, b, self._hyper(h), *args)

    def pass2(self, kind, b, h, *args):
        return self._inner.pass2(kind, b, self._hyper(h), *args)


class CorruptsLargeTensors(Wrapped):
    """Scales every param of over 100,000 elements by 1.05 after pass 2 (the case sets' tensors
    are smaller; the large row's is not)."""

    def pass2(self, kind, b, *args):
        self._inner.pass2(kind, b, *args)
        big = [p for p in b.params if p.numel() > 100_000]
        if big:
            torch._foreach_mul_(big, 1.05)


class ThreadDependent(Wrapped):
    """On more than one thread, moves the first element of each param of over one chunk to its
    next float: a result within any tolerance that still depends on the thread count."""

    def pass2(self, kind, b, *args):
        self._inner.pass2(kind, b, *args)
        if torch.get_num_threads() > 1:
            for p in b.params:
                if p.numel() > check.CPP_CHUNK:
                    x = p.view(-1)[:1]
                    x.copy_(torch.nextafter(x, torch.full_like(x, math.inf)))


def _run_rows(backend_object, names):
    """The protocol rows ``names`` (None: all; no option rows) on the CPU, with
    ``backend_object`` standing for the backend of its name."""
    name = backend_object.name
    out = io.StringIO()
    report = check.run(["cpu"], [name], quick=True, speed=False, out=out, option_rows=False,
                       protocol=names, backend_objects={name: backend_object})
    return report, out.getvalue()


def _printed(out: str, backend: str, case: str) -> list[list[str]]:
    return [r for r in _rows(out) if r[1] == backend and r[4] == case]


CPU_BACKENDS = ["eager", pytest.param("cpp", marks=pytest.mark.skipif(
    not CPP, reason="the cpp backend is not available"))]


def _rules(detail: str) -> dict[str, bool]:
    """The checks a protocol row's detail lists: rule -> met."""
    out = {}
    for part in detail.split("; "):
        rule = part.split()[0].rstrip(":")
        out[rule] = not (re.search(r" > ", part) or re.search(r": [1-9]\d* elements? ", part)
                         or (rule == "no-op" and "changed nothing" not in part))
    return out


def _expected_rules(backend: str, case: str) -> set[str]:
    rules = {"rel"}
    if (case.startswith("misaligned") and backend in check.ALIGNMENT_FREE
            or case == "large" and backend == "cpp"
            or case in ("grad_scale", "grad_scale+clip", "found_inf", "tensor_lr")):
        rules.add("bits")
    if case.startswith("grad_scale"):
        rules.add("grads")
    if case == "found_inf":
        rules.add("no-op")
    return rules


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_protocol_rows_pass_on_the_cpu_backends(backend):
    """Every protocol row passes, held to every check its case calls for (each listed, met, in
    its detail)."""
    out = io.StringIO()
    report = check.run(["cpu"], [backend], quick=True, speed=False, out=out, option_rows=False)
    assert report.ok, out.getvalue()
    assert [(r.kind.upper(), r.dtype, r.case) for r in report.rows] == CPU_PROTOCOL
    for r in report.rows:
        rules = _rules(r.detail)
        assert set(rules) == _expected_rules(backend, r.case) and all(rules.values()), r
    text = out.getvalue()
    assert "protocol rows" in text and "large on cpu" in text


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs compiled on this machine's GPU")
@pytest.mark.filterwarnings("ignore:(invalid value|divide by zero|overflow):RuntimeWarning")
def test_protocol_rows_of_triton_under_the_interpreter():
    """The large row lowers REDUCE_BLOCK for its run only (the finaliser loops over a few chunks)
    and puts it back."""
    from fusedopt.kernels import tables

    block = tables.REDUCE_BLOCK
    seen = []
    real = tables.launch

    def spy(kernel, table, **kw):
        if "RBLOCK" in kw:
            seen.append(kw["RBLOCK"])
        real(kernel, table, **kw)

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tables, "launch", spy)
        report = check.run(["cpu"], ["triton"], quick=True, speed=False, out=out,
                           option_rows=False, protocol=["large"])
    assert report.ok, out.getvalue()
    assert [(r.kind, r.case, r.rule) for r in report.rows] == [("lamb", "large", "rel"),
                                                                ("lars", "large", "rel")]
    assert seen and set(seen) == {check.INTERPRETED_REDUCE_BLOCK}
    assert tables.REDUCE_BLOCK == block
    assert f"REDUCE_BLOCK lowered to {check.INTERPRETED_REDUCE_BLOCK}" in out.getvalue()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("fault,rows", [
    (IgnoresFoundInf, ["found_inf"]),
    (UnscalesOnlyWhenClipping, ["grad_scale"]),
    (ReadsMisalignedGradsFromTheBoundary, ["misaligned:grads", "misaligned:all"]),
    (KeepsTheFirstTensorLr, ["tensor_lr"]),
    (CorruptsLargeTensors, ["large"]),
])
def test_each_protocol_row_fails_on_the_fault_it_is_for(fault, rows, backend):
    """The faulty backend fails exactly the rows of its fault, for LAMB and LARS, each printed
    with the backend, the row and FAIL; the other protocol rows still pass."""
    be = fault(backends.get_backend(backend))
    report, out = _run_rows(be, None)
    assert not report.ok
    failed = {(r.kind, r.case) for r in report.rows if r.status != "pass"}
    assert failed == {(k, c) for k in ("lamb", "lars") for c in rows}, out
    assert all(r.status == "FAIL" for r in report.rows if r.status != "pass")
    for case in rows:
        printed = _printed(out, backend, case)
        assert [r[5] for r in printed] == ["FAIL", "FAIL"], out
    assert "correctness: FAIL" in out


def test_a_thread_dependent_result_fails_the_large_row_by_its_bits():
    """One float's difference on 2 threads: within the rel tolerance, so only the large row's
    bitwise comparison with 1 thread can see it, and does."""
    if not CPP:
        pytest.skip(f"the cpp backend is not available: {backends.load_error('cpp')}")
    report, out = _run_rows(ThreadDependent(backends.get_backend("cpp")), ["large"])
    assert [(r.kind, r.status, r.rule) for r in report.rows] == [("lamb", "FAIL", "bits"),
                                                                 ("lars", "FAIL", "bits")], out
    for r in report.rows:
        assert r.error == 1.0 and "1 thread" in r.detail and re.search(r"rel \S+ <=", r.detail)


def test_a_misaligned_result_off_by_one_float_fails_by_its_bits():
    """On a backend whose results do not depend on alignment (cpp), a misaligned tensor's result
    one float off the aligned one fails the misaligned rows, though within the rel tolerance."""
    if not CPP:
        pytest.skip(f"the cpp backend is not available: {backends.load_error('cpp')}")

    class OffByOneFloatWhenMisaligned(Wrapped):
        def pass2(self, kind, b, *args):
            self._inner.pass2(kind, b, *args)
            for p in b.params:
                if p.numel() and p.data_ptr() % 16:
                    x = p.view(-1)[:1]
                    x.copy_(torch.nextafter(x, torch.full_like(x, math.inf)))

    report, out = _run_rows(OffByOneFloatWhenMisaligned(backends.get_backend("cpp")),
                            ["misaligned:grads", "misaligned:all"])
    status = {(r.kind, r.case): (r.status, r.rule) for r in report.rows}
    # misaligned:grads leaves the params aligned: nothing to move there
    assert status == {("lamb", "misaligned:grads"): ("pass", "rel"),
                      ("lars", "misaligned:grads"): ("pass", "rel"),
                      ("lamb", "misaligned:all"): ("FAIL", "bits"),
                      ("lars", "misaligned:all"): ("FAIL", "bits")}, out


def test_unknown_protocol_rows_are_refused():
    with pytest.raises(ValueError, match=r"unknown protocol rows \['bogus'\]; the rows: "
                                         r"misaligned:grads, "):
        check.run(["cpu"], ["eager"], speed=False, out=io.StringIO(), protocol=["bogus"])
    with pytest.raises(TypeError, match="expected an iterable of row names, got the str 'large'"):
        check.run(["cpu"], ["eager"], speed=False, out=io.StringIO(), protocol="large")


def test_protocol_helpers():
    x = torch.arange(5.0)
    y = testing.misaligned_like(x)
    assert torch.equal(x, y) and y.is_contiguous() and y.data_ptr() % 16 == 4
    assert testing.misaligned_like(torch.zeros(0)).numel() == 0
    for bad in (0, 4, True):  # 4 float32 elements are 16 bytes: aligned
        with pytest.raises(ValueError, match="offset"):
            testing.misaligned_like(x, bad)
    a = torch.tensor([0.0, 1.0, math.nan])
    assert testing.bit_mismatches([a], [a.clone()]) == 0  # NaN's bits equal themselves
    assert testing.bit_mismatches([a], [torch.tensor([-0.0, 1.0, math.nan])]) == 1
    assert testing.bit_mismatches([a], [a.double()]) == 3
    assert testing.bit_mismatches([a, a], [a]) == 3
    inputs = testing.make_inputs(testing.SHAPES_SMALL, 3, zero_weight=1)
    opts = testing.option_case("lars", "mixed").options
    constant = testing.run_reference("lars", opts, inputs, excluded=(5,),
                                     lrs=[testing.LR["lars"]] * 3)
    assert testing.bit_mismatches(constant, testing.run_reference("lars", opts, inputs,
                                                                  excluded=(5,))) == 0
    halved = testing.run_reference("lars", opts, inputs, excluded=(5,),
                                   lrs=[testing.LR["lars"] / 2] * 3)
    assert testing.max_rel_err(halved, constant) > 1e-3
    with pytest.raises(ValueError, match="2 learning rates for 3 steps"):
        testing.run_reference("lars", opts, inputs, lrs=[0.1, 0.1])


# ------------------------------------------------------------------- bench/bench_triton_gpu.py

def _bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_triton_gpu", os.path.join(ROOT, "bench", "bench_triton_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_bench_help():
    proc = subprocess.run([sys.executable, "bench/bench_triton_gpu.py", "--help"], cwd=ROOT,
                          env=_env(False), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--workloads" in proc.stdout, proc.stderr


def test_gpu_bench_times_fused_adamw_in_the_same_rounds():
    """The rows of a workload come from rounds in which every candidate, torch's fused AdamW
    included, is timed in turn; GB/s by each kind's bytes per element (AdamW 28)."""
    mod = _bench_module()
    order = []
    ms = iter(range(1, 1000))

    def fake_bench(fn):
        order.append(fn)
        return [float(next(ms)), float(next(ms))]

    rows = mod.bench_gpu(["lamb", "lars"], ["tiny"], device="cpu", backends=["eager"], rounds=3,
                         bench=fake_bench, table={"tiny": [(5, 3), (7,)]})
    assert [(r["kind"], r["backend"]) for r in rows] == [("lamb", "eager"), ("lars", "eager"),
                                                         ("adamw", "torch fused")]
    assert len(order) == 9 and order[:3] == order[3:6] == order[6:]  # interleaved, same order
    adamw = rows[2]
    # its samples: (5, 6), (11, 12), (17, 18)
    assert adamw["samples"] == 6 and adamw["ms_median"] == 11.5
    assert adamw["ms_p20"] == mod.quantile([5, 6, 11, 12, 17, 18], 0.2) == 6.0
    assert adamw["gbps"] == 28 * 22 / 11.5 / 1e6
    assert rows[0]["gbps"] == 40 * 22 / rows[0]["ms_median"] / 1e6
    assert mod.quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and mod.quantile([1.0, 2.0], 0.25) == 1.25
    with pytest.raises(ValueError):
        mod.interleaved({}, 0, fake_bench)
