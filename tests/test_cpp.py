"""The C++ CPU backend (backend="cpp"): against the float64 reference, against eager, and against
itself (thread counts, ISA clones); its torch.ops.fusedopt.* operators and their fake kernels.
State-dict round trips, tensor lr and allocations inside step() are tested for every backend
(tests/test_optimizer_api.py, tests/test_amp.py, tests/test_memory.py)."""
import copy
import hashlib
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
    """The C++ BucketLists the cpp backend keeps for param group ``gi`` in the list cache (Note
    [list cache] in fusedopt/optim.py), or None."""
    entry = opt._lists.get(gi)
    kept = None if entry is None or entry.group.cache is None else entry.group.cache.get("buckets")
    if kept is None:
        return None
    _, _, (_, bucket, _, _) = kept
    return bucket.handles.get("cpp")


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_steady_steps_go_through_the_bucket_lists(kind, monkeypatch):
    """After the first step, a step whose lists did not change calls the kept BucketLists (Note
    [static lists]), not the torch.ops operators, which convert every list on every call."""
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
    for step in range(1, 3):
        _set_grads(params, step)
        opt.step()
    assert _handle(opt, 0) is not None
    assert not [c for c in calls if "pass" in c], f"steady steps called the operators {calls}"


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_4000_tiny_tensors(kind):
    shapes = [(3,)] * 4000 + [(18011,)]
    params, ref, _ = run_backend(kind, "cpp", shapes, HYPER[kind], steps=2, zero_weight=7)
    assert max_rel_err(params, ref) <= 1e-5


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_bf16_grads_with_fp32_params(kind):
    params, ref, _ = run_backend(kind, "cpp", ZOO, HYPER[kind], grad_dtype=torch.bfloat16)
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

@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_grad_scale_unscales(kind):
    """opt.grad_scale (GradScaler's protocol): grads read as g / scale, never modified."""
    a = [torch.nn.Parameter(t) for t in make_tensors(ZOO, torch.float32, 0)]
    b = [torch.nn.Parameter(t) for t in make_tensors(ZOO, torch.float32, 0)]
    opt_a, opt_b = _opt(kind, a, max_grad_norm=1.0), _opt(kind, b, max_grad_norm=1.0)
    opt_b.grad_scale = torch.tensor(1024.0)
    for step in range(3):
        _set_grads(a, step)
        _set_grads(b, step)
        for p in b:
            p.grad.mul_(1024.0)
        scaled = [p.grad.clone() for p in b]
        opt_a.step()
        opt_b.step()
        _assert_bitwise([p.grad for p in b], scaled)
    for x, y in zip(a, b):  # scaling by a power of two is exact
        _assert_bitwise([x.detach()], [y.detach()])


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16_masters")])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_found_inf_changes_nothing(kind, dtype):
    params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, dtype, 0)]
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
    """sha256 of every tensor after a few steps of each optimizer and storage dtype."""
    h = hashlib.sha256()
    shapes = [(70001,), (4097,), (5,)]
    for kind in ("lamb", "lars"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            params = [torch.nn.Parameter(t) for t in make_tensors(shapes, dtype, 0)]
            opt = _opt(kind, params, max_grad_norm=1.0)
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


# ------------------------------------------------------------------------------ static lists

def _steps_with(kind, dtype, static_lists, monkeypatch):
    """Four steps (global clipping, a tensor lr) with BucketLists on or off (then every pass goes
    through torch.ops.fusedopt.*); returns the snapshot and the list cache's cpp handles."""
    with monkeypatch.context() as m:
        m.setattr(type(CPP), "_has_static_lists", static_lists)
        params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, dtype, 0)]
        opt = _opt(kind, params, max_grad_norm=1.0, lr=torch.tensor(0.02))
        for step in range(4):
            _set_grads(params, step)
            opt.step()
        return _snapshot(params, opt), [_handle(opt, gi) for gi in opt._lists]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_masters"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_static_lists_equal_the_operators_bit_for_bit(kind, dtype, monkeypatch):
    """Note [static lists]: the optimizer keeps a C++ BucketLists per cached bucket (in the list
    cache's handles, Note [list cache]), and the steps it runs are the operators' steps, bit for
    bit."""
    from fusedopt import _C
    fast, handles = _steps_with(kind, dtype, True, monkeypatch)
    slow, no_handles = _steps_with(kind, dtype, False, monkeypatch)
    assert handles and all(isinstance(h, _C.BucketLists) for h in handles)
    assert no_handles == [None]
    _assert_bitwise(fast, slow)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_cached_lists_let_go_of_the_grads(kind):
    """The list cache and the C++ BucketLists keep no grad past the step: after
    zero_grad(set_to_none=True) the grads of the last step are freed (their memory is what
    set_to_none saves until the next backward), and the next step still hits the cache."""
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
    assert _handle(opt, 0) is handle  # the same lists went on
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
    share the looking) through BucketLists and through the operators; ``change(params, opt)`` runs
    before the third step and returns a check, run after the last. Both ways give the same bits."""
    runs = []
    for static_lists in (True, False):
        with monkeypatch.context() as m:
            m.setattr(type(CPP), "_has_static_lists", static_lists)
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
def test_static_lists_follow_tensors_changed_in_place(kind, extra, monkeypatch):
    """Note [checked lists] in ops.cpp: BucketLists keeps its static lists' data pointers between
    steps; when a tensor's data moves while the objects stay (so the state mapping saw no edit),
    BucketLists.accepts sees the change, the step gathers its lists again (checking them all) and
    steps the new data, as the operators do."""
    def change(params, opt):
        handle = _handle(opt, 0)
        edits = opt.state.edits
        _change_in_place(params, opt)
        assert opt.state.edits == edits

        def check():  # lists gathered again, with a new BucketLists (none on the operators' run)
            if handle is not None:
                assert _handle(opt, 0) is not None and _handle(opt, 0) is not handle
        return check
    _both_ways_with_a_change(kind, extra, monkeypatch, change)


@EXTRA
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_static_lists_materialize_a_copy_on_write_state(kind, extra, monkeypatch):
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


def test_static_lists_raise_when_a_changed_tensor_no_longer_fits():
    """A state tensor given data of another size between steps (``.data``: the state mapping sees
    no edit): BucketLists.accepts sees the change, and the step that gathers again raises naming
    the param and the key, and changes nothing."""
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


def test_static_lists_are_rebuilt_when_the_state_is_replaced():
    params = [torch.nn.Parameter(t) for t in make_tensors(ZOO, torch.float32, 0)]
    opt = _opt("lamb", params)
    _set_grads(params, 0)
    opt.step()
    first = _handle(opt, 0)
    assert first is not None
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors
    opt.step()
    second = _handle(opt, 0)
    assert second is not None and second is not first
    opt.step()
    assert _handle(opt, 0) is second
    assert all(float(opt.state[p]["step"]) == 3 for p in params)


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

def _hyper_list(kind, values):
    """The operators' ``hyper`` argument: ``values`` in the order the C++ side reads them (Note
    [hyper fields] in csrc/cpu/ops.h, as ``CppBackend.fields``); every field given, no other."""
    fields = CPP.fields[kind]
    assert sorted(fields) == sorted(values)
    return [float(values[name]) for name in fields]


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
        hyper = _hyper_list("lamb", dict(
            lr=0.1, beta1=0.9, beta2=0.999, beta3=0.1, eps=1e-6, weight_decay=0.01, ratio_lo=0.0,
            ratio_hi=float("inf"), one_minus_beta2=0.001, lambda_in_u=0.01, bias_correction=1,
            adapt=1, decoupled=0, bounded=0))
        m = [torch.zeros(s) for s in shapes]
        v = [torch.zeros(s) for s in shapes]
        return [(ops.lamb_pass1.default, (weights, grads, m, v, steps, hyper, gm, fi)),
                (ops.lamb_pass2.default, (weights, lowp, m, v, steps, sums, hyper, lr, fi))]
    hyper = _hyper_list("lars", dict(
        lr=0.1, momentum=0.9, dampening=0.0, weight_decay=1e-4, trust_coefficient=1e-3, eps=1e-8,
        one_minus_dampening=1.0, nesterov=0, trust_clip=0, combined=0, lr_in_momentum=1, adapt=1))
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

def test_c_extension_exposes_the_list_cache_api_only():
    """The plan cache's identity scans and the grads taken in C++ are gone (Note [list cache] in
    fusedopt/optim.py replaced them); BucketLists takes each step's grads as an argument."""
    from fusedopt import _C
    for gone in ("entries_are", "items_are", "dict_items_are", "take_grads",
                 "taken_grad_sq_norms"):
        assert not hasattr(_C, gone), gone
        assert not hasattr(_C.BucketLists, gone), gone
    for gone in ("take_cached_grads", "fits_cached_bucket"):
        assert not hasattr(backends.Backend, gone) and not hasattr(CPP, gone), gone
    for method in ("accepts", "lamb_pass1", "lamb_pass2", "lars_pass1", "lars_pass2"):
        assert hasattr(_C.BucketLists, method), method


def test_hyper_fields_come_from_cpp_and_name_hyper_attributes():
    """Note [hyper fields]: CppBackend.fields is the C++ enums' order, and every name is a field
    of LambHyper / LarsHyper (Python fills the doubles by name)."""
    import dataclasses

    from fusedopt import _C
    from fusedopt._hyper import LambHyper, LarsHyper
    assert CPP.fields == {"lamb": tuple(_C.lamb_fields()), "lars": tuple(_C.lars_fields())}
    for kind, cls in (("lamb", LambHyper), ("lars", LarsHyper)):
        fields = CPP.fields[kind]
        names = {f.name for f in dataclasses.fields(cls)}
        assert fields and len(set(fields)) == len(fields), fields
        assert all(isinstance(n, str) for n in fields)
        missing = [n for n in fields if n not in names]
        assert not missing, f"{kind}: {missing} are not fields of {cls.__name__}"
        assert "lr" in fields


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_taken_grads_are_released_when_the_step_raises(kind):
    """Note [taken grads]: the kept bucket of group 0 accepts (and holds) its grads, then group 1
    is refused; the step raises and group 0's BucketLists lets go of the grads all the same."""
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
