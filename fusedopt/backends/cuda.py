"""CUDA backend: the multi-tensor kernels of ``csrc/cuda``, called as ``torch.ops.fusedopt.*``.

The operators are the ones of the C++ CPU backend (schemas defined by ``fusedopt._C``, fake
implementations registered by :mod:`fusedopt.backends.cpp`); ``fusedopt._cuda`` registers their
CUDA kernels, so a CUDA tensor dispatches here and a CPU tensor to the CPU kernels.

Per pass and bucket: pass 1 is one chunk kernel plus one per-tensor reduction kernel (for every
table of up to ~60 tensors: see Note [launch splitting] in ``csrc/cuda/multi_tensor_apply.cuh``);
pass 2 is one chunk kernel per table. Norms are reduced in two deterministic stages (per-chunk
partial sums, then a fixed-order sum per tensor; no float atomics), step counts are advanced on
the device by the reduction, and ``grad_mult`` / ``found_inf`` / a tensor ``lr`` on the device are
read by the kernels through pointers, so ``step()`` never synchronizes with the host. A CPU tensor
``lr`` is read on the host by the operator (no device sync, no copy) and passed by value, and
refused during CUDA-graph capture (Note [CPU tensor lr] in fusedopt/backends/triton_backend.py).

The per-element math is ``csrc/fusedopt/math.h``, the header the CPU backend compiles too (its
tests check it on the host against the float64 reference). Low-precision state (``bf16`` and
``8bit``, per tensor, mixed in one launch) is stored bit for bit as the cpp backend stores it
(``tests/test_cuda_lowp.py`` checks it under the SIMT emulation); the keys of LAMB's stochastic
rounding are read on the host from the bucket's CPU ``keys`` tensor.

``fusedopt._cuda`` is imported when this backend is first constructed; when it was not built (a CPU
build of torch, no nvcc) or does not load, the constructor raises ImportError with guidance, which
``backend="auto"`` treats as "use Triton or eager" and an explicit ``backend="cuda"`` reports.
"""
from __future__ import annotations

import torch

from . import refuse_cpu_lr_in_capture
from .cpp import CppBackend, load_extension

_LOW = (torch.float32, torch.bfloat16, torch.float16)


class CudaBackend(CppBackend):
    """The C++ backend's operators and passes; the CUDA kernels behind them and CUDA's dtype rules."""

    name = "cuda"
    # docs/math.md "Low-precision state": bit-identical to the cpp backend's formats (Note [rounded
    # operations] in csrc/fusedopt/math.h, csrc/cuda/lowp.cuh)
    state_formats = ("full", "bf16", "8bit")

    def __init__(self):
        super().__init__()  # fusedopt._C: the operator schemas and fakes
        guidance = ""
        if torch.version.cuda is None:
            guidance = (f"This torch ({torch.__version__}) is a CPU build, which cannot link a CUDA "
                        "extension; install a CUDA build of torch first. ")
        load_extension("_cuda", "CUDA extension", guidance + (
            "Reinstall with `pip install --no-build-isolation -e .` with nvcc on PATH "
            "(FUSEDOPT_BUILD_CUDA=1 forces the CUDA build; TORCH_CUDA_ARCH_LIST picks the GPU "
            "architectures)."))

    def unavailable_reason(self, device, param_dtype, grad_dtype):
        if device.type != "cuda":
            return (f"the cuda backend runs on CUDA tensors only, not on {device.type} "
                    "(use backend='cpp' or 'eager' there)")
        if param_dtype == torch.float64:
            if grad_dtype != torch.float64:
                return (f"the cuda backend has no kernel for float64 params with grad dtype "
                        f"{grad_dtype} (float64 params need float64 grads)")
            return None
        if param_dtype not in _LOW:
            return (f"the cuda backend has no kernel for param dtype {param_dtype} "
                    "(float32, bfloat16, float16 and float64 are supported)")
        if grad_dtype not in _LOW or (param_dtype != torch.float32
                                      and grad_dtype not in (param_dtype, torch.float32)):
            return (f"the cuda backend has no kernel for grad dtype {grad_dtype} with param dtype "
                    f"{param_dtype} (float32 params take float32, bfloat16 or float16 grads; "
                    "bfloat16/float16 params take grads of their own dtype or float32)")
        return None

    def prepare(self, b, kind, h, has_grad_mult, has_found_inf, clip):
        """Note [CPU tensor lr]: a CPU tensor lr is refused in a CUDA-graph capture before the
        step's first launch (the operators refuse it too, as a last line of defence)."""
        refuse_cpu_lr_in_capture(self.name, h.lr, b.device)

    def bind(self, b, check):
        return None  # KeptLayout holds the CPU kernels; CUDA goes through torch.ops

    def sq_norms(self, tensors):
        tensors = list(tensors)
        if not tensors:
            return torch.zeros(0)
        return self._ops.sq_norms(tensors)
