"""The unit of work of every backend (:class:`Bucket`), the dtype rules it carries, and the one
object that keeps what outlives a step (:class:`StepCache`).

A leaf module (it imports nothing of fusedopt but the optional compiled extension), so that the
functional layer, the backends and :mod:`fusedopt.distributed` all import it without a cycle.
"""
from __future__ import annotations

import itertools
import weakref
from array import array
from dataclasses import dataclass, field
from operator import methodcaller
from typing import Any

import torch

_DATA_PTR, _NUMEL = methodcaller("data_ptr"), methodcaller("numel")


# Note [native scans] (csrc/cpu/register.cpp): what a step reads of every tensor of a kept list
# is read by one C loop per list from fusedopt._C; these are the same answers from Python-level
# loops, used where the extension is not built (tests compare the two).
def py_grads(params: list) -> list:
    """``[p.grad for p in params]``."""
    return [p.grad for p in params]


def py_data_ptrs(tensors: list) -> bytes:
    """The data pointers of ``tensors`` as int64 values in one bytes."""
    return array("q", map(_DATA_PTR, tensors)).tobytes()


def py_numels(tensors: list) -> bytes:
    """The numel of each of ``tensors`` as int64 values in one bytes."""
    return array("q", map(_NUMEL, tensors)).tobytes()


def py_dtype_codes(tensors: list, dtypes: tuple) -> bytes:
    """For each entry of ``tensors`` one byte: 1 + the index of its dtype in ``dtypes``, 0 if it
    is no tensor of one of them."""
    codes = {d: i + 1 for i, d in enumerate(dtypes)}
    return bytes(codes.get(t.dtype, 0) if isinstance(t, torch.Tensor) else 0 for t in tensors)


def py_dense(tensors: list, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether every entry of ``tensors`` is a contiguous strided tensor of ``dtype`` on
    ``device``."""
    return all(isinstance(t, torch.Tensor) and t.layout == torch.strided
               and (t.dtype, t.device) == (dtype, device) and t.is_contiguous() for t in tensors)


try:
    from ._C import data_ptrs, dense, dtype_codes, grads, numels
except ImportError:
    data_ptrs, dense, dtype_codes, grads, numels = (
        py_data_ptrs, py_dense, py_dtype_codes, py_grads, py_numels)


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
    # int64 CPU tensor: each param's key in the random bits of stochastic rounding (its index in
    # its param group, and in the high 32 bits the index in the whole tensor of a shard's first
    # element; docs/math.md, "Random bits"); None: the index in these lists
    keys: torch.Tensor | None = None


class StepCache:
    """Note [step cache]: what the backends keep from one step to the next, in one object that
    ``add_param_group``, ``load_state_dict`` and ``__setstate__`` replace (with the optimizer's
    group plans, Note [group plans] in fusedopt/_plan.py):

    * ``layouts``: the cpp backend's native checked layouts, one per bucket slot (Note [kept
      layout] in csrc/cpu/ops.h); a step whose lists are what the layout checked skips the
      Python checks;
    * ``workspaces``: a dict per bucket slot for backend data that each backend validates on use
      (the Triton pointer tables, the eager backend's chunk index);
    * ``single``: group index -> (slot, backend) of a group that was one bucket at its last check
      (the only groups a step may bind without checking them in Python first);
    * ``bases``: the storages of the flat state under torch.compile (Note [traced flat state]
      in fusedopt/_state.py);
    * ``reducer``: the sharded reducer of the DTensor params of the last step and those params,
      kept while a step has the same ones in the same order (it holds the tensors its
      all-reduces select rows by, uploaded once).

    A bucket's slot names its group and its (device, param dtype, grad dtype). Torch.library
    operators, which take no Python objects, find a cache by its ``id`` (:meth:`find`): a weak
    reference, so that the cache lives exactly as long as its optimizer.
    """

    _ids = itertools.count()
    _live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __init__(self) -> None:
        self.id = next(StepCache._ids)
        StepCache._live[self.id] = self
        self.layouts: dict[str, Any] = {}
        self.workspaces: dict[str, dict] = {}
        self.reducer: tuple | None = None  # (the step's DTensor params, their reducer)
        self.single: dict[int, tuple[str, Any]] = {}
        self.bases: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def find(cache_id: int) -> StepCache | None:
        return StepCache._live.get(cache_id)

    def workspace(self, slot: str) -> dict:
        return self.workspaces.setdefault(slot, {})


def slot_of(gi: int, key: tuple) -> str:
    """The slot of the bucket of group ``gi`` with (device, param dtype, grad dtype) ``key``."""
    device, p_dtype, g_dtype = key
    return f"{gi}/{device}/{p_dtype}/{g_dtype}".replace("torch.", "")


@dataclass
class Bucket(TensorLists):
    """The rows of one param group that share device, param dtype and grad dtype: the unit of
    work of a backend. When ``masters`` is given the math reads and writes the fp32 masters and
    ``params`` receive the result rounded to nearest even."""

    # (original, contiguous stand-in) pairs written back after pass 2, for strided tensors
    writeback: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # backend-private data of this step (carried from bind to pass 2, e.g. eager's update
    # direction, the cpp layout bound for the step)
    scratch: dict = field(default_factory=dict)
    # where the bucket keeps data across steps (None: a one-off bucket) and under which slot
    cache: StepCache | None = None
    slot: str = ""
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

    @property
    def workspace(self) -> dict:
        """The bucket's dict of backend data kept across steps (a new one for a one-off bucket,
        and under torch.compile, where the Triton operators find theirs by the cache's id)."""
        if self.cache is None or torch.compiler.is_compiling():
            return self.scratch.setdefault("workspace", {})
        return self.cache.workspace(self.slot)
