"""The unit of work of every backend: :class:`Bucket`, and the dtype rules it carries.

A leaf module (it imports nothing of fusedopt), so that the functional layer, the backends and
:mod:`fusedopt.distributed` all import it without a cycle.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def compute_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Math runs in float64 for float64 params and in float32 for every other storage dtype."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def bias_correction(beta: float, step: torch.Tensor) -> torch.Tensor:
    """``1 - beta**t``, evaluated in float64 (the C++ and Triton backends use the same formula)."""
    return 1.0 - torch.pow(beta, step.to(torch.float64))


@dataclass
class TensorLists:
    """Aligned lists of one group's tensors: entry ``i`` of each belongs to ``params[i]``.

    ``params`` are the stored parameters (the local shard for DTensors); ``masters`` holds the
    fp32 master weight of each bf16/fp16 param (None: no masters). ``exp_avgs``/``exp_avg_sqs``
    are LAMB's state, ``momentum_buffers`` LARS's; a list the optimizer does not use is None.
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    steps: list[torch.Tensor]
    exp_avgs: list[torch.Tensor] | None = None
    exp_avg_sqs: list[torch.Tensor] | None = None
    momentum_buffers: list[torch.Tensor] | None = None
    masters: list[torch.Tensor] | None = None
    # the params as the caller holds them when ``params`` are their local shards (DTensors kept):
    # what a cross-rank reducer reads the sharding of (fusedopt.distributed)
    sources: list[torch.Tensor] | None = None


@dataclass
class Bucket(TensorLists):
    """The rows of one param group that share device, param dtype and grad dtype: the unit of
    work of a backend. When ``masters`` is given the math reads and writes the fp32 masters and
    ``params`` receive the result rounded to nearest even."""

    # (original, contiguous stand-in) pairs written back after pass 2, for strided tensors
    writeback: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # backend-private data carried from pass 1 to pass 2 (e.g. eager's update direction)
    scratch: dict = field(default_factory=dict)
    # backend-private data kept across steps while every list but ``grads`` holds the same tensors
    # (Note [list cache] in fusedopt/optim.py); None: a one-off bucket
    handles: dict | None = None
    # backend-private data that lives as long as the optimizer, one dict per param group and
    # (device, param dtype, grad dtype), whatever the lists hold; whatever a backend keeps there
    # it validates on use (the Triton backend's pointer tables). None: a one-off bucket
    workspace: dict | None = None
    # the group's ``backend`` option: "auto" lets a backend that fails to compile hand the bucket
    # to the next one (Backend.prepare)
    requested_backend: str = "auto"

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def param_dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.grads[0].dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.param_dtype)

    @property
    def weights(self) -> list[torch.Tensor]:
        """The tensors the math reads as ``w``: fp32 masters when present, else the params."""
        return self.masters if self.masters is not None else self.params
