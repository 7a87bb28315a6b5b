"""Distributed training: sharded trust-ratio norms (FSDP2 / DTensor, DeepSpeed ZeRO), ZeRO and DDP
helpers.

Sharded params (FSDP2 ``fully_shard``, or any DTensor with a ``Shard`` placement)
------------------------------------------------------------------------------------
The optimizer updates the local shards. A trust ratio needs norms of the *full* tensors, so every
backend returns per-rank partial sums of squares and :class:`ShardedNormReducer` completes them:

* trust-ratio sums: the ``[n_b, 2]`` sums of all buckets of the step are stacked into one tensor
  and all-reduced once per device mesh (one collective per step for the usual single FSDP2 mesh),
  over the mesh dimensions along which the step's tensors are sharded;
* global clipping (``max_grad_norm``): the local total ``Σ‖g‖²`` is all-reduced once more before
  pass 1 (LAMB's moments need the clipped gradient), over the same mesh dimensions (over the
  default group when the step has sharded tensors on more than one mesh).

Counting rule (note "count once"): a sum is added over the ranks that hold *different* pieces of a
tensor and counted once among the ranks that hold the same piece. A tensor's rows take part in its
mesh's collective only if it is sharded on some mesh dimension; within the collective, a rank
contributes the rows of a tensor only if its mesh coordinate is 0 on every reduced dimension along
which that tensor is replicated (the other ranks contribute zeros). Fully replicated DTensors and
plain tensors hold complete values: their trust-ratio sums are used as they are, and in the
global-clipping total they count on one rank of the reduction group only (plain tensors in a
sharded step are assumed to be identical on every rank). ``Partial`` placements are refused.

Nothing here reads a tensor value on the host, and no parameter is ever gathered.

ZeRO
----
``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=FusedLAMB, ...)`` gives
each rank whole tensors, so trust-ratio norms are local and need no communication. Global clipping
is different: each rank's optimizer sees only the gradients it owns, so ``max_grad_norm`` would clip
by a per-rank norm. :func:`enable_zero_global_clipping` makes it all-reduce the total (one
collective per step).

DeepSpeed ZeRO
--------------
ZeRO stages 1, 2 and 3 hand the optimizer flat float32 pieces (per param group, or ZeRO-3
sub-group, and rank), cut across tensor boundaries. :func:`enable_deepspeed_zero` registers where
each tensor's piece lies; the optimizer then steps each piece as a row (Note [flat partitions] in
fusedopt/_sharding.py) and :class:`_PartitionReducer` completes each tensor's sums with one
all-reduce per step call.

FSDP1
-----
``FullyShardedDataParallel(use_orig_params=True)`` hands the optimizer each rank's 1-D piece of
every param. :func:`enable_fsdp1` registers where each piece lies in its tensor;
:class:`_PieceReducer` completes each tensor's sums with one all-reduce of a table of every tensor
per step.

DDP
---
DDP needs nothing from the optimizer (gradients are already averaged). :func:`accumulate` runs
gradient accumulation with the gradient all-reduce on the last micro-batch only.
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from operator import is_
from typing import TYPE_CHECKING, Any, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist

from . import backends as _backends
from . import lowp
from ._bucket import local as _local
from ._adapters import check_partition_options
from ._sharding import Partition, Sharding

if TYPE_CHECKING:
    from ._bucket import Bucket

__all__ = ["ShardedNormReducer", "accumulate", "enable_deepspeed_zero", "enable_fsdp1",
           "enable_zero_global_clipping", "reducer_for"]

T = TypeVar("T")



def _dtensor_type():
    """The DTensor class, or None where this torch build has no distributed tensors."""
    if not dist.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


@dataclass(frozen=True)
class _Layout:
    """How one param of the step is laid out across ranks."""

    mesh: Any  # DeviceMesh, or None for a plain tensor
    shard_dims: tuple[int, ...]  # mesh dims along which the tensor is split
    coord: tuple[int, ...] | None  # this rank's coordinate in ``mesh`` (None: not in the mesh)

    def primary(self, dims: Iterable[int]) -> bool:
        """True if this rank counts the tensor's piece among the ranks that differ only along
        ``dims`` (its coordinate is 0 on every one of ``dims`` that does not shard the tensor)."""
        return self.coord is not None and all(
            self.coord[d] == 0 for d in dims if d not in self.shard_dims
        )


_PLAIN = _Layout(None, (), None)
# (mesh, placements) -> _Layout; a step's params share a few of these (meshes live for the run)
_LAYOUTS: dict[tuple, _Layout] = {}


def _layout(p: torch.Tensor, dtensor_type) -> _Layout:
    if dtensor_type is None or not isinstance(p, dtensor_type):
        return _PLAIN
    mesh, placements = p.device_mesh, p.placements
    g = p.grad
    if not isinstance(g, dtensor_type) or g.placements != placements or g.device_mesh != mesh:
        got = (g.placements, g.device_mesh) if isinstance(g, dtensor_type) else type(g).__name__
        raise RuntimeError(
            f"the grad of a DTensor param must be a DTensor with the same mesh and placements; param "
            f"of shape {tuple(p.shape)} has placements {placements} on {mesh}, its grad: {got}"
        )
    key = (mesh, placements)
    lay = _LAYOUTS.get(key)
    if lay is None:
        if any(pl.is_partial() for pl in placements):
            raise RuntimeError(
                f"Partial placements are not supported by fusedopt's sharded norms (param of shape "
                f"{tuple(p.shape)}, placements {placements}); redistribute to Shard or Replicate"
            )
        shard_dims = tuple(d for d, pl in enumerate(placements) if pl.is_shard())
        coord = mesh.get_coordinate()
        lay = _LAYOUTS[key] = _Layout(mesh, shard_dims, None if coord is None else tuple(coord))
    return lay


# ------------------------------------------------------------------------------ collectives
_FLAT_GROUPS: dict[tuple, Any] = {}


def _comm_device(t: torch.Tensor, mesh) -> torch.device:
    """Where the collective runs: the mesh's device type (e.g. CUDA for NCCL, even when the
    optimizer state is offloaded to the CPU); for the default group, the default backend's."""
    if mesh is not None:
        dev_type = mesh.device_type
    else:
        dev_type = "cuda" if dist.get_backend() == "nccl" else t.device.type
    if t.device.type == dev_type:
        return t.device
    if dev_type == "cpu":
        return torch.device("cpu")
    return torch.device(dev_type, torch.get_device_module(dev_type).current_device())


def _all_reduce(t: torch.Tensor, mesh, dims: tuple[int, ...]) -> None:
    """Sum ``t`` in place over the ranks of ``mesh`` that differ only along ``dims`` (the default
    group when ``mesh`` is None). One collective; skipped when that set is this rank alone."""
    if mesh is None:
        if dist.get_world_size() > 1:
            _all_reduce_on(t, None, None)
        return
    size = math.prod(mesh.size(d) for d in dims)
    if size == 1:
        return
    if len(dims) == 1:
        _all_reduce_on(t, mesh, mesh.get_group(dims[0]))
    elif size == dist.get_world_size():
        _all_reduce_on(t, mesh, None)
    else:
        groups = _flat_group(mesh, dims)
        for g in groups:  # one group unless the mesh has no dim names (see _flat_group)
            _all_reduce_on(t, mesh, g)


def _all_reduce_on(t: torch.Tensor, mesh, group) -> None:
    dev = _comm_device(t, mesh)
    if dev == t.device:
        dist.all_reduce(t, group=group)
    else:
        buf = t.to(dev)
        dist.all_reduce(buf, group=group)
        t.copy_(buf)


def _flat_group(mesh, dims: tuple[int, ...]) -> list:
    """Process group(s) spanning several mesh dims: the flattened sub-mesh when the mesh has dim
    names (``DeviceMesh._flatten``, created once, on every rank at the same step), else one group
    per dim (one collective each)."""
    key = (mesh, dims)
    if key not in _FLAT_GROUPS:
        names = mesh.mesh_dim_names
        if names:
            sub = mesh[tuple(names[d] for d in dims)] if len(dims) < mesh.ndim else mesh
            _FLAT_GROUPS[key] = [sub._flatten().get_group()]
        else:
            _FLAT_GROUPS[key] = [mesh.get_group(d) for d in dims]
    return _FLAT_GROUPS[key]


# ------------------------------------------------------------------------------ reducers
class ShardedNormReducer:
    """:class:`~fusedopt.functional.SqSumReducer` for steps with DTensor params (see module doc).

    Built by :func:`reducer_for` from a step's params (DTensors), and kept by the optimizer for
    the steps with the same ones (``StepCache.reducer``, so that its tensors of selected rows are
    uploaded once); the rows of each bucket are matched to them through ``Bucket.sources``.
    ``param_groups`` gives each param's group (whose backend recomputes the few per-tensor sums
    that must not be counted twice in the clipping total).
    """

    def __init__(self, params: list[torch.Tensor], param_groups, dtensor_type):
        self._dtensor_type = dtensor_type
        layouts = {id(p): _layout(p, dtensor_type) for p in params}
        distinct = {id(lay): lay for lay in layouts.values()}  # memoized: few distinct objects
        meshes: dict[Any, set[int]] = {}  # sharded meshes in first-use order -> union of shard dims
        for lay in distinct.values():
            if lay.shard_dims and lay.coord is not None:
                meshes.setdefault(lay.mesh, set()).update(lay.shard_dims)
        self._mesh_dims = {m: tuple(sorted(d)) for m, d in meshes.items()}

        self._layouts = layouts
        self._consts: dict[tuple, torch.Tensor] = {}  # see _const
        self._primary = {i: lay.primary(self._mesh_dims[lay.mesh]) for i, lay in distinct.items()
                         if lay.shard_dims and lay.coord is not None}

        # Clipping total: one all-reduce. With one sharded mesh, over the dims along which the
        # step's tensors are sharded; with several, over the default group.
        if len(self._mesh_dims) == 1:
            (mesh, dims), = self._mesh_dims.items()
            self._grad_group = (mesh, dims)
            on_mesh = _Layout(mesh, (), tuple(mesh.get_coordinate()))

            def counted(lay: _Layout) -> bool:
                return (lay if lay.mesh == mesh else on_mesh).primary(dims)
        else:
            self._grad_group = (None, ())
            world_first = dist.get_rank() == 0

            def counted(lay: _Layout) -> bool:
                return world_first if lay.mesh is None else lay.primary(range(lay.mesh.ndim))
        is_counted = {i: counted(lay) for i, lay in distinct.items()}
        uncounted = [p for p in params if not is_counted[id(layouts[id(p)])]]
        group_of = {id(p): g for g in param_groups for p in g["params"]} if uncounted else {}
        self._uncounted = [(p, group_of[id(p)]) for p in uncounted]

    def reduce_grad_sq(self, total: torch.Tensor) -> None:
        """``total`` (0-dim float64, the local ``Σ‖g‖²``) becomes the sum over all ranks."""
        if self._uncounted:
            total.sub_(self._local_grad_sq().to(total.device))
        mesh, dims = self._grad_group
        _all_reduce(total, mesh, dims)

    def _local_grad_sq(self) -> torch.Tensor:
        """Σ‖g‖² of the local grads that this rank must not count, each by the backend of its
        bucket (the values that went into the total, so that subtracting them cancels)."""
        parts = []
        for p, group in self._uncounted:
            lp, lg = _local(p), _local(p.grad)
            be = _backends.resolve(group["backend"], lp.device, lp.dtype, lg.dtype)
            parts.append(be.sq_norms([lg]).to(torch.float64).sum())
        dev = parts[0].device
        return torch.stack([x.to(dev) for x in parts]).sum()

    def reduce_trust_sums(self, sums: list[torch.Tensor], buckets: list[Bucket]) -> None:
        """Complete each ``[n_b, 2]`` tensor of partial sums in place: one stacked all-reduce per
        sharded mesh."""
        per_mesh: dict[Any, list[tuple[int, list[int], list[bool]]]] = {m: [] for m in self._mesh_dims}
        for k, b in enumerate(buckets):
            sources = b.sources if b.sources is not None else b.params
            if len(sources) != sums[k].shape[0]:
                raise RuntimeError("fusedopt.distributed: a bucket's sums do not match its rows")
            rows: dict[Any, tuple[list[int], list[bool]]] = {}
            for j, p in enumerate(sources):
                lay = self._layouts.get(id(p))
                if lay is None:
                    lay = self._layouts[id(p)] = _layout(p, self._dtensor_type)
                if lay.shard_dims and lay.coord is not None:
                    idx, keep = rows.setdefault(lay.mesh, ([], []))
                    idx.append(j)
                    keep.append(self._primary[id(lay)])
            for mesh, (idx, keep) in rows.items():
                per_mesh[mesh].append((k, idx, keep))
        for mesh, selections in per_mesh.items():
            if selections:
                _reduce_rows(sums, selections, mesh, self._mesh_dims[mesh], self._consts)


def _const(consts: dict, values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, made once per reducer and layout: a copy from a
    Python list at every step would be a pageable host-to-device upload (a host sync) and
    cannot be captured in a CUDA graph."""
    key = (tuple(values), dtype, device)
    t = consts.get(key)
    if t is None:
        t = consts[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


def _reduce_rows(sums, selections, mesh, dims, consts: dict) -> None:
    """Stack the selected rows of several ``sums`` tensors (zeroing those this rank does not
    count), all-reduce them once, and write the totals back in place."""
    dtype = torch.float64 if any(sums[k].dtype == torch.float64 for k, _, _ in selections) \
        else torch.float32
    dev = sums[selections[0][0]].device
    parts, index = [], []
    for k, idx, keep in selections:
        s = sums[k]
        ix = None if len(idx) == s.shape[0] else _const(consts, idx, torch.int64, s.device)
        part = (s if ix is None else s.index_select(0, ix)).to(dev, dtype)
        if not all(keep):
            part = part * _const(consts, keep, dtype, dev).unsqueeze(1)
        parts.append(part)
        index.append((k, ix))
    flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    _all_reduce(flat, mesh, dims)
    offset = 0
    for k, ix in index:
        s = sums[k]
        n = s.shape[0] if ix is None else ix.numel()
        out = flat[offset:offset + n].to(s.device, s.dtype)
        offset += n
        if ix is None:
            s.copy_(out)
        else:
            s.index_copy_(0, ix, out)


class _ZeroGradSqReducer:
    """Global clipping under ZeRO: each rank owns whole tensors, so only the gradient total is
    all-reduced; trust-ratio sums are already complete."""

    def __init__(self, group):
        self._group = group

    def reduce_grad_sq(self, total: torch.Tensor) -> None:
        if dist.get_world_size(self._group) > 1:
            dev = _comm_device(total, None)
            buf = total if dev == total.device else total.to(dev)
            dist.all_reduce(buf, group=self._group)
            if buf is not total:
                total.copy_(buf)

    def reduce_trust_sums(self, sums, buckets) -> None:
        return None


def reducer_for(groups, param_groups, cache=None) -> ShardedNormReducer | None:
    """The reducer of one step over ``groups`` (:class:`fusedopt.functional.TensorGroup`, whose
    ``sources`` hold the DTensor params): the sharded one when a param of the step is a DTensor
    with a ``Shard`` placement, else None (no communication). ``cache``: the optimizer's
    StepCache, which keeps it for the steps over the same DTensors."""
    sources = [p for g in groups for p in (g.sources or ())]
    kept = cache.reducer if cache is not None else None
    if kept is not None and len(kept[0]) == len(sources) and all(map(is_, kept[0], sources)):
        return kept[1]
    reducer = None
    dtensor_type = _dtensor_type() if dist.is_available() and dist.is_initialized() else None
    if dtensor_type is not None and any(
            isinstance(p, dtensor_type) and any(pl.is_shard() for pl in p.placements)
            for p in sources):
        reducer = ShardedNormReducer(sources, param_groups, dtensor_type)
    if cache is not None:
        cache.reducer = (sources, reducer)
    return reducer


# ------------------------------------------------------------------------------ ZeRO
def enable_zero_global_clipping(zero_optimizer) -> None:
    """Make ``max_grad_norm`` of a ``ZeroRedundancyOptimizer`` wrapping a fusedopt optimizer clip by
    the norm of *all* ranks' gradients (one all-reduce of a scalar per step, over the ZeRO process
    group).

    Without it, each rank's optimizer sees only the gradients of the params it owns and clips by
    that partial norm: different ranks clip differently, which is not global clipping. Every rank
    must own at least one param with a gradient at every step (the all-reduce is issued by the
    optimizer step of each rank). Not available with ``overlap_with_ddp=True`` (the local optimizer
    is built lazily there).

    It also numbers each rank's params as ZeRO's param groups (those of one process) do, which
    keys the random bits of low-precision state (docs/math.md, "Random bits"), so that LAMB's
    ``v`` rounds as in one process; without it each rank numbers its own params from 0.

    Without this call a step with ``max_grad_norm`` or ``skip_nonfinite`` (decided on the same
    total) refuses, naming it, when the optimizer is a ZeroRedundancyOptimizer's local optimizer. ZeRO leaves no mark on it: it is recognized as
    built by ZeRO's ``_init_local_optimizer`` (the constructor looks at its callers), so one
    built otherwise and handed to ZeRO is not recognized.
    """
    inner = getattr(zero_optimizer, "optim", None)
    if inner is None:
        raise RuntimeError(
            "enable_zero_global_clipping needs a ZeroRedundancyOptimizer whose local optimizer is "
            "built (overlap_with_ddp=False); got "
            f"{type(zero_optimizer).__name__} without an 'optim' attribute"
        )
    if not hasattr(inner, "set_grad_norm_reducer"):
        raise TypeError(
            f"enable_zero_global_clipping needs optimizer_class=fusedopt.FusedLAMB or FusedLARS; "
            f"the local optimizer is {type(inner).__name__}"
        )
    inner.set_sharding(Sharding(
        keys={id(p): i for g in zero_optimizer.param_groups for i, p in enumerate(g["params"])},
        reducer=_ZeroGradSqReducer(zero_optimizer.process_group)))


# ------------------------------------------------------------------------------ DeepSpeed ZeRO
class _TableReducer:
    """Completes per-tensor sums held in pieces on several ranks: each piece's row is put at its
    tensor's row of one table per step (zeros elsewhere), the table is all-reduced over
    ``group``, and each piece's row gets its tensor's total. Every element lies on exactly one
    rank, so the sum counts each once; the clipping total is all-reduced as it is."""

    def __init__(self, group):
        self._group = group
        self._consts: dict[tuple, torch.Tensor] = {}  # see _const

    def reduce_grad_sq(self, total: torch.Tensor) -> None:
        _all_reduce_on(total, None, self._group)

    def _reduce(self, sums, picks, size: int, dtype, dev) -> None:
        """``picks``: (bucket index, the rows of its pieces or None for all, their rows in the
        table) for ``sums``; the table has ``size`` rows."""
        table = torch.zeros(size, 2, dtype=dtype, device=dev)
        picked = []
        for k, rows, at in picks:
            s = sums[k]
            ix = None if rows is None else _const(self._consts, rows, torch.int64, s.device)
            to = _const(self._consts, at, torch.int64, dev)
            table.index_copy_(0, to, (s if ix is None else s.index_select(0, ix)).to(dev, dtype))
            picked.append((s, ix, to))
        _all_reduce_on(table, None, self._group)
        for s, ix, to in picked:
            totals = table.index_select(0, to).to(s.device, s.dtype)
            if ix is None:
                s.copy_(totals)
            else:
                s.index_copy_(0, ix, totals)


class _PartitionReducer(_TableReducer):
    """The table reducer of flat partitions (:func:`enable_deepspeed_zero`): a tensor lies on each
    rank in at most one piece of a partition, whose rows of the table are its param group's
    tensors."""

    def __init__(self, partitions: dict[int, Partition], group):
        super().__init__(group)
        self._partitions = partitions

    def reduce_trust_sums(self, sums: list[torch.Tensor], buckets: list[Bucket]) -> None:
        offsets: dict[int, int] = {}  # id(partition) -> its first row in the table
        size = 0
        picks = []  # (bucket index, rows of its pieces, their rows in the table)
        for k, b in enumerate(buckets):
            rows, at = [], []
            for j, (src, t) in enumerate(zip(b.sources or (), b.params)):
                part = self._partitions.get(id(src))
                if part is None:
                    continue  # a whole tensor: its sums are complete
                if id(part) not in offsets:
                    offsets[id(part)] = size
                    size += part.tensors
                rows.append(j)
                at.append(offsets[id(part)] + part.tensor_of[t.storage_offset() - src.storage_offset()])
            if rows:
                picks.append((k, rows, at))
        if not picks:
            return
        dtype = torch.float64 if any(sums[k].dtype == torch.float64 for k, _, _ in picks) \
            else torch.float32
        self._reduce(sums, picks, size, dtype, sums[picks[0][0]].device)


def enable_deepspeed_zero(engine) -> None:
    """Make a fusedopt optimizer under DeepSpeed ZeRO (stages 1, 2, 3) compute each trust ratio over
    its whole tensor (docs/distributed.md, "DeepSpeed ZeRO"). Call it once, on every rank, after
    ``deepspeed.initialize`` (``engine``: the engine, or its ``engine.optimizer``).

    ZeRO replaces each param group's params by this rank's piece of one flat float32 buffer,
    cut without regard to tensor boundaries (ZeRO-3: per sub-group, this rank's share of each
    param); stepped as one tensor, it would get one trust ratio per rank and group. This reads
    where each tensor's piece lies in it (ZeRO-1/2: the fragment addresses DeepSpeed records
    for its checkpoints; ZeRO-3: each param's partition size) and makes the optimizer step
    every piece as a row of its own and complete each tensor's sums with one all-reduce over the
    data-parallel group per step call. Clip with DeepSpeed's ``gradient_clipping``
    (``max_grad_norm`` is refused: DeepSpeed steps each param group on its own, so no step sees
    the global norm). With ZeRO stage 0 (no partition) there is nothing to do. Raises naming
    what is not supported: ZeRO-3 with NVMe swapping, ZenFlow, Muon or a partial offload,
    low-precision optimizer state, param groups on different data-parallel groups, ranks that
    hold no piece of some param group, elastic checkpoints.

    Without this call (or after it raised) a step refuses, naming it, when DeepSpeed's
    ZeRO-1/2 optimizer, its BF16_Optimizer or its (fused) FP16_Optimizer steps the optimizer
    (recognized as the caller of ``step()``: they leave no mark on the flat buffer) or a param
    is a ZeRO-3 partition (marked ``ds_id``). A step called otherwise than by DeepSpeed's
    method (a subclass of these, another wrapper between them and ``step()`` deeper than a few
    frames) on a ZeRO-1/2 flat buffer is not recognized.
    """
    wrapper = getattr(engine, "optimizer", engine)
    if hasattr(wrapper, "set_sharding"):
        return  # ZeRO stage 0: DeepSpeed steps the fusedopt optimizer on whole tensors
    inner = getattr(wrapper, "optimizer", None)
    kind = type(wrapper).__name__
    if not hasattr(inner, "set_sharding"):
        raise TypeError("enable_deepspeed_zero needs a DeepSpeed engine whose client optimizer is "
                        f"fusedopt.FusedLAMB or FusedLARS; got {kind} wrapping "
                        f"{type(inner).__name__}")
    if hasattr(wrapper, "fp32_partitioned_groups_flat"):
        _register(inner, *_stage3_layout(wrapper))
        return
    lp_groups = getattr(wrapper, "bit16_groups", None) or getattr(wrapper, "bf16_groups", None)
    dp_groups = getattr(wrapper, "real_dp_process_group", None)
    if lp_groups is None or dp_groups is None or len(lp_groups) != len(inner.param_groups):
        raise TypeError(f"enable_deepspeed_zero: {kind} is not a DeepSpeed ZeRO or BF16 "
                        "optimizer (no bit16 param groups and data-parallel groups)")
    if getattr(wrapper, "elastic_checkpoint", False):
        raise RuntimeError(
            "enable_deepspeed_zero: zero_optimization.elastic_checkpoint is not supported: "
            "DeepSpeed loads an elastic checkpoint only with a param-group 'step', which "
            "torch-style optimizers (fusedopt's, torch.optim's) keep per param instead; leave it "
            "false (the default)")
    flats = []
    for gi, (group, lps) in enumerate(zip(inner.param_groups, lp_groups)):
        if len(group["params"]) != 1:
            raise TypeError(f"enable_deepspeed_zero: param group {gi} holds "
                            f"{len(group['params'])} params, not one flat partition")
        pieces = sorted((m.get_hp_fragment_address().start, m.get_hp_fragment_address().numel, t,
                         m.lp_fragment_address.start)
                        for t, m in enumerate(getattr(p, "_hp_mapping", None) for p in lps)
                        if m is not None)
        flats.append((gi, group["params"][0], pieces, len(lps)))
    _register(inner, flats, dp_groups)


def _stage3_layout(wrapper) -> tuple[list, list]:
    """ZeRO-3: every param is cut into equal pieces, one per rank (``ds_tensor``, of
    ``partition_numel()`` elements, the last rank's padded), and each sub-group's flat float32
    buffer is its params' pieces in order. A piece holds the elements ``[r·n, (r+1)·n)`` of its
    param (r: the rank in the sub-group's process group), those below ``ds_numel``."""
    for what in ("swap_optimizer", "zenflow", "use_muon"):
        if getattr(wrapper, what, False):
            raise RuntimeError(f"enable_deepspeed_zero: ZeRO-3 with {what} is not supported")
    if getattr(wrapper, "backup_optimizer", None) is not None:
        raise RuntimeError("enable_deepspeed_zero: ZeRO-3 with sub-groups stepped by a second "
                           "optimizer (a partial offload ratio) is not supported")
    flats = []
    for sg, (flat, params) in enumerate(zip(wrapper.fp32_partitioned_groups_flat,
                                            wrapper.fp16_groups)):
        rank = dist.get_rank(group=wrapper.sub_group_process_groups[sg])
        pieces, at = [], 0
        for t, p in enumerate(params):
            size = p.partition_numel()
            valid = min(size, p.ds_numel - rank * size)
            if valid > 0:
                pieces.append((at, valid, t, rank * size))
            at += size
        flats.append((wrapper.sub_group_to_group_id[sg], flat, pieces, len(params)))
    return flats, wrapper.sub_group_process_groups


def _register(inner, flats: list, dp_groups: list) -> None:
    """Checks the layout of every flat partition ``(param group index, flat buffer, pieces as
    (start, numel, tensor index, first element in the tensor), tensors)`` and makes ``inner``
    step them piece by piece."""
    if len({id(g) for g in dp_groups}) != 1:
        raise RuntimeError("enable_deepspeed_zero: param groups on different data-parallel groups "
                           "(MoE expert groups) are not supported")
    partitions: dict[int, Partition] = {}
    for gi, flat, pieces, tensors in flats:
        try:
            check_partition_options(inner.param_groups[gi])
        except ValueError as e:
            raise ValueError(f"{type(inner).__name__}: param group {gi}: {e}") from None
        end = 0
        for start, numel, *_ in pieces:
            if start < end or numel <= 0:
                raise RuntimeError(f"enable_deepspeed_zero: param group {gi}: pieces overlap "
                                   f"at element {start} of the flat partition")
            end = start + numel
        if flat.dim() != 1 or end > flat.numel() or not flat.is_contiguous():
            raise RuntimeError(f"enable_deepspeed_zero: param group {gi}: the pieces do not fit "
                               f"the flat partition of shape {tuple(flat.shape)}")
        partitions[id(flat)] = Partition(
            starts=[s for s, *_ in pieces], numels=[n for _, n, *_ in pieces],
            tensor_of={s: t for s, _, t, _ in pieces}, firsts=[f for *_, f in pieces],
            tensors=tensors,
            steps=torch.zeros(len(pieces), dtype=torch.float32, device=flat.device))
    group = dp_groups[0]
    # every rank must take part in each step call's all-reduce: a rank without a piece of some
    # param group (a model smaller than the ranks' alignment) would not
    least = torch.tensor([min((len(p.starts) for p in partitions.values()), default=1)],
                         dtype=torch.int64)
    dev = _comm_device(least, None)
    least = least.to(dev)
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
    if int(least.item()) == 0:
        raise RuntimeError("enable_deepspeed_zero: some rank holds no piece of a param group (the "
                           "group is smaller than the ranks' partitions); use fewer ranks or put "
                           "the group's params into another group")
    inner.set_sharding(Sharding(partitions=partitions,
                                reducer=_PartitionReducer(partitions, group)))


# ------------------------------------------------------------------------------ FSDP1
class _PieceReducer(_TableReducer):
    """The table reducer of FSDP1's pieces (:func:`enable_fsdp1`): every param of the step is a
    piece (enable_fsdp1 refuses others, the optimizer params it has not registered), and the
    table has a row for every tensor, so that every rank all-reduces the same table at every
    step."""

    def __init__(self, rows: dict[int, int], group, device: torch.device):
        super().__init__(group)
        self._rows = rows  # id(param) -> its tensor's row
        self._device = device

    def reduce_trust_sums(self, sums: list[torch.Tensor], buckets: list[Bucket]) -> None:
        picks = [(k, None, list(map(self._rows.__getitem__, map(id, b.params))))
                 for k, b in enumerate(buckets)]
        self._reduce(sums, picks, len(self._rows), torch.float64, self._device)


def fsdp1_handles(model: torch.nn.Module) -> list:
    """The FSDP1 handles (one per unit that holds params) under ``model``; none unless
    torch.distributed.fsdp was imported (a model wrapped in it was made by that module)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [m._handle for m in fsdp.FullyShardedDataParallel.fsdp_modules(model)
            if m._handle is not None]


def enable_fsdp1(model: torch.nn.Module, optimizer) -> None:
    """Make a fusedopt optimizer over the params of a model wrapped in torch's
    ``FullyShardedDataParallel`` (FSDP1) with ``use_orig_params=True`` compute each trust ratio,
    and the clipping total, over whole tensors (docs/distributed.md, "FSDP1"). Call it once, on
    every rank, after wrapping the model and constructing the optimizer (or accelerate's
    wrapper of it).

    FSDP1 hands the optimizer each rank's piece of every param: a 1-D run of its elements (empty
    where the rank holds none). Stepped as they are, the pieces of one tensor would get a trust
    ratio each. This reads where each piece lies in its tensor and makes the optimizer complete
    the per-tensor sums with one all-reduce per step (two with ``max_grad_norm`` or
    ``skip_nonfinite``) over the sharding group, key each piece's random bits by its tensor's
    place in its group and its first element (bf16 state rounds as in one process), and give
    each piece the state format of its whole tensor; 8-bit is stored as bf16 (the blocks would
    start where the pieces start). Every rank must hold a piece with a gradient at every step
    (the all-reduce is issued by each rank's step). Call it again after ``add_param_group`` (a
    step refuses params it has not registered). Raises for ``use_orig_params=False`` (the
    optimizer then sees flat params of many tensors, and no param groups of its own), for
    modules sharded over different process groups, and for params of the optimizer that FSDP1
    does not shard beside those it does. With NO_SHARD alone it registers every param as whole.

    Without this call a step refuses params that FSDP1 flattened (it marks them
    ``_fsdp_flattened``, NO_SHARD's too), naming this call; so does it after this call raised.
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    if not hasattr(optimizer, "set_sharding"):
        raise TypeError("enable_fsdp1 needs a fusedopt.FusedLAMB or FusedLARS optimizer; got "
                        f"{type(optimizer).__name__}")
    where = {id(p): (gi, i) for gi, g in enumerate(optimizer.param_groups)
             for i, p in enumerate(g["params"])}
    rows: dict[int, int] = {}
    keys: dict[int, int] = {}
    numels: dict[int, int] = {}
    groups = {}
    handles = fsdp1_handles(model)
    for handle in handles:
        if not handle._use_orig_params:
            raise TypeError("enable_fsdp1 needs FullyShardedDataParallel(use_orig_params=True): "
                            "with use_orig_params=False the optimizer steps flat params of many "
                            "tensors, whose trust ratios cannot be per tensor")
        if not handle.uses_sharded_strategy:
            continue  # NO_SHARD: whole tensors on every rank
        flat = handle.flat_param
        groups[id(handle.process_group)] = handle.process_group
        for p, info, shape in zip(flat._params, flat._shard_param_infos, flat._shapes):
            if id(p) in where and id(p) not in rows:
                i = where[id(p)][1]
                rows[id(p)] = len(rows)
                keys[id(p)] = lowp.key_of(i, info.intra_param_start_idx if info.in_shard else 0)
                numels[id(p)] = shape.numel()
    if len(groups) > 1:
        raise RuntimeError("enable_fsdp1: modules sharded over different process groups are not "
                           "supported")
    if not rows:  # nothing sharded (NO_SHARD: every param is its whole tensor), or no FSDP1
        if handles:
            optimizer.set_sharding(Sharding(wholes={id(p): p.numel() for g in optimizer.param_groups
                                                    for p in g["params"]}))
        return
    if len(rows) < len(where):
        raise RuntimeError(f"enable_fsdp1: {len(where) - len(rows)} param(s) of the optimizer are "
                           "not sharded by FSDP1 (ignored modules, NO_SHARD units; pass the "
                           "FSDP-wrapped model): every rank would count its copy of their "
                           "gradients in the clipping total; put them under FSDP1's sharding, or "
                           "step them with another optimizer")
    group = next(iter(groups.values()))
    pieces = [p for g in optimizer.param_groups for p in g["params"] if id(p) in rows]
    device = _comm_device(pieces[0], None)
    least = torch.tensor([sum(p.numel() > 0 for p in pieces)], dtype=torch.int64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
    if int(least.item()) == 0:
        raise RuntimeError("enable_fsdp1: some rank holds no piece of the optimizer's params (the "
                           "model is smaller than the ranks' shards); use fewer ranks")
    optimizer.set_sharding(Sharding(keys=keys, wholes=numels,
                                    reducer=_PieceReducer(rows, group, device)))


# ------------------------------------------------------------------------------ DDP / FSDP2
def accumulate(model: torch.nn.Module, micro_batches: Iterable[T]) -> Iterator[T]:
    """Yield ``micro_batches`` for gradient accumulation, synchronizing gradients on the last only.

    Every micro-batch but the last is yielded inside ``model.no_sync()`` (DDP), or with
    ``model.set_requires_gradient_sync(False)`` (FSDP2 ``fully_shard``), so the backward passes in
    the loop body accumulate local gradients without communication, and the last backward
    all-reduces (reduce-scatters) the accumulated sum. Other models are yielded unchanged.

    Scale the loss: with ``k`` micro-batches of equal size, use ``loss / k`` (each micro-batch's loss
    being its mean) so that the accumulated gradient equals the gradient of the mean over the whole
    batch, as one big batch would give::

        for x, y in fusedopt.distributed.accumulate(model, zip(xs, ys)):
            (loss_fn(model(x), y) / len(xs)).backward()
        optimizer.step()
        optimizer.zero_grad()

    Works with any iterable (the end is detected by looking one item ahead). Run the backward
    inside the loop body; the micro-batch after which it runs decides whether it synchronizes.
    """
    it = iter(micro_batches)
    try:
        nxt = next(it)
    except StopIteration:
        return
    while True:
        cur = nxt
        try:
            nxt = next(it)
        except StopIteration:
            yield cur  # the last micro-batch: gradients are synchronized
            return
        with _no_grad_sync(model):
            yield cur


@contextlib.contextmanager
def _no_grad_sync(model: torch.nn.Module):
    no_sync = getattr(model, "no_sync", None)
    if no_sync is not None:  # DDP (and FSDP1)
        with no_sync():
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is not None:  # FSDP2 fully_shard
        set_sync(False)
        try:
            yield
        finally:
            set_sync(True)
        return
    yield
