"""The optimizer's state: the ``state`` mapping, which counts its own edits, and the state
tensors a param gets at its first step, in its format (Note [flat state]).

A group's plan (Note [group plans] in fusedopt/_plan.py) keeps its tensor lists between steps
and must drop them when a state dict or a state tensor is replaced or removed.
:class:`OptimizerState` and the per-param :class:`ParamState` dicts it creates are plain dicts that bump one shared
counter on every edit (``opt.state[p] = {...}``, ``opt.state[p]["exp_avg"] = t``, ``del``,
``pop``, ``update`` ...), so the optimizer compares one integer per step instead of looking at
every tensor. In-place changes of a state tensor's values are not edits of the mapping and need
no invalidation. The optimizer's ``state_dict()`` and pickling hand out plain dicts, so
checkpoints carry no fusedopt class.
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

import torch

from . import lowp
from ._bucket import compute_dtype
from ._bucket import local as _local
from .flat import _aligned_offsets, _dense_layout

LOW_PRECISION = (torch.float16, torch.bfloat16)
_STATE_DTYPES = {"bf16": torch.bfloat16, "8bit": torch.uint8}  # of the low-precision formats


class _Counter:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


def _bumping(name: str):
    base = getattr(dict, name)

    def method(self, *args, **kwargs):
        self._edits.value += 1
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


_EDITS = ("__setitem__", "__delitem__", "pop", "popitem", "clear", "update", "setdefault",
          "__ior__")


class ParamState(dict):
    """One param's state dict (see the module docstring)."""

    __slots__ = ("_edits",)

    def __init__(self, edits: _Counter, *args: Any, **kwargs: Any) -> None:
        self._edits = edits
        dict.__init__(self, *args, **kwargs)


class OptimizerState(defaultdict):
    """``optimizer.state``: a ``defaultdict`` of :class:`ParamState` (see the module docstring)."""

    def __init__(self, items: Any = ()) -> None:
        super().__init__(None)
        self._edits = _Counter()
        for k, v in dict(items).items():
            defaultdict.__setitem__(self, k, self._wrap(v))

    @property
    def edits(self) -> int:
        """How many edits the mapping and its state dicts have seen."""
        return self._edits.value

    def _wrap(self, v: Any) -> Any:
        if isinstance(v, dict) and not (isinstance(v, ParamState) and v._edits is self._edits):
            return ParamState(self._edits, v)
        return v

    def __missing__(self, key):
        v = ParamState(self._edits)
        defaultdict.__setitem__(self, key, v)
        self._edits.value += 1
        return v

    def __setitem__(self, key, value) -> None:
        self._edits.value += 1
        defaultdict.__setitem__(self, key, self._wrap(value))

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = {} if default is None else default
        return defaultdict.__getitem__(self, key)

    def update(self, *args, **kwargs) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def plain(self) -> defaultdict:
        """The same items as torch's ``defaultdict(dict)`` of plain dicts (same tensors)."""
        out: defaultdict = defaultdict(dict)
        out.update({k: dict(v) if isinstance(v, dict) else v for k, v in self.items()})
        return out


for _name in _EDITS:
    setattr(ParamState, _name, _bumping(_name))
for _name in ("__delitem__", "pop", "popitem", "clear", "__ior__"):
    setattr(OptimizerState, _name, _bumping(_name))


# ---------------------------------------------------------------------------- state tensors
def alias(buffer: torch.Tensor, offset: int, shape, stride=None) -> torch.Tensor:
    """A tensor of ``shape`` (contiguous, or of a dense ``stride``) on ``buffer``'s storage from
    element ``offset`` on: it shares the storage but, unlike a view, has a version counter of its
    own."""
    return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), offset, shape, *(() if stride is None else (stride,)))


def uses_master(group: dict[str, Any], p: torch.Tensor) -> bool:
    mw = group["master_weights"]
    return p.dtype in LOW_PRECISION and (mw is None or mw)


def state_format(group: dict[str, Any], p: torch.Tensor, whole: int | None) -> str:
    """The format of the moments of ``p`` (docs/math.md, "Low-precision state"): the group's
    ``state_precision`` for a param of at least ``state_min_numel`` elements (counted over the
    whole tensor, ``whole`` elements where ``p`` is a piece of one, also when sharded), else
    full; a non-contiguous param gets bf16 for 8-bit (the blocks of a packed state hold its
    elements in row-major order, which the kernels would step through a contiguous copy), and so
    does a DTensor whose shards are not runs of whole blocks (Note [sharded 8-bit state],
    lowp.py) and a piece of a tensor (its blocks would start where the piece starts)."""
    fmt = group["state_precision"]
    if fmt == "full" or (p.numel() if whole is None else whole) < group["state_min_numel"]:
        return "full"
    if fmt == "8bit" and (whole is not None or (
            not lowp.rows_hold_blocks(p) if hasattr(p, "to_local") else not p.is_contiguous())):
        return "bf16"
    return fmt


def create(owner: str, state: OptimizerState, keys: tuple[str, ...], group: dict[str, Any],
           ps: list[torch.Tensor], wholes: dict[int, int]) -> None:
    """Create the state ``keys`` (and ``step``, and ``master_param`` where the group's
    ``master_weights`` gives one) of ``ps``, params of ``group`` without state; ``wholes``: id ->
    the numel of the whole tensor of each param that is a piece of one (``owner``: the
    optimizer's name, for the warning).

    Note [flat state]: the state of the plain dense params of one (device, dtype) among
    ``ps`` lives in one buffer per state key: each param's ``exp_avg`` (``exp_avg_sq``,
    ``momentum_buffer``, ``master_param``) lies in its key's buffer, starting on a 64-byte
    boundary, and its ``step`` in one float32 buffer. The fused backends then stream each
    state list as (nearly) one array, and the step counts of thousands of tensors share a
    few cache lines instead of one allocation each (docs/performance.md measures it). Each
    is a tensor of its own on the shared storage (``set_``, as ``torch.load`` rebuilds
    tensors), not a view: it has its own version counter, so a step bumps each written
    tensor's version once. ``torch.save`` of the whole state dict writes each buffer once and
    ``torch.load`` restores the sharing; torch.distributed.checkpoint writes each tensor's
    own elements. Saving one state tensor alone writes its whole buffer (as for a view).
    Each tensor has its param's strides (a channels_last param's state is channels_last).
    DTensor shards (sharded training) and params that are not dense (slices with gaps) get
    tensors of their own.
    """
    formats = [state_format(group, p, wholes.get(id(p))) for p in ps]
    if group["state_precision"] == "8bit" and "bf16" in formats:
        warnings.warn(f"{owner}: {formats.count('bf16')} param(s) of a group with "
                      "state_precision='8bit' keep bf16 state: their elements are not "
                      "contiguous (a transposed or channels_last param), or their shards "
                      "are not runs of whole 256-element blocks (docs/math.md, "
                      "\"Low-precision state\")")
    flat: dict[tuple, list[torch.Tensor]] = {}
    for p, fmt in zip(ps, formats):
        if hasattr(p, "to_local") or not _dense_layout(p):
            _create_own(state[p], keys, group, p, fmt)
        else:
            flat.setdefault((p.device, p.dtype, fmt), []).append(p)
    for (device, dtype, fmt), members in flat.items():
        numels = [p.numel() for p in members]
        sdtype = _STATE_DTYPES.get(fmt, compute_dtype(dtype))
        sizes = [lowp.packed_numel(n) for n in numels] if fmt == "8bit" else numels
        offsets, total = _aligned_offsets(sizes, sdtype)
        steps = torch.zeros(len(members), dtype=torch.float32, device=device)
        buffers = {key: torch.zeros(total, dtype=sdtype, device=device) for key in keys}
        master = uses_master(group, members[0])  # one dtype: the same for all
        if master:
            m_offsets, m_total = ((offsets, total) if fmt == "full"
                                  else _aligned_offsets(numels, torch.float32))
            masters = torch.empty(m_total, dtype=torch.float32, device=device)
        for i, (p, offset, size) in enumerate(zip(members, offsets, sizes)):
            st = state[p]
            st["step"] = alias(steps, i, ())
            # laid out as the param (channels_last, ...): the kernels walk its memory
            layout = ((size,), None) if fmt == "8bit" else (p.shape, p.stride())
            for key, buffer in buffers.items():
                st[key] = alias(buffer, offset, *layout)
            if master:
                st["master_param"] = alias(masters, m_offsets[i], p.shape, p.stride())
                st["master_param"].copy_(p.detach())


def _create_own(st: ParamState, keys: tuple[str, ...], group: dict[str, Any], p: torch.Tensor,
                fmt: str) -> None:
    """The state of one param in tensors of its own (DTensors, params that are not dense)."""
    lp = _local(p)
    cd = compute_dtype(lp.dtype)
    st["step"] = torch.zeros((), dtype=torch.float32, device=lp.device)
    for key in keys:
        st[key] = lowp.zeros(lp if fmt == "8bit" else p, fmt, dtype=cd)
    if uses_master(group, lp):
        st["master_param"] = p.detach().to(torch.float32, copy=True)


def columns(owner: str, gi: int, group: dict[str, Any], states: list, keys: tuple[str, ...],
            ps: list, all_ps: list, lps: list) -> tuple[list[list], bool, list]:
    """The state lists of the rows ``ps`` of param group ``gi`` (``all_ps``: all of the group's
    params; ``lps``: the rows' local tensors; ``states``: their state dicts): the step counts,
    the moments ``keys``, and last the masters (None for a param without) where some row steps
    through one; whether one does; and the rows whose state keeps a master the group no longer
    uses (master weights turned off since), which the step drops once it succeeded. Raises,
    naming the param, where a state lacks a tensor."""
    dtypes = set(map(attrgetter("dtype"), lps))
    master = group["master_weights"] is not False and not dtypes.isdisjoint(LOW_PRECISION)
    low = ([True] * len(lps) if dtypes <= set(LOW_PRECISION)
           else [p.dtype in LOW_PRECISION for p in lps]) if master else [False] * len(lps)
    names = ("step", *keys)
    try:
        out = [[st[k] for st in states] for k in names]
        if master:
            out.append([st["master_param"] if lo else None for st, lo in zip(states, low)])
    except KeyError:
        i, key = next((i, k) for i, st in enumerate(states) for k in (*names, "master_param")
                      if k not in st and (k != "master_param" or low[i]))
        j = next(k for k, q in enumerate(all_ps) if q is ps[i])
        raise RuntimeError(f"{owner}: param {j} of param group {gi} has no state tensor {key!r} "
                           "(a state dict of another optimizer, or master weights switched on "
                           "after steps?)") from None
    if master and sum(map(is_, out[-1], repeat(None))) != low.count(False):
        # a None master would step its param as if it had none
        i = next(i for i, (m, lo) in enumerate(zip(out[-1], low)) if lo and m is None)
        raise TypeError(f"{owner}: param group {gi}, param {i} of those with grads: state "
                        "'master_param' is NoneType, not a tensor")
    stale = ([p for p, st in zip(ps, states) if "master_param" in st]
             if not master and max(map(len, states)) > len(names) else [])
    return out, master, stale


def traced_layout(columns: list[list], bases: list, kept: dict[tuple, torch.Tensor]) -> tuple:
    """Note [traced flat state]: the flat state (Note [flat state]) is tensors that share a
    storage and that a step writes. Given to a traced step as graph inputs, they would alias each
    other, and AOTAutograd would clone their storage once per tensor and copy it back around the
    operators (time that grows with the square of the tensor count). A traced step gets instead
    one tensor per storage (``bases``: each spans its storage, kept in ``kept``, the step cache's,
    the same object for as long as the cache lives, which the guards on it check) and builds each
    state tensor as a view of it in the graph. Returns, per state list of ``columns``, ``(base
    index, storage offset, shape, stride)`` of each entry (None: no master), constants of the
    trace. The state tensors themselves are still appended to the lists, which the traced step
    then replaces by the views: dynamo guards on them, so a step after their replacement
    (``load_state_dict``) compiles again instead of writing the old storages. Only for the
    backends that run as operators: inductor fuses the eager backend's foreach operations,
    clones included, and views of the bases made its compile slower without making its step
    faster (docs/performance.md)."""
    index: dict[tuple, int] = {}

    def entry(t):
        if t is None:
            return None
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device, t.dtype)
        if key not in index:
            base = kept.get(key)
            if base is None:
                base = kept[key] = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)
            index[key] = len(bases)
            bases.append(base)
        return index[key], t.storage_offset(), tuple(t.shape), tuple(t.stride())

    return tuple(tuple(entry(t) for t in xs) for xs in columns)
