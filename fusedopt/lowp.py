"""Low-precision optimizer state: the bf16 and 8-bit formats of docs/math.md ("Low-precision
state"), written in torch operations.

This is the readable statement of the formats that the eager backend runs and that converts
state between formats (``load_state_dict``); the fused backends implement the same operations
(``csrc/fusedopt/math.h``). A state tensor's format is told by its dtype: float32 or float64 is
full state, bfloat16 is bf16, uint8 is 8-bit. An 8-bit tensor is *packed*: one flat uint8 tensor
per moment and param, the float32 scales of its blocks (padded to 64 bytes) followed by one code
per element (:func:`packed_numel`).

Everything runs in float32 with one IEEE rounding per operation, in the order docs/math.md
writes; the 32-bit hash runs in int64 arithmetic masked to 32 bits (its multipliers are below
2^31, so no product leaves int64).
"""
from __future__ import annotations

from typing import Optional

import torch

FORMATS = ("full", "bf16", "8bit")
BLOCK = 256  # elements per 8-bit block
_SEED = 0x9E3779B9
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97
_MASK = 0xFFFFFFFF
_SCALE_ALIGN = 16  # scales per 64 bytes


def format_of(state: torch.Tensor) -> str:
    """The format of a state tensor, told by its dtype."""
    return {torch.bfloat16: "bf16", torch.uint8: "8bit"}.get(state.dtype, "full")


def n_blocks(n: int) -> int:
    return -(-n // BLOCK)


def codes_offset(n: int) -> int:
    """Byte offset of the codes in the packed tensor of ``n`` elements (the scales before them,
    padded to 64 bytes)."""
    return 4 * (-(-n_blocks(n) // _SCALE_ALIGN) * _SCALE_ALIGN)


def packed_numel(n: int) -> int:
    """Bytes of the packed 8-bit tensor of a moment of ``n`` elements."""
    return codes_offset(n) + n


def zeros(like: torch.Tensor, fmt: str, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zero state in format ``fmt`` for the param ``like`` (``dtype``: the full format's dtype).
    An 8-bit tensor of zeros holds the value 0 (scales 0)."""
    if fmt == "full":
        return torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)
    if fmt == "bf16":
        return torch.zeros_like(like, dtype=torch.bfloat16, memory_format=torch.preserve_format)
    if fmt == "8bit":
        return torch.zeros(packed_numel(like.numel()), dtype=torch.uint8, device=like.device)
    raise ValueError(f"unknown state format {fmt!r}; expected one of {FORMATS}")


def split(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scales ``[n_blocks(n)]`` and uint8 codes ``[n]`` of a packed tensor (views)."""
    if n == 0:  # an empty tensor counts as contiguous whatever its stride, which view() refuses
        return packed.new_empty(0, dtype=torch.float32), packed[:0]
    scales = packed[: 4 * n_blocks(n)].view(torch.float32)
    return scales, packed[codes_offset(n):codes_offset(n) + n]


# ------------------------------------------------------------------------------ random bits
def _mix(x: torch.Tensor) -> torch.Tensor:
    """docs/math.md's ``mix`` on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK
    return x ^ (x >> 15)


def _operator(name: str, fn, fake):
    """``fn`` as it runs in the eager step: the torch.library operator ``name`` (``fake`` gives
    its outputs' shapes) under torch.compile, ``fn`` itself otherwise (Note [8-bit operators])."""
    op = torch.library.custom_op(name, fn, mutates_args=())
    op.register_fake(fake)
    return lambda *args: (op if torch.compiler.is_compiling() else fn)(*args)


def _hash_bits(step: torch.Tensor, key: int, n: int) -> torch.Tensor:
    t = step.reshape(()).to(torch.int64) & _MASK
    base = _mix(_mix(t ^ _SEED) ^ (key & _MASK))
    e = (torch.arange(n, dtype=torch.int64, device=step.device) + (key >> 32)) & _MASK
    return _mix(base ^ e)


_hash_bits_step = _operator("fusedopt::lowp_random_bits", _hash_bits,
                            lambda step, key, n: step.new_empty((n,), dtype=torch.int64))


def random_bits(step: torch.Tensor, key: int, n: int) -> torch.Tensor:
    """``bits(e)`` for the ``n`` elements stepped of a tensor whose step count (after the
    increment) is ``step`` and whose key is ``key`` (docs/math.md, "Random bits": its low 32 bits
    key the tensor, its high 32 bits are the index of the first element stepped): int64 values
    in [0, 2^32). Under torch.compile an operator (Note [8-bit operators]): fused by inductor,
    the hash of the step count failed to compile when a param group held params of two dtypes (a
    C++ XOR of two floats)."""
    return _hash_bits_step(step, key, n)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root, as every backend takes it (docs/math.md). torch's CPU
    square root of float32 is within one ulp (MKL's VML), a fifth of its results one ulp from
    the rounded root; taken in float64 (within one float64 ulp, VML again) and rounded to float32
    it is the rounded root: scaled to [1, 2), the root r of a float32 x lies at least 2^-50 from
    a float32 rounding boundary m (x - m² is a nonzero multiple of 2^-48, and r + m < 4), and an
    error of one float64 ulp (2^-52) cannot carry it across."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return x.double().sqrt_().float()
    return x.sqrt()


# ---------------------------------------------------------------------------------- bf16
def _bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of int64 tensors holding their bit patterns in [0, 2^32)."""
    signed = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return signed.to(torch.int32).view(torch.float32)


def bf16_grid(v: torch.Tensor, bits: torch.Tensor | None) -> torch.Tensor:
    """``v`` (float32) rounded to bf16 (docs/math.md), as the float32 values of the bf16
    numbers: stochastically with ``bits`` (the float32 bits plus ``bits >> 16``), to nearest even
    without (plus ``0x7fff`` and the kept bit's parity), the low 16 bits dropped; inf and NaN
    kept. Rounded in the integer bits, not by casts: torch.compile's inductor drops a cast to
    bf16 and back inside one fused kernel (it keeps the float32 value), and the trust ratio must
    see the values stored."""
    raw = v.view(torch.int32)  # the sums wrap only for NaN patterns, which are not used
    add = (bits >> 16).to(torch.int32) if bits is not None else ((raw >> 16) & 1) + 0x7FFF
    return torch.where(torch.isfinite(v), ((raw + add) & -0x10000).view(torch.float32), v)


# ---------------------------------------------------------------------------------- 8-bit
def _blocks(x: torch.Tensor) -> torch.Tensor:
    """A flat tensor as ``[n_blocks, BLOCK]`` (the last block padded with zeros)."""
    n = x.numel()
    pad = n_blocks(n) * BLOCK - n
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a tensor of ``like``'s shape: a division by a CPU scalar may run as a
    multiplication by its reciprocal, a division by a tensor divides."""
    return torch.full_like(like, value)


def _block_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: the largest value of ``x`` (``[blocks, BLOCK]``, >= 0) and whether the block
    holds a value that is not finite."""
    return x.amax(dim=1), ~torch.isfinite(x).all(dim=1)


_SIGNED_TOP, _SIGNED_OFFSET = 1.875, (127 - 15) << 3  # E4M3: 2^0·15/8, 896
_ROOT_TOP, _ROOT_OFFSET = 1.9375, (127 - 15) << 4  # E4M4: 2^0·31/16, 1792


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns of ``x`` as int64 values in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK


def encode_signed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, flat) in the signed E4M3 map, rounded to nearest even: (int8 codes
    ``[n]``, scales ``f = a / 1.875``)."""
    n = x.numel()
    xb = _blocks(x)
    a, bad = _block_max(xb.abs())
    scale = torch.where(bad, torch.full_like(a, float("nan")), a / _full(a, _SIGNED_TOP))
    q = torch.where(a > 0, _full(a, _SIGNED_TOP) / a, torch.zeros_like(a))
    b = _bits(xb.abs() * q[:, None])
    c = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) - _SIGNED_OFFSET
    c = torch.where(bad[:, None], torch.zeros_like(c), c.clamp(0, 127))
    codes = torch.where(xb < 0, -c, c).to(torch.int8)
    return codes.reshape(-1)[:n], scale


def decode_signed(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The values of int8 E4M3 codes (flat) with their blocks' scales (float32, flat)."""
    c = codes.to(torch.int64)
    mag = c.abs()
    y = torch.where(mag > 0, _bits_to_float((mag + _SIGNED_OFFSET) << 20), 0.0)
    return torch.where(c < 0, -y, y) * scales.repeat_interleave(BLOCK)[: codes.numel()]


def encode_sqrt(v: torch.Tensor, bits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` (float32, flat, >= 0) by its square root in the E4M4 map with no code for 0:
    (uint8 codes ``[n]``, scales ``f = S / 1.9375``). ``bits``: the random bits of stochastic
    rounding, or None to round to nearest even (conversions outside a step)."""
    n = v.numel()
    sb = _blocks(sqrt_rn(v))
    s_max, bad = _block_max(sb)
    scale = torch.where(bad, torch.full_like(s_max, float("nan")), s_max / _full(s_max, _ROOT_TOP))
    q = torch.where(s_max > 0, _full(s_max, _ROOT_TOP) / s_max, torch.zeros_like(s_max))
    b = _bits(sb * q[:, None])
    add = (_blocks(bits) >> 13) if bits is not None else 0x3FFFF + ((b >> 19) & 1)
    c = ((b + add) >> 19) - _ROOT_OFFSET
    c = torch.where(bad[:, None], torch.zeros_like(c), c.clamp(0, 255))
    return c.to(torch.uint8).reshape(-1)[:n], scale


def decode_sqrt(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The square roots ``s`` of uint8 E4M4 codes (flat) with their blocks' scales."""
    y = _bits_to_float((codes.to(torch.int64) + _ROOT_OFFSET) << 19)
    return y * scales.repeat_interleave(BLOCK)[: codes.numel()]


# ----------------------------------------------------------------------- whole tensors
# Note [8-bit operators]: under torch.compile the eager step reads and writes 8-bit state, and
# draws the random bits, through three torch.library operators, so that inductor runs them as the
# eager functions they are instead of fusing them into the step's kernels (uncompiled, the step
# calls the functions themselves: an operator call costs about as much as a dozen small torch
# ops, docs/performance.md). Fused, inductor's CPU code computed a per-block value broadcast to
# the elements (``scales.repeat_interleave(BLOCK)[:n]``, or ``x / amax`` over blocks then
# flattened to ``n``) over the first block only when ``n`` is not a multiple of BLOCK, leaving
# the others unwritten: the trust ratio of a compiled eager step then belonged to other values
# than the ones stored. bf16 state needs no operator: its rounding is written in the integer
# bits (``bf16_grid``), which inductor keeps.
def _read8(state: torch.Tensor, n: int, root: bool) -> torch.Tensor:
    scales, codes = split(state, n)
    if root:
        return decode_sqrt(codes, scales)
    return decode_signed(codes.view(torch.int8), scales)


_read8_step = _operator("fusedopt::lowp_read8", _read8,
                        lambda state, n, root: state.new_empty((n,), dtype=torch.float32))


def _write8(x: torch.Tensor, root: bool,
            bits: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.reshape(-1)
    if root:
        codes, scales = encode_sqrt(flat, bits)
        return pack(codes, scales), decode_sqrt(codes, scales).view(x.shape)
    codes, scales = encode_signed(flat)
    return pack(codes, scales), decode_signed(codes, scales).view(x.shape)


_write8_step = _operator("fusedopt::lowp_write8", _write8, lambda x, root, bits: (
    x.new_empty((packed_numel(x.numel()),), dtype=torch.uint8),
    x.new_empty(x.shape, dtype=torch.float32)))


def read(state: torch.Tensor, shape: torch.Size, root: bool = False) -> torch.Tensor:
    """The float32 values a state tensor stores, of the param's ``shape`` (full state is returned
    as it is). ``root``: the tensor is LAMB's ``exp_avg_sq``; 8-bit state then gives ``s`` and the
    caller squares it (docs/math.md), other formats give ``v``."""
    fmt = format_of(state)
    if fmt == "full":
        return state
    if fmt == "bf16":
        return state.to(torch.float32)
    return _read8_step(state, shape.numel(), root).view(shape)


def pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A packed 8-bit tensor of codes (int8 or uint8, flat) and their blocks' scales."""
    n = codes.numel()
    out = torch.zeros(packed_numel(n), dtype=torch.uint8, device=codes.device)
    s, c = split(out, n)
    s.copy_(scales)
    c.copy_(codes.view(torch.uint8))
    return out


def write(fmt: str, x: torch.Tensor, *, root: bool = False,
          bits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float32 ``x`` to format ``fmt``: (what the state tensor stores, the float32 values
    it then holds, of ``x``'s shape). ``root``: ``x`` is LAMB's ``v`` (stochastic rounding with
    ``bits`` when given, to nearest otherwise), and the values returned are ``s = √v``; otherwise
    ``x`` is a signed moment, rounded to nearest."""
    if fmt == "full":
        return x, sqrt_rn(x) if root else x
    if fmt == "bf16":
        held = bf16_grid(x.reshape(-1), bits if root else None).view(x.shape)
        return held.to(torch.bfloat16), sqrt_rn(held) if root else held
    return _write8_step(x, root, bits)


def convert(state: torch.Tensor, fmt: str, like: torch.Tensor, *, root: bool,
            full_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A state tensor of the param ``like`` in format ``fmt``, from one in any format (rounding
    to nearest: no randomness outside a step)."""
    if format_of(state) == fmt:
        return state
    values = read(state, like.shape, root)
    if root and format_of(state) == "8bit":
        values = values * values
    if fmt == "full":
        return values.to(full_dtype).view(like.shape).clone()
    return write(fmt, values.to(torch.float32).reshape(like.shape), root=root)[0]


# ------------------------------------------------------------------------- state dicts
# Note [saved 8-bit state]: a state dict holds each 8-bit moment as two tensors, its codes
# (uint8, the param's shape) under the moment's key and its scales (float32) under the key +
# "_scales": ``[rows, row length / BLOCK]`` when the rows of dim 0 are whole blocks
# (``scales_shape``), else ``[blocks]``. The optimizer keeps them packed (one tensor per moment,
# which the kernels stream); the saved form is the one that shards: the blocks of a param whose
# rows are whole blocks lie in its rows, so the codes and scales of a shard of rows are its
# packed state, and a checkpoint of one process and one of FSDP2 shards (DTensors placed like
# the param) hold the same tensors, which torch.distributed.checkpoint saves, gathers and
# reshards as it does the param.
#
# Note [sharded 8-bit state]: a DTensor param keeps 8-bit state when its local shards are runs of
# whole blocks (``rows_hold_blocks``): every placement Replicate or Shard(0), and a row a whole
# number of blocks. The optimizer keeps the packed tensor of the local shard (a plain tensor).
def scales_shape(shape: torch.Size) -> tuple[int, ...]:
    """The shape of the saved scales of an 8-bit moment of a param of ``shape`` (Note [saved
    8-bit state])."""
    n = shape.numel()
    if len(shape) > 0 and n > 0 and (n // shape[0]) % BLOCK == 0:
        return (shape[0], n // shape[0] // BLOCK)
    return (n_blocks(n),)


def _shards_are_runs(p: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether the local shard ``local`` of the DTensor ``p`` is a run of whole rows of dim 0 of
    the whole tensor: every placement Replicate or Shard(0), the shard contiguous."""
    return local.is_contiguous() and all(pl.is_replicate() or pl.is_shard(0)
                                         for pl in p.placements)


def rows_hold_blocks(p: torch.Tensor) -> bool:
    """Whether the local shards of the DTensor ``p`` are runs of whole rows made of whole 8-bit
    blocks (Note [sharded 8-bit state])."""
    return len(scales_shape(p.shape)) == 2 and _shards_are_runs(p, p.to_local())


def random_key(index: int, p: torch.Tensor, local: torch.Tensor) -> int:
    """The key of the random bits of the param ``p`` (``local``: its local shard) whose index in
    its group is ``index`` (docs/math.md, "Random bits"): the index in its low 32 bits and, in its
    high 32 bits, the position in the whole tensor of the local shard's first element (mod 2^32)
    when ``p`` is a DTensor whose local shard is a run of the tensor (placements Shard(0) or
    Replicate), so that each element draws the bits it draws in one process; 0 otherwise. As a
    signed int64."""
    first = 0
    coord = p.device_mesh.get_coordinate() if hasattr(p, "to_local") and p.dim() > 0 else None
    if coord is not None and _shards_are_runs(p, local):
        rows = p.shape[0]  # of the run so far, cut mesh dimension by mesh dimension
        for d, pl in enumerate(p.placements):
            if pl.is_shard(0):  # as torch.chunk cuts (Shard's rule), in plain integers
                chunk = -(-rows // p.device_mesh.size(d))
                start = min(coord[d] * chunk, rows)
                first += start
                rows = min(chunk, rows - start)
        first *= p.numel() // p.shape[0] if p.shape[0] else 0
    return key_of(index, first)


def key_of(index: int, first: int) -> int:
    """The key of the random bits of elements counted from ``first`` in the tensor whose index in
    its group is ``index`` (docs/math.md, "Random bits"), as a signed int64."""
    key = (first & _MASK) << 32 | (index & _MASK)
    return key - (1 << 64) if key >= 1 << 63 else key


def _placed_like(local: torch.Tensor, p: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``local`` as the local shard of a DTensor of ``shape`` placed like the DTensor ``p``."""
    stride = tuple(torch.empty(shape, device="meta").stride())
    return type(p).from_local(local, p.device_mesh, p.placements, run_check=False, shape=shape,
                              stride=stride)


def saved_form(packed: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales of the packed 8-bit moment of ``p`` (of its local shard for a
    DTensor, then as DTensors placed like ``p``): the codes a view of ``packed``, the scales a
    copy (Note [saved 8-bit state])."""
    lp = p.to_local() if hasattr(p, "to_local") else p
    scales, codes = split(packed, lp.numel())
    # the scales copied: torch.save refuses two views of one storage as different dtypes
    scales, codes = scales.clone(), codes.view(lp.shape)
    shape = scales_shape(p.shape)
    if not hasattr(p, "to_local"):
        return codes, scales.view(shape)
    return (_placed_like(codes, p, tuple(p.shape)),
            _placed_like(scales.view(lp.shape[0], shape[1]), p, shape))


def from_saved(codes: torch.Tensor, scales: torch.Tensor | None,
               p: torch.Tensor) -> torch.Tensor:
    """The packed 8-bit moment of ``p`` (of its local shard for a DTensor) from the codes and
    scales of a state dict (DTensors or whole tensors; Note [saved 8-bit state])."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError("an 8-bit moment is saved as its codes and, under its key + '_scales', "
                        f"its scales; got scales of type {type(scales).__name__}")
    shape = scales_shape(p.shape)
    if tuple(codes.shape) != tuple(p.shape) or scales.numel() != n_blocks(p.numel()):
        raise ValueError(f"8-bit codes of shape {tuple(codes.shape)} with {scales.numel()} "
                         f"scales do not fit a param of shape {tuple(p.shape)} (expected "
                         f"{n_blocks(p.numel())} scales)")
    if hasattr(p, "to_local"):
        if not rows_hold_blocks(p):
            raise ValueError("8-bit state saved for a param whose shards are not whole 8-bit "
                             "blocks cannot be placed on its shards; load it with "
                             "state_precision='full' on one process first")
        from torch.distributed.tensor import Replicate

        def local(t):  # t's part of p's local shard; a whole tensor is the same on every rank
            if not hasattr(t, "to_local"):
                t = type(p).from_local(t.to(p.device), p.device_mesh,
                                       [Replicate()] * p.device_mesh.ndim, run_check=False)
            if t.device_mesh != p.device_mesh or t.placements != p.placements:
                t = t.redistribute(p.device_mesh, p.placements)
            return t.to_local()

        codes, scales = local(codes), local(scales.reshape(shape))
    else:
        codes, scales = (t.full_tensor() if hasattr(t, "full_tensor") else t
                         for t in (codes, scales))
    device = p.device if not hasattr(p, "to_local") else p.to_local().device
    return pack(codes.reshape(-1).to(device),
                scales.reshape(-1).to(device=device, dtype=torch.float32))


def packed_moment(saved: dict, key: str, p: torch.Tensor) -> torch.Tensor | None:
    """The packed 8-bit moment ``key`` of ``p`` (its local shard's for a DTensor) in the saved
    state ``saved`` of one param: from its codes and scales, or from the packed form that older
    versions saved for the whole tensor; None where ``saved[key]`` is no 8-bit moment or is
    already the packed moment of ``p``. Raises on codes, scales or bytes that do not fit ``p``."""
    value = saved.get(key)
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8):
        return None
    if key + "_scales" in saved:
        return from_saved(value, saved[key + "_scales"], p)
    size = packed_numel(p.numel())
    if value.dim() != 1 or value.numel() != size:
        raise ValueError(f"the 8-bit {key!r} is {tuple(value.shape)} bytes "
                         f"without {key + '_scales'!r}; expected codes and scales, or {size} "
                         "packed bytes")
    if not hasattr(p, "to_local"):
        return None
    scales, codes = split(value, p.numel())
    return from_saved(codes.view(p.shape), scales, p)


def placed(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A local state tensor of the param's shape as a DTensor placed like ``p``."""
    return _placed_like(local, p, tuple(p.shape))
