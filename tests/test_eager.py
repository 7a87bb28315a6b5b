"""The eager backend against the float64 evaluation of SPEC.md."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


lamb_hyper = st.fixed_dictionaries({}, optional={
    "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.9999)),
    "eps": st.sampled_from([0.0, 1e-8, 1e-6, 1e-3]),
    "weight_decay": st.sampled_from([0.0, 1e-3, 0.1]),
    "bias_correction": st.booleans(),
    "grad_averaging": st.booleans(),
    "max_grad_norm": st.sampled_from([None, 0.1, 10.0]),
    "trust_ratio_bounds": st.sampled_from([None, (0.0, 10.0), (0.9, 1.1)]),
    "decoupled_weight_decay": st.booleans(),
    "adapt": st.booleans(),
})
lars_hyper = st.fixed_dictionaries({}, optional={
    "momentum": st.sampled_from([0.0, 0.5, 0.9]),
    "weight_decay": st.sampled_from([0.0, 1e-4, 1e-2]),
    "trust_coefficient": st.sampled_from([1e-3, 0.02, 1.0]),
    "eps": st.sampled_from([0.0, 1e-8]),
    "trust_clip": st.booleans(),
    "denominator": st.sampled_from(["sum", "combined"]),
    "lr_in_momentum": st.booleans(),
    "dampening": st.sampled_from([0.0, 0.5]),
    "max_grad_norm": st.sampled_from([None, 0.1, 10.0]),
    "adapt": st.booleans(),
})
shapes_st = st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hyper=lamb_hyper, shapes=shapes_st, seed=st.integers(0, 2**16))
def test_lamb_property(hyper, shapes, seed):
    params, ref, _ = run_backend("lamb", "eager", shapes, hyper, dtype=torch.float64, steps=3, seed=seed)
    assert max_rel_err(params, ref) <= 1e-10


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hyper=lars_hyper, shapes=shapes_st, seed=st.integers(0, 2**16), nesterov=st.booleans())
def test_lars_property(hyper, shapes, seed, nesterov):
    if nesterov and hyper.get("momentum", 0.9) > 0:
        hyper = {**hyper, "nesterov": True, "dampening": 0.0}
    params, ref, _ = run_backend("lars", "eager", shapes, hyper, dtype=torch.float64, steps=3, seed=seed)
    assert max_rel_err(params, ref) <= 1e-10
