"""SPEC.md's reference points, checked against a public implementation that runs here: optax.

* ``FusedLAMB`` defaults (with any lr, betas, eps, weight_decay) equal ``optax.lamb``
  (``eps_root=0``): Adam moments with bias correction, ``λ·w`` added before the trust ratio,
  ``‖w‖/‖u‖`` with the zero-norm rule.
* ``FusedLARS(denominator="combined", lr_in_momentum=True)`` equals ``optax.lars``:
  decayed weights, ``κ‖w‖/(‖g+λw‖+eps)``, lr applied before the momentum trace (``v ← μ·v + lr·d``).

apex FusedLAMB (``use_nvlamb=True, max_grad_norm=0``) and timm's Lamb/Lars are documented in the
README; they cannot run here (apex needs CUDA, timm needs torchvision, which does not import beside
this CPU torch build).
"""
import numpy as np
import pytest
import torch

import fusedopt

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
