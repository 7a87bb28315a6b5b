"""Note [NaN propagation] (csrc/fusedopt/math.h) on the backends that run on the CPU without
Triton's interpreter; tests/test_triton.py runs the same cases on the Triton backend."""
import pytest

from helpers import assert_nan_rule, nan_rule_runs

import fusedopt


@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_nan_norms_give_nan_trust_ratios(backend):
    if backend not in fusedopt.available_backends():
        pytest.skip(f"backend {backend!r} is not built in this environment")
    assert_nan_rule(nan_rule_runs(backend))
