"""The C++ CPU backend (backend="cpp"): against the float64 reference, against eager, and against
itself (thread counts, ISA clones); its torch.ops.fusedopt.* operators and their fake kernels.
State-dict round trips, tensor lr and allocations inside step() are tested for every backend
(tests/test_optimizer_api.py, tests/test_amp.py, tests/test_memory.py)."""
import copy
import hashlib
import operator
import os
import subprocess
import sys

import pytest
import torch

import fusedopt
from fusedopt import backends
from helpers import (
    SHAPES_ZOO,
    assert_within_rounding,
    make_tensors,
    max_rel_err,
    run_backend,
)

CPP = backends.get_backend("cpp")
pytestmark = pytest.mark.skipif(
    CPP is None, reason=f"fusedopt._C is not built: {backends.load_error('cpp')}")

LOW = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
HYPER = {"lamb": {}, "lars": dict(weight_decay=1e-4)}
ZOO = SHAPES_ZOO


def _opt(kind, params, **kw):
    if kind == "lamb":
        return fusedopt.FusedLAMB(params, backend="cpp", **kw)
    return fusedopt.FusedLARS(params, backend="cpp", **{"lr": 0.5, **HYPER["lars"], **kw})


def _set_grads(params, seed, dtype=None):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        if dtype not in (None, p.dtype) and hasattr(p, "grad_dtype"):
            p.grad_dtype = dtype  # torch >= 2.10 checks grad dtypes unless told otherwise
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype or p.dtype)


def _snapshot(params, opt):
    """Every tensor the step may touch: params and all state (incl. steps and masters)."""
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [v.clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))


def _handle(opt, gi):
    """The C++ KeptLayout the cpp backend keeps for param group ``gi`` in the optimizer's step
    cache (Note [step cache] in fusedopt/_bucket.py), or None."""
    single = opt._cache.single.get(gi)
    return None if single is None else opt._cache.layouts.get(single[0])


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_steady_steps_go_through_the_kept_layout(kind, monkeypatch):
    """After the first step, a step whose lists did not change binds the kept KeptLayout (Note
    [kept layout] in csrc/cpu/ops.h) without checking them in Python, and calls no torch.ops
    operator (which converts and checks every list on every call)."""
    from fusedopt import functional
    params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, torch.float32, 0)]
    opt = _opt(kind, params, max_grad_norm=1.0)
    _set_grads(params, 0)
    opt.step()
    calls = []
    ops = CPP._ops

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ops, name)

    monkeypatch.setattr(CPP, "_ops", Counting())
    checked = []
    real_check = functional._check_group
    monkeypatch.setattr(functional, "_check_group", lambda *a: checked.append(a) or real_check(*a))
    handle = _handle(opt, 0)
    for step in range(1, 3):
        _set_grads(params, step)
        opt.step()
    assert handle is not None and _handle(opt, 0) is handle
    assert not [c for c in calls if "pass" in c], f"steady steps called the operators {calls}"
    assert not checked, "steady steps checked their lists in Python"


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_4000_tiny_tensors(kind):
    shapes = [(3,)] * 4000 + [(18011,)]
    params, ref, _ = run_backend(kind, "cpp", shapes, HYPER[kind], steps=2, zero_weight=7)
    assert max_rel_err(params, ref) <= 1e-5


@pytest.mark.parametrize("master_weights", [True, False], ids=["masters", "no_masters"])
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_low_precision_within_rounding(kind, dtype, master_weights):
    """bf16/fp16 params (and grads): |cpp - ref64| <= 2 |eager - ref64| + atol, elementwise."""
    kw = dict(dtype=dtype, master_weights=master_weights, steps=4, zero_grad=3)
    fast, ref, opt = run_backend(kind, "cpp", ZOO, HYPER[kind], **kw)
    slow, _, _ = run_backend(kind, "eager", ZOO, HYPER[kind], **kw)
    atol = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    assert_within_rounding(fast, slow, ref, atol)
    if master_weights:  # the param is its master rounded to nearest even
        for p in fast:
            torch.testing.assert_close(p.detach(), opt.state[p]["master_param"].to(dtype),
                                       rtol=0, atol=0)


# ------------------------------------------------------------------------------ against eager

@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_close_to_eager(kind):
    cases = {"lamb": dict(decoupled_weight_decay=True, weight_decay=0.1), "lars": HYPER["lars"]}
    fast, _, _ = run_backend(kind, "cpp", ZOO, cases[kind], steps=5)
    slow, _, _ = run_backend(kind, "eager", ZOO, cases[kind], steps=5)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=2e-6, atol=1e-7)


def test_sq_norms():
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=gen, dtype=torch.float64) for s in [(0,), (1,), (70001,), (9, 7)]]
    ts.append(torch.randn(5, 8, generator=gen, dtype=torch.float64).t())  # dense, transposed
    ts.append(torch.randn(6, 8, generator=gen, dtype=torch.float64)[:, ::2])  # not dense
    expected = torch.stack([(t * t).sum() for t in ts])
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        low = [t.to(dtype) for t in ts]
        got = CPP.sq_norms(low)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        exact = torch.stack([(t.double() ** 2).sum() for t in low])
        torch.testing.assert_close(got.double(), exact, rtol=1e-6 if dtype != torch.float64 else 1e-13,
                                   atol=0)
    torch.testing.assert_close(CPP.sq_norms(ts), expected, rtol=1e-13, atol=0)


def test_missing_extension_raises_with_guidance(monkeypatch):
    from fusedopt.backends import cpp

    monkeypatch.delattr(fusedopt, "_C", raising=False)
    monkeypatch.setitem(sys.modules, "fusedopt._C", None)
    with pytest.raises(ImportError, match="pip install --no-build-isolation -e ."):
        cpp.CppBackend()


# --------------------------------------------------------------------- grad_mult and found_inf

# opt.grad_scale and opt.found_inf on fp32 params, and bf16 grads of fp32 params: the protocol
# rows of `python -m fusedopt check` (tests/test_check.py: bit for bit against the unscaled run,
# every state entry compared) and tests/test_parity.py's "fp32,grad=bf16" rows
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_found_inf_changes_nothing_with_bf16_masters(kind):
    params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, torch.bfloat16, 0)]
    opt = _opt(kind, params, max_grad_norm=1.0)
    _set_grads(params, 0)
    opt.step()
    before = _snapshot(params, opt)
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(1.0)
    _set_grads(params, 1)
    opt.step()
    _assert_bitwise(_snapshot(params, opt), before)
    opt.found_inf = torch.tensor(0.0)
    opt.step()
    assert all(opt.state[p]["step"].item() == 2 for p in params)


# ------------------------------------------------------------------------------ determinism

def _run_steps(kind, shapes, steps, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        params = [torch.nn.Parameter(t) for t in make_tensors(shapes, torch.float32, 0)]
        opt = _opt(kind, params, max_grad_norm=1.0)
        for step in range(steps):
            _set_grads(params, step)
            opt.step()
        norms = CPP.sq_norms([p.detach() for p in params])
        return _snapshot(params, opt) + [norms]
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_bit_identical_for_1_and_2_threads(kind):
    # more tensors than kTensorGrain (multi_tensor.h): the per-tensor work is split too
    shapes = [(300_001,), (5,)] * 2 + [(70001,)] + [(100,)] * 600
    one = _run_steps(kind, shapes, 3, threads=1)
    two = _run_steps(kind, shapes, 3, threads=2)
    _assert_bitwise(one, two)
    _assert_bitwise(two, _run_steps(kind, shapes, 3, threads=2))


def _digest():
    """sha256 of every tensor after a few steps of each optimizer, storage dtype and state format
    (docs/math.md "Low-precision state": its stochastic rounding too is bit-identical)."""
    h = hashlib.sha256()
    shapes = [(70001,), (4097,), (5,)]
    cases = [(d, "full") for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
    cases += [(d, sp) for d in (torch.float32, torch.bfloat16) for sp in ("bf16", "8bit")]
    for kind in ("lamb", "lars"):
        for dtype, precision in cases:
            params = [torch.nn.Parameter(t) for t in make_tensors(shapes, dtype, 0)]
            opt = _opt(kind, params, max_grad_norm=1.0, state_precision=precision)
            for step in range(2):
                _set_grads(params, step, torch.bfloat16 if dtype == torch.float32 else None)
                opt.step()
            for t in _snapshot(params, opt) + [CPP.sq_norms([p.detach() for p in params])]:
                h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _isa_digest(cap):
    """(clone that ran, _digest()) in a fresh process with FUSEDOPT_CPU_ISA=cap."""
    env = {**os.environ, "FUSEDOPT_CPU_ISA": cap, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = "import test_cpp; from fusedopt import _C; print(_C.cpu_isa(), test_cpp._digest())"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.dirname(__file__),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return tuple(out.stdout.strip().splitlines()[-1].split())


def test_isa_clones_are_bit_identical():
    """Note [ISA clones] in csrc/cpu/multi_tensor.h: every clone this CPU can run gives the
    baseline's bits (the clones this CPU lacks cannot be checked here)."""
    from fusedopt import _C
    runs = {cap: _isa_digest(cap) for cap in ("baseline", "avx2", "best")}
    assert runs["baseline"][0] == "baseline"
    ran = {isa for isa, _ in runs.values()}
    if ran == {"baseline"}:
        pytest.skip("this CPU has no AVX2: only the baseline clone runs")
    assert runs["best"][0] == _C.cpu_isa()
    assert len({digest for _, digest in runs.values()}) == 1, runs


# ------------------------------------------------------------------------------ kept layouts

def _steps_with(kind, dtype, kept, monkeypatch):
    """Four steps (global clipping, a tensor lr) with the kept layouts on or off (then every pass
    goes through torch.ops.fusedopt.*); returns the snapshot and the cache's layouts."""
    with monkeypatch.context() as m:
        if not kept:
            m.setattr(type(CPP), "bind", lambda self, b, check: False)
        params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, dtype, 0)]
        opt = _opt(kind, params, max_grad_norm=1.0, lr=torch.tensor(0.02))
        for step in range(4):
            _set_grads(params, step)
            opt.step()
        return _snapshot(params, opt), list(opt._cache.layouts.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_masters"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_kept_layouts_equal_the_operators_bit_for_bit(kind, dtype, monkeypatch):
    """Note [kept layout]: the optimizer keeps a C++ KeptLayout per bucket (in its step cache),
    and the steps it runs are the operators' steps, bit for bit."""
    from fusedopt import _C
    fast, layouts = _steps_with(kind, dtype, True, monkeypatch)
    slow, none = _steps_with(kind, dtype, False, monkeypatch)
    assert layouts and all(isinstance(h, _C.KeptLayout) for h in layouts)
    assert none == []
    _assert_bitwise(fast, slow)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_kept_layouts_let_go_of_the_grads(kind):
    """The kept layout holds no list past the step: after zero_grad(set_to_none=True) the grads
    of the last step are freed (their memory is what set_to_none saves until the next backward),
    and the next step still binds the same layout."""
    import gc
    import weakref

    params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, torch.float32, 0)]
    opt = _opt(kind, params, max_grad_norm=1.0)
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    handle = _handle(opt, 0)
    assert handle is not None
    grads = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    alive = [i for i, r in enumerate(grads) if r() is not None]
    assert not alive, f"the grads of params {alive[:5]} outlive zero_grad(set_to_none=True)"
    _set_grads(params, 2)
    opt.step()
    assert _handle(opt, 0) is handle  # the same layout went on
    assert all(float(opt.state[p]["step"]) == 3 for p in params)


def _change_in_place(params, opt):
    """Changes what three tensors near the end of the list hold without replacing the objects: a
    param's and a state tensor's ``.data`` (new storages) and a param's ``share_memory_()`` (same
    storage, new data)."""
    moved = []
    for t in (params[-3], opt.state[params[-5]]["step"]):
        before = t.data_ptr()
        t.data = t.data.clone()
        moved.append(t.data_ptr() != before)
    before = params[-4].data_ptr()
    params[-4].share_memory_()
    moved.append(params[-4].data_ptr() != before)
    assert all(moved)


def _both_ways_with_a_change(kind, extra, monkeypatch, change):
    """Four steps over ZOO (after ``extra`` tensors of 3 elements: above kTensorGrain the threads
    share the looking) through the kept layout and through the operators; ``change(params, opt)``
    runs before the third step and returns a check, run after the last. Both ways give the same
    bits."""
    runs = []
    for kept in (True, False):
        with monkeypatch.context() as m:
            if not kept:
                m.setattr(type(CPP), "bind", lambda self, b, check: False)
            shapes = [(3,)] * extra + list(ZOO)
            params = [torch.nn.Parameter(t) for t in make_tensors(shapes, torch.float32, 0)]
            opt = _opt(kind, params)
            for step in range(4):
                if step == 2:
                    check = change(params, opt)
                _set_grads(params, step)
                opt.step()
            check()
            runs.append(_snapshot(params, opt))
    _assert_bitwise(*runs)


EXTRA = pytest.mark.parametrize("extra", [0, 1500], ids=["zoo", "zoo+1500"])


@EXTRA
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_kept_layouts_follow_tensors_changed_in_place(kind, extra, monkeypatch):
    """Note [kept layout] in ops.h: the kept layout keeps its lists' data pointers between
    steps; when a tensor's data moves while the objects stay, bind sees the change, the step
    checks its lists in Python and binds them checked again, and steps the new data, as the
    operators do."""
    from fusedopt import functional

    def change(params, opt):
        handle = _handle(opt, 0)
        _change_in_place(params, opt)
        checked = []
        real_check = functional._check_group
        monkeypatch.setattr(functional, "_check_group",
                            lambda *a: checked.append(a) or real_check(*a))

        def check():  # checked once (the step after the change), bound to the same layout
            monkeypatch.setattr(functional, "_check_group", real_check)
            if handle is not None:
                assert _handle(opt, 0) is handle and len(checked) == 1
        return check
    _both_ways_with_a_change(kind, extra, monkeypatch, change)


@EXTRA
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_kept_layouts_materialize_a_copy_on_write_state(kind, extra, monkeypatch):
    """A state tensor lazily cloned between steps (copy-on-write storage, same data pointer): the
    step writes a copy of its own, the clone keeps its values, as with the operators."""
    key = "exp_avg" if kind == "lamb" else "momentum_buffer"

    def change(params, opt):
        state = opt.state[params[-3]][key]
        before = state.clone()
        lazy = torch._lazy_clone(state)

        def check():
            assert torch.equal(lazy, before) and not torch.equal(state, before)
        return check
    _both_ways_with_a_change(kind, extra, monkeypatch, change)


def test_kept_layouts_raise_when_a_changed_tensor_no_longer_fits():
    """A state tensor given data of another size between steps (``.data``): bind sees the
    change, and the step that checks again raises naming the param and the key, and changes
    nothing."""
    params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, torch.float32, 0)]
    opt = _opt("lamb", params)
    _set_grads(params, 0)
    opt.step()
    big = max(range(len(params)), key=lambda i: params[i].numel())
    opt.state[params[big]]["exp_avg"].data = torch.zeros(3)
    _set_grads(params, 1)
    before = _snapshot(params, opt)
    with pytest.raises(RuntimeError, match=rf"param {big} of those with grads.*state 'exp_avg' "
                                           r"must be .* got torch.float32 of shape \(3,\)"):
        opt.step()
    _assert_bitwise(_snapshot(params, opt), before)


def test_kept_layouts_are_made_again_when_the_state_is_replaced():
    params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, torch.float32, 0)]
    opt = _opt("lamb", params)
    _set_grads(params, 0)
    opt.step()
    first = _handle(opt, 0)
    assert first is not None
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors, a new cache
    opt.step()
    second = _handle(opt, 0)
    assert second is not None and second is not first
    opt.step()
    assert _handle(opt, 0) is second
    assert all(float(opt.state[p]["step"]) == 3 for p in params)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_kept_layout_sees_a_state_entry_that_is_no_tensor(kind):
    """A state entry replaced by something that is not a tensor after steps: the kept layout's
    bind cannot take it, the step checks its lists and names the entry, and changes nothing."""
    params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, torch.float32, 0)]
    opt = _opt(kind, params)
    _set_grads(params, 0)
    opt.step()
    key = "exp_avg_sq" if kind == "lamb" else "momentum_buffer"
    opt.state[params[2]][key] = 0.0
    before = _snapshot(params, opt)
    with pytest.raises(TypeError, match=rf"param group 0, param 2 of those with grads: state "
                                        rf"'{key}' is float, not a tensor"):
        opt.step()
    _assert_bitwise(_snapshot(params, opt), before)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_steps_bump_version_counters(kind):
    """Note [version counters] in ops.cpp: a tensor saved for backward and then stepped is caught
    by autograd, as with torch's optimizers; a skipped step (found_inf) bumps nothing. A 0-size
    tensor (no chunk) is written too: its step count."""
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3)),
              torch.nn.Parameter(torch.randn(0))]
    params += [torch.nn.Parameter(torch.randn(5)) for _ in range(600)]
    opt = _opt(kind, params)
    _set_grads(params, 0)
    loss = (params[0] * params[0]).sum()  # saves params[0]
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    versions = [t._version for t in _live_tensors(params, opt)]
    opt.step()
    assert [t._version for t in _live_tensors(params, opt)] == [v + 1 for v in versions]
    opt.found_inf = torch.ones(())
    opt.step()
    assert [t._version for t in _live_tensors(params, opt)] == [v + 1 for v in versions]


def _live_tensors(params, opt):
    return list(params) + [v for p in params for v in opt.state[p].values()]


# --------------------------------------------------------------------------- torch operators

def _hyper_tensor(kind, options):
    """The operators' ``hyper`` argument (Note [hyper fields] in csrc/cpu/ops.h) of ``options``."""
    from fusedopt import _hyper
    if kind == "lamb":
        return _hyper.encode(_hyper.lamb_hyper({**_hyper.LAMB_DEFAULTS, **options}))
    return _hyper.encode(_hyper.lars_hyper({**_hyper.LARS_DEFAULTS, **options}))


def _op_args(kind, n=3, masters=False):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (3, 4), (0,)][:n]
    dtype = torch.bfloat16 if masters else torch.float32
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    weights = [p.float() for p in params] if masters else params
    grads = [torch.randn(s, generator=gen) for s in shapes]
    steps = [torch.zeros((), dtype=torch.float32) for _ in shapes]
    lowp = params if masters else []
    gm, fi = torch.tensor(0.5), torch.tensor(0.0)
    sums = torch.rand(len(shapes), 2, generator=gen)
    lr = torch.tensor(0.1, dtype=torch.float64)
    ops = torch.ops.fusedopt
    if kind == "lamb":
        hyper = _hyper_tensor("lamb", dict(lr=0.1))
        m = [torch.zeros(s) for s in shapes]
        v = [torch.zeros(s) for s in shapes]
        return [(ops.lamb_pass1.default, (weights, grads, m, v, steps, hyper, gm, fi)),
                (ops.lamb_pass2.default, (weights, lowp, m, v, steps, sums, hyper, lr, fi))]
    hyper = _hyper_tensor("lars", dict(lr=0.1, weight_decay=1e-4))
    buf = [torch.zeros(s) for s in shapes]
    return [(ops.lars_pass1.default, (weights, grads, steps, hyper, gm, fi)),
            (ops.lars_pass2.default, (weights, lowp, grads, buf, steps, sums, hyper, lr, gm, fi))]


@pytest.mark.parametrize("masters", [False, True], ids=["plain", "masters"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_opcheck(kind, masters):
    """Schemas (mutation annotations), fake kernels and AOT dispatch of the operators."""
    for op, args in _op_args(kind, masters=masters):
        torch.library.opcheck(op, args)
    gen = torch.Generator().manual_seed(0)
    torch.library.opcheck(torch.ops.fusedopt.sq_norms.default,
                          ([torch.randn(5, generator=gen), torch.randn(0), torch.randn(3, 2)],))


def test_fake_tensor_mode():
    """The fake kernels give the shapes and dtypes of the real ones, without touching data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake(mode, a):
        if isinstance(a, torch.Tensor):
            return mode.from_tensor(a)
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            return [mode.from_tensor(x) for x in a]
        return a

    with FakeTensorMode() as mode:
        for kind in ("lamb", "lars"):
            (op1, args1), (op2, args2) = _op_args(kind)
            sums = op1(*[fake(mode, a) for a in args1])
            assert sums.shape == (3, 2) and sums.dtype == torch.float32
            assert op2(*[fake(mode, a) for a in args2]) is None
        out = torch.ops.fusedopt.sq_norms([torch.empty(4, dtype=torch.float64), torch.empty(2, 3)])
        assert out.shape == (2,) and out.dtype == torch.float64


# ------------------------------------------------------------------ the C++ side's Python API

def test_hyper_fields_of_cpp_are_the_dataclass_fields_in_order():
    """Note [hyper fields]: the C++ tables read the hyper tensor as the fields of LambHyper /
    LarsHyper in declaration order, which is how fusedopt._hyper.encode writes it."""
    from fusedopt import _C, _hyper
    assert tuple(_C.lamb_fields()) == _hyper.LAMB_FIELDS
    assert tuple(_C.lars_fields()) == _hyper.LARS_FIELDS


def test_hyper_tensor_is_checked():
    (op, args), _ = _op_args("lamb")
    bad = list(args)
    bad[5] = args[5][:-1]
    with pytest.raises(RuntimeError, match=r"hyper must be a contiguous float64 CPU tensor of 16 "
                                           r"values"):
        op(*bad)
    bad[5] = args[5].float()
    with pytest.raises(RuntimeError, match="hyper must be"):
        op(*bad)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_bound_grads_are_released_when_the_step_raises(kind):
    """The kept layout of group 0 binds (and holds) its grads, then group 1 is refused; the step
    raises and group 0's layout lets go of the grads all the same (Backend.end)."""
    import gc
    import weakref

    a = [torch.nn.Parameter(torch.randn(50)) for _ in range(3)]
    b = [torch.nn.Parameter(torch.randn(7))]
    opt = _opt(kind, [{"params": a}, {"params": b}])
    for step in range(2):
        _set_grads(a + b, step)
        opt.step()
    assert _handle(opt, 0) is not None
    _set_grads(a + b, 2)
    opt.param_groups[1]["lr"] = -1.0
    with pytest.raises(ValueError, match="param group 1: Invalid lr"):
        opt.step()
    refs = [weakref.ref(p.grad) for p in a]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs), "a refused step kept the grads alive"


def test_native_scans_equal_their_python_fallbacks():
    """Note [native scans]: fusedopt._C's C loops over a list of tensors give what the Python
    loops used without the extension give, on tensors of every layout the engine meets (views
    with offsets, non-contiguous, empty, Parameters, other dtypes and devices) and on entries
    that are not tensors."""
    from fusedopt import _bucket, _C

    base = torch.randn(8, 6)
    meta = torch.empty(3, device="meta")
    tensors = [base, base[1:], base.t(), base[:, ::2], torch.empty(0), torch.nn.Parameter(
        torch.randn(5)), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(7, dtype=torch.uint8),
        torch.zeros((), dtype=torch.float64), base.view(48)[3:].view(9, 5)]
    assert _C.data_ptrs(tensors) == _bucket.py_data_ptrs(tensors)
    assert _C.numels(tensors) == _bucket.py_numels(tensors)
    assert _C.data_ptrs([]) == b"" == _C.numels([])
    dtypes = (torch.bfloat16, torch.uint8)
    assert _C.dtype_codes(tensors, dtypes) == _bucket.py_dtype_codes(tensors, dtypes)
    assert set(_C.dtype_codes(tensors, dtypes)) == {0, 1, 2}
    assert _C.dtype_codes([base, None, 1, meta], (torch.float32,)) == bytes([1, 0, 0, 1])
    cpu = torch.device("cpu")
    for xs in (tensors, tensors[:2], [base, base.clone()], [base, meta], [base, None], [base, 1],
               [base.to_sparse()], [torch.nn.Parameter(base)], []):
        for dtypes in ((torch.float32,), (torch.bfloat16, torch.float32)):
            assert _C.dtype_codes(xs, dtypes) == _bucket.py_dtype_codes(xs, dtypes)
        for dtype in (torch.float32, torch.bfloat16):
            for device in (cpu, meta.device):
                assert _C.dense(xs, dtype, device) == _bucket.py_dense(xs, dtype, device)
    assert _C.dense([base, base[1:]], torch.float32, cpu)
    assert not _C.dense([base, base.t()], torch.float32, cpu)
    with pytest.raises(TypeError, match=r"data_ptrs: tensors\[1\] is not a tensor"):
        _C.data_ptrs([base, None])

    class Logged(torch.Tensor):  # reads .grad through __torch_function__
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)] + [
        torch.randn(2, requires_grad=True), torch.randn(2).as_subclass(Logged).requires_grad_()]
    for p in params[::2]:
        p.grad = torch.randn_like(p)
    for ps in (params, tuple(params), []):
        got, want = _C.grads(ps), _bucket.py_grads(ps)
        assert len(got) == len(want) and all(map(operator.is_, got, want))
    assert [g is None for g in _C.grads(params)] == [False, True, False, True, False]
    with pytest.raises(AttributeError):
        _C.grads([params[0], 1])
