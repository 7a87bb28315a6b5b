"""What the kernels and the backends both raise or ask, in a leaf module (imports only torch):
kernels/ builds its launches with them and imports no backend."""
from __future__ import annotations

import torch


class BackendCompileError(RuntimeError):
    """A backend could not compile a kernel it needs for a step (raised by ``Backend.prepare``,
    before anything is modified). ``str()`` names the backend, the kernel and its specialization."""


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def refuse_cpu_lr_in_capture(name: str, lr, device: torch.device) -> None:
    """Note [CPU tensor lr]: a GPU backend reads a CPU tensor lr of params on another device on
    the host (no device sync, and the bits of reading it on the device); a CUDA graph would keep
    the captured step's value at every replay, so such an lr is refused during capture."""
    if (isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and device.type != "cpu"
            and not torch.compiler.is_compiling() and capturing(device)):
        raise RuntimeError(
            f"fusedopt {name} backend: a CPU tensor lr cannot be captured in a CUDA graph: the "
            "step reads its value on the host, so every replay would use the value of the "
            "captured step; keep the tensor lr on the params' device for a captured step")
