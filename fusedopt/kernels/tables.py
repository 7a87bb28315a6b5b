"""The launcher: per-bucket pointer tables, chunk maps, launch splitting, the launch guard.

The kernels never receive a Python list of tensors. A set of ``n`` tensors is described by

* ``records``: int64 ``[n, RECORD]``, one row per tensor: the data pointers of its param, grad,
  master, the two state tensors and the step count (0 where the kernel does not use one), its
  ``numel``, the index of its first chunk, ``OUT``, the tensor's row in the pass's output
  ``sums`` (its index in the bucket), and the ``FORMAT`` and ``KEY`` of its state (Note [state
  formats in the tables]);
* ``owner``: int32, the tensor of each chunk. Tensor ``i`` is cut into
  ``max(1, ceil(numel / CHUNK_SIZE))`` chunks (a 0-size tensor still gets one: it writes its sums
  and its step count). A program takes ``ROWS`` consecutive chunks, one per row of its
  ``[ROWS, BLOCK_SIZE]`` tiles, so many small tensors share a program and a large one spreads
  over many; ``owner`` is padded with -1 to a multiple of ``ROWS``;
* the workspace of the two-stage norms: ``partials`` ``[C, 2]`` and the int32 ``counters`` ``[n]``
  (zero between launches, see kernels/common.py).

Note [per-tensor alignment]: the kernels load 16-byte vectors only when told (``ALIGNED``) that
every data pointer of the table is a multiple of 16 bytes. A bucket's tensors are therefore split
into the aligned ones and the others, each set with tables (and launches) of its own: one
misaligned tensor (an odd-sized param before a bucket-view grad, a user's view) costs its own
launch, never the vector loads of the others, and a tensor's sums do not depend on its
neighbours (``ALIGNED`` changes the layout of a tile, and with it the order of ``tl.sum``).

Note [table ownership]: building a table is a host loop over the tensors and one host-to-device
copy (from pinned memory, non-blocking: the host never waits for the queued backward). A bucket's
tables live in its ``workspace`` (a ``TableStore``, which the optimizer keeps per param group and
bucket as long as the optimizer lives), one entry per role of the step (the passes; the grads'
norms for clipping), each replaced only when the tensors it describes moved (its key is the tuple
of every data pointer and every ``numel``). Nothing is evicted: a table, its norm counters and
partial sums stay valid as long as the bucket, as a captured CUDA graph that points to them
needs, and two buckets never share a workspace. Under CUDA-graph capture a table that would
have to be built raises instead (build it with one step before capturing). A one-off bucket
without workspace (the functional API) builds its tables per call.

Note [launch limit]: one launch covers at most ``MAX_TENSORS_PER_LAUNCH`` tensors; a larger set
is cut into consecutive slices with one set of launches each (and its own table), so the
launches per step are constant up to that many tensors and grow by one set per further slice.
The limit bounds the size of one table (88 B per tensor) and of one host-to-device copy; it is a
module attribute so tests can lower it.

Note [runtime flags]: a kernel's constexprs are structural only: dtypes, whether fp32 masters
exist, alignment and tile sizes. The hyper-parameters' variant switches (bias correction,
adaptation, bounds, LARS's denominator, trust clip, Nesterov, lr in momentum, a tensor lr) are
bits of one int32 ``flags`` argument that Triton does not specialize on
(``do_not_specialize``). Each is the same for every program of a launch, so its branches are
uniform; most select a per-tensor scalar, and LARS's Nesterov / lr-in-momentum / combined
switches one line of per-element math. ``grad_mult`` and ``found_inf`` are always given, as a
tensor on the bucket's device (1 and 0 when the step has none, see :func:`operand`), and a
tensor lr travels as float64 (exact from any floating dtype). So the kernels a backend can
launch are one per dtype combination, masters and alignment: a few hundred, all compiled in the
tests (docs/triton_kernels.md), where constexpr switches would multiply them to tens of
thousands, each one a compile on the first step that uses it.

Note [scalar operands]: ``grad_mult``, ``found_inf`` and ``lr_ptr`` are 0-dim tensors read as
scalars (``SCALAR_OPERANDS``). Triton specializes a pointer argument on whether it is a multiple
of 16 bytes unless told not to, and one of them may well not be (a 0-dim view such as
``lrs[k]`` of a float64 tensor of learning rates): that kernel would be a specialization that
``prepare`` did not compile (it sees the stand-in 1/0 operands, made aligned), compiled mid-step
after pass 1 ran. The pass kernels are therefore declared with ``do_not_specialize_on_alignment``
for these arguments (a scalar load gains nothing from the alignment), so one compiled kernel
serves every address, and the backend's record of compiled specializations leaves their
addresses out.

Note [state formats in the tables]: docs/math.md's low-precision state is per tensor (told by the
state tensor's dtype: bfloat16 is bf16, uint8 the packed 8-bit format), so one launch may hold
tensors of every format. Each record carries ``FORMAT`` (0 full, 1 bf16, 2 8-bit, from the first
state list) and ``KEY``, the tensor's key in the random bits of stochastic rounding (the bucket's
``keys``, or its index in the bucket, as the cpp backend; its high 32 bits are the index of the
first element stepped, docs/math.md "Random bits"), and the kernels branch on them per
program: a program whose rows are all full-state runs the code it ran before formats existed,
and one with a low-precision row runs each format present among its rows with a mask per row
(on the GPU a program has one row, so one format). The pass kernels over state take one
constexpr, ``LOWP``: whether the table holds a low-precision record. A launch without one
compiles no low-precision loop, whose registers would otherwise hold down the full-state loop's
occupancy (docs/triton_kernels.md gives the registers of each build). An 8-bit tensor's
codes start ``q8_codes_offset(numel)`` bytes into its packed tensor, which the kernels compute
from ``NUMEL``. Its blocks of 256 elements count from the tensor's first element: chunks start
at multiples of ``CHUNK_SIZE`` and tiles at multiples of ``BLOCK_SIZE`` within a chunk, so both
must be multiples of 256 (checked when a table with low-precision state is built), and a tile
holds whole blocks (the last one of a tensor may be short).

Note [no FMA]: docs/math.md states the update as one IEEE rounding per operation, and the cpp
backend does not contract a multiply and an add into an FMA; Triton does by default
(``enable_fp_fusion``), which changes the last bit of a product-sum, and with it an 8-bit code
or a stochastic rounding. Every launch and compilation passes ``enable_fp_fusion=False`` (ptxas
then runs with ``--fmad=false``); the interpreter has no FMA anyway.

Note [device guard]: Triton launches on ``torch.cuda.current_device()`` and that device's current
stream. Every launch (and compilation) runs under a guard of its table's device, so a bucket on
``cuda:1`` runs in cuda:1's context, ordered after the work queued on cuda:1's current stream,
whatever device is current for the caller.
"""
from __future__ import annotations

import contextlib
import os
from array import array
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .._bucket import data_ptrs, dtype_codes, numels
from .._errors import BackendCompileError, capturing

# Note [launch limit]
MAX_TENSORS_PER_LAUNCH = 32768
# Elements per chunk; chunks per program (rows of a tile); columns of a tile. Powers of two.
# Compiled, every row of a tile carries 64-bit pointers per element, so registers grow with the
# rows (docs/triton_kernels.md, "Tile sizes"): the GPU default is one chunk per program. The
# interpreter's cost is per program and per operation, not per element, so under it the kernels
# take many rows of wide tiles; those tiles are for the interpreter only (compiled, they spill
# and take minutes to build).
CHUNK_SIZE = 16384
ROWS = 1
BLOCK_SIZE = 1024
NUM_WARPS = 4
# Registers a thread may use. Without a limit ptxas picks its own budget for the block size
# Triton declares (.reqntid) and spills a few bytes in some float64 kernels to meet it; with
# the limit stated, it keeps every value in registers (docs/triton_kernels.md).
MAX_REGISTERS = 255
INTERPRETER_TILES = dict(CHUNK_SIZE=2048, ROWS=64, BLOCK_SIZE=512)
if os.environ.get("TRITON_INTERPRET") == "1":  # read when triton makes its choice, at first import
    CHUNK_SIZE, ROWS, BLOCK_SIZE = (INTERPRETER_TILES[k] for k in ("CHUNK_SIZE", "ROWS", "BLOCK_SIZE"))
# Lanes of the finaliser's fixed-order reduction over the chunk partials of one tensor.
REDUCE_BLOCK = 128

# Columns of a record (kernels/common.py reads them by these numbers).
PARAM, GRAD, MASTER, STATE0, STATE1, STEP, NUMEL, FIRST_CHUNK, OUT, FORMAT, KEY = range(11)
RECORD = 11
# FORMAT codes (Note [state formats in the tables]): 0 for full state, else 1 + the index of the
# state tensor's dtype in STATE_DTYPES
FULL_STATE, BF16_STATE, Q8_STATE = 0, 1, 2
STATE_DTYPES = (torch.bfloat16, torch.uint8)
Q8_BLOCK = 256  # elements per 8-bit block (docs/math.md)
# Note [scalar operands]: the 0-dim tensor arguments whose address the kernels do not specialize on
SCALAR_OPERANDS = ("grad_mult", "found_inf", "lr_ptr")
# Bits of ``flags`` (Note [runtime flags]); kernels/common.py reads them by these numbers.
FLAG_BITS = dict(LR_TENSOR=1, BIAS_CORRECTION=2, ADAPT=4, BOUNDED=8, COMBINED=16, TRUST_CLIP=32,
                 NESTEROV=64, LR_IN_MOMENTUM=128)
LR_TENSOR, BIAS_CORRECTION, ADAPT, BOUNDED, COMBINED, TRUST_CLIP, NESTEROV, LR_IN_MOMENTUM = (
    FLAG_BITS.values())


def flags(**switches: bool) -> int:
    """The ``flags`` argument with the named bits (FLAG_BITS) set where the switch is True."""
    return sum(FLAG_BITS[name] for name, on in switches.items() if on)

_launches = 0
_builds = 0


class KernelError(RuntimeError):
    """A Triton kernel of fusedopt failed to compile or to launch; the message names the backend,
    the kernel and the specialization (its constexpr arguments)."""

    def __init__(self, kernel: str, specialization: str, action: str, cause: BaseException):
        self.kernel, self.specialization = kernel, specialization
        super().__init__(f"fusedopt triton backend: kernel {kernel} failed to {action} for the "
                         f"specialization {specialization}: {type(cause).__name__}: {cause}")


class KernelCompileError(KernelError, BackendCompileError):
    """A kernel failed to compile (``compile_only``, before anything ran)."""


def specialization(kwargs: dict) -> str:
    """The constexpr arguments of a launch (upper-case names by convention), its runtime flags
    and the dtypes of its scalar tensor arguments, as a readable string."""
    parts = [f"{k}={v}" for k, v in kwargs.items() if k.isupper()]
    if "flags" in kwargs:
        parts.append("flags=" + ("|".join(k for k, bit in FLAG_BITS.items() if kwargs["flags"] & bit)
                                 or "0"))
    parts += [f"{k}:{v.dtype}".replace("torch.", "") for k, v in kwargs.items()
              if isinstance(v, torch.Tensor) and k in ("grad_mult", "found_inf", "lr_ptr")]
    return "(" + ", ".join(parts) + ")"


def _kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", repr(kernel))


def device_guard(device: torch.device):
    """Note [device guard]: the context a launch on ``device`` runs in."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def launch(kernel, table: Table, **kwargs) -> None:
    """Launch ``kernel`` over ``table`` (one program per ``ROWS`` chunks); every Triton launch of
    fusedopt goes through here."""
    global _launches
    _launches += 1
    try:
        with device_guard(table.device):
            kernel[(table.num_programs,)](num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
                                          enable_fp_fusion=False, **kwargs)
    except Exception as e:
        error = KernelError(_kernel_name(kernel), specialization(kwargs), "compile or launch", e)
        try:  # a launch that stopped half-way may leave norm counters nonzero
            table.counters.zero_()
        except Exception as reset:  # a sticky CUDA error fails every later device call too; the
            # error raised still names the kernel and the launch's own cause
            error.args = (f"{error} (its table's norm counters could not be reset either: "
                          f"{type(reset).__name__}: {reset})",)
        raise error from e


def compile_only(kernel, table: Table, **kwargs) -> None:
    """Compile ``kernel`` for the arguments ``launch`` would get, without running it (a no-op under
    the interpreter, which compiles nothing)."""
    try:
        with device_guard(table.device):
            kernel.warmup(grid=(table.num_programs,), num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
                          enable_fp_fusion=False, **kwargs)
    except Exception as e:
        raise KernelCompileError(_kernel_name(kernel), specialization(kwargs), "compile", e) from e


def launch_count() -> int:
    """Triton launches made so far in this process (tests and the benchmark take differences)."""
    return _launches


def build_count() -> int:
    """Tables built so far in this process (each is a host loop and a host-to-device copy)."""
    return _builds


@dataclass(eq=False)
class Table:
    """Pointer table, chunk map and norm workspace of one launch."""

    device: torch.device
    n: int
    num_chunks: int
    num_programs: int
    records: torch.Tensor  # int64 [n, RECORD]
    owner: torch.Tensor  # int32 [num_programs * ROWS], -1 past the last chunk
    counters: torch.Tensor  # int32 [n], zero between launches
    aligned: bool  # every data pointer (not the steps) is a multiple of 16 bytes
    lowp: bool = False  # some record's state is low-precision (Note [state formats in the tables])
    _host: tuple = ()  # the pinned sources of the non-blocking copies, kept alive with the table
    _partials: dict = field(default_factory=dict)

    def partials(self, dtype: torch.dtype) -> torch.Tensor:
        """Chunk partial sums ``[num_chunks, 2]`` in ``dtype`` (reused across steps)."""
        p = self._partials.get(dtype)
        if p is None:
            if capturing(self.device):
                raise RuntimeError(_CAPTURE_MSG)
            p = self._partials[dtype] = torch.empty(self.num_chunks, 2, dtype=dtype, device=self.device)
        return p


class TableStore:
    """The tables of one bucket, one entry per role (Note [table ownership])."""

    def __init__(self):
        self.entries: dict[str, tuple[tuple, list[Table]]] = {}


_operands: dict[tuple, torch.Tensor] = {}


def operand(device: torch.device, dtype: torch.dtype, value: float) -> torch.Tensor:
    """A 0-dim tensor holding ``value`` on ``device``, made once per process and never written
    (Note [runtime flags]: the ``grad_mult`` of 1 or ``found_inf`` of 0 that a step without them
    passes, and the unused ``lr_ptr`` of a number lr). Under CUDA-graph capture one that does
    not exist yet raises, as a table does."""
    key = (device, dtype, value)
    t = _operands.get(key)
    if t is None:
        if capturing(device):
            raise RuntimeError(_CAPTURE_MSG)
        t = _operands[key] = torch.full((), value, dtype=dtype, device=device)
    return t


_CAPTURE_MSG = ("fusedopt triton backend: a pointer table or a constant operand had to be made "
                "during CUDA graph capture (the bucket's tensors moved, or this bucket never "
                "stepped): run one step with the same tensors before capturing")


def _upload(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``host`` on ``device`` without making the host wait: a pinned copy and a non-blocking
    transfer. Returns the device tensor and the pinned source (None on the CPU)."""
    if device.type == "cpu":
        return host, None
    pinned = host.pin_memory() if device.type == "cuda" else host
    return pinned.to(device, non_blocking=True), pinned


def _ints(values: bytes, n: int) -> Sequence[int]:
    """The int64 values of ``data_ptrs`` / ``numels`` (empty bytes: a list the kernel does not
    use, zeros)."""
    return memoryview(values).cast("q") if values else (0,) * n


def _build(device: torch.device, columns: list[Sequence[int]], numels: Sequence[int],
           idx: Sequence[int], aligned: bool, formats: bytes | None,
           keys: Sequence[int] | None) -> Table:
    global _builds
    _builds += 1
    n = len(idx)
    counts = [max(1, -(-numels[i] // CHUNK_SIZE)) for i in idx]
    firsts, c = [], 0
    for k in counts:
        firsts.append(c)
        c += k
    rows = [[col[i] for col in columns]
            + [numels[i], f, i, 0 if formats is None else formats[i],
               i if keys is None else keys[i]]
            for i, f in zip(idx, firsts)]
    records = torch.tensor(rows, dtype=torch.int64).reshape(n, RECORD)
    programs = -(-c // ROWS)
    owner = torch.full((programs * ROWS,), -1, dtype=torch.int32)
    owner[:c] = torch.repeat_interleave(torch.arange(n, dtype=torch.int32),
                                        torch.tensor(counts, dtype=torch.int64))
    records_d, records_h = _upload(records, device)
    owner_d, owner_h = _upload(owner, device)
    return Table(device=device, n=n, num_chunks=c, num_programs=programs, records=records_d,
                 owner=owner_d, counters=torch.zeros(n, dtype=torch.int32, device=device),
                 aligned=aligned, lowp=formats is not None and any(formats[i] for i in idx),
                 _host=(records_h, owner_h))


def _partition(columns: list[Sequence[int]], n: int) -> list[tuple[list[int], bool]]:
    """Note [per-tensor alignment] and Note [launch limit]: the tensors' indices in launch-sized
    slices, the 16-byte aligned tensors first."""
    data = columns[PARAM:STEP]  # the steps are read as scalars
    is_aligned = [all(col[i] % 16 == 0 for col in data) for i in range(n)]
    out = []
    for flag in (True, False):
        idx = [i for i in range(n) if is_aligned[i] == flag]
        out += [(idx[s:s + MAX_TENSORS_PER_LAUNCH], flag)
                for s in range(0, len(idx), MAX_TENSORS_PER_LAUNCH)]
    return out


def state_formats(states: Sequence[torch.Tensor] | None) -> bytes | None:
    """The FORMAT of each state tensor (Note [state formats in the tables]), or None when every
    one is full state (one C loop over their dtypes: Note [native scans])."""
    if states is None:
        return None
    formats = dtype_codes(states, STATE_DTYPES)
    return None if formats.count(FULL_STATE) == len(formats) else formats


def check_tiles(formats: bytes | None) -> None:
    """Note [state formats in the tables]: tiles of whole 8-bit blocks."""
    if formats is not None and (CHUNK_SIZE % Q8_BLOCK or BLOCK_SIZE % Q8_BLOCK):
        raise ValueError(f"fusedopt triton backend: low-precision state needs CHUNK_SIZE and "
                         f"BLOCK_SIZE that are multiples of {Q8_BLOCK} (got {CHUNK_SIZE} and "
                         f"{BLOCK_SIZE})")


def tables(tensors: Sequence[Sequence[torch.Tensor] | None], store: TableStore | None = None,
           role: str = "pass", keys: torch.Tensor | Sequence[int] | None = None) -> list[Table]:
    """Tables for the tensors ``[params, grads, masters, state0, state1, steps]`` (entries may be
    None; the first list gives the device and each tensor's ``numel``), in launch-sized slices.
    ``keys``: the keys of the random bits of stochastic rounding (Note [state formats in the
    tables]; None: each tensor's index in the lists), recorded only for low-precision state.

    With a ``store``, the tables of ``role`` are reused while every pointer and size (and state
    format and key) is the same (Note [table ownership]); without, they are built for this call.
    """
    tensors = list(tensors) + [None] * (STEP + 1 - len(tensors))
    first = tensors[0]
    n = len(first)
    device = first[0].device
    # Note [native scans] in csrc/cpu/register.cpp: one C loop per list, compared as bytes
    columns = [b"" if ts is None else data_ptrs(ts) for ts in tensors]
    sizes = numels(first)
    formats = state_formats(tensors[STATE0])
    check_tiles(formats)
    if formats is not None and keys is not None:
        keys = array("q", keys.tolist() if isinstance(keys, torch.Tensor) else map(int, keys))
        if len(keys) != n:
            raise ValueError(f"fusedopt triton backend: keys must hold one key per tensor ({n}), "
                             f"got {len(keys)}")
        keys = keys.tobytes()
    else:
        keys = None
    key = (device, CHUNK_SIZE, ROWS, MAX_TENSORS_PER_LAUNCH, *columns, sizes, formats, keys)
    if store is not None:
        hit = store.entries.get(role)
        if hit is not None and hit[0] == key:
            return hit[1]
    if capturing(device):
        raise RuntimeError(_CAPTURE_MSG)
    ints = [_ints(c, n) for c in columns]
    built = [_build(device, ints, _ints(sizes, n), idx, aligned, formats,
                    None if keys is None else _ints(keys, n))
             for idx, aligned in _partition(ints, n)]
    if store is not None:
        store.entries[role] = (key, built)
    return built
