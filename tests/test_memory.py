"""Fused backends allocate no parameter-sized temporaries inside step(): only O(tensors + chunks)
tables, measured with the PyTorch profiler's allocator events."""
import pytest
import torch

import fusedopt
from helpers import backend_params

# the Triton interpreter evaluates ‖w‖/‖u‖ for zero norms too before the zero-norm rule discards it
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|divide by zero):RuntimeWarning")

BIG = 1 << 20  # a 4 MiB fp32 param: any parameter-sized temporary would show as >= 4 MiB


def _step_allocations(kind, backend, dtype=torch.float32, big=(BIG,), **kw):
    """The largest allocation inside the second step of a param of ``big`` (a shape, or a
    tensor) beside a small one; grads made like the params."""
    big = big if isinstance(big, torch.Tensor) else torch.randn(big)
    params = [torch.nn.Parameter(big.to(dtype)), torch.nn.Parameter(torch.randn(7, 3).to(dtype))]
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls(params, lr=1e-2, backend=backend, max_grad_norm=1.0, **kw)
    for _ in range(2):  # the first step creates the state
        for p in params:
            p.grad = torch.randn_like(p)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            opt.step()
    allocs = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocs, "the profiler recorded no allocation at all (the check would be vacuous)"
    return max(allocs)


@pytest.mark.parametrize("backend", backend_params(("cpp", "triton")))
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_step_allocates_only_small_tables(kind, backend, dtype):
    largest = _step_allocations(kind, backend, dtype)
    assert largest < 64 * 1024, f"largest allocation inside step(): {largest} bytes"


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_low_precision_state_allocates_only_small_tables(kind, precision):
    """The 8-bit passes hold one block of each moment in float32 at a time (docs/math.md,
    "Low-precision state"): extra memory grows with the blocks in flight, not the tensor size."""
    largest = _step_allocations(kind, "cpp", state_precision=precision)
    assert largest < 64 * 1024, f"largest allocation inside step(): {largest} bytes"


@pytest.mark.parametrize("precision", ["full", "bf16"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_a_channels_last_param_is_stepped_in_its_own_memory(kind, precision):
    """A channels_last param, its grad of the same strides (as autograd makes it), is walked in
    its memory order, which also draws bf16 v's random bits (docs/math.md, "Random bits"): no
    contiguous copy of it (it stepped through copies of the param, grad and state)."""
    big = torch.randn(64, 256, 8, 8).to(memory_format=torch.channels_last)
    assert big.numel() == BIG and not big.is_contiguous()
    largest = _step_allocations(kind, "cpp", big=big, state_precision=precision)
    assert largest < 64 * 1024, f"largest allocation inside step(): {largest} bytes"


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_eager_step_does_allocate_parameter_sized_temporaries(kind):
    """The contrast that shows the measurement sees such temporaries when they exist."""
    assert _step_allocations(kind, "eager") >= 4 * BIG


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "full"), (torch.float32, "bf16"),
                                             (torch.bfloat16, "full")])
def test_state_loaded_from_another_layout_takes_its_params_layout(dtype, precision):
    """A checkpoint of a contiguous model loaded into the model made channels_last: the moments
    (and master weights) take their param's layout when loaded, so the steps after walk memory
    with no copy (they stepped copies of the state at every step) and continue as the
    contiguous optimizer does."""
    values = torch.randn(64, 256, 8, 8).to(dtype)
    runs = []
    for layout in (torch.contiguous_format, torch.channels_last):
        p = torch.nn.Parameter(values.clone())
        opt = fusedopt.FusedLAMB([p], backend="cpp", state_precision=precision)
        p.grad = torch.ones_like(p)
        opt.step()
        saved = opt.state_dict()
        q = torch.nn.Parameter(p.detach().to(memory_format=layout))
        opt = fusedopt.FusedLAMB([q], backend="cpp", state_precision=precision)
        opt.load_state_dict(saved)
        assert all(t.stride() == q.stride() for k, t in opt.state[q].items() if k != "step")
        q.grad = torch.full_like(q, 0.5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            opt.step()
        allocs = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
        assert allocs and max(allocs) < 64 * 1024, f"largest allocation inside step(): {max(allocs)}"
        runs.append(q.detach().contiguous())
    if precision == "full":  # bf16 v draws its bits by the memory order
        assert torch.equal(*runs)
