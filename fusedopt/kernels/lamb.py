"""LAMB's two launches (docs/math.md, NVLAMB form) over a bucket's tables (kernels/tables.py).

Pass 1 (``lamb_pass1_kernel``), per element, with ``t`` the new step count::

    m ← β1·m + β3·g,  v ← β2·v + (1-β2)·g²          (stored)
    u = m̂ / (sqrt(v̂) + eps) + λ·w                     (not stored)
    sums[i] = (Σ w², Σ u²)                             (Note [two-stage norms] in common.py)

Pass 2 (``lamb_pass2_kernel``) recomputes ``u`` from the stored ``w, m, v`` and the stored step
count, takes ``φ`` from ``sums`` (which may have been all-reduced in between) and writes
``w ← w·decay − lr·φ·u`` to the weight (the fp32 master, and the param rounded to nearest even).
Memory traffic per element: pass 1 reads w, g, m, v and writes m, v; pass 2 reads w, m, v and
writes w: docs/math.md's 40 bytes for float32.

Low-precision state (docs/math.md, "Low-precision state"; Note [state formats in the tables] in
kernels/tables.py): with float32 compute, a program with a bf16 or 8-bit row runs the tiles of
``_pass1_lowp`` / ``_pass2_lowp``, which hold whole 8-bit blocks (``[ROWS, BLOCK // 256, 256]``)
and run each format present among the program's rows: pass 1 reads the stored moments, updates
them in float32, stores them rounded to the format (``v`` stochastically, with the random bits of
the tensor's step count and key) and takes ``u`` from the values it stored; pass 2 takes ``u``
from the same stored values (csrc/cpu/kernels.h's ``lamb_pass{1,2}_chunk_{bf16,q8}``). 8-bit state
holds the direction ``d = m / (s + ε)`` in ``exp_avg`` and the root ``s = sqrt(v)`` in
``exp_avg_sq`` (Note [8-bit maps] in csrc/fusedopt/math.h), so ``u = c8·d + λ·w`` and pass 2
reads ``exp_avg`` alone.

Hyper-parameters are float64 runtime arguments (Note [float64 scalars] in math.py) and the
variant flags bits of the runtime ``flags`` (Note [runtime flags] in kernels/tables.py);
constexprs are structural only: dtypes, whether fp32 masters exist, alignment, tile sizes.
"""
import triton
import triton.language as tl

from .math import (
    NAN_WORD, QBLOCK, bf16_rne, bf16_stochastic, bf16_value, bits_float, block_top, float_bits,
    ieee_div, ieee_sqrt, lamb_apply, lamb_coef, lamb_coef8, lamb_direction, lamb_moments,
    lamb_trust_ratio, q8_direction_code, q8_direction_step, q8_direction_value, q8_root_code,
    q8_root_stochastic, q8_root_value, q8_saturate, q8_scaling, root_words, sr_base, sr_bits,
)
from .common import (
    ADAPT, BIAS_CORRECTION, BOUNDED, FORMAT, GRAD, KEY, LR_TENSOR, MASTER, OUT, PARAM, PASS_KERNEL,
    STATE0, STATE1, STEP, any_row, chunks_of, finish_rows, flag, format_rows, load_tile, masked_sq,
    round_to, state_ptrs, tensor_ptrs, tile_lanes, tile_mask, tile_range, tiles3,
)


@triton.jit
def _pass1_tile(w_ptr, g_ptr, m_ptr, v_ptr, mask, gm, beta1, beta2, beta3, one_minus_beta2,
                r1, r2, eps, lambda_in_u, CD: tl.constexpr):
    """One tile of pass 1; returns its ``(w², u²)`` (0 outside ``mask``; None: a full tile).
    Masked-off lanes load 0, so their w² is 0; their u is 0/eps, or NaN when eps = 0."""
    w = load_tile(w_ptr, mask).to(CD)
    g = load_tile(g_ptr, mask).to(CD) * gm
    m = load_tile(m_ptr, mask)
    v = load_tile(v_ptr, mask)
    m, v = lamb_moments(g, m, v, beta1, beta2, beta3, one_minus_beta2)
    tl.store(m_ptr, m, mask=mask)
    tl.store(v_ptr, v, mask=mask)
    u = lamb_direction(w, m, v, r1, r2, eps, lambda_in_u)
    return w * w, masked_sq(u, mask)


@triton.jit
def _pass1_full(w_ptr, g_ptr, m_ptr, v_ptr, n, gm, b1, b2, b3, omb2, r1, r2, eps, lam,
                CD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 over the program's chunks with full state: the rows' ``(Σw², Σu²)``. ``r1``, ``r2``:
    ``[ROWS, 1]``."""
    cols = tl.arange(0, BLOCK)[None, :]
    acc_w = tl.full([ROWS, BLOCK], 0.0, CD)
    acc_u = tl.full([ROWS, BLOCK], 0.0, CD)
    for phase in tl.static_range(2):  # Note [whole tiles] in common.py
        lo, hi = tile_range(phase, n, BLOCK)
        for off in range(lo, hi, BLOCK):
            o = off + cols
            sw, su = _pass1_tile(w_ptr + o, g_ptr + o, m_ptr + o, v_ptr + o,
                                 tile_lanes(phase, o, n), gm, b1, b2, b3, omb2, r1, r2, eps, lam,
                                 CD)
            acc_w += sw
            acc_u += su
    return tl.sum(acc_w, 1), tl.sum(acc_u, 1)


@triton.jit
def _pass1_tile_bf16(w_ptr, g_ptr, m_ptr, v_ptr, mask, e, base, gm, beta1, beta2, beta3,
                     one_minus_beta2, r1, r2, eps, lambda_in_u):
    """One tile of pass 1 with bf16 moments (``m_ptr``, ``v_ptr``: their bits): ``m`` rounded to
    nearest even, ``v`` stochastically with the bits of the elements ``e``; ``u`` from the stored
    values. Returns ``(w², u²)``, 0 outside ``mask``."""
    w = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32) * gm
    m = bf16_value(tl.load(m_ptr, mask=mask, other=0))
    v = bf16_value(tl.load(v_ptr, mask=mask, other=0))
    m, v = lamb_moments(g, m, v, beta1, beta2, beta3, one_minus_beta2)
    mq = bf16_rne(m)
    vq = bf16_stochastic(v, sr_bits(base, e))
    tl.store(m_ptr, mq.to(tl.uint16), mask=mask)
    tl.store(v_ptr, vq.to(tl.uint16), mask=mask)
    u = lamb_direction(w, bf16_value(mq), bf16_value(vq), r1, r2, eps, lambda_in_u)
    return w * w, masked_sq(u, mask)


@triton.jit
def _pass1_tile_q8(w_ptr, g_ptr, mw_ptr, mc_ptr, vw_ptr, vc_ptr, bmask, mask, e, base, gm, beta1,
                   beta2, beta3, one_minus_beta2, eps8, c8, lambda_in_u):
    """One tile of pass 1 with 8-bit moments, whole blocks (``[ROWS, NB, 256]``; ``mw_ptr``,
    ``vw_ptr``: the blocks' first words ``[ROWS, NB, 1]``, where ``bmask``; ``mc_ptr``,
    ``vc_ptr``: the codes), as csrc/cpu/kernels.h's lamb_pass1_chunk_q8: ``m = d·(s + ε)`` and
    ``v = s·s`` read and updated; the roots ``s = sqrt(saturate(v))`` stored (stochastically,
    with the bits of the elements ``e``), the direction ``d = m / (s + eps8)`` from the roots as
    stored, then ``u = c8·d + λ·w`` from the directions as stored. Returns ``(w², u²)``."""
    w = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32) * gm
    f0 = bits_float(tl.load(mw_ptr, mask=bmask, other=0))
    eps0 = bits_float(tl.load(mw_ptr + 1, mask=bmask, other=0))
    top0 = tl.load(vw_ptr, mask=bmask, other=0)
    sh0 = tl.load(vw_ptr + 1, mask=bmask, other=0)
    s0 = q8_root_value(tl.load(vc_ptr, mask=mask, other=0).to(tl.int32), top0, sh0)
    m = q8_direction_value(tl.load(mc_ptr, mask=mask, other=0).to(tl.int32), f0) * (s0 + eps0)
    m, v = lamb_moments(g, m, s0 * s0, beta1, beta2, beta3, one_minus_beta2)
    s = tl.where(mask, ieee_sqrt(q8_saturate(v)), 0.0)  # lanes past the end: not in a block
    top, sh, v_ok = root_words(s)
    top3 = top[:, :, None]
    sh3 = sh[:, :, None]
    v_ok3 = v_ok[:, :, None]
    cv = tl.where(v_ok3, q8_root_code(s, top3, sh3, q8_root_stochastic(sr_bits(base, e), sh3)),
                  255)  # a block that is not finite: codes 255, read as its NaN word
    tl.store(vw_ptr, tl.where(v_ok, top, NAN_WORD)[:, :, None], mask=bmask)
    tl.store(vw_ptr + 1, tl.where(v_ok, sh, 0)[:, :, None], mask=bmask)
    tl.store(vc_ptr, cv.to(tl.uint8), mask=mask)
    d = ieee_div(m, q8_root_value(cv, top3, sh3) + eps8)
    d = tl.where(mask, d, 0.0)
    a, d_ok = block_top(d)
    d_ok = d_ok & v_ok
    f = tl.where(d_ok, q8_direction_step(a), float("nan"))[:, :, None]
    p, q = q8_scaling(a, 127.0)  # a tiny block is prescaled (P = 2^64)
    d = tl.where(d_ok[:, :, None], d, 0.0)  # a block that is not finite: codes 0, read as 0·NaN
    cm = q8_direction_code(d * p[:, :, None], q[:, :, None])
    tl.store(mw_ptr, float_bits(f).to(tl.int32, bitcast=True), mask=bmask)
    tl.store(mw_ptr + 1, tl.broadcast_to(float_bits(eps8).to(tl.int32, bitcast=True), f.shape),
             mask=bmask)
    tl.store(mc_ptr, cm.to(tl.int8), mask=mask)
    u = c8 * q8_direction_value(cm, f) + lambda_in_u * w
    return w * w, masked_sq(u, mask)


@triton.jit
def _pass1_lowp(rec, start, n, fmt, t, w_ptr, g_ptr, m_ptr, v_ptr, gm, b1, b2, b3, omb2, r1, r2,
                eps, lam, ALIGNED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 over the program's chunks when a row holds low-precision state (float32 compute):
    tiles of whole 8-bit blocks, each format present among the rows run with a mask per row. The
    ``(Σw², Σu²)`` of every row are those of ``_pass1_full`` (the same lanes accumulate the same
    terms). ``w_ptr`` ... ``v_ptr``: ``[ROWS, 1]`` at the chunks' starts; ``fmt``, ``t``, ``r1``,
    ``r2``: ``[ROWS]``."""
    o3, nb, start3 = tiles3(start, BLOCK, QBLOCK)
    n3 = n[:, None, None]
    w3 = w_ptr[:, :, None]
    g3 = g_ptr[:, :, None]
    mf3 = m_ptr[:, :, None]
    vf3 = v_ptr[:, :, None]
    r1 = r1[:, None, None]
    r2 = r2[:, None, None]
    eps8, c8 = lamb_coef8(eps, r1, r2)  # 8-bit state (Note [8-bit maps] in math.h)
    mh, mw, mc, _ = state_ptrs(rec, STATE0, ALIGNED, QBLOCK)
    vh, vw, _, vc = state_ptrs(rec, STATE1, ALIGNED, QBLOCK)
    key = tl.load(rec + KEY)
    base = sr_base(t, key)[:, None, None]
    first = (key >> 32)[:, None, None]  # docs/math.md, "Random bits"
    full, half, q8, any_full, any_half, any_q8 = format_rows(fmt)
    acc_w = tl.full([ROWS, BLOCK // QBLOCK, QBLOCK], 0.0, tl.float32)
    acc_u = tl.full([ROWS, BLOCK // QBLOCK, QBLOCK], 0.0, tl.float32)
    for phase in tl.static_range(2):  # Note [whole tiles] in common.py
        lo, hi = tile_range(phase, n, BLOCK)
        for off in range(lo, hi, BLOCK):
            o = off + o3
            inside = tile_mask(phase, o, n3)
            if any_full:
                sw, su = _pass1_tile(w3 + o, g3 + o, mf3 + o, vf3 + o, inside & full, gm, b1, b2,
                                     b3, omb2, r1, r2, eps, lam, tl.float32)
                acc_w += sw
                acc_u += su
            if any_half:
                e = start3 + o
                sw, su = _pass1_tile_bf16(w3 + o, g3 + o, mh + e, vh + e, inside & half, first + e,
                                          base, gm, b1, b2, b3, omb2, r1, r2, eps, lam)
                acc_w += sw
                acc_u += su
            if any_q8:
                e = start3 + o
                blk = (start3 + off) // QBLOCK + nb
                bmask = ((off + nb * QBLOCK) < n3) & q8
                sw, su = _pass1_tile_q8(w3 + o, g3 + o, mw + 2 * blk, mc + e, vw + 2 * blk, vc + e,
                                        bmask, inside & q8, first + e, base, gm, b1, b2, b3, omb2,
                                        eps8, c8, lam)
                acc_w += sw
                acc_u += su
    return (tl.sum(tl.reshape(acc_w, [ROWS, BLOCK]), 1),
            tl.sum(tl.reshape(acc_u, [ROWS, BLOCK]), 1))


@triton.jit(**PASS_KERNEL)
def lamb_pass1_kernel(
    records,  # int64 [n, RECORD]: param, grad, master, exp_avg, exp_avg_sq, step pointers
    owner,  # int32 [programs * ROWS]: tensor of each chunk, -1 for padding
    partials,  # CD [C, 2]: chunk partial sums
    counters,  # int32 [n]: finished chunks per tensor (zero between launches)
    sums,  # CD [bucket size, 2]: output, (‖w‖², ‖u‖²) at each tensor's OUT row
    grad_mult,  # CD scalar: every gradient is read as g·grad_mult
    found_inf,  # float32 scalar: nonzero skips the step
    beta1: tl.float64, beta2: tl.float64, beta3: tl.float64, one_minus_beta2: tl.float64,
    eps: tl.float64,
    lambda_in_u: tl.float64,  # λ, or 0 for decoupled weight decay
    flags: tl.int32,  # BIAS_CORRECTION
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, CD: tl.constexpr,
    HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr, LOWP: tl.constexpr,
    CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
):
    """Moments, step counts and the per-tensor ``(‖w‖², ‖u‖²)`` of one LAMB step."""
    c, valid, i, rec, start, n, first, count, inc = chunks_of(
        records, owner, found_inf, CHUNK, ROWS)
    step_ptr = tl.load(rec + STEP).to(tl.pointer_type(tl.float32))
    t = tl.load(step_ptr, mask=valid, other=0.0) + inc  # Note [step counts] in common.py
    b1, b2, b3, omb2, eps_c, r1, r2, lam = lamb_coef(t, beta1, beta2, beta3, one_minus_beta2, eps,
                                                     lambda_in_u, CD, flag(flags, BIAS_CORRECTION))
    gm = tl.load(grad_mult).to(CD)
    if HAS_MASTER:
        w_ptr = tensor_ptrs(rec, MASTER, CD, ALIGNED) + start[:, None]
    else:
        w_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    g_ptr = tensor_ptrs(rec, GRAD, G_DTYPE, ALIGNED) + start[:, None]
    m_ptr = tensor_ptrs(rec, STATE0, CD, ALIGNED) + start[:, None]
    v_ptr = tensor_ptrs(rec, STATE1, CD, ALIGNED) + start[:, None]
    if LOWP:  # Note [state formats in the tables]: float32 compute only
        fmt = tl.load(rec + FORMAT).to(tl.int32)
        if any_row(fmt != 0):
            p_w, p_u = _pass1_lowp(rec, start, n, fmt, t, w_ptr, g_ptr, m_ptr, v_ptr, gm, b1, b2,
                                   b3, omb2, r1, r2, eps_c, lam, ALIGNED, ROWS, BLOCK)
        else:
            p_w, p_u = _pass1_full(w_ptr, g_ptr, m_ptr, v_ptr, n, gm, b1, b2, b3, omb2,
                                   r1[:, None], r2[:, None], eps_c, lam, CD, ROWS, BLOCK)
    else:
        p_w, p_u = _pass1_full(w_ptr, g_ptr, m_ptr, v_ptr, n, gm, b1, b2, b3, omb2, r1[:, None],
                               r2[:, None], eps_c, lam, CD, ROWS, BLOCK)
    last = finish_rows(partials, counters, sums, c, valid, i, rec, first, count, p_w, p_u, 2, ROWS,
                       RBLOCK)
    tl.store(step_ptr, t, mask=last)


@triton.jit
def _pass2_tile(w_ptr, p_ptr, m_ptr, v_ptr, mask, r1, r2, eps, lambda_in_u, lr_phi, decay,
                P_DTYPE: tl.constexpr, CD: tl.constexpr, HAS_MASTER: tl.constexpr):
    w = load_tile(w_ptr, mask).to(CD)
    m = load_tile(m_ptr, mask)
    v = load_tile(v_ptr, mask)
    u = lamb_direction(w, m, v, r1, r2, eps, lambda_in_u)
    _store_weight(w_ptr, p_ptr, lamb_apply(w, u, lr_phi, decay), mask, P_DTYPE, HAS_MASTER)


@triton.jit
def _store_weight(w_ptr, p_ptr, w, mask, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr):
    """The new weight to the weight (the fp32 master, and the param rounded to nearest even)."""
    tl.store(w_ptr, round_to(w, w_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(p_ptr, round_to(w, P_DTYPE), mask=mask)


@triton.jit
def _pass2_full(w_ptr, p_ptr, m_ptr, v_ptr, n, r1, r2, eps, lam, lr_phi, decay,
                P_DTYPE: tl.constexpr, CD: tl.constexpr, HAS_MASTER: tl.constexpr,
                BLOCK: tl.constexpr):
    """Pass 2 over the program's chunks with full state. ``r1``, ``r2``, ``lr_phi``:
    ``[ROWS, 1]``."""
    cols = tl.arange(0, BLOCK)[None, :]
    for phase in tl.static_range(2):  # Note [whole tiles] in common.py
        lo, hi = tile_range(phase, n, BLOCK)
        for off in range(lo, hi, BLOCK):
            o = off + cols
            _pass2_tile(w_ptr + o, p_ptr + o, m_ptr + o, v_ptr + o, tile_lanes(phase, o, n), r1,
                        r2, eps, lam, lr_phi, decay, P_DTYPE, CD, HAS_MASTER)


@triton.jit
def _pass2_tile_bf16(w_ptr, p_ptr, m_ptr, v_ptr, mask, r1, r2, eps, lambda_in_u, lr_phi, decay,
                     P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr):
    """One tile of pass 2 with bf16 moments: ``u`` from the stored values (pass 1's ``u``)."""
    w = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
    m = bf16_value(tl.load(m_ptr, mask=mask, other=0))
    v = bf16_value(tl.load(v_ptr, mask=mask, other=0))
    u = lamb_direction(w, m, v, r1, r2, eps, lambda_in_u)
    _store_weight(w_ptr, p_ptr, lamb_apply(w, u, lr_phi, decay), mask, P_DTYPE, HAS_MASTER)


@triton.jit
def _pass2_tile_q8(w_ptr, p_ptr, mw_ptr, mc_ptr, bmask, mask, c8, lambda_in_u, lr_phi, decay,
                   P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr):
    """One tile of pass 2 with 8-bit moments (whole blocks, as ``_pass1_tile_q8``): ``u = c8·d +
    λ·w`` from the stored directions alone (``exp_avg_sq`` is not read)."""
    w = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
    f = bits_float(tl.load(mw_ptr, mask=bmask, other=0))
    u = c8 * q8_direction_value(tl.load(mc_ptr, mask=mask, other=0).to(tl.int32), f) \
        + lambda_in_u * w
    _store_weight(w_ptr, p_ptr, lamb_apply(w, u, lr_phi, decay), mask, P_DTYPE, HAS_MASTER)


@triton.jit
def _pass2_lowp(rec, start, n, fmt, w_ptr, p_ptr, m_ptr, v_ptr, r1, r2, eps, lam, lr_phi, decay,
                P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr,
                ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 2 over the program's chunks when a row holds low-precision state (as
    ``_pass1_lowp``); ``r1``, ``r2``, ``lr_phi``: ``[ROWS]``."""
    o3, nb, start3 = tiles3(start, BLOCK, QBLOCK)
    n3 = n[:, None, None]
    w3 = w_ptr[:, :, None]
    p3 = p_ptr[:, :, None]
    mf3 = m_ptr[:, :, None]
    vf3 = v_ptr[:, :, None]
    r1 = r1[:, None, None]
    r2 = r2[:, None, None]
    lr_phi = lr_phi[:, None, None]
    _, c8 = lamb_coef8(eps, r1, r2)  # 8-bit state (Note [8-bit maps] in math.h)
    mh, mw, mc, _ = state_ptrs(rec, STATE0, ALIGNED, QBLOCK)
    vh, _, _, _ = state_ptrs(rec, STATE1, ALIGNED, QBLOCK)
    full, half, q8, any_full, any_half, any_q8 = format_rows(fmt)
    for phase in tl.static_range(2):  # Note [whole tiles] in common.py
        lo, hi = tile_range(phase, n, BLOCK)
        for off in range(lo, hi, BLOCK):
            o = off + o3
            inside = tile_mask(phase, o, n3)
            if any_full:
                _pass2_tile(w3 + o, p3 + o, mf3 + o, vf3 + o, inside & full, r1, r2, eps, lam,
                            lr_phi, decay, P_DTYPE, tl.float32, HAS_MASTER)
            if any_half:
                e = start3 + o
                _pass2_tile_bf16(w3 + o, p3 + o, mh + e, vh + e, inside & half, r1, r2, eps, lam,
                                 lr_phi, decay, P_DTYPE, HAS_MASTER)
            if any_q8:
                e = start3 + o
                blk = (start3 + off) // QBLOCK + nb
                bmask = ((off + nb * QBLOCK) < n3) & q8
                _pass2_tile_q8(w3 + o, p3 + o, mw + 2 * blk, mc + e, bmask, inside & q8, c8, lam,
                               lr_phi, decay, P_DTYPE, HAS_MASTER)


@triton.jit(**PASS_KERNEL)
def lamb_pass2_kernel(
    records,  # int64 [n, RECORD]: param, grad, master, exp_avg, exp_avg_sq, step pointers
    owner,  # int32 [programs * ROWS]: tensor of each chunk, -1 for padding
    sums,  # [bucket size, 2]: (‖w‖², ‖u‖²) by OUT row, from pass 1 (possibly all-reduced)
    found_inf,  # float32 scalar: nonzero skips the step
    lr_ptr,  # float64 scalar: the learning rate when it is a tensor (flag LR_TENSOR)
    beta1: tl.float64, beta2: tl.float64, beta3: tl.float64, one_minus_beta2: tl.float64,
    eps: tl.float64,
    lambda_in_u: tl.float64,  # λ, or 0 for decoupled weight decay
    lr: tl.float64,  # the learning rate when it is a number
    decoupled_wd: tl.float64,  # λ for decoupled weight decay, else 0
    ratio_lo: tl.float64, ratio_hi: tl.float64,
    flags: tl.int32,  # LR_TENSOR, BIAS_CORRECTION, ADAPT, BOUNDED
    P_DTYPE: tl.constexpr, CD: tl.constexpr, HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr,
    LOWP: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Trust ratio ``φ`` from ``sums`` and the update ``w ← w·(1 − lr·λ_decoupled) − lr·φ·u``."""
    c, valid, i, rec, start, n, first, count, inc = chunks_of(
        records, owner, found_inf, CHUNK, ROWS)
    t = tl.load(tl.load(rec + STEP).to(tl.pointer_type(tl.float32)), mask=valid, other=1.0)
    _, _, _, _, eps_c, r1, r2, lam = lamb_coef(t, beta1, beta2, beta3, one_minus_beta2, eps,
                                               lambda_in_u, CD, flag(flags, BIAS_CORRECTION))  # t of pass 1
    row = tl.load(rec + OUT)  # the tensor's row of sums
    w_sq = tl.load(sums + 2 * row, mask=valid, other=0.0).to(CD)
    u_sq = tl.load(sums + 2 * row + 1, mask=valid, other=0.0).to(CD)
    phi = lamb_trust_ratio(w_sq, u_sq, tl.full((), ratio_lo, CD), tl.full((), ratio_hi, CD),
                           flag(flags, ADAPT), flag(flags, BOUNDED))
    lr64 = tl.where(flag(flags, LR_TENSOR), tl.load(lr_ptr), tl.full((), lr, tl.float64))
    lr_phi = lr64.to(CD) * phi
    decay = (1.0 - lr64 * tl.full((), decoupled_wd, tl.float64)).to(CD)
    if HAS_MASTER:
        w_ptr = tensor_ptrs(rec, MASTER, CD, ALIGNED) + start[:, None]
    else:
        w_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    p_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    m_ptr = tensor_ptrs(rec, STATE0, CD, ALIGNED) + start[:, None]
    v_ptr = tensor_ptrs(rec, STATE1, CD, ALIGNED) + start[:, None]
    if LOWP:  # Note [state formats in the tables]: float32 compute only
        fmt = tl.load(rec + FORMAT).to(tl.int32)
        if any_row(fmt != 0):
            _pass2_lowp(rec, start, n, fmt, w_ptr, p_ptr, m_ptr, v_ptr, r1, r2, eps_c, lam, lr_phi,
                        decay, P_DTYPE, HAS_MASTER, ALIGNED, ROWS, BLOCK)
        else:
            _pass2_full(w_ptr, p_ptr, m_ptr, v_ptr, n, r1[:, None], r2[:, None], eps_c, lam,
                        lr_phi[:, None], decay, P_DTYPE, CD, HAS_MASTER, BLOCK)
    else:
        _pass2_full(w_ptr, p_ptr, m_ptr, v_ptr, n, r1[:, None], r2[:, None], eps_c, lam,
                    lr_phi[:, None], decay, P_DTYPE, CD, HAS_MASTER, BLOCK)
