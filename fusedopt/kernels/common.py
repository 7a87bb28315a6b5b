"""What every fusedopt kernel shares: reading the tables, and the deterministic two-stage norms.

A program owns ``ROWS`` consecutive chunks of the bucket (kernels/tables.py), one per row of its
``[ROWS, BLOCK]`` tiles; per-tensor values (pointers, step counts, trust ratios) are ``[ROWS]``
vectors broadcast along the row. It walks its chunks in tiles of ``BLOCK`` columns (Note [whole
tiles]).

Note [whole tiles]: a mask with a term per element (``offset < n`` for a runtime ``n``) makes
Triton split every load and store of the tile into one instruction per element (``LDG.E`` for
float32, ``LDG.E.U16`` for bf16 state, ``LDG.E.U8`` for 8-bit codes), four (float32) to eight
times the memory instructions of the vector form. Every loop therefore walks the tiles that lie
inside every row first, without a mask (full state: ``tile_lanes``) or under one that is
constant along the row (the low-precision loops, whose masks also select each row's state
format: ``tile_mask``), and the rest after, under the per-element one (``tile_range``): the
same tiles in the same order as one masked walk, so the same sums (a masked-off lane adds 0),
with vector loads and stores in the first part (tests/test_triton_compile.py reads them in the
machine code; docs/performance.md has the counts). A padding row holds 0 elements, so a program
that has one walks every tile under the per-element mask.

Note [two-stage norms]: each program reduces every row to the partial sums of its chunk (a fixed
tree over the tile's columns) and stores them at the chunk's slot of ``partials``. It then adds
1 to the int32 counter of each row's tensor; the row that brings a counter to the tensor's
number of chunks is the tensor's last, and only its program reduces the tensor's partials, in
chunk order over ``RBLOCK`` fixed lanes, writes the tensor's sums and resets the counter to 0.
Which program comes last varies from run to run, but the reduction it performs does not, so the
sums are bit-identical on every run (no float atomics). The integer atomic has acquire-release
semantics at GPU scope and a CTA barrier precedes it, so the partial stores of every program
(and its earlier reads of the step counts, see Note [step counts]) happen before the last
program's reads, which bypass L1 (``.cg``: it could hold lines from an earlier step).

Note [step counts]: pass 1 advances each tensor's step count (unless found_inf). Every row of a
tensor reads the old count and uses ``t + 1``; only the tensor's last row (the one that writes
its sums) stores ``t + 1``, after all the others have read ``t`` (Note [two-stage norms]).
Pass 2, a later launch, reads the new count. (The CUDA backend keeps the same rule with a
separate reduction kernel: Note [step counts in reduce_kernel] in
csrc/cuda/multi_tensor_apply.cuh.)

Note [bf16 rounding in the interpreter]: compiled kernels round float32 to bfloat16 to nearest
even (``cvt.rn.bf16.f32``), as torch does; Triton's interpreter (3.7) truncates instead. Under
the interpreter, :func:`round_to` rounds by hand (``INTERPRETED`` is fixed when this module is
imported, like the choice between compiling and interpreting), so the CPU tests see the GPU's
rounding.
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
OUT = tl.constexpr(_tables.OUT)
FORMAT = tl.constexpr(_tables.FORMAT)
KEY = tl.constexpr(_tables.KEY)
BF16_STATE = tl.constexpr(_tables.BF16_STATE)
Q8_STATE = tl.constexpr(_tables.Q8_STATE)
# Bits of the kernels' runtime ``flags`` argument (Note [runtime flags] in kernels/tables.py).
LR_TENSOR = tl.constexpr(_tables.LR_TENSOR)
BIAS_CORRECTION = tl.constexpr(_tables.BIAS_CORRECTION)
ADAPT = tl.constexpr(_tables.ADAPT)
BOUNDED = tl.constexpr(_tables.BOUNDED)
COMBINED = tl.constexpr(_tables.COMBINED)
TRUST_CLIP = tl.constexpr(_tables.TRUST_CLIP)
NESTEROV = tl.constexpr(_tables.NESTEROV)
LR_IN_MOMENTUM = tl.constexpr(_tables.LR_IN_MOMENTUM)
INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))
# The decorator arguments of the pass kernels: Note [runtime flags] and Note [scalar operands]
# in kernels/tables.py
PASS_KERNEL = dict(do_not_specialize=["flags"],
                   do_not_specialize_on_alignment=list(_tables.SCALAR_OPERANDS))


@triton.jit
def chunks_of(records, owner, found_inf, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows, as ``[ROWS]`` vectors: ``(c, valid, i, rec, start, n, first, count,
    inc)`` = chunk index, whether the row holds a chunk, its tensor (in the table), the tensor's
    record, the chunk's first element, the elements to update (0 for padding, a 0-size tensor, or
    when ``*found_inf`` is nonzero), the tensor's first chunk and number of chunks, and the step
    increment (1, or 0 when ``*found_inf`` is nonzero). ``found_inf`` None (the norms of
    sq_norms_kernel): nothing is skipped.

    Note [skipped steps]: when ``*found_inf`` is nonzero no element of a param, grad, master or
    state tensor is read or written, but a pass 1 still runs its bookkeeping: it stores the
    (unchanged) step count and writes the norm workspace (``partials``, ``counters``) and its
    output ``sums`` (zeros), which pass 2 then ignores."""
    c = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i = tl.load(owner + c)
    valid = i >= 0
    i = tl.maximum(i, 0)
    rec = records + i.to(tl.int64) * RECORD
    numel = tl.load(rec + NUMEL)
    first = tl.load(rec + FIRST_CHUNK)
    count = tl.maximum((numel + CHUNK - 1) // CHUNK, 1)
    start = (c - first) * CHUNK
    n = tl.where(valid, tl.minimum(numel - start, CHUNK), 0).to(tl.int32)  # <= CHUNK
    inc = 1.0
    if found_inf is not None:
        skip = tl.load(found_inf) != 0
        n = tl.where(skip, 0, n)
        inc = tl.where(skip, 0.0, 1.0)
    return c, valid, i, rec, start, n, first, count, inc


@triton.jit
def tensor_ptrs(rec, COLUMN: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The data pointers in column COLUMN of the rows' records, typed ``DTYPE*``, as a ``[ROWS, 1]``
    column; ALIGNED promises that each is a multiple of 16 bytes."""
    ptr = tl.load(rec + COLUMN).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr[:, None]


@triton.jit
def tiles3(start, BLOCK: tl.constexpr, QB: tl.constexpr):
    """A tile viewed as ``[1, BLOCK // QB, QB]`` (whole 8-bit blocks: Note [state formats in the
    tables]): the element offsets in the tile, the block index ``[1, BLOCK // QB, 1]`` and the
    chunk starts as ``[ROWS, 1, 1]``."""
    nb = tl.arange(0, BLOCK // QB)[None, :, None]
    k = tl.arange(0, QB)[None, None, :]
    return nb * QB + k, nb, start[:, None, None]


@triton.jit
def tile_range(PHASE: tl.constexpr, n, BLOCK: tl.constexpr):
    """Note [whole tiles]: the offsets ``[lo, hi)`` of the tiles of ``PHASE`` in chunks of ``n``
    elements (``[ROWS]``): 0, the tiles inside every row; 1, the rest."""
    whole = tl.min(n, 0) // BLOCK * BLOCK
    if PHASE == 0:
        lo, hi = 0, whole
    else:
        lo, hi = whole, tl.max(n, 0)
    return lo, hi


@triton.jit
def tile_mask(PHASE: tl.constexpr, o, n3):
    """Note [whole tiles]: which elements of a tile of ``PHASE`` at offsets ``o`` lie in their
    rows of ``n3`` elements: in phase 0 all, by a mask constant along each row."""
    if PHASE == 0:
        inside = n3 >= 0
    else:
        inside = o < n3
    return inside


@triton.jit
def tile_lanes(PHASE: tl.constexpr, o, n):
    """Note [whole tiles]: the mask of a full-state tile of ``PHASE`` at offsets ``o`` (``[1,
    BLOCK]``) in rows of ``n`` elements (``[ROWS]``): None (no mask) in phase 0."""
    if PHASE == 0:
        lanes = None
    else:
        lanes = o < n[:, None]
    return lanes


@triton.jit
def state_ptrs(rec, COLUMN: tl.constexpr, ALIGNED: tl.constexpr, QB: tl.constexpr):
    """The pointers of the state in column COLUMN as each low-precision format reads it, as
    ``[ROWS, 1, 1]`` columns: bf16 bits (uint16), and the 8-bit block words (two int32 bit
    patterns per block, ``(w0, w1)``) and codes (int8 and uint8 views) of a packed tensor
    (docs/math.md: the words padded to 64 bytes, then the codes, ``q8_codes_offset`` of math.h
    computed from the tensor's NUMEL)."""
    raw = tl.load(rec + COLUMN)
    blocks = (tl.load(rec + NUMEL) + QB - 1) // QB
    codes = raw + 4 * ((2 * blocks + 15) // 16) * 16
    half = raw.to(tl.pointer_type(tl.uint16))
    words = raw.to(tl.pointer_type(tl.int32))
    signed = codes.to(tl.pointer_type(tl.int8))
    unsigned = codes.to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        half = tl.multiple_of(half, 16)
        words = tl.multiple_of(words, 16)
        signed = tl.multiple_of(signed, 16)
        unsigned = tl.multiple_of(unsigned, 16)
    return (half[:, None, None], words[:, None, None], signed[:, None, None],
            unsigned[:, None, None])


@triton.jit
def any_row(x):
    """Whether the ``[ROWS]`` bool ``x`` holds anywhere (a scalar, uniform over the program)."""
    return tl.max(x.to(tl.int32), 0) > 0


@triton.jit
def format_rows(fmt):
    """For the ``[ROWS]`` state formats of a program's rows: per format (full, bf16, 8-bit) the
    ``[ROWS, 1, 1]`` mask of its rows over a tile of whole 8-bit blocks, then whether any row
    holds it (the format's branch runs only then)."""
    full = fmt == 0
    half = fmt == BF16_STATE
    q8 = fmt == Q8_STATE
    return (full[:, None, None], half[:, None, None], q8[:, None, None],
            any_row(full), any_row(half), any_row(q8))


@triton.jit
def flag(flags, BIT: tl.constexpr):
    """Whether bit BIT of the runtime ``flags`` is set (Note [runtime flags] in kernels/tables.py)."""
    return (flags & BIT) != 0


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """``x`` (float32) rounded to DTYPE, to nearest even (Note [bf16 rounding in the interpreter])."""
    if INTERPRETED and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x == x, y, x.to(tl.bfloat16))
    else:
        return x.to(DTYPE)


@triton.jit
def load_tile(ptr, mask):
    """``*ptr`` over a tile; 0 where ``mask`` is False (``mask`` None: a full tile, no mask)."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def masked_sq(x, mask):
    """``x²``, 0 where ``mask`` is False (``mask`` None: the whole tile)."""
    if mask is None:
        return x * x
    else:
        return tl.where(mask, x * x, 0.0)


@triton.jit
def partial_slots(partials, c):
    """The ``partials`` rows of the chunks ``c`` (int32 ``[ROWS]``): ``partials + 2·c``, in 64-bit
    arithmetic (``2·c`` in int32 wraps past 2**30 chunks)."""
    return partials + 2 * c.to(tl.int64)


@triton.jit
def finish_rows(partials, counters, sums, c, valid, i, rec, first, count, p0, p1, NS: tl.constexpr,
                ROWS: tl.constexpr, RBLOCK: tl.constexpr):
    """Second stage of Note [two-stage norms]: store the rows' partial sums ``(p0, p1)``; for each
    row that finishes its tensor, write the tensor's sums to its output row ``o = rec[OUT]``
    (``sums[o]``, or ``sums[o, 0:2]`` when NS == 2). Returns the ``[ROWS]`` mask of those rows."""
    row_slot = partial_slots(partials, c)  # (a name of its own: the loop below has ``slot``)
    tl.store(row_slot, p0, mask=valid)
    tl.store(row_slot + 1, p1, mask=valid)
    tl.debug_barrier()
    done = tl.atomic_add(counters + i, 1, mask=valid, sem="acq_rel", scope="gpu")
    last = valid & (done == count - 1)
    n_last = tl.max(tl.where(last, count, 0), 0)
    if n_last > 0:
        lanes = tl.arange(0, RBLOCK)[None, :]
        acc0 = tl.full([ROWS, RBLOCK], 0.0, p0.dtype)
        acc1 = tl.full([ROWS, RBLOCK], 0.0, p0.dtype)
        for j in range(0, n_last, RBLOCK):
            mask = last[:, None] & (j + lanes < count[:, None])
            slot = partials + 2 * (first[:, None] + j + lanes)
            acc0 += tl.load(slot, mask=mask, other=0.0, cache_modifier=".cg")
            acc1 += tl.load(slot + 1, mask=mask, other=0.0, cache_modifier=".cg")
        row = tl.load(rec + OUT)
        if NS == 2:
            tl.store(sums + 2 * row, tl.sum(acc0, 1), mask=last)
            tl.store(sums + 2 * row + 1, tl.sum(acc1, 1), mask=last)
        else:
            tl.store(sums + row, tl.sum(acc0, 1), mask=last)
        tl.store(counters + i, 0, mask=last)
    return last


@triton.jit
def sq_norms_kernel(
    records,  # int64 [n, RECORD]: the tensors in the PARAM column
    owner,  # int32 [programs * ROWS]: tensor of each chunk, -1 for padding
    partials,  # CD [C, 2]: chunk partial sums
    counters,  # int32 [n]: finished chunks per tensor (zero between launches)
    sums,  # CD [bucket size]: output, Σx² per tensor, at the tensor's OUT row
    X_DTYPE: tl.constexpr, CD: tl.constexpr, ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
):
    """``sums[i] = Σ x_i²`` (global gradient clipping), accumulated in CD."""
    c, valid, i, rec, start, n, first, count, inc = chunks_of(records, owner, None, CHUNK, ROWS)
    x_ptr = tensor_ptrs(rec, PARAM, X_DTYPE, ALIGNED) + start[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    acc = tl.full([ROWS, BLOCK], 0.0, CD)
    for phase in tl.static_range(2):  # Note [whole tiles]
        lo, hi = tile_range(phase, n, BLOCK)
        for off in range(lo, hi, BLOCK):
            o = off + cols
            x = load_tile(x_ptr + o, tile_lanes(phase, o, n)).to(CD)
            acc += x * x
    p = tl.sum(acc, 1)
    finish_rows(partials, counters, sums, c, valid, i, rec, first, count, p, p, 1, ROWS, RBLOCK)
