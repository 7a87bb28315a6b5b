"""Per-element LAMB and LARS math for the Triton kernels: the Triton statement of docs/math.md.

The functions carry the names of ``csrc/fusedopt/math.h`` (and of the eager backend) and compute
the same expressions in the same order, so the backends agree to the last bit wherever the
hardware rounds the same way. Symbols: ``w`` weight, ``g`` gradient (already times grad_mult),
``m``, ``v`` LAMB moments, ``v`` LARS momentum buffer, ``t`` step count, ``λ`` weight decay,
``κ`` trust coefficient, ``μ`` momentum. Every value is in the compute dtype (float32, or float64
for float64 params) except :func:`bias_correction`, which runs in float64.

Note [IEEE division and square root]: on NVIDIA GPUs Triton lowers a float32 ``/`` to
``div.full.f32`` and ``tl.sqrt`` to ``sqrt.approx.f32`` (a few ulp off); the eager and C++
backends round correctly, so float32 math goes through ``tl.div_rn`` / ``tl.sqrt_rn``. Float64
``/`` and ``tl.sqrt`` are already correctly rounded (and ``div_rn``/``sqrt_rn`` accept only
float32).

Note [float64 scalars]: hyper-parameters arrive as float64 kernel arguments (``tl.float64``
annotation; a plain Python float would be passed as float32) and are rounded to the compute
dtype once with ``tl.full((), x, CD)``, as math.h's ``T(h.beta1)`` does. ``tl.full`` rather
than ``tl.cast`` because under ``TRITON_INTERPRET=1`` a kernel argument stays a Python float, which
``tl.cast`` would first round to float32; ``tl.full`` builds the constant in the target dtype.
"""
import triton
import triton.language as tl


@triton.jit
def ieee_div(a, b):
    """Correctly rounded ``a / b`` (Note [IEEE division and square root])."""
    if a.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def ieee_sqrt(x):
    """Correctly rounded ``sqrt(x)`` (Note [IEEE division and square root])."""
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def bias_correction(beta, t):
    """``1 - β^t`` in float64 from the float32 step ``t``.

    ``β^t = exp2(t·log2 β)`` in float64 (Triton has no portable ``pow``; the interpreter lacks
    libdevice): within a few float64 ulp of ``pow``, so the factors derived from it match
    functional.bias_correction after rounding to float32. ``β = 0`` gives ``exp2(-inf) = 0``, as
    ``pow(0, t)`` for ``t >= 1``.
    """
    b = tl.full((), beta, tl.float64)
    return 1.0 - tl.exp2(t.to(tl.float64) * tl.log2(b))


@triton.jit
def zero_norm_rule(w_norm, other_norm, ratio):
    """Note [zero-norm rule] of math.h: the trust ratio is exactly 1 when ``‖w‖`` or the other
    norm of its formula (``‖u‖`` for LAMB, the gradient norm for LARS) is 0; a NaN norm gives a
    NaN ratio (Note [NaN propagation] of math.h)."""
    return tl.where((w_norm == 0) | (other_norm == 0), 1.0, ratio).to(ratio.dtype)


@triton.jit
def clamp_keep_nan(x, lo, hi):
    """``x`` clamped to ``[lo, hi]``, NaN kept (Note [NaN propagation] of math.h): the comparisons
    of math.h's ternaries, not ``tl.minimum``/``tl.maximum``, which compile to NaN-dropping
    ``minnum``/``maxnum``."""
    return tl.where(x < lo, lo, tl.where(x > hi, hi, x))


# ------------------------------------------------------------------------------------- LAMB


@triton.jit
def lamb_coef(t, beta1, beta2, beta3, one_minus_beta2, eps, lambda_in_u, CD: tl.constexpr,
              corrected):
    """math.h's LambCoef: the LAMB scalars of step ``t`` in CD, ``(β1, β2, β3, 1-β2, eps, r1, r2,
    λ_u)``; ``r1 = 1/(1 - β1^t)`` and ``r2 = 1/sqrt(1 - β2^t)`` (1 when ``corrected``, the
    runtime bias-correction flag, is False: Note [bias-correction factors] of math.h) are
    computed in float64 with the shape of ``t``; ``λ_u`` is λ, or 0 for decoupled weight decay."""
    r1 = tl.where(corrected, 1.0 / bias_correction(beta1, t), 1.0).to(CD)
    r2 = tl.where(corrected, 1.0 / tl.sqrt(bias_correction(beta2, t)), 1.0).to(CD)
    return (tl.full((), beta1, CD), tl.full((), beta2, CD), tl.full((), beta3, CD),
            tl.full((), one_minus_beta2, CD), tl.full((), eps, CD), r1, r2,
            tl.full((), lambda_in_u, CD))


@triton.jit
def lamb_moments(g, m, v, beta1, beta2, beta3, one_minus_beta2):
    """``m ← β1·m + β3·g``,  ``v ← β2·v + (1-β2)·g²``; returns ``(m, v)``."""
    m = beta1 * m + beta3 * g
    v = beta2 * v + one_minus_beta2 * g * g
    return m, v


@triton.jit
def lamb_direction(w, m, v, r1, r2, eps, lambda_in_u):
    """``u = m̂ / (sqrt(v̂) + eps) + λ·w`` evaluated as ``(m·r1) / (sqrt(v)·r2 + eps) + λ·w``
    (Note [bias-correction factors] of math.h: one division and one root per element).

    ``lambda_in_u`` is λ, or 0 for decoupled weight decay. Pass 1 (for ``‖u‖²``) and pass 2 (for
    the update) call this with the same arguments, so both see the same ``u``.
    """
    return lamb_direction_s(w, m, ieee_sqrt(v), r1, r2, eps, lambda_in_u)


@triton.jit
def lamb_direction_s(w, m, s, r1, r2, eps, lambda_in_u):
    """:func:`lamb_direction` with ``s = sqrt(v)`` given (8-bit state stores ``s``)."""
    return ieee_div(m * r1, s * r2 + eps) + lambda_in_u * w


@triton.jit
def lamb_trust_ratio(w_sq, u_sq, ratio_lo, ratio_hi, adapt, bounded):
    """``φ = ‖w‖ / ‖u‖`` (zero-norm rule), clamped to ``[ratio_lo, ratio_hi]`` when ``bounded``;
    1 when not ``adapt`` (runtime bools: the ratio is per row)."""
    w_n = ieee_sqrt(w_sq)
    u_n = ieee_sqrt(u_sq)
    phi = zero_norm_rule(w_n, u_n, ieee_div(w_n, u_n))
    phi = tl.where(bounded, clamp_keep_nan(phi, ratio_lo, ratio_hi), phi)
    return tl.where(adapt, phi, 1.0).to(w_sq.dtype)


@triton.jit
def lamb_apply(w, u, lr_phi, decay):
    """``w ← w·decay − lr_phi·u`` with ``decay = 1 − lr·λ`` (decoupled) or 1, ``lr_phi = lr·φ``."""
    return w * decay - lr_phi * u


# ------------------------------------------------------------------------------------- LARS


@triton.jit
def lars_trust_ratio(w_sq, g_sq, kappa, lam, eps, adapt, combined, trust_clip):
    """``κ‖w‖ / (‖g‖ + λ‖w‖ + eps)``, or ``κ‖w‖ / (‖g + λw‖ + eps)`` when ``combined`` (``g_sq``
    is then ``‖g + λw‖²``); zero-norm rule on ``‖w‖`` and the gradient norm; ``min(ratio, 1)`` when
    ``trust_clip``; 1 when not ``adapt`` (runtime bools: the ratio is per row)."""
    w_n = ieee_sqrt(w_sq)
    g_n = ieee_sqrt(g_sq)
    den = tl.where(combined, g_n + eps, g_n + lam * w_n + eps)
    ratio = zero_norm_rule(w_n, g_n, ieee_div(kappa * w_n, den))
    ratio = tl.where(trust_clip & (ratio > 1.0), 1.0, ratio)  # NaN kept
    return tl.where(adapt, ratio, 1.0).to(w_sq.dtype)


@triton.jit
def lars_coef(t, lr, momentum, one_minus_dampening, CD: tl.constexpr, lr_in_momentum):
    """math.h's LarsCoef for steps ``t``: ``(μ, keep, add)`` in CD, ``keep``/``add`` with the shape
    of ``t``: ``(μ, lr)`` when ``lr_in_momentum``, else ``(μ, 1 - dampening)``, or ``(0, 1)`` on
    the first step (torch SGD starts the buffer as ``d``). ``lr`` is already in CD."""
    mu = tl.full((), momentum, CD)
    first = t == 1.0
    keep = tl.where(lr_in_momentum, mu, tl.where(first, 0.0, mu)).to(CD)
    add = tl.where(lr_in_momentum, lr, tl.where(first, 1.0, tl.full((), one_minus_dampening, CD))).to(CD)
    return mu, keep, add


@triton.jit
def lars_direction(w, g, ratio, lam):
    """``d = ratio·(g + λw)``."""
    return ratio * (g + lam * w)


@triton.jit
def lars_buffer(d, v, keep, add):
    """The new buffer ``keep·v + add·d``."""
    return keep * v + add * d


@triton.jit
def lars_step(w, d, v, lr, mu, nesterov, lr_in_momentum):
    """``w − step`` from ``d`` and the buffer ``v`` as stored, where

    * ``lr_in_momentum``: ``step = v`` (``nesterov``: ``lr·d + μ·v``);
    * otherwise: ``step = lr·v`` (``nesterov``: ``lr·(d + μ·v)``).

    ``nesterov`` and ``lr_in_momentum`` are runtime bools, the same for every program: the
    branches are uniform (Note [runtime flags] in kernels/tables.py).
    """
    if lr_in_momentum:
        if nesterov:
            step = lr * d + mu * v
        else:
            step = v
    else:
        if nesterov:
            step = lr * (d + mu * v)
        else:
            step = lr * v
    return w - step


@triton.jit
def lars_apply(w, g, v, ratio, lam, lr, mu, keep, add, nesterov, lr_in_momentum):
    """:func:`lars_direction`, :func:`lars_buffer` and :func:`lars_step`: returns
    ``(w − step, v)`` with the new buffer ``v`` (full-precision state). ``keep = μ``, ``add = lr``
    when ``lr_in_momentum``; otherwise ``keep = μ`` and ``add = 1 − dampening``, or ``keep = 0``,
    ``add = 1`` on the first step (torch SGD)."""
    d = lars_direction(w, g, ratio, lam)
    v = lars_buffer(d, v, keep, add)
    return lars_step(w, d, v, lr, mu, nesterov, lr_in_momentum), v


# ----------------------------------------------------------------------- low-precision state
# Note [state formats in the kernels]: docs/math.md, "Low-precision state", and the functions of
# the same names in csrc/fusedopt/math.h (Note [8-bit maps] there), whose cpp backend these equal
# bit for bit under the interpreter. Everything is float32 with one rounding per operation in the
# order written (the launcher compiles with fp fusion off, so no multiply-add is contracted: Note
# [no FMA] in kernels/tables.py) and integer operations on float32 bit patterns; the hash is
# uint32 arithmetic (wrapping multiplies). Codes travel as int32 between these functions, and a
# block's two words (w0, w1) as int32 bit patterns. The kernels evaluate every lane of a tile
# (selects, not branches), so a value a lane does not keep is made harmless before it reaches a
# float-to-int conversion (a block that is not finite is coded from zeros, as math.h's callers
# do).
QBLOCK: tl.constexpr = tl.constexpr(256)  # elements per 8-bit block (kQBlock)
WEYL: tl.constexpr = tl.constexpr(0x9E3779B9)  # bits(e) = base + e*WEYL (kWeyl)
NAN_WORD: tl.constexpr = tl.constexpr(0x7FC00000)  # kNanWord
INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)  # kInfBits
TINY: tl.constexpr = tl.constexpr(2.0 ** -64)  # kTiny: below it a block is prescaled
PRESCALE: tl.constexpr = tl.constexpr(2.0 ** 64)  # kPrescale
ROOT_RANGE: tl.constexpr = tl.constexpr(24 << 23)  # kRootRange: the root map's 24 octaves
ROOT_SHIFTS: tl.constexpr = tl.constexpr(21)  # kRootShifts: 254 << 20 covers ROOT_RANGE
ROUND_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + it) - it is rint(y)
ONE_SEVENTH_BITS: tl.constexpr = tl.constexpr(0x3E124925)  # float32(1/7)


@triton.jit
def mix32(x):
    """docs/math.md's ``mix`` of uint32 ``x``."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x21F0AAAD, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x735A2D97, tl.uint32)
    return x ^ (x >> 15)


@triton.jit
def sr_base(t, key):
    """The per-tensor base of the random bits of step ``t`` (float32, after the increment) for
    the tensor's ``key`` (int64; its low 32 bits count)."""
    ti = t.to(tl.int64).to(tl.uint32)
    return mix32(mix32(tl.full((), 0x9E3779B9, tl.uint32) ^ ti) ^ key.to(tl.uint32))


@triton.jit
def sr_bits(base, e):
    """``bits(e) = base + e·0x9e3779b9`` (mod 2^32) of the element ``e`` (int64 index in its
    tensor, taken mod 2^32): a Weyl sequence from the hashed base (docs/math.md, "Random bits")."""
    return base + e.to(tl.uint32) * tl.full((), WEYL, tl.uint32)


@triton.jit
def float_bits(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def bits_float(u):
    return u.to(tl.float32, bitcast=True)


@triton.jit
def magnitude_bits(x):
    """The bit pattern of ``|x|`` (int32, >= 0): for magnitudes the order of the patterns is the
    values', and only inf and NaN lie at INF_BITS or above."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def bf16_rne(x):
    """The bf16 bits (in a uint32) of float32 ``x`` rounded to nearest even; every NaN (any sign
    or payload) gives 0x7fc0."""
    u = float_bits(x)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, tl.full((), 0x7FC0, tl.uint32), r)


@triton.jit
def bf16_stochastic(x, bits):
    """The bf16 bits of ``x`` rounded stochastically: the float32 bits plus ``bits >> 16``, the
    low 16 dropped; inf and NaN rounded to nearest (inf kept, NaN 0x7fc0)."""
    u = float_bits(x)
    r = (u + (bits >> 16)) >> 16
    return tl.where((u & 0x7F800000) == 0x7F800000, bf16_rne(x), r)


@triton.jit
def bf16_value(h):
    """The float32 value of bf16 bits ``h`` (uint16 or uint32)."""
    return bits_float(h.to(tl.uint32) << 16)


@triton.jit
def lamb_coef8(eps, r1, r2):
    """math.h's LambCoef ``(eps8, c8) = (eps / r2, r1 / r2)`` of 8-bit state (``eps`` the float32
    eps, ``r1``, ``r2`` per row), one division each."""
    return ieee_div(tl.broadcast_to(eps, r2.shape), r2), ieee_div(r1, r2)


@triton.jit
def block_top(x):
    """Per 8-bit block of ``x`` (``[ROWS, NB, QBLOCK]``, lanes outside the block 0): the largest
    ``|x|`` (from the largest bit pattern, as math.h's block_top) and whether every value is
    finite (``[ROWS, NB]``)."""
    top = tl.max(magnitude_bits(x), 2)
    return bits_float(top), top < INF_BITS


@triton.jit
def q8_scaling(a, C: tl.constexpr):
    """math.h's q8_scaling: the prescale ``P`` (2^64 below 2^-64, else 1) and the factor
    ``q = C / (a·P)`` (0 where ``a`` is not > 0: no division by 0 is evaluated) of blocks whose
    largest magnitude is ``a``."""
    p = tl.where(a < TINY, PRESCALE, 1.0)
    pos = a > 0.0
    q = tl.where(pos, ieee_div(tl.full(a.shape, C, tl.float32), tl.where(pos, a * p, 1.0)), 0.0)
    return p, q


@triton.jit
def q8_direction_step(a):
    """The linear map's scale ``f = a / 127``."""
    return ieee_div(a, tl.full(a.shape, 127.0, tl.float32))


@triton.jit
def q8_direction_code(y, q):
    """The linear code (int32) of ``y = d·P`` with the block's factor ``q``: ``rint(y·q)``, half
    to even, by adding and subtracting 1.5·2^23 (``|y·q|`` rounds to at most 127: no clamp)."""
    return (((y * q) + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int32)


@triton.jit
def q8_direction_value(code, f):
    return code.to(tl.float32) * f


@triton.jit
def q8_saturate(v):
    """``v >= 0`` saturated at the largest float32 (NaN kept): +inf becomes its neighbour below."""
    b = float_bits(v)
    return bits_float(b - (b == INF_BITS).to(tl.uint32))


@triton.jit
def root_words(s):
    """The root map's words of each block of roots ``s`` (``[ROWS, NB, QBLOCK]``, lanes outside
    the block 0; math.h's root_words and q8_root_shift): ``T`` (the largest bit pattern) and the
    shift ``sh``, the smallest ``k`` with ``T - L <= 254·2^k`` (``L`` the smallest nonzero
    pattern, ``T`` when there is none, raised to ``T - ROOT_RANGE`` when it lies lower), as
    int32 ``[ROWS, NB]``, and whether the block is finite (its words are then (NAN_WORD, 0),
    which the caller stores)."""
    b = magnitude_bits(s)
    top = tl.max(b, 2)
    low = tl.min(tl.where(b == 0, 0x7FFFFFFF, b), 2)  # 0x7fffffff: none (a NaN pattern)
    low = tl.where(low == 0x7FFFFFFF, top, low)
    low = tl.where(top - low > ROOT_RANGE, top - ROOT_RANGE, low)
    span = top - low
    sh = tl.zeros_like(span)
    for k in tl.static_range(ROOT_SHIFTS - 1):  # math.h's loop: the thresholds grow with k
        sh += (span > (254 << k)).to(tl.int32)
    return top, sh, top < INF_BITS


@triton.jit
def q8_root_stochastic(bits, sh):
    """The rounding term of a step: the top ``sh`` bits of the random ``bits`` (uint32)."""
    return (bits >> 1) >> (31 - sh.to(tl.uint32))


@triton.jit
def q8_root_code(s, top, sh, rnd):
    """The root code (int32 in [0, 255]) of ``s >= 0`` in a block of words ``(top, sh)`` with the
    rounding term ``rnd`` (uint32): 0 for ``s = 0``, else ``255 - min((T - bits(s) + rnd) >> sh,
    254)``, in uint32 arithmetic as math.h."""
    b = magnitude_bits(s).to(tl.uint32)
    k = (top.to(tl.uint32) - b + rnd) >> sh.to(tl.uint32)
    c = 255 - tl.where(k < 254, k, 254)
    return tl.where(b != 0, c, 0).to(tl.int32)


@triton.jit
def q8_root_value(c, top, sh):
    """The root ``s`` that code ``c`` (int32) stores in a block of words ``(top, sh)`` (int32):
    0 for code 0, else the float of bits ``T - ((255 - c) << sh)``, 0 below 0 (NaN where ``T`` is
    NAN_WORD and the code 255)."""
    x = top - ((255 - c) << sh)
    return tl.where(c != 0, bits_float(tl.where(x > 0, x, 0)), 0.0)


@triton.jit
def q8_dynamic_code(x, p, q, top):
    """math.h's q8_dynamic_code: the dynamic-map code (int32 in [-127, 127]) of ``x`` (finite)
    in a block with prescale ``p``, factor ``q = 1/(a·p)`` and ``top`` the bit pattern of its
    largest magnitude ``a`` (int32): 127 for ``|x| = a``, else the part of its decade that holds
    ``y = (|x|·p)·q``, then moved to the neighbour whose value is nearer to ``y`` where one is
    (the midpoints ``M[c] = (V[c] + V[c + 1])·0.5`` of math.h's q8_dynamic_mid)."""
    xb = magnitude_bits(x)
    y = (bits_float(xb) * p) * q
    yb = float_bits(y)
    e = (yb >> 23).to(tl.int32)
    d = tl.where(e > 126, 0, 126 - e)
    t = (d * 171) >> 9  # d / 3 for d < 384
    t = tl.where(t > 6, 6, t)
    level = 6 - t
    count = tl.where(level == 6, 63, 1 << level)
    z = bits_float(yb + ((3 * t + 3) << 23).to(tl.uint32))  # y·8^(t+1), in [1, 8)
    # K[L] = float32(n / 7): 9 for n = 63, else float32(1/7)·2^L
    k = tl.where(level == 6, 9.0, bits_float(((level << 23) + ONE_SEVENTH_BITS).to(tl.uint32)))
    j = ((z - 1.0) * k).to(tl.int32)
    j = tl.where(j < count - 1, j, count - 1)
    mag = (1 << level) + j
    mag = tl.where(e < 106, 0, mag)  # y < 2^-21 = 8^-7
    # the block's largest |x| itself (y may round below 1); a block of zeros stores 0
    mag = tl.where((xb == top) & (top != 0), 127, mag)
    # to the nearest value: M[lo] = M[mag - 1] below mag, M[hi] = M[mag] above it (the same
    # midpoint at either end of the map, where only one neighbour exists)
    lo = tl.where(mag >= 1, mag - 1, 0)
    hi = tl.where(mag <= 126, mag, 126)
    u0 = q8_dynamic_unit(lo)
    u1 = q8_dynamic_unit(lo + 1)
    mid_lo = (u0 + u1) * 0.5
    mid_hi = tl.where(hi == lo, mid_lo, (u1 + q8_dynamic_unit(hi + 1)) * 0.5)
    down = (mag >= 1) & (y < mid_lo)
    up = (mag <= 126) & (y >= mid_hi)
    mag = mag - down.to(tl.int32) + up.to(tl.int32)
    return tl.where(x < 0.0, -mag, mag)


@triton.jit
def q8_dynamic_unit(mag):
    """``V[mag]`` of the dynamic map for magnitudes ``mag`` (int32 in [0, 127]; math.h's
    q8_dynamic_unit, evaluated per element: float32, one rounding per operation; V[0] = 0,
    V[127] = 1)."""
    m = tl.where(mag > 1, mag, 1)
    level = (float_bits(m.to(tl.float32)) >> 23).to(tl.int32) - 127  # floor(log2(mag)), exact
    level = tl.where(level < 6, level, 6)
    count = tl.where(level == 6, 63.0, (1 << level).to(tl.float32))
    j = (m - (1 << level)).to(tl.float32)
    frac = ieee_div(7.0 * (j + 0.5), count)
    octave = bits_float(((127 - 3 * (7 - level)) << 23).to(tl.uint32))
    unit = (1.0 + frac) * octave
    return tl.where(mag <= 0, 0.0, tl.where(mag >= 127, 1.0, unit))


@triton.jit
def q8_dynamic_value(code, a):
    """The value of a dynamic-map code (int32) in a block whose largest magnitude is ``a``."""
    c = tl.where(code < 0, -code, code)
    c = tl.where(c > 127, 127, c)
    y = q8_dynamic_unit(c) * a
    return tl.where(code < 0, -y, y)
