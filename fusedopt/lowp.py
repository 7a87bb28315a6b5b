"""Low-precision optimizer state: the bf16 and 8-bit formats of docs/math.md ("Low-precision
state"), written in torch operations.

This is the readable statement of the formats that the eager backend runs and that converts
state between formats (``load_state_dict``); the fused backends implement the same operations
(``csrc/fusedopt/math.h``). A state tensor's format is told by its dtype: float32 or float64 is
full state, bfloat16 is bf16, uint8 is 8-bit. An 8-bit tensor is *packed*: one flat uint8 tensor
per moment and param, the two 32-bit words of each of its blocks (padded to 64 bytes) followed by
one code per element (:func:`packed_numel`).

Everything runs in float32 with one IEEE rounding per operation, in the order docs/math.md
writes; the 32-bit hash runs in int64 arithmetic masked to 32 bits (its multipliers are below
2^31, so no product leaves int64).
"""
from __future__ import annotations

import torch

FORMATS = ("full", "bf16", "8bit")
BLOCK = 256  # elements per 8-bit block
_SEED = 0x9E3779B9
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97
_WEYL = 0x9E3779B9  # bits(e) = base + e·_WEYL (mod 2^32)
_MASK = 0xFFFFFFFF
_WORD_ALIGN = 16  # block words per 64 bytes


def format_of(state: torch.Tensor) -> str:
    """The format of a state tensor, told by its dtype."""
    return {torch.bfloat16: "bf16", torch.uint8: "8bit"}.get(state.dtype, "full")


def n_blocks(n: int) -> int:
    return -(-n // BLOCK)


def codes_offset(n: int) -> int:
    """Byte offset of the codes in the packed tensor of ``n`` elements (two words per block
    before them, padded to 64 bytes)."""
    return 4 * (-(-2 * n_blocks(n) // _WORD_ALIGN) * _WORD_ALIGN)


def packed_numel(n: int) -> int:
    """Bytes of the packed 8-bit tensor of a moment of ``n`` elements."""
    return codes_offset(n) + n


def zeros(like: torch.Tensor, fmt: str, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zero state in format ``fmt`` for the param ``like`` (``dtype``: the full format's dtype).
    An 8-bit tensor of zeros holds the value 0 (every word 0)."""
    if fmt == "full":
        return torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)
    if fmt == "bf16":
        return torch.zeros_like(like, dtype=torch.bfloat16, memory_format=torch.preserve_format)
    if fmt == "8bit":
        return torch.zeros(packed_numel(like.numel()), dtype=torch.uint8, device=like.device)
    raise ValueError(f"unknown state format {fmt!r}; expected one of {FORMATS}")


def split(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block words ``[n_blocks(n), 2]`` (int32) and uint8 codes ``[n]`` of a packed tensor
    (views)."""
    if n == 0:  # an empty tensor counts as contiguous whatever its stride, which view() refuses
        return packed.new_empty((0, 2), dtype=torch.int32), packed[:0]
    words = packed[: 8 * n_blocks(n)].view(torch.int32).view(-1, 2)
    return words, packed[codes_offset(n):codes_offset(n) + n]


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


def _hash_bits(step: torch.Tensor, key: torch.Tensor, n: int) -> torch.Tensor:
    t = step.reshape(()).to(torch.int64) & _MASK
    base = _mix(_mix(t ^ _SEED) ^ (key & _MASK))
    e = (torch.arange(n, dtype=torch.int64, device=step.device) + (key >> 32)) & _MASK
    return (base + e * _WEYL) & _MASK


_hash_bits_step = _operator("fusedopt::lowp_random_bits", _hash_bits,
                            lambda step, key, n: step.new_empty((n,), dtype=torch.int64))


def random_bits(step: torch.Tensor, key: int | torch.Tensor, n: int) -> torch.Tensor:
    """``bits(e)`` for the ``n`` elements stepped of a tensor whose step count (after the
    increment) is ``step`` and whose key is ``key`` (docs/math.md, "Random bits": its low 32 bits
    key the tensor, its high 32 bits are the index of the first element stepped): int64 values
    in [0, 2^32). Under torch.compile an operator (Note [8-bit operators]): fused by inductor,
    the hash of the step count failed to compile when a param group held params of two dtypes (a
    C++ XOR of two floats). ``key`` may be an int64 tensor of one element, as a traced step reads
    it without a graph break."""
    if isinstance(key, torch.Tensor):
        key = key.reshape(())
    elif torch.compiler.is_compiling():  # the operator's schema takes a tensor
        key = torch.tensor(key, dtype=torch.int64)
    return _hash_bits_step(step, key, n)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root, as every backend takes it (docs/math.md). torch's CPU
    square root of float32 is within one ulp (MKL's VML), a fifth of its results one ulp from
    the rounded root; taken in float64 (within one float64 ulp, VML again) and rounded to float32
    it is the rounded root: scaled to [1, 2), the root r of a float32 x lies at least 2^-50 from
    a float32 rounding boundary m (x - m² is a nonzero multiple of 2^-48, and r + m < 4), and an
    error of one float64 ulp (2^-52) cannot carry it across. VML's float64 root is itself one
    ulp off for some inputs, which ones depending on the CPU; the real part of
    torch's complex root is not VML's but the IEEE root (of a non-negative x, whose imaginary part
    is 0), so a CPU float64 root is that, with sqrt(-0) = -0 and NaN below 0. A compiled step's
    root is inductor's, the IEEE one too."""
    if x.device.type == "cpu":
        if x.dtype == torch.float32:
            return x.double().sqrt_().float()
        if x.dtype == torch.float64 and not torch.compiler.is_compiling():
            root = x.to(torch.complex128).sqrt().real
            return torch.where(x >= 0, root.copysign(x), torch.nan)
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
# Note [8-bit maps]: docs/math.md, "8-bit". Three maps, one per state key: LAMB's exp_avg holds
# the direction d = m / (s + ε) in a linear map, LAMB's exp_avg_sq the root s = √v by its bit
# pattern between the block's extremes, LARS's momentum_buffer a dynamic map of base 8. Each
# block of a packed moment has two 32-bit words (w0, w1) before the codes. Everything is float32
# with one IEEE rounding per operation, and integer arithmetic on bit patterns (int64 here, so
# that no intermediate wraps), in the order docs/math.md writes it.
_FLT_MAX = 3.4028234663852886e38
_NAN_WORD = 0x7FC00000
_INF_BITS = 0x7F800000
_TINY, _PRESCALE = 2.0 ** -64, 2.0 ** 64
_ROOT_OCTAVES = 24  # the root map's range below the block's largest root
_ROOT_SHIFTS = 21  # 254 << 20 covers 24 octaves of bit patterns (24 << 23)
_DYN_K = (1 / 7, 2 / 7, 4 / 7, 8 / 7, 16 / 7, 32 / 7, 9.0)  # float32(n / 7), n = 2^L or 63
MAPS = {"exp_avg": "direction", "exp_avg_sq": "root", "momentum_buffer": "dynamic"}


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """A flat tensor as ``[n_blocks, BLOCK]`` (the last block padded with zeros)."""
    n = x.numel()
    pad = n_blocks(n) * BLOCK - n
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)


def _per_element(x: torch.Tensor, n: int) -> torch.Tensor:
    """A per-block value ``[blocks]`` broadcast to the ``n`` elements."""
    return x.repeat_interleave(BLOCK)[:n]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns of ``x`` as int64 values in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK


def _magnitude_bits(x: torch.Tensor) -> torch.Tensor:
    return _bits(x) & 0x7FFFFFFF


def _block_top(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``xb`` (``[blocks, BLOCK]``): the largest ``|x|`` (from the largest bit
    pattern: for magnitudes their order is the values') and whether every value is finite."""
    top = _magnitude_bits(xb).amax(dim=1)
    return _bits_to_float(top), top < _INF_BITS


def _scaled(xb: torch.Tensor, a: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``xb·P`` and the factor ``q = c / (a·P)`` (0 where ``a = 0``) of docs/math.md, with
    ``P = 2^64`` for a block whose largest value ``a`` is below 2^-64."""
    p = torch.where(a < _TINY, _full(a, _PRESCALE), _full(a, 1.0))
    ap = a * p
    q = torch.where(a > 0, _full(a, c) / torch.where(a > 0, ap, _full(a, 1.0)), _full(a, 0.0))
    return xb * p[:, None], q


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a tensor of ``like``'s shape: a division by a CPU scalar may run as a
    multiplication by its reciprocal, a division by a tensor divides."""
    return torch.full_like(like, value)


def _words(w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """Block words ``[blocks, 2]`` (int32) from two int64 tensors of bit patterns."""
    w = torch.stack([w0, w1], dim=1)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def encode_direction(d: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``d`` (float32, flat) in the linear map, to nearest even, with the block words
    ``(bits(f), bits(ε))``: (int8 codes ``[n]``, int32 words ``[blocks, 2]``)."""
    n = d.numel()
    db = _blocks(d)
    a, ok = _block_top(db)
    dp, q = _scaled(db, a, 127.0)
    c = torch.round(dp * q[:, None]).clamp(-127, 127)
    c = torch.where(ok[:, None], c, torch.zeros_like(c))
    f = torch.where(ok, a / _full(a, 127.0), _full(a, float("nan")))
    e = _bits(eps.to(torch.float32).reshape(1)).expand(len(a))
    return c.to(torch.int8).reshape(-1)[:n], _words(_bits(f), e)


def decode_direction(codes: torch.Tensor, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The values ``d`` of int8 linear codes (flat) and, per element, its block's ``ε``."""
    n = codes.numel()
    f = words[:, 0].contiguous().view(torch.float32)
    eps = words[:, 1].contiguous().view(torch.float32)
    return codes.to(torch.float32) * _per_element(f, n), _per_element(eps, n)


def _shifts(span: torch.Tensor) -> torch.Tensor:
    """The smallest ``k >= 0`` with ``span <= 254·2^k``, per block."""
    return sum((span > (254 << k)).to(torch.int64) for k in range(_ROOT_SHIFTS))


def encode_root(s: torch.Tensor, bits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Roots ``s`` (float32, flat, >= 0 or NaN) in the root map: (uint8 codes ``[n]``, int32
    words ``(T, sh)`` ``[blocks, 2]``). ``bits``: the random bits of stochastic rounding, or None
    to round to nearest (conversions outside a step)."""
    n = s.numel()
    b = _magnitude_bits(_blocks(s))
    top = b.amax(dim=1)
    ok = top < _INF_BITS
    low = torch.where(b > 0, b, torch.full_like(b, 1 << 40)).amin(dim=1)
    low = torch.where(low == 1 << 40, top, low)
    low = torch.maximum(low, top - (_ROOT_OCTAVES << 23))
    sh = _shifts(top - low)
    if bits is None:
        r = (1 << sh) >> 1
        r = r[:, None]
    else:
        r = (_blocks(bits) >> 1) >> (31 - sh)[:, None]
    k = (top[:, None] - b + r) >> sh[:, None]
    c = 255 - torch.minimum(k, torch.full_like(k, 254))
    c = torch.where(b == 0, torch.zeros_like(c), c)
    c = torch.where(ok[:, None], c, torch.full_like(c, 255))
    words = _words(torch.where(ok, top, _NAN_WORD), torch.where(ok, sh, 0))
    return c.to(torch.uint8).reshape(-1)[:n], words


def decode_root(codes: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The roots ``s`` of uint8 root-map codes (flat) with their blocks' words."""
    n = codes.numel()
    top = _per_element(words[:, 0].to(torch.int64) & _MASK, n)
    sh = _per_element(words[:, 1].to(torch.int64), n)
    c = codes.to(torch.int64)
    x = top - ((255 - c) << sh)
    s = _bits_to_float(x.clamp(min=0))
    return torch.where(c == 0, torch.zeros_like(s), s)


def _dynamic_values() -> torch.Tensor:
    """``V[mag]`` of docs/math.md for the magnitudes 0..127 (float32, one rounding per op)."""
    mag = torch.arange(128)
    level = torch.floor(torch.log2(mag.clamp(min=1).double())).to(torch.int64)
    n = torch.where(level == 6, 63, 1 << level).to(torch.float32)
    j = (mag - (1 << level)).to(torch.float32)
    one = torch.ones(128)
    v = (one + (_full(one, 7.0) * (j + 0.5)) / n) * _bits_to_float((127 - 3 * (7 - level)) << 23)
    v[0], v[127] = 0.0, 1.0
    return v


_DYNAMIC = _dynamic_values()
_DYNAMIC_MID = (_DYNAMIC[:-1] + _DYNAMIC[1:]) * 0.5  # between magnitude c and c + 1


def encode_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, flat) in the dynamic map of base 8: (int8 codes ``[n]``, int32 words
    ``(bits(a), 0)`` ``[blocks, 2]``)."""
    n = x.numel()
    xb = _blocks(x)
    a, ok = _block_top(xb)
    xp, q = _scaled(xb.abs(), a, 1.0)
    y = xp * q[:, None]
    yb = _bits(y)
    t = (126 - (yb >> 23)).clamp(min=0) // 3
    tc = t.clamp(max=6)
    level = 6 - tc
    z = _bits_to_float(yb + ((3 * tc + 3) << 23))
    k = torch.tensor(_DYN_K, dtype=torch.float32, device=x.device)[level]
    j = torch.floor((z - 1.0) * k).to(torch.int64)
    count = torch.where(level == 6, 63, 1 << level)
    mag = (1 << level) + torch.minimum(j, count - 1)
    mag = torch.where(t >= 7, torch.zeros_like(mag), mag)
    top = (xb.abs() == a[:, None]) & (a[:, None] > 0)
    mag = torch.where(top, torch.full_like(mag, 127), mag)  # a itself (a block of zeros: 0)
    # to the nearest value: the part's mean is, within its decade; at a decade's edge the
    # neighbour's may be nearer
    mid = _DYNAMIC_MID.to(x.device)
    down = (mag >= 1) & (y < mid[(mag - 1).clamp(min=0)])
    up = (mag <= 126) & (y >= mid[mag.clamp(max=126)])
    mag = mag - down.to(mag.dtype) + up.to(mag.dtype)
    c = torch.where(xb < 0, -mag, mag)
    c = torch.where(ok[:, None], c, torch.zeros_like(c))
    words = _words(_bits(torch.where(ok, a, _full(a, float("nan")))), torch.zeros_like(t[:, 0]))
    return c.to(torch.int8).reshape(-1)[:n], words


def decode_dynamic(codes: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The values of int8 dynamic-map codes (flat) with their blocks' words."""
    n = codes.numel()
    a = _per_element(words[:, 0].contiguous().view(torch.float32), n)
    c = codes.to(torch.int64)
    y = _DYNAMIC.to(codes.device)[c.abs()] * a
    return torch.where(c < 0, -y, y)


def lamb_read8(m_state: torch.Tensor, v_state: torch.Tensor,
               n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LAMB's moments ``(m, v)`` (float32, flat) from its packed 8-bit state: ``m = d·(s + ε)``,
    ``v = s·s``."""
    wm, cm = split(m_state, n)
    wv, cv = split(v_state, n)
    d, eps = decode_direction(cm.view(torch.int8), wm)
    s = decode_root(cv, wv)
    return d * (s + eps), s * s


def lamb_write8(m: torch.Tensor, v: torch.Tensor, eps: torch.Tensor,
                bits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LAMB's updated moments (float32, flat) stored in 8 bits: (packed ``exp_avg``, packed
    ``exp_avg_sq``, the direction ``d`` as stored). ``eps``: ``ε`` (a float32 0-dim tensor);
    ``bits``: the random bits of ``v``'s rounding (None: to nearest)."""
    v = torch.where(v > _FLT_MAX, _full(v, _FLT_MAX), v)  # NaN kept
    cv, wv = encode_root(sqrt_rn(v), bits)
    s = decode_root(cv, wv)
    d = m / (s + eps.to(torch.float32))
    cm, wm = encode_direction(d, eps)
    dq, _ = decode_direction(cm, wm)
    return pack(cm, wm), pack(cv, wv), dq


def read8(state: torch.Tensor, n: int) -> torch.Tensor:
    """LARS's buffer (float32, flat) from its packed 8-bit state."""
    words, codes = split(state, n)
    return decode_dynamic(codes.view(torch.int8), words)


def write8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LARS's buffer (float32, flat) stored in 8 bits: (packed state, the values stored)."""
    codes, words = encode_dynamic(x.reshape(-1))
    return pack(codes, words), decode_dynamic(codes, words)


def pack(codes: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """A packed 8-bit tensor of codes (int8 or uint8, flat) and their blocks' words
    (``[blocks, 2]``, any 32-bit dtype)."""
    n = codes.numel()
    out = torch.zeros(packed_numel(n), dtype=torch.uint8, device=codes.device)
    w, c = split(out, n)
    w.copy_(words.reshape(-1, 2).contiguous().view(torch.int32))
    c.copy_(codes.reshape(-1).view(torch.uint8))
    return out


# Note [8-bit operators]: under torch.compile the eager step reads and writes 8-bit state, and
# draws the random bits, through torch.library operators, so that inductor runs them as the eager
# functions they are instead of fusing them into the step's kernels (uncompiled, the step calls
# the functions themselves: an operator call costs about as much as a dozen small torch ops,
# docs/performance.md). Fused, inductor's CPU code computed a per-block value broadcast to the
# elements (``x.repeat_interleave(BLOCK)[:n]``, or ``x / amax`` over blocks then flattened to
# ``n``) over the first block only when ``n`` is not a multiple of BLOCK, leaving the others
# unwritten: the trust ratio of a compiled eager step then belonged to other values than the ones
# stored. bf16 state needs no operator: its rounding is written in the integer bits
# (``bf16_grid``), which inductor keeps.
def _lamb_read8_op(m_state: torch.Tensor, v_state: torch.Tensor,
                   n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return lamb_read8(m_state, v_state, n)


def _lamb_write8_op(m: torch.Tensor, v: torch.Tensor, eps: torch.Tensor,
                    bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return lamb_write8(m.reshape(-1), v.reshape(-1), eps, bits)


def _read8_op(state: torch.Tensor, n: int) -> torch.Tensor:
    return read8(state, n)


def _write8_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return write8(x)


_lamb_read8_step = _operator(
    "fusedopt::lowp_lamb_read8", _lamb_read8_op,
    lambda m, v, n: (m.new_empty((n,), dtype=torch.float32), m.new_empty((n,), dtype=torch.float32)))
_lamb_write8_step = _operator(
    "fusedopt::lowp_lamb_write8", _lamb_write8_op,
    lambda m, v, eps, bits: (m.new_empty((packed_numel(m.numel()),), dtype=torch.uint8),
                             m.new_empty((packed_numel(m.numel()),), dtype=torch.uint8),
                             m.new_empty((m.numel(),), dtype=torch.float32)))
_read8_step = _operator("fusedopt::lowp_read8", _read8_op,
                        lambda state, n: state.new_empty((n,), dtype=torch.float32))
_write8_step = _operator("fusedopt::lowp_write8", _write8_op, lambda x: (
    x.new_empty((packed_numel(x.numel()),), dtype=torch.uint8),
    x.new_empty((x.numel(),), dtype=torch.float32)))


def step_read_lamb(m_state, v_state, shape):
    """LAMB's ``(m, v)`` of the param's ``shape`` from 8-bit state, inside a step."""
    m, v = _lamb_read8_step(m_state, v_state, shape.numel())
    return m.view(shape), v.view(shape)


def step_write_lamb(m, v, eps, bits):
    """LAMB's moments stored in 8 bits inside a step: (packed m, packed v, ``d`` of ``m``'s
    shape)."""
    ms, vs, d = _lamb_write8_step(m, v, eps, bits)
    return ms, vs, d.view(m.shape)


def step_read(state, shape):
    """LARS's buffer of the param's ``shape`` from 8-bit state, inside a step."""
    return _read8_step(state, shape.numel()).view(shape)


def step_write(x):
    """LARS's buffer stored in 8 bits inside a step: (packed state, the values stored)."""
    state, held = _write8_step(x)
    return state, held.view(x.shape)


# ----------------------------------------------------------------------- whole tensors
def _to_bf16(held: torch.Tensor) -> torch.Tensor:
    """float32 values on the bf16 grid as bfloat16, a NaN as 0x7fc0 (docs/math.md, "bf16"):
    their high 16 bits, taken in the integers (torch's vectorized conversion gives a NaN of its
    own, 0xffff on the CPU)."""
    hi = (held.view(torch.int32) >> 16).to(torch.int16)  # the low 16 bits of the shifted word
    return torch.where(held != held, 0x7FC0, hi).view(torch.bfloat16)


def write_bf16(x: torch.Tensor, bits: torch.Tensor | None = None):
    """``x`` (float32) rounded to bf16 (stochastically with ``bits``): (the bf16 tensor, the
    float32 values it holds)."""
    held = bf16_grid(x.reshape(-1), bits).view(x.shape)
    return _to_bf16(held), held


def read(state: torch.Tensor, shape: torch.Size, key: str) -> torch.Tensor:
    """The float32 values a state tensor of ``key`` holds, of the param's ``shape``: a full or
    bf16 moment's values; for 8-bit state what the key's map stores (LAMB's ``d`` and ``s``,
    LARS's buffer: docs/math.md, "8-bit")."""
    fmt = format_of(state)
    if fmt == "full":
        return state
    if fmt == "bf16":
        return state.to(torch.float32)
    words, codes = split(state, shape.numel())
    kind = MAPS[key]
    if kind == "direction":
        return decode_direction(codes.view(torch.int8), words)[0].view(shape)
    if kind == "root":
        return decode_root(codes, words).view(shape)
    return decode_dynamic(codes.view(torch.int8), words).view(shape)


def moments(states: dict[str, torch.Tensor], shape: torch.Size) -> dict[str, torch.Tensor]:
    """The float32 moments (``m``, ``v``, LARS's buffer) that a param's state tensors in any
    format hold, by key; a LAMB 8-bit ``exp_avg`` needs the 8-bit ``exp_avg_sq`` beside it."""
    out = {}
    for key, x in states.items():
        if format_of(x) != "8bit":
            out[key] = x.to(torch.float32) if format_of(x) == "bf16" else x
        elif key == "momentum_buffer":
            out[key] = read8(x, shape.numel()).view(shape)
        else:
            partner = states.get("exp_avg_sq" if key == "exp_avg" else "exp_avg")
            if partner is None or format_of(partner) != "8bit":
                raise ValueError("LAMB's 8-bit exp_avg and exp_avg_sq are read together (exp_avg "
                                 "holds m / (√v + ε)); one of them is not 8-bit")
            m, v = lamb_read8(*(states["exp_avg"], states["exp_avg_sq"]), shape.numel())
            out[key] = (m if key == "exp_avg" else v).view(shape)
    return out


def stored(values: dict[str, torch.Tensor], fmt: str, like: torch.Tensor, *,
           eps: torch.Tensor | None = None, full_dtype: torch.dtype = torch.float32):
    """Moments (float32 values by key, of ``like``'s shape) as state tensors in format ``fmt``,
    rounded to nearest (no randomness outside a step). LAMB's 8-bit state needs ``eps``, the
    ``ε`` of the param's step count (docs/math.md); where ``s + ε`` is 0 the moments are 0 and
    so is ``d``."""
    if fmt == "full":
        return {k: x.to(full_dtype).view(like.shape).clone() for k, x in values.items()}
    if fmt == "bf16":
        return {k: write_bf16(x.to(torch.float32).reshape(like.shape))[0]
                for k, x in values.items()}
    if "momentum_buffer" in values:
        return {"momentum_buffer": write8(values["momentum_buffer"].to(torch.float32))[0]}
    m = values["exp_avg"].to(torch.float32).reshape(-1)
    v = values["exp_avg_sq"].to(torch.float32).reshape(-1)
    v = torch.where(v > _FLT_MAX, _full(v, _FLT_MAX), v)
    cv, wv = encode_root(sqrt_rn(v), None)
    s = decode_root(cv, wv)
    den = s + eps.to(torch.float32)
    d = torch.where(den == 0, torch.zeros_like(m), m / den)
    cm, wm = encode_direction(d, eps)
    return {"exp_avg": pack(cm, wm), "exp_avg_sq": pack(cv, wv)}


def lamb_eps(eps: float, beta2: float, bias_correction: bool, step: float) -> torch.Tensor:
    """``ε = eps / r2`` of a LAMB tensor at step count ``step`` (float32, 0-dim), as a step
    computes it: ``r2 = 1/√(1 − β2^t)`` in float64, rounded once."""
    e = torch.tensor(eps, dtype=torch.float32)
    if not bias_correction:
        return e
    bc = 1.0 - torch.pow(torch.tensor(beta2, dtype=torch.float64), float(step))
    r2 = sqrt_rn(bc).reciprocal().to(torch.float32)
    return e / r2


# ------------------------------------------------------------ the earlier 8-bit format
# The format of fusedopt's first 8-bit state (docs/math.md names it the earlier format): one
# float32 scale per block (padded to 16 scales), E4M3 codes for m and LARS's buffer, E4M4 codes
# of √v; read only, to convert a checkpoint.
_V1_SIGNED_OFFSET, _V1_ROOT_OFFSET = (127 - 15) << 3, (127 - 15) << 4


def v1_packed_numel(n: int) -> int:
    """Bytes of the earlier format's packed tensor of ``n`` elements."""
    return 4 * (-(-n_blocks(n) // 16) * 16) + n


def v1_split(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scales and uint8 codes of the earlier format's packed tensor."""
    scales = packed[:4 * n_blocks(n)].contiguous().view(torch.float32)
    off = v1_packed_numel(n) - n
    return scales, packed[off:off + n]


def decode_v1(codes: torch.Tensor, scales: torch.Tensor, key: str) -> torch.Tensor:
    """The values of the earlier format's codes (uint8, flat) with their blocks' float32 scales:
    ``s`` for ``exp_avg_sq`` (E4M4 of √v, no zero), else E4M3 with a sign."""
    n = codes.numel()
    scale = _per_element(scales.reshape(-1).to(torch.float32), n)
    if key == "exp_avg_sq":
        return _bits_to_float((codes.to(torch.int64) + _V1_ROOT_OFFSET) << 19) * scale
    c = codes.view(torch.int8).to(torch.int64)
    mag = c.abs()
    y = torch.where(mag > 0, _bits_to_float((mag + _V1_SIGNED_OFFSET) << 20), 0.0)
    return torch.where(c < 0, -y, y) * scale


# ------------------------------------------------------------------------- state dicts
# Note [saved 8-bit state]: a state dict holds each 8-bit moment as two tensors, its codes
# (uint8, the param's shape) under the moment's key and its block words under the key +
# "_blocks" (uint8, 8 bytes per block, ``words_shape``: ``[rows, row length / BLOCK, 8]`` when
# the rows of dim 0 are whole blocks, else ``[blocks, 8]``), both views of the optimizer's packed
# tensor: live, as torch's state dicts are (one dtype, so that torch.save writes the storage once;
# ``.view(torch.int32)`` or ``.view(torch.float32)`` reads the words). The saved form is the one
# that shards: the blocks of a param whose rows are whole blocks lie in its rows, so the codes and
# words of a shard of rows are its packed state, and a checkpoint of one process and one of FSDP2
# shards (DTensors placed like the param) hold the same tensors, which
# torch.distributed.checkpoint saves, gathers and reshards as it does the param.
#
# Note [sharded 8-bit state]: a DTensor param keeps 8-bit state when its local shards are runs of
# whole blocks (``rows_hold_blocks``): every placement Replicate or Shard(0), and a row a whole
# number of blocks. The optimizer keeps the packed tensor of the local shard (a plain tensor).
BLOCKS_SUFFIX, V1_SUFFIX = "_blocks", "_scales"


def words_shape(shape: torch.Size) -> tuple[int, ...]:
    """The shape of the saved block words of an 8-bit moment of a param of ``shape`` (Note
    [saved 8-bit state])."""
    n = shape.numel()
    if len(shape) > 0 and n > 0 and (n // shape[0]) % BLOCK == 0:
        return (shape[0], n // shape[0] // BLOCK, 8)
    return (n_blocks(n), 8)


def check_words(words: torch.Tensor, key: str) -> None:
    """Raises ValueError when block words ``[blocks, 2]`` (int32) are none that the map of
    ``key`` writes (docs/math.md, "8-bit")."""
    w0 = words[:, 0].to(torch.int64) & _MASK
    w1 = words[:, 1].to(torch.int64) & _MASK
    kind = MAPS[key]
    if kind == "root":
        nan = w0 == _NAN_WORD
        bad = ((w0 >= _INF_BITS) & ~nan) | (w1 > _ROOT_SHIFTS - 1) | (nan & (w1 != 0))
        what = "a root block's words are (bits of its largest √v, a shift of at most 20)"
    else:
        # a scale: a finite value >= 0 or the NaN of a block that is not finite
        bad = ((w0 >= _INF_BITS) & (w0 != _NAN_WORD)) | (w0 >= 1 << 31)
        if kind == "direction":  # ε: finite and >= 0
            bad |= w1 >= _INF_BITS
            what = "a direction block's words are (its step f >= 0, the ε of its step >= 0)"
        else:
            bad |= w1 != 0
            what = "a dynamic-map block's words are (its largest |x| >= 0, 0)"
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"8-bit {key!r}: block {i} holds the words ({int(w0[i]):#x}, "
                         f"{int(w1[i]):#x}); {what}")


def _shards_are_runs(p: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether the local shard ``local`` of the DTensor ``p`` is a run of whole rows of dim 0 of
    the whole tensor: every placement Replicate or Shard(0), the shard contiguous."""
    return local.is_contiguous() and all(pl.is_replicate() or pl.is_shard(0)
                                         for pl in p.placements)


def rows_hold_blocks(p: torch.Tensor) -> bool:
    """Whether the local shards of the DTensor ``p`` are runs of whole rows made of whole 8-bit
    blocks (Note [sharded 8-bit state])."""
    return len(words_shape(p.shape)) == 3 and _shards_are_runs(p, p.to_local())


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


def placed(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A local state tensor of the param's shape as a DTensor placed like ``p``."""
    return _placed_like(local, p, tuple(p.shape))


def _whole_tensor_only(p: torch.Tensor, key: str) -> None:
    """Raises ValueError for a moment of the earlier 8-bit format on the DTensor ``p``: its
    blocks are the whole tensor's, which no shard's state can take."""
    if hasattr(p, "to_local"):
        raise ValueError(f"8-bit {key!r} of the earlier format cannot be placed on shards; "
                         "load it into one process with state_precision='full' first")


def saved_form(packed: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and block words of the packed 8-bit moment of ``p`` (of its local shard for a
    DTensor, then as DTensors placed like ``p``): views of ``packed`` (Note [saved 8-bit
    state])."""
    lp = p.to_local() if hasattr(p, "to_local") else p
    n = lp.numel()
    codes = packed[codes_offset(n):codes_offset(n) + n].view(lp.shape)
    words = packed[:8 * n_blocks(n)]
    shape = words_shape(p.shape)
    if not hasattr(p, "to_local"):
        return codes, words.view(shape)
    return placed(codes, p), _placed_like(words.view(lp.shape[0], shape[1], 8), p, shape)


def _local_part(t: torch.Tensor, p: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The part of the saved tensor ``t`` (a DTensor, or a whole tensor, the same on every rank)
    of shape ``shape`` that belongs to the local shard of the DTensor ``p``."""
    from torch.distributed.tensor import Replicate

    if not hasattr(t, "to_local"):
        t = type(p).from_local(t.reshape(shape).to(p.to_local().device), p.device_mesh,
                               [Replicate()] * p.device_mesh.ndim, run_check=False)
    if t.device_mesh != p.device_mesh or t.placements != p.placements:
        t = t.redistribute(p.device_mesh, p.placements)
    return t.to_local()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def saved_moment(saved: dict, key: str, p: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """The 8-bit moment ``key`` of ``p`` (of its local shard for a DTensor) in the saved state
    ``saved`` of one param: ``("8bit", packed)`` from its codes and block words, checked;
    ``("v1", values)``, the float32 values (``s`` for ``exp_avg_sq``) of a moment of the earlier
    format (codes and ``_scales``, or its packed tensor); None where ``saved[key]`` is no 8-bit
    moment. Raises ValueError naming what does not fit ``p``."""
    value = saved.get(key)
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8):
        return None
    lp = p.to_local() if hasattr(p, "to_local") else p
    device = lp.device
    if key + BLOCKS_SUFFIX in saved:
        words = saved[key + BLOCKS_SUFFIX]
        shape = words_shape(p.shape)
        if not isinstance(words, torch.Tensor) or words.dtype != torch.uint8:
            raise TypeError(f"8-bit {key!r}: its block words {key + BLOCKS_SUFFIX!r} must be a "
                            "uint8 tensor (8 bytes per block), got "
                            + (str(words.dtype) if isinstance(words, torch.Tensor)
                               else type(words).__name__))
        if tuple(value.shape) != tuple(p.shape) or tuple(words.shape) != shape:
            raise ValueError(f"8-bit {key!r}: codes of shape {tuple(value.shape)} and block words "
                             f"of shape {tuple(words.shape)} do not fit a param of shape "
                             f"{tuple(p.shape)} (expected {tuple(p.shape)} and {shape})")
        if hasattr(p, "to_local"):
            if not rows_hold_blocks(p):
                raise ValueError("8-bit state saved for a param whose shards are not whole 8-bit "
                                 "blocks cannot be placed on its shards; load it with "
                                 "state_precision='full' on one process first")
            codes = _local_part(value, p, tuple(p.shape))
            words = _local_part(words, p, shape)
        else:
            codes, words = _whole(value), _whole(words)
        words = words.to(device).contiguous().view(torch.int32).view(-1, 2)
        check_words(words, key)
        return "8bit", pack(codes.reshape(-1).to(device), words)
    if key + V1_SUFFIX in saved:
        scales = saved[key + V1_SUFFIX]
        if not isinstance(scales, torch.Tensor) or not scales.is_floating_point():
            raise TypeError(f"8-bit {key!r} of the earlier format: its scales "
                            f"{key + V1_SUFFIX!r} must be a float tensor")
        if tuple(value.shape) != tuple(p.shape) or scales.numel() != n_blocks(p.numel()):
            raise ValueError(f"8-bit {key!r} of the earlier format: codes of shape "
                             f"{tuple(value.shape)} with {scales.numel()} scales do not fit a "
                             f"param of shape {tuple(p.shape)} (expected {n_blocks(p.numel())} "
                             "scales)")
        _whole_tensor_only(p, key)
        codes, scales = _whole(value), _whole(scales)
        return "v1", decode_v1(codes.reshape(-1).to(device), scales.to(device), key).view(lp.shape)
    n = p.numel()
    if value.dim() != 1 or value.numel() != v1_packed_numel(n):
        raise ValueError(f"the 8-bit {key!r} is {tuple(value.shape)} bytes without "
                         f"{key + BLOCKS_SUFFIX!r}; expected codes of the param's shape "
                         f"{tuple(p.shape)} and block words, or the {v1_packed_numel(n)} packed "
                         "bytes of the earlier format")
    _whole_tensor_only(p, key)
    scales, codes = v1_split(_whole(value).to(device), n)
    return "v1", decode_v1(codes, scales, key).view(lp.shape)
