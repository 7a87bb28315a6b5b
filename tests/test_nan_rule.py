"""Note [NaN propagation] (csrc/fusedopt/math.h) on the backends that run on the CPU without
Triton's interpreter; tests/test_triton.py runs the same cases on the Triton backend."""
import pytest
import torch

import fusedopt
from fusedopt.reference import ReferenceLAMB, ReferenceLARS
from fusedopt.testing import LR
from helpers import assert_nan_rule, backend_params, nan_rule_runs


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_nan_norms_give_nan_trust_ratios(backend):
    if backend not in fusedopt.available_backends():
        pytest.skip(f"backend {backend!r} is not built in this environment")
    assert_nan_rule(nan_rule_runs(backend))


@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", backend_params(("eager", "cpp", "triton")))
def test_a_nan_gradient_total_makes_every_param_nan_under_clipping(backend, kind):
    """With ``max_grad_norm``, one NaN gradient element makes G NaN, so ``c = max(1, G / M)`` is
    NaN and every element of every param becomes NaN, on the backend and in the float64
    reference alike (the reference's ``max(1.0, nan)`` gave 1 and stepped the other params)."""
    gen = torch.Generator().manual_seed(0)
    w = [torch.randn(9, generator=gen), torch.randn(4, 3, generator=gen)]
    g = [torch.randn(9, generator=gen), torch.randn(4, 3, generator=gen)]
    g[0][2] = float("nan")
    hyper = dict(max_grad_norm=0.5, weight_decay=0.01)
    params = [torch.nn.Parameter(x.clone()) for x in w]
    for p, x in zip(params, g):
        p.grad = x.clone()
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    cls(params, lr=LR[kind], backend=backend, **hyper).step()
    ref_w = [x.double() for x in w]
    (ReferenceLAMB if kind == "lamb" else ReferenceLARS)([{**hyper, "lr": LR[kind]}]).step(
        [ref_w], [[x.double() for x in g]])
    for p, r in zip(params, ref_w):
        assert torch.isnan(p).all() and torch.isnan(r).all()
