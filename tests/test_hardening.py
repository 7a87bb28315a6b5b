"""Bad input gets a clear error and changes nothing, in every group, on every backend (each fault
of the hardening issue has its test here; tests/test_adversarial.py searches for more).

Every case steps two groups once, edits the LATER group (or its state), and steps again: a step
that checked group 1 only after writing group 0 would show in group 0's tensors."""
import math
import threading

import pytest
import torch

import fusedopt
from helpers import backend_params

BACKENDS = backend_params(("eager", "cpp"))
KINDS = ["lamb", "lars"]
CLS = {"lamb": fusedopt.FusedLAMB, "lars": fusedopt.FusedLARS}
MOMENT = {"lamb": "exp_avg", "lars": "momentum_buffer"}


def _setup(kind, backend, dtype=torch.float32, lr=0.1, **kw):
    gen = torch.Generator().manual_seed(0)
    groups = [[torch.nn.Parameter(torch.randn(5, 3, generator=gen, dtype=dtype)),
               torch.nn.Parameter(torch.randn(5, generator=gen, dtype=dtype))] for _ in range(2)]
    opt = CLS[kind]([{"params": g} for g in groups], lr=lr, backend=backend, **kw)
    for _ in range(2):
        for p in (p for g in groups for p in g):
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
        opt.step()
    return opt, groups


def _snapshot(opt):
    out = []
    for g in opt.param_groups:
        for p in g["params"]:
            out.append(p.detach().clone())
            for key in sorted(opt.state.get(p, {})):
                v = opt.state[p][key]
                if isinstance(v, torch.Tensor):
                    out.append(v.detach().clone())
    return out


def _unchanged(before, after) -> bool:
    return len(before) == len(after) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num())
        for a, b in zip(before, after))


def _refused(opt, match, exc=(ValueError, RuntimeError)):
    """step() raises an error matching ``match`` and changes nothing (edits made before the call
    are part of ``before``)."""
    before = _snapshot(opt)
    with pytest.raises(exc, match=match):
        opt.step()
    assert _unchanged(before, _snapshot(opt)), "a refused step changed tensors"


# ------------------------------------------------------------------ half-done steps
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_param_data_of_another_shape_is_refused_before_any_write(kind, backend):
    opt, groups = _setup(kind, backend)
    p = groups[1][0]
    p.data = torch.randn(4, 4)
    p.grad = None
    p.grad = torch.randn(4, 4)
    _refused(opt, r"param group 1.*state '(exp_avg|momentum_buffer)'.*shape")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_state_tensor_of_wrong_shape_is_refused(kind, backend):
    opt, groups = _setup(kind, backend)
    opt.state[groups[1][0]][MOMENT[kind]] = torch.zeros(3)
    _refused(opt, rf"param group 1, param 0.*state '{MOMENT[kind]}'.*shape \(3,\)")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_state_tensor_of_wrong_dtype_is_refused(kind, backend):
    opt, groups = _setup(kind, backend)
    st = opt.state[groups[1][0]]
    st[MOMENT[kind]] = st[MOMENT[kind]].double()
    _refused(opt, rf"state '{MOMENT[kind]}' must be a torch.float32 tensor")


@pytest.mark.parametrize("step", [torch.tensor(2), torch.tensor([2.0]), torch.tensor(2.0).double()],
                         ids=["int64", "shape1", "float64"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_step_of_another_format_set_by_hand_is_refused(kind, backend, step):
    """One rule on every backend: a float32 0-dim tensor (load_state_dict converts, see below)."""
    opt, groups = _setup(kind, backend)
    opt.state[groups[1][0]]["step"] = step
    _refused(opt, r"param group 1, param 0.*'step' must be a 0-dim float32 tensor")


@pytest.mark.parametrize("step", [2, 2.0, torch.tensor(2), torch.tensor([2.0]), torch.tensor([[2]])],
                         ids=["int", "float", "int64", "shape1", "shape11"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_loaded_step_of_any_old_format_is_converted(kind, backend, step):
    opt, groups = _setup(kind, backend)
    sd = opt.state_dict()
    for st in sd["state"].values():
        st["step"] = step
    opt.load_state_dict(sd)
    for p in (p for g in groups for p in g):
        s = opt.state[p]["step"]
        assert s.dtype == torch.float32 and s.dim() == 0 and s.item() == 2
    opt.step()
    assert opt.state[groups[1][0]]["step"].item() == 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_lr_on_the_meta_device_is_refused(kind, backend):
    opt, _ = _setup(kind, backend)
    opt.param_groups[1]["lr"] = torch.tensor(0.1, device="meta")
    _refused(opt, "param group 1: Invalid lr.*meta")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_expanded_stride0_param_is_refused_before_any_write(kind, backend):
    base = torch.nn.Parameter(torch.randn(3))
    bad = torch.randn(1).expand(4).requires_grad_()
    opt = CLS[kind]([{"params": [base]}, {"params": [bad]}], lr=0.1, backend=backend)
    base.grad, bad.grad = torch.randn(3), torch.randn(4)
    before = [base.detach().clone(), bad.detach().clone()]
    with pytest.raises(RuntimeError, match="param group 1, param 0.*overlap in memory"):
        opt.step()
    assert torch.equal(base, before[0]) and torch.equal(bad, before[1])
    assert not opt.state.get(base) or opt.state[base]["step"].item() == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_grad_of_shape_1_on_a_param_of_5_is_refused(kind, backend):
    opt, groups = _setup(kind, backend)
    groups[1][1].grad.data = torch.randn(1)
    _refused(opt, r"param group 1 has a grad of shape \(1,\) for a param of shape \(5,\)")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_resized_grad_is_refused(kind, backend):
    opt, groups = _setup(kind, backend)
    groups[1][0].grad.resize_(2)
    _refused(opt, r"param group 1 has a grad of shape \(2,\)")


# -------------------------------------------------------------- options checked at step()
BAD_OPTIONS = {
    "lamb": [("lr", "0.1"), ("lr", -1), ("lr", 1e308), ("betas", (2, 0)), ("betas", (0.9,)),
             ("trust_ratio_bounds", (2, 1)), ("trust_ratio_bounds", (1,)),
             ("trust_ratio_bounds", (math.inf, math.inf)), ("adapt", "no"), ("eps", 0.0),
             ("eps", 1e-60), ("weight_decay", 1e300), ("backend", "bogus"),
             ("master_weights", "yes"), ("max_grad_norm", -1.0)],
    "lars": [("lr", "0.1"), ("lr", -1), ("lr", 1e308), ("denominator", "bogus"),
             ("trust_coefficient", -1), ("trust_coefficient", 1e308), ("adapt", "no"),
             ("weight_decay", 1e300), ("momentum", -0.5), ("dampening", 2.0),
             ("backend", "bogus"), ("nesterov", 1)],
}
CASES = [(k, key, v) for k in KINDS for key, v in BAD_OPTIONS[k]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,key,value", CASES, ids=[f"{k}-{key}={v!r}" for k, key, v in CASES])
def test_group_option_edited_after_construction_is_checked_at_step(kind, key, value, backend):
    opt, _ = _setup(kind, backend)
    opt.param_groups[1][key] = value
    _refused(opt, rf"param group 1: Invalid {key if key != 'betas' else 'beta'}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,key,value", CASES, ids=[f"{k}-{key}={v!r}" for k, key, v in CASES])
def test_group_option_from_load_state_dict_is_checked_at_step(kind, key, value, backend):
    opt, _ = _setup(kind, backend)
    sd = opt.state_dict()
    sd["param_groups"][1][key] = value
    opt.load_state_dict(sd)
    if key == "backend":  # the constructed backend is kept (see below)
        opt.step()
        return
    _refused(opt, rf"param group 1: Invalid {key if key != 'betas' else 'beta'}")


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_tensor_lr_of_nan_inf_or_negative_is_refused(kind, backend, value):
    with pytest.raises(ValueError, match="Invalid lr: a tensor lr holds"):
        CLS[kind]([torch.nn.Parameter(torch.randn(3))], lr=torch.tensor(value), backend=backend)
    opt, _ = _setup(kind, backend)
    opt.param_groups[1]["lr"] = torch.tensor(value)  # a new tensor
    _refused(opt, "param group 1: Invalid lr: a tensor lr holds")



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_deleted_group_option_is_named(kind, backend):
    opt, _ = _setup(kind, backend)
    del opt.param_groups[1]["weight_decay"]
    _refused(opt, "param group 1 has no option 'weight_decay'")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_lr_tensor_of_one_element_any_shape_runs_alike(kind, backend):
    results = []
    for lr in (0.1, torch.tensor(0.1), torch.tensor([0.1]), torch.tensor([[0.1]])):
        opt, groups = _setup(kind, backend, lr=lr)
        results.append([p.detach().clone() for g in groups for p in g])
    for r in results[1:]:
        for a, b in zip(results[0], r):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_values_that_overflow_float32_are_refused_and_float64_takes_them(kind, backend):
    opt, _ = _setup(kind, backend)
    opt.param_groups[1]["weight_decay"] = 1e300
    _refused(opt, "param group 1: Invalid weight_decay: 1e.300 overflows torch.float32")
    opt, groups = _setup(kind, backend, dtype=torch.float64)
    opt.param_groups[1]["weight_decay"] = 1e-300  # representable in float64: runs
    opt.step()


# ------------------------------------------------------------ state and data loss
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_stale_master_never_restores_old_weights(kind, backend):
    """master_weights False after some steps, then back to None: the stale fp32 master must not
    overwrite the weights the steps in between wrote."""
    opt, groups = _setup(kind, backend, dtype=torch.bfloat16)
    for g in opt.param_groups:
        g["master_weights"] = False
    for p in (p for g in groups for p in g):
        p.grad = torch.ones_like(p)
    opt.step()
    assert all("master_param" not in opt.state[p] for g in groups for p in g)
    for g in opt.param_groups:
        g["master_weights"] = None
    w = groups[0][0].detach().clone()
    _refused(opt, r"has no state tensor 'master_param'")
    assert torch.equal(groups[0][0], w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masters_turned_off_step_the_param_itself(backend):
    """From the step that turns master weights off, the bf16 param is the weight: the update reads
    it, not the (more precise, now stale) fp32 master."""
    p = torch.nn.Parameter(torch.randn(6, dtype=torch.bfloat16))
    opt = fusedopt.FusedLARS([p], lr=1.0, weight_decay=0.01, adapt=False, backend=backend)
    p.grad = torch.randn(6, dtype=torch.bfloat16)
    opt.step()
    assert not torch.equal(opt.state[p]["master_param"], p.float())  # the master is more precise
    opt.param_groups[0]["master_weights"] = False
    v = opt.state[p]["momentum_buffer"].clone()
    p.grad = torch.randn(6, dtype=torch.bfloat16)
    expected = 0.9 * v + (p.grad.float() + 0.01 * p.float())
    opt.step()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_model_half_after_steps_names_the_missing_master(kind, backend):
    opt, groups = _setup(kind, backend)
    for p in (p for g in groups for p in g):
        p.data = p.data.half()
        p.grad = None
        p.grad = torch.ones_like(p)
    _refused(opt, r"param 0 of param group 0 has no state tensor 'master_param'")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_same_param_twice_in_one_group_is_refused(kind, backend):
    opt, groups = _setup(kind, backend)
    opt.param_groups[1]["params"].append(groups[1][0])
    _refused(opt, "param group 1 holds the same param twice")


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_keeps_the_constructed_backend(kind):
    if fusedopt.backends.get_backend("cpp") is None:
        pytest.skip(f"needs the cpp backend: {fusedopt.backends.load_error('cpp')}")
    eager, _ = _setup(kind, "eager")
    opt, _ = _setup(kind, "cpp")
    opt.load_state_dict(eager.state_dict())
    assert [g["backend"] for g in opt.param_groups] == ["cpp", "cpp"]


# ------------------------------------------------------------------- foreign state
@pytest.mark.parametrize("source", ["sgd", "other"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_foreign_state_dict_names_param_group_and_key(kind, backend, source):
    opt, groups = _setup(kind, backend)
    params = [p for g in groups for p in g]
    if source == "sgd":
        other = torch.optim.SGD([{"params": g} for g in groups], lr=0.1, momentum=0.9)
        other.step()
    else:
        other = CLS["lars" if kind == "lamb" else "lamb"](
            [{"params": g} for g in groups], lr=0.1, backend=backend)
        other.step()
    sd = other.state_dict()
    fresh = CLS[kind]([{"params": g} for g in groups], lr=0.1, backend=backend)
    fresh.load_state_dict(sd)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"param 0 of param group 0 has no state tensor '\w+'"):
        fresh.step()


@pytest.mark.parametrize("backend", BACKENDS)
def test_adam_state_warm_starts_lamb(backend):
    """Adam's exp_avg, exp_avg_sq and step mean what LAMB's do: its state loads into FusedLAMB
    and the moments go on from it (documented in docs/api.md)."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    adam = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.randn(4, 3)
    adam.step()
    lamb = fusedopt.FusedLAMB([p], lr=0.1, backend=backend)
    lamb.load_state_dict(adam.state_dict())
    m = adam.state[p]["exp_avg"].clone()
    lamb.step()
    assert lamb.state[p]["step"].item() == 2
    torch.testing.assert_close(lamb.state[p]["exp_avg"], 0.9 * m + 0.1 * p.grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_none_state_tensor_and_complex_grad_are_named(kind, backend):
    opt, groups = _setup(kind, backend)
    opt.state[groups[1][0]][MOMENT[kind]] = None
    _refused(opt, rf"param group 1, param 0 of those with grads: state '{MOMENT[kind]}' is "
                  "NoneType, not a tensor", exc=TypeError)
    opt, groups = _setup(kind, backend)
    groups[1][0].grad.data = torch.randn(5, 3, dtype=torch.complex64)
    _refused(opt, r"does not support complex grads \(param group 1")


# ---------------------------------------------------------------------- threads
# (several threads on one optimizer: tests/test_adversarial.py, test_four_threads_one_optimizer)
@pytest.mark.parametrize("backend", BACKENDS)
def test_separate_optimizers_in_threads_match_sequential(backend):
    def run(threaded):
        opts, params = [], []
        for i in range(3):
            gen = torch.Generator().manual_seed(i)
            ps = [torch.nn.Parameter(torch.randn(300, generator=gen)) for _ in range(20)]
            for p in ps:
                p.grad = torch.randn(300, generator=gen)
            opts.append(fusedopt.FusedLAMB(ps, lr=0.01, backend=backend))
            params.append(ps)

        def work(o):
            for _ in range(30):
                o.step()

        if threaded:
            ts = [threading.Thread(target=work, args=(o,)) for o in opts]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        else:
            for o in opts:
                work(o)
        return [p.detach().clone() for ps in params for p in ps]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


# ---------------------------------------------------------------------- zero-size
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_size_param_with_stride0_grad_runs_on_every_backend(kind, backend):
    p = torch.nn.Parameter(torch.zeros(0, 3))
    q = torch.nn.Parameter(torch.randn(3))
    opt = CLS[kind]([p, q], lr=0.1, backend=backend)
    p.grad = torch.zeros(1, 3).expand(0, 3)
    q.grad = torch.ones(3)
    opt.step()
    assert opt.state[p]["step"].item() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoupled_decay_factor_in_the_compute_dtype(backend):
    """float64 params with a float32 tensor lr and decoupled weight decay: ``1 - lr·λ`` is formed
    in float64 (from the float32 lr's value), as the float lr of the same value gives."""
    lr32 = torch.tensor(0.1, dtype=torch.float32)
    results = []
    for lr in (lr32, lr32.item()):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(50, generator=gen, dtype=torch.float64))
        opt = fusedopt.FusedLAMB([p], lr=lr, weight_decay=0.3, decoupled_weight_decay=True,
                                 backend=backend)
        for _ in range(3):
            p.grad = torch.randn(50, generator=gen, dtype=torch.float64)
            opt.step()
        results.append(p.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=1e-14, atol=0)


# ------------------------------------------------------- values refused where they are given
@pytest.mark.parametrize("kind", KINDS)
def test_odd_values_are_refused_at_construction_naming_them(kind):
    """Values that could only fail later (or overflow the compute dtype) are refused when given:
    ``max_grad_norm=inf`` (None means no clipping), a LARS momentum that float32 math cannot hold,
    an int lr too large for a float."""
    p = torch.nn.Parameter(torch.randn(3))
    cls, lr = CLS[kind], 0.1
    with pytest.raises(ValueError, match=r"Invalid max_grad_norm: inf; expected None \(no "
                                         r"clipping\) or a finite number > 0"):
        cls([p], lr=lr, max_grad_norm=math.inf)
    with pytest.raises(ValueError, match=r"Invalid lr: an int of 401 digits"):
        cls([p], lr=10 ** 400)
    if kind == "lars":
        with pytest.raises(ValueError, match=r"Invalid momentum: 1e\+39 overflows torch.float32"):
            cls([p], lr=lr, momentum=1e39)
        cls([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))], lr=lr, momentum=1e39)
    opt = cls([p], lr=lr)
    with pytest.raises(ValueError, match=r"Invalid lr: an int of 401 digits"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "lr": 10 ** 400})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_overlapping_param_views_are_refused(kind, backend):
    """Two params that are views of one tensor sharing elements: refused at the first step,
    before any state is made (a step would write the shared elements twice)."""
    base = torch.zeros(20, requires_grad=True)
    a, b = base.detach()[:10], base.detach()[5:15]
    for p in (a, b):
        p.grad = torch.ones(10)
    opt = CLS[kind]([a, b], lr=0.1, backend=backend)
    with pytest.raises(ValueError, match=r"params\[0\] and params\[1\] \(of those with grads\)|"
                                         r"params\[0\] and params\[1\] overlap in memory"):
        opt.step()
    assert not opt.state and torch.equal(base, torch.zeros(20))
