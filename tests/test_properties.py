"""Property tests (hypothesis): random hyper-parameters and shapes, every CPU backend that is fast
enough for many examples, against the float64 reference in float64."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedopt.testing import max_rel_err, run_backend
from helpers import LAMB_HYPER_ST as lamb_hyper
from helpers import LARS_HYPER_ST as lars_hyper
from helpers import backend_params

# Triton's interpreter is too slow for many examples; its flags are covered by test_triton.py.
BACKENDS = backend_params(("eager", "cpp"))

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
