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
