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
# the same names in csrc/fusedopt/math.h, whose cpp backend these equal bit for bit under the
# interpreter. Everything is float32 with one rounding per operation in the order written (the
# launcher compiles with fp fusion off, so no multiply-add is contracted: Note [no FMA] in
# kernels/tables.py) and integer operations on float32 bit patterns; the hash is uint32
# arithmetic (wrapping multiplies). Codes travel as int32 between these functions.
QBLOCK: tl.constexpr = tl.constexpr(256)  # elements per 8-bit block (kQBlock)
SIGNED_OFFSET: tl.constexpr = tl.constexpr((127 - 15) << 3)  # 896, E4M3 (kSignedOffset)
ROOT_OFFSET: tl.constexpr = tl.constexpr((127 - 15) << 4)  # 1792, E4M4 (kRootOffset)


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
    """``bits(e)`` of the element ``e`` (int64 index in its tensor, taken mod 2^32)."""
    return mix32(base ^ e.to(tl.uint32))


@triton.jit
def float_bits(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def bits_float(u):
    return u.to(tl.float32, bitcast=True)


@triton.jit
def bf16_rne(x):
    """The bf16 bits (in a uint32) of float32 ``x`` rounded to nearest even; NaN gives 0x7fc0."""
    u = float_bits(x)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, tl.full((), 0x7FC0, tl.uint32), r)


@triton.jit
def bf16_stochastic(x, bits):
    """The bf16 bits of ``x`` rounded stochastically: the float32 bits plus ``bits >> 16``, the
    low 16 dropped; inf and NaN rounded to nearest (kept)."""
    u = float_bits(x)
    r = (u + (bits >> 16)) >> 16
    return tl.where((u & 0x7F800000) == 0x7F800000, bf16_rne(x), r)


@triton.jit
def bf16_value(h):
    """The float32 value of bf16 bits ``h`` (uint16 or uint32)."""
    return bits_float(h.to(tl.uint32) << 16)


@triton.jit
def _div_const(a, c: tl.constexpr):
    return ieee_div(a, tl.full(a.shape, c, tl.float32))


@triton.jit
def _const_div(c: tl.constexpr, a):
    """``c / a`` where ``a > 0``, else 0 (math.h's q8_*_factor; no division by 0 is evaluated)."""
    pos = a > 0.0
    return tl.where(pos, ieee_div(tl.full(a.shape, c, tl.float32), tl.where(pos, a, 1.0)), 0.0)


@triton.jit
def q8_signed_scale(a):
    return _div_const(a, 1.875)


@triton.jit
def q8_signed_factor(a):
    return _const_div(1.875, a)


@triton.jit
def q8_root_scale(s_max):
    return _div_const(s_max, 1.9375)


@triton.jit
def q8_root_factor(s_max):
    return _const_div(1.9375, s_max)


@triton.jit
def q8_signed_code(x, q):
    """E4M3 code (int32 in [-127, 127]) of ``x`` with the block's factor ``q``, to nearest even."""
    b = float_bits(tl.abs(x) * q)
    t = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20).to(tl.int32) - SIGNED_OFFSET
    c = tl.where(t < 0, 0, tl.where(t > 127, 127, t))
    return tl.where(x < 0.0, -c, c)


@triton.jit
def q8_signed_value(code, f):
    """The value of an E4M3 code (int32) with the block's scale ``f``."""
    c = tl.where(code < 0, -code, code)
    y = tl.where(c == 0, 0.0, bits_float(((c + SIGNED_OFFSET) << 20).to(tl.uint32)))
    return tl.where(code < 0, -y, y) * f


@triton.jit
def q8_root_code(s, q, bits):
    """E4M4 code (int32 in [0, 255]) of ``s = sqrt(v)`` with the block's factor ``q``, rounded
    stochastically with the random ``bits``."""
    b = float_bits(s * q)
    t = ((b + (bits >> 13)) >> 19).to(tl.int32) - ROOT_OFFSET
    return tl.where(t < 0, 0, tl.where(t > 255, 255, t))


@triton.jit
def q8_root_value(c, f):
    """The square root ``s`` that an E4M4 code (int32) stores with the block's scale ``f``."""
    return bits_float(((c + ROOT_OFFSET) << 19).to(tl.uint32)) * f


@triton.jit
def block_top(x):
    """Per 8-bit block of ``x`` (``[ROWS, NB, QBLOCK]``, lanes outside the tensor 0): the largest
    ``|x|`` and whether every value is finite (``[ROWS, NB]``), as math.h's block_top."""
    a = tl.abs(x)
    bad = ((x != x) | (a == float("inf"))).to(tl.int32)
    return tl.max(a, 2), tl.max(bad, 2) == 0


@triton.jit
def q8_signed_block(top, ok):
    """Scales ``f`` and factors ``q`` of the signed map for blocks whose largest ``|x|`` is
    ``top`` and that are all finite where ``ok``: a block that is not finite gets the scale NaN
    and the factor 0 (the caller writes its codes as 0)."""
    f = tl.where(ok, q8_signed_scale(top), float("nan"))
    q = tl.where(ok, q8_signed_factor(top), 0.0)
    return f, q


@triton.jit
def q8_root_block(top, ok):
    """The same for the square-root map, ``top`` the block's largest ``v`` (not ``s``)."""
    s_top = ieee_sqrt(top)
    f = tl.where(ok, q8_root_scale(s_top), float("nan"))
    q = tl.where(ok, q8_root_factor(s_top), 0.0)
    return f, q
