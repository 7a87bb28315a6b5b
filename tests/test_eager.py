"""The eager backend against the float64 evaluation of SPEC.md."""
import pytest
import torch

from helpers import LAMB_CASES, LARS_CASES, SHAPES_SMALL, max_rel_err, run_backend, tols

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_matches_reference(case, dtype):
    params, ref, _ = run_backend("lamb", "eager", SHAPES_SMALL, LAMB_CASES[case], dtype=dtype,
                                 steps=6, zero_weight=1, zero_grad=3, excluded=(5,))
    assert max_rel_err(params, ref) <= tols(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(LARS_CASES))
def test_lars_matches_reference(case, dtype):
    params, ref, _ = run_backend("lars", "eager", SHAPES_SMALL, LARS_CASES[case], dtype=dtype,
                                 steps=6, zero_weight=1, zero_grad=3, excluded=(5,))
    assert max_rel_err(params, ref) <= tols(dtype)


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
