import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels can only run through its interpreter, which must be chosen before
# triton is first imported. On a machine with CUDA, Triton tests compile for the GPU instead.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the exhaustive build tier: every Triton specialization "
                          "(tests/test_triton_compile.py), not the sample (docs/triton_kernels.md, "
                          "\"Two tiers\"); .ci/run adds it after the README's test command")


# Two xdist workers share the machine's cores: one intra-op thread each avoids oversubscribed
# OpenMP regions (tests that are about threads set their own counts).
if os.environ.get("PYTEST_XDIST_WORKER"):
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


# The two workers of scripts/dev.py (`-n 2 --dist loadfile --no-loadscope-reorder`) take whole
# files in collection order, each the next one when it is nearly through its own: the longest
# files first, so that neither waits at the end for the other's last long file (xdist's own
# order, by the number of tests, put the build files last). Longest first by the per-file times
# of `pytest -n 2 --dist loadfile --durations=0 --junitxml` (docs/testing.md); the files not
# named follow in their own order.
LONGEST_FIRST = ("test_compile.py", "test_deepspeed.py", "test_triton_compile.py",
                 "test_triton.py", "test_distributed.py", "test_golden.py",
                 "test_low_precision.py", "test_cuda_emulated.py", "test_cuda_compile.py",
                 "test_triton_lowp.py", "test_cpp.py", "test_check.py", "test_amp.py",
                 "test_gpu_verify.py", "test_cuda_lowp.py", "test_eager.py", "test_flat.py",
                 "test_build_cache.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole

