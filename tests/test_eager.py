"""The eager backend against the float64 evaluation of docs/math.md."""
import pytest
import torch

from helpers import SHAPES_SMALL, max_rel_err, run_backend


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_many_tiny_tensors_and_an_odd_one(kind):
    shapes = [(5,)] * 200 + [(18011,)]
    params, ref, _ = run_backend(kind, "eager", shapes, {}, steps=5)
    assert max_rel_err(params, ref) <= 1e-5


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_bf16_grads_with_fp32_params(kind):
    params, ref, _ = run_backend(kind, "eager", SHAPES_SMALL, {}, grad_dtype=torch.bfloat16)
    assert max_rel_err(params, ref) <= 1e-5


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_zero_norm_rule_gives_ratio_one(kind):
    """A zero weight: the trust ratio is exactly 1, so the step is the plain inner update."""
    hyper = {} if kind == "lamb" else dict(weight_decay=1e-4)
    params, ref, _ = run_backend(kind, "eager", [(4,)], hyper, steps=1, zero_weight=0)
    g = params[0].grad.double()
    if kind == "lamb":  # first step, bias-corrected: u = g / (|g| + eps), w = -lr * u
        expected = -1e-2 * g / (g.abs() + 1e-6)
    else:  # ratio 1, d = g, v = lr*d, w = -v
        expected = -0.5 * g
    torch.testing.assert_close(params[0].detach().double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(ref[0], expected, rtol=1e-12, atol=0)
