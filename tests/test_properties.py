"""Property tests (hypothesis): random hyper-parameters and shapes, every CPU backend that is fast
enough for many examples, against the float64 reference in float64; and the memory-order rule
of low-precision state over random layouts."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedopt
from fusedopt.testing import max_rel_err, run_backend
from helpers import LAMB_HYPER_ST as lamb_hyper
from helpers import LARS_HYPER_ST as lars_hyper
from helpers import backend_params, in_memory

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


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.sampled_from([1, 2, 3, 7, 16]), min_size=2, max_size=4),
       data=st.data(), seed=st.integers(0, 2**16))
def test_a_param_of_any_dense_layout_steps_as_the_contiguous_tensor_of_its_memory(
        backend, shape, data, seed):
    """docs/math.md, "Random bits": a dense param in any order of its dims in memory (size-1
    dims included) stores the bf16 LAMB state, and cpp the params, of the contiguous tensor of
    its elements in memory order (eager's float32 norms may sum in another order)."""
    order = data.draw(st.permutations(range(len(shape))))
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn([shape[d] for d in order], generator=gen).permute(
        *sorted(range(len(shape)), key=order.__getitem__))
    grads = [torch.empty_like(values).copy_(torch.randn(shape, generator=gen)) for _ in range(3)]
    out = []
    for twin in (False, True):
        p = torch.nn.Parameter(in_memory(values) if twin else values.clone())
        opt = fusedopt.FusedLAMB([p], backend=backend, state_precision="bf16", state_min_numel=0)
        for g in grads:
            p.grad = in_memory(g) if twin else g.clone()
            opt.step()
        out.append([in_memory(t) for t in (p.detach(), opt.state[p]["exp_avg_sq"])])
    assert torch.equal(out[0][1], out[1][1])
    if backend == "cpp":
        assert torch.equal(out[0][0], out[1][0])
