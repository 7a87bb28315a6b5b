"""The CUDA backend (``backend="cuda"``, csrc/cuda) on a GPU: float64-reference parity for every
flag of docs/math.md, low precision with master weights, the GradScaler protocol, launches per step, no host
synchronization, deterministic norms and tensors over 2**31 elements.

These tests need a CUDA device and the ``fusedopt._cuda`` extension (built by setup.py with a CUDA
build of torch and nvcc); without them they are skipped with the reason, and only the availability
tests at the end run. tests/test_cuda_compile.py checks the sources compile without a GPU.
"""
from __future__ import annotations

import io
import math

import pytest
import torch

import fusedopt
from fusedopt import backends, lowp
from fusedopt.testing import (REL_TOL, SHAPES_SMALL, assert_within_rounding, make_inputs,
                              max_rel_err, option_cases, run_backend, run_optimizer)

LAMB_CASES, LARS_CASES = option_cases("lamb"), option_cases("lars")
pytestmark = pytest.mark.gpu  # scripts/gpu_verify.py runs this file on a GPU


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if backends.get_backend("cuda") is None:
        return f"the CUDA extension is not usable: {backends.load_error('cuda')}"
    return None


SKIP = _skip_reason()
gpu = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
CHUNK = 65536  # kChunkSize of csrc/cuda/launch.h
# SHAPES_SMALL (0-size, 1 element, odd sizes) plus a tensor of three chunks with a partial last
# group, so that multi-chunk norms, the vectorized path and the scalar tail all run.
SHAPES = [*SHAPES_SMALL, (2 * CHUNK + 4099,)]
CASES = {"lamb": LAMB_CASES, "lars": LARS_CASES}
LOW = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _cuda(kind, hyper, **kw):
    kw.setdefault("steps", 6)
    return run_backend(kind, "cuda", kw.pop("shapes", SHAPES), hyper, device="cuda", **kw)


def _optimizer(kind, params, **kw):
    if kind == "lamb":
        return fusedopt.FusedLAMB(params, **{"lr": 1e-2, "backend": "cuda", **kw})
    return fusedopt.FusedLARS(params, **{"lr": 0.5, "weight_decay": 1e-4, "backend": "cuda", **kw})


def _params(shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to("cuda", dtype)) for s in shapes]


def _set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to("cuda", p.dtype)


def _snapshot(params, opt):
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [v.clone() for v in opt.state[p].values() if torch.is_tensor(v)]
    return out


# ------------------------------------------------------------------------ float64 reference
@gpu
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.float64, id="fp64")])
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_matches_reference(case, dtype):
    params, ref, _ = _cuda("lamb", LAMB_CASES[case], dtype=dtype, zero_weight=1, zero_grad=3,
                           excluded=(5,))
    assert max_rel_err(params, ref) <= REL_TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.float64, id="fp64")])
@pytest.mark.parametrize("case", list(LARS_CASES))
def test_lars_matches_reference(case, dtype):
    params, ref, _ = _cuda("lars", LARS_CASES[case], dtype=dtype, zero_weight=1, zero_grad=3,
                           excluded=(5,))
    assert max_rel_err(params, ref) <= REL_TOL[dtype]


@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_low_precision_grads_with_fp32_params(kind):
    params, ref, _ = _cuda(kind, {}, grad_dtype=torch.bfloat16, steps=4)
    assert max_rel_err(params, ref) <= REL_TOL[torch.float32]


@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_hundreds_of_tensors_split_over_launches(kind):
    shapes = [(1 + i % 7,) for i in range(300)] + [(18011,), (0,)]
    params, ref, _ = _cuda(kind, dict(max_grad_norm=1.0), shapes=shapes, steps=4)
    assert max_rel_err(params, ref) <= REL_TOL[torch.float32]


@gpu
def test_tensor_lr_is_read_on_the_device():
    lr = torch.tensor(0.5, device="cuda")
    a = _params(SHAPES)
    b = _params(SHAPES)
    opt_a = _optimizer("lars", a, lr=lr)
    opt_b = _optimizer("lars", b, lr=0.5)
    for step in range(3):
        _set_grads(a, step)
        _set_grads(b, step)
        opt_a.step()
        opt_b.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------- low precision
@gpu
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind,case", [("lamb", "default"), ("lamb", "decoupled"),
                                       ("lars", "default"), ("lars", "torch_sgd_nesterov")])
def test_master_weights_follow_fp32_reference(kind, case, dtype):
    params, ref, opt = _cuda(kind, CASES[kind][case], dtype=dtype, zero_weight=1, excluded=(5,),
                             master_weights=True)
    masters = [opt.state[p]["master_param"] for p in params]
    assert all(m.dtype == torch.float32 for m in masters)
    assert max_rel_err(masters, ref) <= 1e-5
    for p, m in zip(params, masters):  # written in the same pass, rounded to nearest even
        assert torch.equal(p.detach(), m.to(dtype))


@gpu
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_low_precision_without_masters_is_within_rounding(kind, dtype):
    kw = dict(dtype=dtype, steps=4, master_weights=False)
    fast, ref, _ = _cuda(kind, {}, **kw)
    eager, _, _ = run_backend(kind, "eager", SHAPES, {}, device="cuda", **kw)
    assert_within_rounding(fast, eager, ref, atol=1e-2 if dtype == torch.float16 else 4e-2)


# ------------------------------------------------------------------- GradScaler protocol
@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_found_inf_makes_the_whole_step_a_no_op(kind):
    params = _params(SHAPES, dtype=torch.bfloat16)
    opt = _optimizer(kind, params, master_weights=True)
    _set_grads(params, 1)
    opt.step()
    before = _snapshot(params, opt)
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    opt.grad_scale = torch.tensor(1024.0, device="cuda")
    opt.found_inf = torch.tensor(1.0, device="cuda")
    opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(params, opt)))
    assert all(opt.state[p]["step"].item() == 1.0 for p in params)
    opt.found_inf = torch.tensor(0.0, device="cuda")
    _set_grads(params, 2)
    opt.step()
    assert all(opt.state[p]["step"].item() == 2.0 for p in params)


@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_grad_scale_and_clipping_match_eager(kind):
    out = []
    for backend in ("cuda", "eager"):
        params = _params(SHAPES)
        opt = _optimizer(kind, params, backend=backend, max_grad_norm=0.5)
        for step in range(3):
            _set_grads(params, step)
            for p in params:
                p.grad.mul_(1024.0)
            opt.grad_scale = torch.tensor(1024.0, device="cuda")
            opt.found_inf = torch.tensor(0.0, device="cuda")
            opt.step()
        out.append(params)
    fast, slow = out
    assert max_rel_err(fast, [s.detach().double().cpu() for s in slow]) <= 1e-6


@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_grad_scaler_skips_an_overflowing_step(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4)).cuda()
    opt = _optimizer(kind, model.parameters())
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    x = torch.randn(32, 8, device="cuda")
    scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    before = _snapshot(list(model.parameters()), opt)
    opt.zero_grad()
    scaler.scale(model(x).square().mean()).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(list(model.parameters()), opt)))


# ------------------------------------------------------------ launches, syncs, determinism
def _kernels_of_one_step(opt, params):
    from torch.profiler import ProfilerActivity, profile

    _set_grads(params, 0)
    opt.step()  # state creation happens on the first step
    _set_grads(params, 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_launches_per_step(kind):
    """Pass 1: a chunk kernel and a reduction per table; pass 2: a chunk kernel per table; nothing
    else (no copies, no memsets, no extra kernels)."""
    params = _params([(3, 5), (4097,), (2 * CHUNK + 1,)])
    names = _kernels_of_one_step(_optimizer(kind, params), params)
    assert len(names) == 3, names
    assert not any(n.startswith(("Memcpy", "Memset")) for n in names), names
    many = _params([(5,)] * 200)
    names = _kernels_of_one_step(_optimizer(kind, many), many)
    assert len(names) <= 3 * math.ceil(200 / 48), names  # >= 48 tensors per table


@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_step_does_not_synchronize(kind):
    params = _params(SHAPES, dtype=torch.bfloat16)
    opt = _optimizer(kind, params, max_grad_norm=1.0, master_weights=True,
                     lr=torch.tensor(0.1, device="cuda"))
    _set_grads(params, 0)
    opt.step()
    _set_grads(params, 1)
    opt.grad_scale = torch.tensor(2.0, device="cuda")
    opt.found_inf = torch.tensor(0.0, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@pytest.mark.parametrize("lr_device", ["cpu", "cuda"])
@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_tensor_lr_steps_without_a_host_sync(kind, lr_dtype, lr_device):
    """Note [CPU tensor lr]: a CPU tensor lr is read on the host (no copy, no sync) and a device
    one by the kernels (cast to float64 on the device); both give the bits of the number lr."""
    value = 0.05

    def run(lr, sync_mode=None):
        params = _params(SHAPES)
        opt = _optimizer(kind, params, lr=lr, max_grad_norm=1.0)
        for step in range(3):
            _set_grads(params, step)
            if step:  # the first step reads a new tensor lr once (Note [group plans])
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode(sync_mode or "default")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return params

    expect = run(value)
    got = run(torch.tensor(value, dtype=lr_dtype, device=lr_device), "error")
    assert all(torch.equal(x, y) for x, y in zip(got, expect))


two_gpus = pytest.mark.skipif(SKIP is not None or torch.cuda.device_count() < 2,
                              reason=str(SKIP or "needs a second CUDA device"))


@two_gpus
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_a_second_device(kind, backend):
    """Params on cuda:1 while cuda:0 is the current device: the step launches on the params'
    device (its tables, scalars and a device tensor lr there), without a host sync, and gives the
    bits of the same steps on cuda:0."""
    if backends.get_backend(backend) is None:
        pytest.skip(f"backend {backend!r} is not available: {backends.load_error(backend)}")

    def run(device, sync_mode="default"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]
        opt = _optimizer(kind, params, backend=backend, max_grad_norm=1.0,
                         lr=torch.tensor(0.05, device=device))
        for step in range(3):
            g = torch.Generator().manual_seed(10 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device)
            if step:
                torch.cuda.synchronize(device)
                torch.cuda.set_sync_debug_mode(sync_mode)
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [p.detach().cpu() for p in params]

    with torch.cuda.device(0):
        expect = run(torch.device("cuda", 0))
        got = run(torch.device("cuda", 1), "error")
    assert all(torch.equal(x, y) for x, y in zip(got, expect))


@gpu
def test_cpu_tensor_lr_is_refused_in_a_capture():
    params = _params(SHAPES)
    _set_grads(params, 0)
    opt = _optimizer("lamb", params, lr=torch.tensor(0.05))
    opt.step()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CPU tensor lr cannot be captured"):
        with torch.cuda.graph(graph):
            opt.step()


@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_step_can_be_captured_in_a_cuda_graph(kind):
    def make():
        params = _params(SHAPES)
        _set_grads(params, 0)  # static grads, read by every replay
        return params, _optimizer(kind, params, lr=torch.tensor(0.05, device="cuda"),
                                  capturable=True)

    plain, opt = make()
    for _ in range(5):
        opt.step()
    graphed, opt = make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(plain, graphed))
    assert all(opt.state[p]["step"].item() == 5.0 for p in graphed)


@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_runs_are_bit_identical(kind):
    a, _, _ = _cuda(kind, {}, steps=3)
    b, _, _ = _cuda(kind, {}, steps=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@gpu
def test_results_do_not_depend_on_alignment():
    """Note [vectorization]: misaligned tensors take the scalar path with the same order."""
    n = 3 * CHUNK + 13
    out = []
    for offset in (0, 1):
        base = torch.zeros(n + 8, device="cuda")
        gen = torch.Generator().manual_seed(0)
        base[offset:offset + n] = torch.randn(n, generator=gen).cuda()
        p = torch.nn.Parameter(base[offset:offset + n])
        assert (p.data_ptr() % 16 == 0) == (offset == 0)
        opt = _optimizer("lamb", [p])
        for step in range(3):
            gen = torch.Generator().manual_seed(10 + step)
            g = torch.zeros(n + 8, device="cuda")
            g[offset:offset + n] = torch.randn(n, generator=gen).cuda()
            p.grad = g[offset:offset + n]
            opt.step()
        out.append(p.detach().clone())
    assert torch.equal(out[0], out[1])


@gpu
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_low_precision_state_follows_eager(kind, precision):
    """bf16 and 8-bit state on the GPU (docs/math.md "Low-precision state"): the formats and the
    random bits of the stochastic rounding are those of the eager backend (and of cpp, which
    equals eager bit for bit), so over 4 steps the params agree with an eager run on the CPU to
    float32 accuracy (the two reduce their norms in different orders, so the trust ratios differ
    by rounding) and the stored moments decode to the eager values except where such a rounding
    difference moves a value across a code boundary. Tensors of several chunks, blocks cut by a
    tensor's end and a tensor under state_min_numel (fp32 state) in one launch.
    tests/test_cuda_lowp.py checks every stored bit against cpp under the SIMT emulation."""
    shapes = [(40, 130), (300,), (2 * CHUNK + 4099,), (7,)]
    inputs = make_inputs(shapes, 4, seed=3)
    hyper = dict(state_precision=precision, state_min_numel=256)
    got, opt = run_optimizer(kind, "cuda", hyper, inputs, device="cuda")
    want, ref = run_optimizer(kind, "eager", hyper, inputs)
    for p, w in zip(got, want):
        p = p.detach().cpu()
        close = torch.isclose(p, w.detach(), rtol=2e-5, atol=2e-6)
        assert close.float().mean() > 0.998, close.float().mean()
        torch.testing.assert_close(p, w.detach(), rtol=0, atol=1e-4)
    for p, w in zip(got, want):
        for key, v in ref.state[w].items():
            mine = opt.state[p][key]
            if key == "step":
                assert float(mine) == float(v)
                continue
            # what the key's format stores (8-bit: LAMB's d and s, LARS's buffer)
            a = lowp.read(mine, p.shape, key).cpu().double()
            b = lowp.read(v, w.shape, key).double()
            off = ~torch.isclose(a, b, rtol=1e-5, atol=1e-12)
            assert off.float().mean() < 0.01, (key, off.float().mean())


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_sq_norms(dtype):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=gen).to("cuda", dtype)
          for s in [(4097,), (1,), (0,), (3 * CHUNK + 5,)]]
    xs.append(torch.randn(6, 4, generator=gen).to("cuda", dtype).t())  # dense, not contiguous
    be = backends.get_backend("cuda")
    out = be.sq_norms(xs)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(be.sq_norms(xs), out)
    expect = torch.stack([(x.double() ** 2).sum() for x in xs]).to(out.dtype)
    # float32 accumulation: runs of 128 squares per thread, then fixed-order trees
    torch.testing.assert_close(out, expect, rtol=5e-6 if dtype != torch.float64 else 1e-12, atol=0)


@gpu
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_state_dict_round_trip_continues_bit_for_bit(kind):
    def run(steps_a, steps_b):
        params = _params(SHAPES)
        opt = _optimizer(kind, params)
        for s in range(steps_a):
            _set_grads(params, s)
            opt.step()
        if steps_b:
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            buf.seek(0)
            opt = _optimizer(kind, params)
            opt.load_state_dict(torch.load(buf))
            for s in range(steps_a, steps_a + steps_b):
                _set_grads(params, s)
                opt.step()
        return params

    assert all(torch.equal(x, y) for x, y in zip(run(5, 0), run(3, 2)))


@gpu
def test_auto_prefers_cuda_on_cuda_tensors():
    be = backends.resolve("auto", torch.device("cuda"), torch.float32, torch.float32)
    assert be.name == "cuda"


@gpu
@pytest.mark.slow
def test_tensor_over_2_31_elements():
    n = 2**31 + 4097
    need = n * (2 + 2 + 4) + (1 << 30)  # fp16 param and grad, fp32 momentum, slack
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    far = [2**31 + 5, n - 1]
    x = torch.zeros(n, dtype=torch.float16, device="cuda")
    x[far[0]], x[far[1]] = 2.0, 3.0
    assert backends.get_backend("cuda").sq_norms([x]).item() == 13.0
    del x
    # zero weight: trust ratio 1 (zero-norm rule); w <- -lr*g where g is nonzero
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float16, device="cuda"))
    p.grad = torch.zeros_like(p)
    p.grad[far] = 1.0
    opt = fusedopt.FusedLARS([p], lr=0.5, backend="cuda", master_weights=False)
    opt.step()
    assert p[far].tolist() == [-0.5, -0.5]
    assert p[: 2**31].count_nonzero().item() == 0


# -------------------------------------------------------------------------- availability
def test_unavailable_reasons_name_device_and_dtypes():
    from fusedopt.backends.cuda import CudaBackend

    be = object.__new__(CudaBackend)  # the reasons need no extension
    assert "cpu" in be.unavailable_reason(torch.device("cpu"), torch.float32, torch.float32)
    cuda = torch.device("cuda")
    assert be.unavailable_reason(cuda, torch.float32, torch.bfloat16) is None
    assert be.unavailable_reason(cuda, torch.bfloat16, torch.float32) is None
    assert be.unavailable_reason(cuda, torch.float64, torch.float64) is None
    reason = be.unavailable_reason(cuda, torch.bfloat16, torch.float16)
    assert "torch.bfloat16" in reason and "torch.float16" in reason
    assert "float64" in be.unavailable_reason(cuda, torch.float64, torch.float32)
    assert "int32" in be.unavailable_reason(cuda, torch.int32, torch.int32)


def test_cpu_tensor_lr_is_refused_in_a_capture_before_any_launch(monkeypatch):
    """Note [CPU tensor lr]: ``prepare`` refuses it while the bucket's stream captures (mocked:
    no device here), and lets a device tensor lr or a number lr through."""
    import contextlib
    import types

    from fusedopt.backends.cuda import CudaBackend

    be = object.__new__(CudaBackend)  # prepare needs no extension
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    b = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="CPU tensor lr cannot be captured in a CUDA graph"):
        be.prepare(b, "lamb", types.SimpleNamespace(lr=torch.tensor(0.1)), False, False, False)
    be.prepare(b, "lamb", types.SimpleNamespace(lr=0.1), False, False, False)
    be.prepare(b, "lamb", types.SimpleNamespace(lr=torch.empty((), device="meta")), False, False,
               False)  # a tensor lr elsewhere than the CPU: read by the kernels
    capturing[0] = False
    be.prepare(b, "lamb", types.SimpleNamespace(lr=torch.tensor(0.1)), False, False, False)


@pytest.mark.skipif(backends.get_backend("cuda") is not None, reason="the CUDA extension is built")
def test_missing_extension_is_reported_with_guidance():
    assert "fusedopt._cuda" in backends.load_error("cuda")
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match=r"backend='cuda' is not available.*pip install"):
        fusedopt.FusedLAMB([p], backend="cuda").step()
