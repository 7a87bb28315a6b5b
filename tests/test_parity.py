"""Every flag of docs/math.md, on the eager and C++ backends, against the float64 reference: fp32 (rel <= 1e-5)
and fp64 (rel <= 1e-11), 6 steps, over the shape zoo with a zero-norm weight, a zero gradient and an
excluded group. (Triton runs the same cases in test_triton.py with interpreter-sized tiles.)"""
import pytest
import torch

from helpers import LAMB_CASES, LARS_CASES, SHAPES_ZOO, backend_params, max_rel_err, run_backend, tols

BACKENDS = backend_params(("eager", "cpp"))
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]
CASES = [pytest.param("lamb", name, id=f"lamb-{name}") for name in LAMB_CASES] + \
        [pytest.param("lars", name, id=f"lars-{name}") for name in LARS_CASES]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,case", CASES)
def test_matches_reference(backend, kind, case, dtype):
    hyper = (LAMB_CASES if kind == "lamb" else LARS_CASES)[case]
    params, ref, _ = run_backend(kind, backend, SHAPES_ZOO, hyper, dtype=dtype, steps=6,
                                 zero_weight=1, zero_grad=3, excluded=(5,))
    assert max_rel_err(params, ref) <= tols(dtype)
