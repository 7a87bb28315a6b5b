"""What every fusedopt kernel shares: reading the tables, and the deterministic two-stage norms.

A program owns one chunk of ``CHUNK`` elements of one tensor (kernels/tables.py). It walks its
chunk in tiles of ``BLOCK`` elements: the full tiles without a mask (so the loads vectorise), the
last, partial one with a mask.

Note [two-stage norms]: each program reduces its chunk to partial sums (a fixed tree over the
lanes of its tile accumulators) and stores them at its own slot of ``partials``. It then adds 1
to the int32 counter of its tensor; the program that brings the counter to the tensor's number
of chunks is the last one of that tensor, and only it reduces the tensor's partials, in chunk
order with ``RBLOCK`` fixed lanes, writes the tensor's sums and resets the counter to 0. Which
program comes last varies from run to run, but the reduction it performs does not, so the sums
are bit-identical on every run (no float atomics). The integer atomic has acquire-release
semantics at GPU scope and a CTA barrier precedes it, so each program's partial stores (and its
earlier reads of the step count, see Note [step counts]) happen before the last program's
reads; those bypass L1 (``.cg``), which could hold lines from an earlier step.

Note [step counts]: pass 1 increments each tensor's step count (unless found_inf). Every program
of a tensor reads the old count and uses ``t + 1``; only the last program of the tensor (the one
that finalises its sums) stores ``t + 1``, after all the others have read ``t`` (Note
[two-stage norms]). Pass 2, a later launch, reads the new count.
"""
import triton
import triton.language as tl

from . import tables as _tables

# Record columns (kernels/tables.py) as compile-time constants.
RECORD = tl.constexpr(_tables.RECORD)
PARAM = tl.constexpr(_tables.PARAM)
GRAD = tl.constexpr(_tables.GRAD)
MASTER = tl.constexpr(_tables.MASTER)
STATE0 = tl.constexpr(_tables.STATE0)
STATE1 = tl.constexpr(_tables.STATE1)
STEP = tl.constexpr(_tables.STEP)
NUMEL = tl.constexpr(_tables.NUMEL)
FIRST_CHUNK = tl.constexpr(_tables.FIRST_CHUNK)


@triton.jit
def chunk_of(records, owner, CHUNK: tl.constexpr):
    """This program's chunk: ``(i, rec, start, n_here, first, count)`` = its tensor, the tensor's
    record, the chunk's first element, its number of elements (``<= CHUNK``, 0 for a 0-size
    tensor), the tensor's first chunk and its number of chunks."""
    pid = tl.program_id(0)
    i = tl.load(owner + pid)
    rec = records + i.to(tl.int64) * RECORD
    numel = tl.load(rec + NUMEL)
    first = tl.load(rec + FIRST_CHUNK)
    count = tl.maximum(tl.cdiv(numel, CHUNK), 1)
    start = (pid - first) * CHUNK
    n_here = tl.minimum(numel - start, CHUNK)
    return i, rec, start, n_here, first, count


@triton.jit
def tensor_ptr(rec, COLUMN: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The data pointer in column COLUMN of a record, typed ``DTYPE*``; ALIGNED promises 16 bytes."""
    ptr = tl.load(rec + COLUMN).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def live_elements(n_here, found_inf, HAS_FOUND_INF: tl.constexpr):
    """``(n, inc)``: the elements this program updates and the step increment; ``(0, 0)`` when
    ``*found_inf`` is nonzero, so a skipped step touches no memory and leaves the count alone."""
    if HAS_FOUND_INF:
        skip = tl.load(found_inf) != 0
        return tl.where(skip, 0, n_here), tl.where(skip, 0.0, 1.0)
    else:
        return n_here, 1.0


@triton.jit
def grad_multiplier(grad_mult, CD: tl.constexpr, HAS_GRAD_MULT: tl.constexpr):
    """``*grad_mult`` in CD, or 1."""
    if HAS_GRAD_MULT:
        return tl.load(grad_mult).to(CD)
    else:
        return tl.full((), 1.0, CD)


@triton.jit
def masked_sq(x, mask):
    """``x²``, 0 where ``mask`` is False (``mask`` None: the whole tile)."""
    if mask is None:
        return x * x
    else:
        return tl.where(mask, x * x, 0.0)


@triton.jit
def finish_chunk(partials, counters, sums, i, first, count, p0, p1, NS: tl.constexpr,
                 RBLOCK: tl.constexpr):
    """Second stage of Note [two-stage norms]: store this chunk's partial sums ``(p0, p1)``; if
    this is the tensor's last chunk to finish, write the tensor's sums (``sums[i]``, or
    ``sums[i, 0:2]`` when NS == 2). Returns whether this program was the last."""
    pid = tl.program_id(0)
    tl.store(partials + 2 * pid, p0)
    tl.store(partials + 2 * pid + 1, p1)
    tl.debug_barrier()
    done = tl.atomic_add(counters + i, 1, sem="acq_rel", scope="gpu")
    last = done == count - 1
    if last:
        lanes = tl.arange(0, RBLOCK)
        acc0 = tl.zeros([RBLOCK], p0.dtype)
        acc1 = tl.zeros([RBLOCK], p0.dtype)
        for c in range(0, count, RBLOCK):
            j = c + lanes
            mask = j < count
            slot = partials + 2 * (first + j)
            acc0 += tl.load(slot, mask=mask, other=0.0, cache_modifier=".cg")
            acc1 += tl.load(slot + 1, mask=mask, other=0.0, cache_modifier=".cg")
        if NS == 2:
            tl.store(sums + 2 * i, tl.sum(acc0, 0))
            tl.store(sums + 2 * i + 1, tl.sum(acc1, 0))
        else:
            tl.store(sums + i, tl.sum(acc0, 0))
        tl.store(counters + i, 0)
    return last


@triton.jit
def sq_norms_kernel(
    records,  # int64 [n, RECORD]: the tensors in the PARAM column
    owner,  # int32 [C]: tensor of each chunk
    partials,  # CD [C, 2]: chunk partial sums
    counters,  # int32 [n]: finished chunks per tensor (zero between launches)
    sums,  # CD [n]: output, Σx² per tensor
    X_DTYPE: tl.constexpr, CD: tl.constexpr, ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
):
    """``sums[i] = Σ x_i²`` (global gradient clipping), accumulated in CD."""
    i, rec, start, n_here, first, count = chunk_of(records, owner, CHUNK)
    x_ptr = tensor_ptr(rec, PARAM, X_DTYPE, ALIGNED) + start
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], CD)
    n_full = n_here // BLOCK * BLOCK
    for off in range(0, n_full, BLOCK):
        off = tl.multiple_of(off, BLOCK)
        x = tl.load(x_ptr + off + lanes).to(CD)
        acc += x * x
    if n_full < n_here:
        mask = lanes < n_here - n_full
        x = tl.load(x_ptr + n_full + lanes, mask=mask, other=0.0).to(CD)
        acc += x * x
    p = tl.sum(acc, 0)
    finish_chunk(partials, counters, sums, i, first, count, p, p, 1, RBLOCK)
