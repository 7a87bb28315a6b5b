"""Mixed precision: fp32 master weights, GradScaler without host syncs, tensor lr, no host reads."""
import contextlib
import io

import pytest
import torch

import fusedopt
from fusedopt.testing import (SHAPES_SMALL, assert_within_rounding, max_rel_err, option_cases,
                              run_backend)
from helpers import backend_params

BACKENDS = backend_params()
LOW = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
CASES = {"lamb": option_cases("lamb"), "lars": option_cases("lars")}


def optimizer(kind, params, **kw):
    if kind == "lamb":
        return fusedopt.FusedLAMB(params, **{"lr": 1e-2, **kw})
    return fusedopt.FusedLARS(params, **{"lr": 0.5, "weight_decay": 1e-4, **kw})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind,case", [("lamb", "default"), ("lamb", "clip"), ("lamb", "decoupled"),
                                       ("lars", "default"), ("lars", "torch_sgd_nesterov")])
def test_master_weights_follow_fp32_reference(backend, dtype, kind, case):
    params, ref, opt = run_backend(kind, backend, SHAPES_SMALL, CASES[kind][case], dtype=dtype,
                                   steps=6, zero_weight=1, excluded=(5,))
    masters = [opt.state[p]["master_param"] for p in params]
    assert all(m.dtype == torch.float32 for m in masters)
    assert max_rel_err(masters, ref) <= 1e-5
    for p, m in zip(params, masters):  # the param is the master rounded to nearest even
        assert torch.equal(p.detach(), m.to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_low_precision_without_master_weights_is_within_rounding(backend, dtype, kind):
    kw = dict(dtype=dtype, steps=4, master_weights=False)
    fast, ref, opt = run_backend(kind, backend, SHAPES_SMALL, {}, **kw)
    eager, _, _ = run_backend(kind, "eager", SHAPES_SMALL, {}, **kw)
    assert all("master_param" not in s for s in opt.state.values())
    assert all(s["exp_avg" if kind == "lamb" else "momentum_buffer"].dtype == torch.float32
               for s in opt.state.values())
    assert_within_rounding(fast, eager, ref, atol=1e-2 if dtype == torch.float16 else 4e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_master_weights_state_dict_round_trip_is_bit_for_bit(backend, kind):
    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).to(torch.bfloat16)
        return m, optimizer(kind, m.parameters(), backend=backend)

    def train(m, opt, seed, steps):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad()
            m(torch.randn(4, 5, generator=gen).to(torch.bfloat16)).float().square().mean().backward()
            opt.step()

    m_full, o_full = make()
    train(m_full, o_full, 1, 3)
    train(m_full, o_full, 2, 3)
    m_a, o_a = make()
    train(m_a, o_a, 1, 3)
    buf = io.BytesIO()
    torch.save((m_a.state_dict(), o_a.state_dict()), buf)
    buf.seek(0)
    msd, osd = torch.load(buf)
    m_b, o_b = make()
    m_b.load_state_dict(msd)
    o_b.load_state_dict(osd)
    st = o_b.state[next(iter(m_b.parameters()))]
    assert st["master_param"].dtype == torch.float32  # not cast to the param's bf16
    train(m_b, o_b, 2, 3)
    for p, q in zip(m_full.parameters(), m_b.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(m_full.parameters(), m_b.parameters()):
        assert torch.equal(o_full.state[p]["master_param"], o_b.state[q]["master_param"])


def _amp_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _full_snapshot(model, opt):
    tensors = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        tensors += [v.clone() for v in s.values() if torch.is_tensor(v)]
    return tensors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_grad_scaler_trains_and_skips_inf_steps(backend, kind, clip):
    model = _amp_model()
    groups = fusedopt.param_groups(model, weight_decay=1e-4)
    opt = optimizer(kind, groups, backend=backend, max_grad_norm=clip,
                    **({"lr": 5e-2} if kind == "lamb" else {"lr": 2.0, "trust_coefficient": 0.02}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    y = torch.randint(0, 4, (64,), generator=gen)

    def loss_fn():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.cross_entropy(model(x).float(), y)

    first = loss_fn().item()
    for _ in range(30):
        opt.zero_grad()
        scaler.scale(loss_fn()).backward()
        scaler.step(opt)
        scaler.update()
    assert loss_fn().item() < 0.7 * first  # it trains

    # an overflowing step: everything bit-identical, the scale lowered
    opt.zero_grad()
    scaler.scale(loss_fn()).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    before, scale = _full_snapshot(model, opt), scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    after = _full_snapshot(model, opt)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    assert scaler.get_scale() < scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_tensor_lr_equals_float_lr(backend, kind):
    """A float64 tensor lr gives the float lr's result bit for bit; a float32 one, holding the lr
    rounded to float32, within that rounding."""
    out = []
    for lr in (0.05, torch.tensor(0.05, dtype=torch.float64), torch.tensor(0.05)):
        params, _, opt = run_backend(kind, backend, SHAPES_SMALL, CASES[kind]["default"] if kind == "lars"
                                     else {"decoupled_weight_decay": True}, steps=3, lr=lr)
        out.append([p.detach() for p in params])
    for a, b64, b32 in zip(*out):
        assert torch.equal(a, b64)
        torch.testing.assert_close(a, b32, rtol=1e-6, atol=0)


@contextlib.contextmanager
def no_host_reads():
    """Replace every way of reading a tensor's value on the host with a trap."""
    names = ["item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"]
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def trap(name):
        def f(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} called inside step()")
        return f

    for n in names:
        setattr(torch.Tensor, n, trap(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_reads_no_tensor_value_on_the_host(backend, kind, dtype):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in [(6, 5), (7,), (0,), (1,)]]
    opt = optimizer(kind, [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0, "adapt": False}],
                    backend=backend, max_grad_norm=0.5, lr=torch.tensor(0.01))
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.grad_scale = torch.tensor(4.0)
    opt.found_inf = torch.tensor(0.0)
    with no_host_reads():
        opt.step()  # first step: creates state
        opt.step()
    assert all(s["step"].item() == 2 for s in opt.state.values())
