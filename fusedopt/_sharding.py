"""What the sharding adapters of fusedopt.distributed hand an optimizer (its ``set_sharding``),
so that it steps pieces of tensors as parts of their tensors: the keys of the random bits of
params numbered elsewhere, the whole numel of each piece of a tensor, the flat partitions stepped
piece by piece (Note [flat partitions]), and the reducer that completes per-tensor sums across
ranks. The optimizer reads it; it never reaches back into the adapters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch

from . import lowp
from ._adapters import check_partition_options
from ._state import alias


@dataclass(eq=False)
class Partition:
    """Where the pieces of a flat partition lie (sorted by start), which tensor of its param
    group (numbered as DeepSpeed lists them, the same on every rank) each piece belongs to, and
    where in that tensor it begins."""

    starts: list[int]
    numels: list[int]
    tensor_of: dict[int, int]  # start -> tensor index
    firsts: list[int]  # the index in its tensor of each piece's first element
    tensors: int  # tensors in the param group, over all ranks
    steps: torch.Tensor  # one float32 step count per piece (Note [flat partitions])
    step: torch.Tensor | None = None


@dataclass(eq=False)
class Sharding:
    """How an optimizer's params lie across ranks (none of it: every param a whole tensor)."""

    #: id(param) -> its key of the random bits (``lowp.key_of``) instead of its place in its
    #: group: a ZeroRedundancyOptimizer rank's params numbered as in the ZeRO optimizer's groups
    #: (which hold every rank's params as one process's would); FSDP1's pieces, keyed by their
    #: tensor's place and their first element
    keys: dict[int, int] = field(default_factory=dict)
    #: id(param) -> the numel of the whole tensor of each param that is a piece of one (FSDP1):
    #: its state format is the whole tensor's; when given, every param stepped must be in it
    wholes: dict[int, int] = field(default_factory=dict)
    #: id(flat param) -> its Partition (DeepSpeed ZeRO)
    partitions: dict[int, Partition] = field(default_factory=dict)
    #: completes the clipping total (and the pieces' trust-ratio sums) across ranks, or None
    #: (a :class:`fusedopt.functional.SqSumReducer`)
    reducer: Any = None

    def check_registered(self, name: str, gi: int, ps: list) -> None:
        if self.wholes and not self.wholes.keys() >= set(map(id, ps)):
            raise RuntimeError(f"{name}: param group {gi} holds params that enable_fsdp1 did not "
                               "register (added after it?): call "
                               "fusedopt.distributed.enable_fsdp1(model, optimizer) again")

    def random_keys(self, ps: list, all_ps: list, all_grads: list, lps: list,
                    sharded: bool) -> list | None:
        """The keys of the random bits of the rows ``ps`` (those of the group's params
        ``all_ps`` with grads ``all_grads``; ``lps``: their local tensors, ``sharded``: DTensor
        shards), where they are not the rows' indices (docs/math.md, "Random bits"); else
        None."""
        if not (sharded or ps is not all_ps or self.keys):
            return None
        rows = (range(len(ps)) if ps is all_ps
                else [i for i, g in enumerate(all_grads) if g is not None])
        if self.keys:  # params numbered as in the groups they were taken from
            rows = [self.keys.get(id(p), i) for i, p in zip(rows, ps)]
        return list(map(lowp.random_key, rows, ps, lps)) if sharded else rows

    def holds_partitions(self, ps: list) -> bool:
        return bool(self.partitions) and not self.partitions.keys().isdisjoint(map(id, ps))

    def pieces(self, name: str, gi: int, group: dict[str, Any], state, state_keys: tuple,
               ps: list, lps: list, lgs: list, columns: list[list],
               keys) -> tuple[list, list, list, list[list], list | None]:
        """Note [flat partitions]: a param of ``partitions`` (a flat buffer of pieces of several
        tensors, as DeepSpeed ZeRO hands its optimizer) enters the step as one row per piece:
        views of the param, its grad and its state over the piece, with the param itself as the
        source of each row, so that the reducer completes each piece's sums into its tensor's.
        Elements outside every piece (padding) are not stepped. The pieces of one param share its
        step count: each row gets an element of a buffer of its own (a step increments every
        row's count), the param's ``state["step"]`` being the first one, which the others copy
        before each step (a checkpoint loader may set it in place). Each piece's key of the
        random bits (bf16 state) is that of its elements in its tensor: the tensor's index and
        the piece's first element (docs/math.md, "Random bits"). ``columns``: the state lists
        (step, moments, masters) of the rows ``ps`` (``lps``, ``lgs``: their local tensors and
        grads) of param group ``gi``; ``keys`` are the keys of the rows given (None: their
        indices), the keys returned those of the rows returned (None where no row has bf16 state
        and none was given: the kernels then read none)."""
        try:
            check_partition_options(group)
        except ValueError as e:
            raise ValueError(f"{name}: param group {gi}: {e}") from None
        out: list[list] = [[] for _ in range(3 + len(columns))]
        row_keys, rounded = [], keys is not None
        for i, p in enumerate(ps):
            row = (p, lps[i], lgs[i], *(xs[i] for xs in columns))
            part = self.partitions.get(id(p))
            if part is None:
                for xs, x in zip(out, row):
                    xs.append(x)
                row_keys.append(i if keys is None else keys[i])
                continue
            if (len(columns) > len(state_keys) + 1
                    or columns[1][i].dtype not in (p.dtype, torch.bfloat16)):
                raise ValueError(f"{name}: param group {gi}: a flat partition takes state of its "
                                 "own dtype or bf16 state, and no master weights (DeepSpeed keeps "
                                 f"the float32 masters); its params are {p.dtype}")
            rounded = rounded or columns[1][i].dtype == torch.bfloat16
            if lgs[i].shape != p.shape or not lgs[i].is_contiguous():
                raise RuntimeError(f"{name}: param group {gi}: the grad of a flat partition must "
                                   f"be contiguous of shape {tuple(p.shape)}")
            for key, xs in zip(state_keys, columns[1:]):
                if xs[i].shape != p.shape or not xs[i].is_contiguous():
                    raise ValueError(f"{name}: param group {gi}: state {key!r} of a flat partition "
                                     f"of shape {tuple(p.shape)} has shape {tuple(xs[i].shape)} (a "
                                     "state dict of another partitioning?)")
            step = columns[0][i]
            if step is not part.step:  # a new state (first step, load_state_dict)
                part.steps.copy_(step)
                part.step = state[p]["step"] = alias(part.steps, 0, ())
            elif len(part.starts) > 1:  # the count as state["step"] holds it, also if set in place
                part.steps[1:].copy_(part.steps[:1].expand(len(part.starts) - 1))
            out[0].extend(repeat(p, len(part.starts)))
            for xs, t in zip(out[1:], (lps[i], lgs[i], None, *(xs[i] for xs in columns[1:]))):
                if t is None:
                    xs.extend(alias(part.steps, k, ()) for k in range(len(part.starts)))
                else:
                    xs.extend(t.narrow(0, s, n) for s, n in zip(part.starts, part.numels))
            row_keys.extend(map(lowp.key_of, map(part.tensor_of.get, part.starts), part.firsts))
        ps, lps, lgs, *columns = out
        return ps, lps, lgs, columns, row_keys if rounded else None

