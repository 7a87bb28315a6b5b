"""Where users meet torch.optim's conventions: maximize and the foreach/fused/differentiable flags,
the state_dict contracts of torch's own optimizer tests (a load or deepcopy round trip gives an
equal state_dict, entries that are not a param's dict survive), a per-group-only LARS lr."""
import copy

import pytest
import torch

import fusedopt
from fusedopt import functional
from helpers import backend_params

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|divide by zero):RuntimeWarning")


def _make(kind, params, **kw):
    if kind == "lamb":
        return fusedopt.FusedLAMB(params, **kw)
    return fusedopt.FusedLARS(params, **{"lr": 0.1, "weight_decay": 1e-4, **kw})


def _pair(seed=0, shapes=((30, 7), (11,))):
    gen = torch.Generator().manual_seed(seed)
    a = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    return a, [torch.nn.Parameter(p.detach().clone()) for p in a]


@pytest.mark.parametrize("extra", [{}, {"max_grad_norm": 0.5}, {"scaler": 1024.0}],
                         ids=["plain", "clipped", "grad_scale"])
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_maximize_equals_the_step_on_negated_grads_bit_for_bit(kind, backend, extra):
    extra = dict(extra)
    scale = extra.pop("scaler", None)
    up, down = _pair()
    opt_up = _make(kind, up, backend=backend, maximize=True, **extra)
    opt_down = _make(kind, down, backend=backend, **extra)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in up]
        for p, g in zip(up, grads):
            p.grad = g.clone() if scale is None else g * scale
        for p, g in zip(down, grads):
            p.grad = -g if scale is None else -g * scale
        for o in (opt_up, opt_down):
            if scale is not None:
                o.grad_scale, o.found_inf = torch.tensor(scale), torch.tensor(0.0)
            o.step()
    for a, b in zip(up, down):
        assert torch.equal(a, b)
    for a, b in zip(up, down):
        for key, x in opt_up.state[a].items():
            assert torch.equal(x, opt_down.state[b][key]), key


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_maximize_in_the_functional_api_and_per_group(kind):
    up, down = _pair(2)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=gen) for p in up]
    steps = [[torch.zeros(()) for _ in up] for _ in range(2)]
    fn = functional.lamb if kind == "lamb" else functional.lars
    state = ([[torch.zeros_like(p) for p in up] for _ in range(2)] if kind == "lamb" else
             [[torch.zeros_like(p) for p in up]])
    args = {"lamb": {}, "lars": {"lr": 0.1}}[kind]
    with torch.no_grad():
        fn([p.data for p in up], grads, *state, steps[0], maximize=True, **args)
    state2 = [[torch.zeros_like(p) for p in up] for _ in state]
    with torch.no_grad():
        fn([p.data for p in down], [-g for g in grads], *state2, steps[1], **args)
    assert all(torch.equal(a, b) for a, b in zip(up, down))
    with pytest.raises(ValueError, match="maximize"):
        fn([p.data for p in up], grads, *state, steps[0], maximize=1, **args)
    # per group: one group maximizes, the other does not
    a, b = _pair(4)
    opt = _make(kind, [{"params": a[:1], "maximize": True}, {"params": a[1:]}])
    ref = _make(kind, [{"params": b[:1]}, {"params": b[1:]}])
    g = [torch.randn(p.shape, generator=gen) for p in a]
    a[0].grad, a[1].grad = g[0], g[1]
    b[0].grad, b[1].grad = -g[0], g[1]
    opt.step()
    ref.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # toggled after steps: the kept lists follow the option
    opt.param_groups[0]["maximize"] = False
    a[0].grad, b[0].grad = g[0], g[0]
    opt.step()
    ref.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_compiled_maximize_equals_uncompiled():
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        ps, _ = _pair(5)
        opt = fusedopt.FusedLAMB(ps, backend="cpp", maximize=True)
        step = torch.compile(opt.step) if compiled else opt.step
        gen = torch.Generator().manual_seed(6)
        for t in range(3):
            opt.param_groups[0]["lr"] = 1e-3 * (t + 1)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            step()
        runs.append([p.detach().clone() for p in ps])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_torch_flags_are_accepted_as_torch_accepts_them(kind):
    a, b = _pair(7)
    opt = _make(kind, a, foreach=True, fused=True)
    ref = _make(kind, b)
    for p, q in zip(a, b):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    opt.step()
    ref.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # foreach/fused change nothing
    with pytest.raises(ValueError, match="differentiable"):
        _make(kind, a, differentiable=True)
    with pytest.raises(ValueError, match="fused: True with backend='eager'"):
        _make(kind, a, fused=True, backend="eager")
    with pytest.raises(ValueError, match="foreach"):
        _make(kind, a, foreach="yes")


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_state_dict_round_trips_are_equal(kind):
    """torch's TestOptimRenewed contract: load_state_dict and deepcopy give an optimizer whose
    state_dict() equals the one it came from (no key added to the groups)."""
    a, _ = _pair(8)
    opt = _make(kind, a)
    for p in a:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.state["global_step"] = 7  # what schedulers and frameworks put there
    sd = opt.state_dict()
    assert sd["state"]["global_step"] == 7
    twin = _make(kind, [torch.nn.Parameter(p.detach().clone()) for p in a])
    twin.load_state_dict(copy.deepcopy(sd))
    got = twin.state_dict()
    assert got["param_groups"] == sd["param_groups"]
    assert got["state"]["global_step"] == 7
    assert twin.state["global_step"] == 7
    clone = copy.deepcopy(opt)
    assert clone.state_dict()["param_groups"] == sd["param_groups"]
    for p in twin.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    twin.step()  # a non-param entry does not disturb a step


def test_lars_lr_may_be_given_per_group_and_defaults_to_sgds():
    """As torch.optim.SGD: per-group lrs, and 1e-3 where none is given (FusedLARS(params)
    constructs, as SGD(params) does)."""
    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    opt = fusedopt.FusedLARS([{"params": ps[:1], "lr": 0.1}, {"params": ps[1:], "lr": 0.2}])
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    opt = fusedopt.FusedLARS([{"params": ps[:1], "lr": 0.1}, {"params": ps[1:]}])
    sgd = torch.optim.SGD([{"params": ps[:1], "lr": 0.1}, {"params": ps[1:]}])
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in sgd.param_groups] == [0.1, 1e-3]
    assert fusedopt.FusedLARS(ps).param_groups[0]["lr"] == torch.optim.SGD(ps).param_groups[0]["lr"]


_SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=2),
    "LinearLR + ExponentialLR": lambda o: torch.optim.lr_scheduler.ChainedScheduler([
        torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=5),
        torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.95)]),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20),
}


@pytest.mark.parametrize("scheduler", list(_SCHEDULERS))
@pytest.mark.parametrize("backend", backend_params(("eager", "cpp")))
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_a_group_with_its_own_lr_under_a_scheduler_goes_downhill(kind, backend, scheduler):
    """The shape of torch's generic optimizer check: the class's default lr for one group, a
    lr of 0.01 for the other, 20 steps of a closure under a scheduler; the loss falls (it needs
    no lr of the caller: FusedLARS(params) constructs as torch.optim.SGD(params) does)."""
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(10, 5)), torch.nn.Parameter(torch.randn(10))
    x = torch.randn(5)
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls([{"params": [weight]}, {"params": [bias], "lr": 0.01}], backend=backend)
    sched = _SCHEDULERS[scheduler](opt)

    def closure():
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        return loss

    first = closure().item()
    for _ in range(20):
        loss = opt.step(closure)
        sched.step(loss) if scheduler == "ReduceLROnPlateau" else sched.step()
    assert closure().item() < first


def _state_of(opt, params, keys):
    return [[opt.state[p][k].clone() for k in keys] for p in params]


@pytest.mark.parametrize("precision", ["full", "8bit"])
def test_state_dict_hooks_see_what_they_see_of_torch_optimizers(precision):
    """torch's state-dict hooks, beside torch's Adam in the same test: a state_dict post-hook sees
    the state dict returned (8-bit moments as codes and scales); a load_state_dict pre-hook may
    return another state dict, which is the one loaded (here one that maps the saved params to
    this optimizer's in another order, as a loader by names does); a post-hook sees the state
    as kept (8-bit moments packed). Masters (a bf16 param) and step counts keep this optimizer's
    rules. Pickling keeps the first behaviour."""
    gen = torch.Generator().manual_seed(3)
    shapes = ((64, 80), (5000,), (300,))
    for name in ("adam", "lamb"):
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        ps[2] = torch.nn.Parameter(ps[2].detach().bfloat16())
        opt = (torch.optim.Adam(ps, lr=1e-3) if name == "adam" else fusedopt.FusedLAMB(
            ps, backend="cpp", state_precision=precision, state_min_numel=0))
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()
        seen = {}
        opt.register_state_dict_post_hook(lambda o, sd: seen.update(saved=sd["state"][0].keys()))
        saved = opt.state_dict()
        assert seen["saved"] == saved["state"][0].keys()
        if name == "lamb" and precision == "8bit":
            assert "exp_avg_sq_blocks" in seen["saved"]
        # the same params in another order, the state dict mapped to it by a pre-hook
        order = [2, 0, 1]
        qs = [torch.nn.Parameter(ps[i].detach().clone()) for i in order]
        new = (torch.optim.Adam(qs, lr=1e-3) if name == "adam" else fusedopt.FusedLAMB(
            qs, backend="cpp", state_precision=precision, state_min_numel=0))

        def remap(o, sd):
            return {"state": {j: sd["state"][i] for j, i in enumerate(order)},
                    "param_groups": sd["param_groups"]}

        new.register_load_state_dict_pre_hook(remap)
        new.register_load_state_dict_post_hook(
            lambda o: seen.update(loaded={k: (v.dtype, v.dim()) for k, v in o.state[qs[1]].items()}))
        new.load_state_dict(saved)
        keys = ("step", "exp_avg", "exp_avg_sq")
        assert all(torch.equal(a, b) for xs, ys in zip(_state_of(opt, [ps[i] for i in order], keys),
                                                        _state_of(new, qs, keys))
                   for a, b in zip(xs, ys))
        if name == "lamb":
            assert seen["loaded"]["step"] == (torch.float32, 0)
            assert seen["loaded"]["exp_avg"][0] == (torch.uint8 if precision == "8bit"
                                                    else torch.float32)
            assert "exp_avg_blocks" not in seen["loaded"]
            assert new.state[qs[0]]["master_param"].dtype == torch.float32
            assert torch.equal(new.state[qs[0]]["master_param"], opt.state[ps[2]]["master_param"])
            again = copy.deepcopy(new).state_dict()
            assert again["state"][1].keys() == saved["state"][0].keys()
        for p in qs:
            p.grad = torch.ones_like(p)
        new.step()  # the loaded state fits its params


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_warm_start_from_fused_adamw_keeps_only_what_is_learned(backend):
    """A state dict of torch.optim.AdamW(fused=True) loads into FusedLAMB and steps: its moments
    and step counts are taken, its implementation flags (fused, foreach, capturable,
    differentiable) are not (the eager backend refused every step of a group that came back with
    fused=True)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    adamw = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        adamw.step()
    sd = adamw.state_dict()
    assert sd["param_groups"][0]["fused"] is True
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    lamb = fusedopt.FusedLAMB(qs, backend=backend)
    lamb.load_state_dict(sd)
    group = lamb.param_groups[0]
    assert (group["fused"], group["foreach"], group["capturable"], group["differentiable"]) == (
        None, None, False, False)
    assert group["betas"] == sd["param_groups"][0]["betas"]  # what was learned is kept
    for q, p in zip(qs, ps):
        assert torch.equal(lamb.state[q]["exp_avg"], adamw.state[p]["exp_avg"])
        assert float(lamb.state[q]["step"]) == 2
        q.grad = torch.randn_like(q)
    before = [q.detach().clone() for q in qs]
    lamb.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, qs))
    assert float(lamb.state[qs[0]]["step"]) == 3
