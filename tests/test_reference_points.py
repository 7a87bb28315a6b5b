"""docs/math.md's reference points, checked against public implementations that run here: optax
and timm.

* ``FusedLAMB`` defaults (with any lr, betas, eps, weight_decay) equal ``optax.lamb``
  (``eps_root=0``): Adam moments with bias correction, ``λ·w`` added before the trust ratio,
  ``‖w‖/‖u‖`` with the zero-norm rule.
* ``FusedLARS(denominator="combined", lr_in_momentum=True)`` equals ``optax.lars``:
  decayed weights, ``κ‖w‖/(‖g+λw‖+eps)``, lr applied before the momentum trace (``v ← μ·v + lr·d``).
* ``FusedLAMB`` equals timm's ``Lamb(always_adapt=True)`` with the same ``max_grad_norm`` (None, or
  global clipping). timm's ``decoupled_decay`` is not our ``decoupled_weight_decay``: it takes ‖w‖
  after the decay (a test pins the difference).
* ``FusedLARS(denominator="sum", lr_in_momentum=False)`` equals timm's ``Lars(always_adapt=True)``
  (the torch-SGD momentum form with dampening and Nesterov).

apex FusedLAMB (``use_nvlamb=True, max_grad_norm=0``) is documented in docs/math.md; it needs CUDA.
timm is loaded by :func:`fusedopt.tools.bench.timm_optimizers`, the benchmark's loader of the same
timm classes it times (its optimizer modules without its model zoo, which needs torchvision).
"""
import copy

import numpy as np
import pytest
import torch

import fusedopt
from fusedopt.tools.bench import timm_optimizers

jax = pytest.importorskip("jax", reason="jax/optax are installed by requirements-dev.txt")
optax = pytest.importorskip("optax", reason="optax is installed by requirements-dev.txt")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

SHAPES = [(6, 5), (9,), (1,), (4, 3, 2)]


def _compare(opt, tx, steps=6, seed=0, zero_weight=None):
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s) for s in SHAPES]
    if zero_weight is not None:
        init[zero_weight][...] = 0.0
    params = [torch.nn.Parameter(torch.tensor(w)) for w in init]
    opt = opt(params)
    jparams = [jnp.asarray(w) for w in init]
    state = tx.init(jparams)
    for _ in range(steps):
        grads = [rng.standard_normal(s) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g)
        opt.step()
        updates, state = tx.update([jnp.asarray(g) for g in grads], state, jparams)
        jparams = optax.apply_updates(jparams, updates)
    for p, jp in zip(params, jparams):
        np.testing.assert_allclose(p.detach().numpy(), np.asarray(jp), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("hyper", [
    dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01),
    dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.0),
    dict(lr=1e-1, betas=(0.95, 0.98), eps=1e-4, weight_decay=0.3),
], ids=["defaults", "no_decay", "strong_decay"])
@pytest.mark.parametrize("zero_weight", [None, 1], ids=["", "zero_weight"])
def test_lamb_equals_optax_lamb(hyper, zero_weight):
    tx = optax.lamb(hyper["lr"], b1=hyper["betas"][0], b2=hyper["betas"][1], eps=hyper["eps"],
                    eps_root=0.0, weight_decay=hyper["weight_decay"])
    _compare(lambda ps: fusedopt.FusedLAMB(ps, **hyper), tx, zero_weight=zero_weight)


@pytest.mark.parametrize("hyper", [
    dict(lr=0.5, momentum=0.9, weight_decay=1e-2, trust_coefficient=0.001, eps=0.0, nesterov=False),
    dict(lr=0.1, momentum=0.8, weight_decay=0.0, trust_coefficient=0.02, eps=1e-8, nesterov=True),
    dict(lr=1.0, momentum=0.0, weight_decay=1e-4, trust_coefficient=1.0, eps=1e-6, nesterov=False),
], ids=["decay", "nesterov", "no_momentum"])
@pytest.mark.parametrize("zero_weight", [None, 1], ids=["", "zero_weight"])
def test_lars_combined_equals_optax_lars(hyper, zero_weight):
    tx = optax.lars(hyper["lr"], weight_decay=hyper["weight_decay"],
                    trust_coefficient=hyper["trust_coefficient"], eps=hyper["eps"],
                    momentum=hyper["momentum"], nesterov=hyper["nesterov"])
    _compare(lambda ps: fusedopt.FusedLARS(ps, denominator="combined", lr_in_momentum=True, **hyper),
             tx, zero_weight=zero_weight)


# --------------------------------------------------------------------------------------- timm

def _timm(index):
    found = timm_optimizers()
    if found is None:
        pytest.fail("timm is not importable; scripts/dev.py installs it (pip install --no-deps timm)")
    return found[index]


def _compare_torch(ours, theirs, steps=6, seed=0, zero_weight=None, grad_scale=1.0):
    """Both torch optimizers on copies of the same float64 params and grads, step by step."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s) for s in SHAPES]
    if zero_weight is not None:
        init[zero_weight][...] = 0.0
    a = [torch.nn.Parameter(torch.tensor(w)) for w in init]
    b = [torch.nn.Parameter(torch.tensor(w)) for w in init]
    opt_a, opt_b = ours(a), theirs(b)
    for _ in range(steps):
        for p, q, s in zip(a, b, SHAPES):
            g = torch.tensor(rng.standard_normal(s) * grad_scale)
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("hyper", [
    dict(lr=1e-2, weight_decay=0.01),
    dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.0, bias_correction=False),
    dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0),  # clipping active (grad_scale=5)
    dict(lr=1e-2, weight_decay=0.1, grad_averaging=False),
], ids=["defaults", "no_decay_no_bias_correction", "global_clipping", "no_grad_averaging"])
@pytest.mark.parametrize("zero_weight", [None, 1], ids=["", "zero_weight"])
def test_lamb_equals_timm_lamb(hyper, zero_weight):
    theirs = {"max_grad_norm": None, **hyper}
    _compare_torch(lambda ps: fusedopt.FusedLAMB(ps, **hyper),
                   lambda ps: _timm(0)(ps, always_adapt=True, **theirs),
                   zero_weight=zero_weight, grad_scale=5.0)


def test_timm_decoupled_decay_takes_the_norm_after_decay():
    """timm's ``decoupled_decay`` decays w first and takes ‖w‖ of the decayed weight, so its φ is
    ours times (1 - lr·λ): docs/math.md says so, and this pins it (ours takes ‖w‖ before the decay,
    docs/math.md). With λ = 0 the two decoupled forms are the same update."""
    def pair(weight_decay):
        hyper = dict(lr=1e-2, weight_decay=weight_decay)
        return (lambda ps: fusedopt.FusedLAMB(ps, decoupled_weight_decay=True, **hyper),
                lambda ps: _timm(0)(ps, always_adapt=True, max_grad_norm=None,
                                    decoupled_decay=True, **hyper))
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        _compare_torch(*pair(0.1))
    _compare_torch(*pair(0.0))


@pytest.mark.parametrize("hyper", [
    dict(lr=0.5, momentum=0.9, weight_decay=1e-2, trust_coefficient=0.001, eps=1e-8),
    dict(lr=0.1, momentum=0.8, weight_decay=1e-4, trust_coefficient=0.02, eps=0.0, nesterov=True),
    dict(lr=0.2, momentum=0.9, dampening=0.5, weight_decay=1e-3, trust_coefficient=0.01),
    dict(lr=1.0, momentum=0.0, weight_decay=0.0, trust_coefficient=1.0, eps=1e-6),
], ids=["decay", "nesterov", "dampening", "no_momentum_no_decay"])
@pytest.mark.parametrize("zero_weight", [None, 1], ids=["", "zero_weight"])
def test_lars_sum_equals_timm_lars(hyper, zero_weight):
    theirs = dict(hyper)
    theirs["trust_coeff"] = theirs.pop("trust_coefficient")
    _compare_torch(
        lambda ps: fusedopt.FusedLARS(ps, denominator="sum", lr_in_momentum=False, **hyper),
        lambda ps: _timm(1)(ps, always_adapt=True, **theirs), zero_weight=zero_weight)


# ------------------------------------------------------------- resuming their checkpoints

def _apex_form(state_dict):
    """A state dict as apex's ``FusedLAMB`` saves it: the step count an int in the param group,
    none in the params' states."""
    out = copy.deepcopy(state_dict)
    for g in out["param_groups"]:
        g["step"] = int(out["state"][g["params"][0]]["step"].item())
        for pid in g["params"]:
            del out["state"][pid]["step"]
    return out


@pytest.mark.parametrize("theirs, ours, saved", [
    (lambda ps: _timm(0)(ps, always_adapt=True, max_grad_norm=None, lr=1e-2, weight_decay=0.01),
     lambda ps: fusedopt.FusedLAMB(ps, lr=1e-2, weight_decay=0.01), None),
    (lambda ps: fusedopt.FusedLAMB(ps, lr=1e-2, weight_decay=0.01),
     lambda ps: fusedopt.FusedLAMB(ps, lr=1e-2, weight_decay=0.01), _apex_form),
    (lambda ps: _timm(1)(ps, always_adapt=True, lr=0.5, momentum=0.9, weight_decay=1e-2,
                         trust_coeff=0.001),
     lambda ps: fusedopt.FusedLARS(ps, denominator="sum", lr_in_momentum=False, lr=0.5,
                                   momentum=0.9, weight_decay=1e-2, trust_coefficient=0.001),
     None),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True),
     lambda ps: fusedopt.FusedLARS(ps, adapt=False, lr_in_momentum=False, lr=0.1, momentum=0.9,
                                   weight_decay=1e-3, nesterov=True), None),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, dampening=0.5),
     lambda ps: fusedopt.FusedLARS(ps, adapt=False, lr_in_momentum=False, lr=0.1, momentum=0.8,
                                   dampening=0.5, weight_decay=0.0), None),
], ids=["timm_Lamb", "apex_FusedLAMB_form", "timm_Lars", "torch_SGD_nesterov",
        "torch_SGD_dampening"])
def test_their_checkpoint_resumes_as_their_run_goes_on(theirs, ours, saved):
    """Note [foreign step counts]: their optimizer steps three times; its state dict, loaded into
    ours, goes on for three steps as their optimizer does (the rows above make the update the
    same; the step count comes from the group, or counts 1 for a momentum buffer), and the group's
    count does not stay behind in ours."""
    rng = np.random.default_rng(1)
    a = [torch.nn.Parameter(torch.tensor(rng.standard_normal(s))) for s in SHAPES]
    opt_a = theirs(a)
    for _ in range(3):
        for p, s in zip(a, SHAPES):
            p.grad = torch.tensor(rng.standard_normal(s))
        opt_a.step()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = ours(b)
    state_dict = copy.deepcopy(opt_a.state_dict())
    opt_b.load_state_dict(state_dict if saved is None else saved(state_dict))
    assert all("step" not in g for g in opt_b.state_dict()["param_groups"])
    for _ in range(3):
        for p, q, s in zip(a, b, SHAPES):
            p.grad = torch.tensor(rng.standard_normal(s))
            q.grad = p.grad.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        np.testing.assert_allclose(q.detach().numpy(), p.detach().numpy(), rtol=1e-10, atol=1e-14)
