"""The eager and C++ backends against the float64 reference, over fusedopt.testing's "full" case
set, which `python -m fusedopt check` runs too: every option case in fp32 (rel <= 1e-5) and fp64
(rel <= 1e-11), and the default and mixed options in bf16 and fp16 with and without fp32 master
weights and with grads of another dtype (fusedopt.testing.RULES), 5 steps over
fusedopt.testing.SHAPES_FULL with a zero-norm weight, a zero gradient and an excluded group. (Triton runs the option
cases in test_triton.py with interpreter-sized tiles.)"""
import pytest

from fusedopt import testing
from fusedopt.reference import LAMB_SPEC, LARS_SPEC
from helpers import backend_params

BACKENDS = backend_params(("eager", "cpp"))
CASE_SET = testing.CASE_SETS["full"]
PAIRS = [pytest.param(case, dtype, id=f"{case.id}-{dtype.name}") for case, dtype in CASE_SET.pairs]
# consecutive tests share a pair (the backend varies fastest): its inputs, reference and eager run
CACHE = testing.RunCache(maxsize=4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case,dtype", PAIRS)
def test_matches_reference(backend, case, dtype):
    result = testing.run_case(case, backend, "cpu", dtype, CASE_SET, cache=CACHE)
    if result.status == "skip":
        pytest.skip(result.detail)
    assert result.passed, str(result)


@pytest.mark.parametrize("kind,spec", [("lamb", LAMB_SPEC), ("lars", LARS_SPEC)],
                         ids=["lamb", "lars"])
def test_every_option_is_varied_by_an_option_case(kind, spec):
    """The option cases set every option of docs/math.md to a value other than its default (lr:
    every case runs with testing.LR, which is not LAMB's default)."""
    varied = {k for c in testing.OPTION_CASES if c.kind == kind for k, v in c.items if v != spec[k]}
    assert set(spec) - {"lr"} - varied == set()
    assert testing.LR["lamb"] != LAMB_SPEC["lr"]
