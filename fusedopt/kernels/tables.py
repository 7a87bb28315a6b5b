"""The launcher: per-bucket pointer tables, chunk maps, launch splitting, the launch counter.

The kernels never receive a Python list of tensors. A bucket of ``n`` tensors is described by

* ``records``: int64 ``[n, RECORD]``, one row per tensor: the data pointers of its param, grad,
  master, the two state tensors and the step count (0 where the kernel does not use one), its
  ``numel`` and the index of its first chunk;
* ``owner``: int32, the tensor of each chunk. Tensor ``i`` is cut into
  ``max(1, ceil(numel / CHUNK_SIZE))`` chunks (a 0-size tensor still gets one: it writes its sums
  and its step count). A program takes ``ROWS`` consecutive chunks, one per row of its
  ``[ROWS, BLOCK_SIZE]`` tiles, so many small tensors share a program and a large one spreads
  over many; ``owner`` is padded with -1 to a multiple of ``ROWS``;
* the workspace of the two-stage norms: ``partials`` ``[C, 2]`` and the int32 ``counters`` ``[n]``
  (zero between launches, see kernels/norms.py).

Note [table cache]: building a table is a host loop over the tensors and one host-to-device copy,
so tables are cached, keyed by the device, the chunk layout, the tuple of every data pointer and
every ``numel``; a step whose tensors did not move reuses them. A hit costs one Python pass over
the tensors (``data_ptr()``/``numel()``), no torch op. Only the pointers are keyed, never the
tensors, so the cache keeps no user memory alive; it is a small LRU.

Note [launch limit]: one launch covers at most ``MAX_TENSORS_PER_LAUNCH`` tensors; a larger
bucket is cut into consecutive slices with one set of launches each (and its own table), so the
launches per step are constant up to that many tensors and grow by one set per further slice.
The limit bounds the size of one table (64 B per tensor) and of one host-to-device copy; it is a
module attribute so tests can lower it.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

# Note [launch limit]
MAX_TENSORS_PER_LAUNCH = 32768
# Elements per chunk; chunks per program (rows of a tile); columns of a tile. Powers of two.
# Compiled for sm_90, LAMB's pass 1 needs 64 registers a thread with one row of 1024 columns and
# 4 warps, 96 with 2 x 512 and 239 with 4 x 512 (each row's pointers are 64-bit per element), so
# the GPU default is one chunk per program. The interpreter's cost is per program and per
# operation, not per element, so the tests take many rows of wide tiles.
CHUNK_SIZE = 16384
ROWS = 1
BLOCK_SIZE = 1024
NUM_WARPS = 4
if os.environ.get("TRITON_INTERPRET") == "1":  # read when triton makes its choice, at first import
    CHUNK_SIZE, ROWS, BLOCK_SIZE = 2048, 64, 512
# Lanes of the finaliser's fixed-order reduction over the chunk partials of one tensor.
REDUCE_BLOCK = 128
CACHE_ENTRIES = 64

# Columns of a record (kernels/norms.py reads them by these numbers).
PARAM, GRAD, MASTER, STATE0, STATE1, STEP, NUMEL, FIRST_CHUNK = range(8)
RECORD = 8

_launches = 0


def launch(kernel, num_programs: int, **kwargs) -> None:
    """Launch ``kernel`` on a 1-D grid; every Triton launch of fusedopt goes through here."""
    global _launches
    _launches += 1
    try:
        kernel[(num_programs,)](num_warps=NUM_WARPS, **kwargs)
    except BaseException:
        clear_cache()  # a launch that stopped half-way may leave norm counters nonzero
        raise


def launch_count() -> int:
    """Triton launches made so far in this process (tests and the benchmark take differences)."""
    return _launches


@dataclass
class Table:
    """Pointer table, chunk map and norm workspace of one slice of a bucket."""

    n: int
    num_chunks: int
    num_programs: int
    records: torch.Tensor  # int64 [n, RECORD]
    owner: torch.Tensor  # int32 [num_programs * ROWS], -1 past the last chunk
    counters: torch.Tensor  # int32 [n], zero between launches
    aligned: bool  # every data pointer (not the steps) is a multiple of 16 bytes
    _partials: dict = field(default_factory=dict)

    def partials(self, dtype: torch.dtype) -> torch.Tensor:
        """Chunk partial sums ``[num_chunks, 2]`` in ``dtype`` (reused across steps)."""
        p = self._partials.get(dtype)
        if p is None:
            p = self._partials[dtype] = torch.empty(
                self.num_chunks, 2, dtype=dtype, device=self.records.device)
        return p


_cache: OrderedDict[tuple, Table] = OrderedDict()


def _ptrs(tensors: Sequence[torch.Tensor] | None, n: int) -> tuple[int, ...]:
    return (0,) * n if tensors is None else tuple(t.data_ptr() for t in tensors)


def _build(device: torch.device, columns: list[tuple[int, ...]], numels: tuple[int, ...]) -> Table:
    n = len(numels)
    counts = [max(1, -(-k // CHUNK_SIZE)) for k in numels]
    firsts, c = [], 0
    for k in counts:
        firsts.append(c)
        c += k
    rows = [list(r) for r in zip(*columns, numels, firsts)]
    records = torch.tensor(rows, dtype=torch.int64).reshape(n, RECORD)
    programs = -(-c // ROWS)
    owner = torch.full((programs * ROWS,), -1, dtype=torch.int32)
    owner[:c] = torch.repeat_interleave(torch.arange(n, dtype=torch.int32),
                                        torch.tensor(counts, dtype=torch.int64))
    aligned = all(p % 16 == 0 for col in columns[PARAM:STEP] for p in col)  # data, not steps
    return Table(n=n, num_chunks=c, num_programs=programs, records=records.to(device),
                 owner=owner.to(device), counters=torch.zeros(n, dtype=torch.int32, device=device),
                 aligned=aligned)


def tables(tensors: Sequence[Sequence[torch.Tensor] | None]) -> list[tuple[int, int, Table]]:
    """Tables for the tensors ``[params, grads, masters, state0, state1, steps]`` (entries may be
    None), cut into slices of at most MAX_TENSORS_PER_LAUNCH tensors: ``[(start, stop, table)]``.

    The first list gives the device and the ``numel`` of each tensor.
    """
    tensors = list(tensors) + [None] * (STEP + 1 - len(tensors))
    first = tensors[0]
    n_all = len(first)
    device = first[0].device
    out = []
    for start in range(0, n_all, MAX_TENSORS_PER_LAUNCH):
        stop = min(n_all, start + MAX_TENSORS_PER_LAUNCH)
        part = [None if ts is None else ts[start:stop] for ts in tensors]
        columns = [_ptrs(ts, stop - start) for ts in part]
        numels = tuple(t.numel() for t in part[0])
        key = (device, CHUNK_SIZE, ROWS, tuple(columns), numels)
        table = _cache.get(key)
        if table is None:
            table = _cache[key] = _build(device, columns, numels)
            while len(_cache) > CACHE_ENTRIES:
                _cache.popitem(last=False)
        else:
            _cache.move_to_end(key)
        out.append((start, stop, table))
    return out


def clear_cache() -> None:
    _cache.clear()
