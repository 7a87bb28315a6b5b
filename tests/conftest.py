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
