"""Property tests (hypothesis): random hyper-parameters and shapes, every CPU backend that is fast
enough for many examples, against the float64 reference in float64."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import backend_params, max_rel_err, run_backend

# Triton's interpreter is too slow for many examples; its flags are covered by test_triton.py.
BACKENDS = backend_params(("eager", "cpp"))

lamb_hyper = st.fixed_dictionaries({}, optional={
    "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.9999)),
    "eps": st.sampled_from([1e-30, 1e-8, 1e-6, 1e-3]),
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


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hyper=lamb_hyper, shapes=shapes_st, seed=st.integers(0, 2**16))
def test_lamb_property(backend, hyper, shapes, seed):
    params, ref, _ = run_backend("lamb", backend, shapes, hyper, dtype=torch.float64, steps=3, seed=seed)
    assert max_rel_err(params, ref) <= 1e-10


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hyper=lars_hyper, shapes=shapes_st, seed=st.integers(0, 2**16), nesterov=st.booleans())
def test_lars_property(backend, hyper, shapes, seed, nesterov):
    if nesterov and hyper.get("momentum", 0.9) > 0:
        hyper = {**hyper, "nesterov": True, "dampening": 0.0}
    params, ref, _ = run_backend("lars", backend, shapes, hyper, dtype=torch.float64, steps=3, seed=seed)
    assert max_rel_err(params, ref) <= 1e-10
