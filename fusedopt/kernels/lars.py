"""LARS's two launches (docs/math.md, the form of Paddle's ``lars_momentum``) over a bucket's tables.

Pass 1 (``lars_pass1_kernel``) reads w and g and writes ``sums[i] = (Σ w², Σ g²)``, or
``(Σ w², Σ (g + λw)²)`` for ``denominator="combined"``, finalised in the same launch by the
last program of each tensor (Note [two-stage norms] in common.py), which also advances the step
count. Pass 2 (``lars_pass2_kernel``) takes the trust ratio from ``sums`` (possibly all-reduced in
between), reads w, g, v and writes v and w (the fp32 master, and the param rounded to nearest
even). Memory traffic per element: 8 + 20 bytes, docs/math.md's 28 for float32.

A bf16 or 8-bit momentum buffer (docs/math.md, "Low-precision state"; Note [state formats in the
tables] in kernels/tables.py) is stored rounded to nearest (bf16: even; 8-bit: the dynamic map
of Note [8-bit maps] in csrc/fusedopt/math.h), and the step moves by the buffer just computed in
float32, before its rounding (csrc/cpu/kernels.h's ``lars_pass2_chunk_{bf16,q8}``): the trust ratio
does not depend on the buffer, so nothing reads the rounded one before the next step. With
float32 compute, a program with such a row runs the tiles of ``_pass2_lowp``, whole 8-bit blocks
per tile.
"""
import triton
import triton.language as tl

from .math import (
    NAN_WORD, QBLOCK, bf16_rne, bf16_value, bits_float, block_top, float_bits, lars_apply,
    lars_buffer, lars_coef, lars_direction, lars_step, lars_trust_ratio, q8_dynamic_code,
    q8_dynamic_value, q8_scaling,
)
from .common import (
    ADAPT, COMBINED, FORMAT, GRAD, LR_IN_MOMENTUM, LR_TENSOR, MASTER, NESTEROV, OUT, PARAM,
    PASS_KERNEL, STATE0, STEP, TRUST_CLIP, any_row, chunks_of, finish_rows, flag, format_rows,
    load_tile, round_to, state_ptrs, tensor_ptrs, tile_lanes, tile_mask, tile_range, tiles3,
)


@triton.jit
def _pass1_tile(w_ptr, g_ptr, mask, gm, lam, CD: tl.constexpr, combined):
    """One tile of pass 1; returns its ``(w², g²)`` or, when ``combined`` (a runtime bool, the
    same for every program), ``(w², (g + λw)²)`` (masked-off lanes load 0, so they add 0)."""
    w = load_tile(w_ptr, mask).to(CD)
    g = load_tile(g_ptr, mask).to(CD) * gm
    if combined:
        g = g + lam * w
    return w * w, g * g


@triton.jit(**PASS_KERNEL)
def lars_pass1_kernel(
    records,  # int64 [n, RECORD]: param, grad, master, momentum_buffer, -, step pointers
    owner,  # int32 [programs * ROWS]: tensor of each chunk, -1 for padding
    partials,  # CD [C, 2]: chunk partial sums
    counters,  # int32 [n]: finished chunks per tensor (zero between launches)
    sums,  # CD [bucket size, 2]: output, (‖w‖², ‖g‖²) or (‖w‖², ‖g + λw‖²) at each OUT row
    grad_mult,  # CD scalar: every gradient is read as g·grad_mult
    found_inf,  # float32 scalar: nonzero skips the step
    weight_decay: tl.float64,  # λ
    flags: tl.int32,  # COMBINED
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, CD: tl.constexpr,
    HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
):
    """Step counts and the per-tensor sums of squares of one LARS step."""
    c, valid, i, rec, start, n, first, count, inc = chunks_of(
        records, owner, found_inf, CHUNK, ROWS)
    step_ptr = tl.load(rec + STEP).to(tl.pointer_type(tl.float32))
    t = tl.load(step_ptr, mask=valid, other=0.0) + inc  # Note [step counts] in common.py
    gm = tl.load(grad_mult).to(CD)
    lam = tl.full((), weight_decay, CD)
    combined = flag(flags, COMBINED)
    if HAS_MASTER:
        w_ptr = tensor_ptrs(rec, MASTER, CD, ALIGNED) + start[:, None]
    else:
        w_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    g_ptr = tensor_ptrs(rec, GRAD, G_DTYPE, ALIGNED) + start[:, None]

    cols = tl.arange(0, BLOCK)[None, :]
    acc_w = tl.full([ROWS, BLOCK], 0.0, CD)
    acc_g = tl.full([ROWS, BLOCK], 0.0, CD)
    for phase in tl.static_range(2):  # Note [whole tiles] in common.py
        lo, hi = tile_range(phase, n, BLOCK)
        for off in range(lo, hi, BLOCK):
            o = off + cols
            sw, sg = _pass1_tile(w_ptr + o, g_ptr + o, tile_lanes(phase, o, n), gm, lam, CD,
                                 combined)
            acc_w += sw
            acc_g += sg
    last = finish_rows(partials, counters, sums, c, valid, i, rec, first, count, tl.sum(acc_w, 1),
                       tl.sum(acc_g, 1), 2, ROWS, RBLOCK)
    tl.store(step_ptr, t, mask=last)


@triton.jit
def _store_weight(w_ptr, p_ptr, w, mask, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr):
    """The new weight to the weight (the fp32 master, and the param rounded to nearest even)."""
    tl.store(w_ptr, round_to(w, w_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(p_ptr, round_to(w, P_DTYPE), mask=mask)


@triton.jit
def _pass2_tile(w_ptr, p_ptr, g_ptr, v_ptr, mask, gm, ratio, lam, lr, mu, keep, add,
                P_DTYPE: tl.constexpr, CD: tl.constexpr, HAS_MASTER: tl.constexpr, nesterov,
                lr_in_momentum):
    w = load_tile(w_ptr, mask).to(CD)
    g = load_tile(g_ptr, mask).to(CD) * gm
    v = load_tile(v_ptr, mask)
    w, v = lars_apply(w, g, v, ratio, lam, lr, mu, keep, add, nesterov, lr_in_momentum)
    tl.store(v_ptr, v, mask=mask)
    _store_weight(w_ptr, p_ptr, w, mask, P_DTYPE, HAS_MASTER)


@triton.jit
def _pass2_full(w_ptr, p_ptr, g_ptr, v_ptr, n, gm, ratio, lam, lr, mu, keep, add,
                P_DTYPE: tl.constexpr, CD: tl.constexpr, HAS_MASTER: tl.constexpr, nesterov,
                lr_in_momentum, BLOCK: tl.constexpr):
    """Pass 2 over the program's chunks with a full buffer. ``ratio``, ``keep``, ``add``:
    ``[ROWS, 1]``."""
    cols = tl.arange(0, BLOCK)[None, :]
    for phase in tl.static_range(2):  # Note [whole tiles] in common.py
        lo, hi = tile_range(phase, n, BLOCK)
        for off in range(lo, hi, BLOCK):
            o = off + cols
            _pass2_tile(w_ptr + o, p_ptr + o, g_ptr + o, v_ptr + o, tile_lanes(phase, o, n), gm,
                        ratio, lam, lr, mu, keep, add, P_DTYPE, CD, HAS_MASTER, nesterov,
                        lr_in_momentum)


@triton.jit
def _pass2_tile_bf16(w_ptr, p_ptr, g_ptr, v_ptr, mask, gm, ratio, lam, lr, mu, keep, add,
                     P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, nesterov, lr_in_momentum):
    """One tile of pass 2 with a bf16 buffer (``v_ptr``: its bits): the step from the new buffer,
    which is stored rounded to nearest even."""
    w = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32) * gm
    d = lars_direction(w, g, ratio, lam)
    v = lars_buffer(d, bf16_value(tl.load(v_ptr, mask=mask, other=0)), keep, add)
    tl.store(v_ptr, bf16_rne(v).to(tl.uint16), mask=mask)
    w = lars_step(w, d, v, lr, mu, nesterov, lr_in_momentum)
    _store_weight(w_ptr, p_ptr, w, mask, P_DTYPE, HAS_MASTER)


@triton.jit
def _pass2_tile_q8(w_ptr, p_ptr, g_ptr, vw_ptr, c_ptr, bmask, mask, gm, ratio, lam, lr, mu, keep,
                   add, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, nesterov, lr_in_momentum):
    """One tile of pass 2 with an 8-bit buffer, whole blocks (``[ROWS, NB, 256]``; ``vw_ptr``: the
    blocks' first words ``[ROWS, NB, 1]``, where ``bmask``; ``c_ptr``: the codes), as
    csrc/cpu/kernels.h's lars_pass2_chunk_q8: the step from the new buffer, which is then stored in
    the dynamic map with the words ``(bits(a), 0)`` (a block that is not finite: ``(NaN, 0)`` and
    codes 0)."""
    w = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32) * gm
    d = lars_direction(w, g, ratio, lam)
    old = q8_dynamic_value(tl.load(c_ptr, mask=mask, other=0).to(tl.int32),
                           bits_float(tl.load(vw_ptr, mask=bmask, other=0)))
    v = lars_buffer(d, old, keep, add)
    _store_weight(w_ptr, p_ptr, lars_step(w, d, v, lr, mu, nesterov, lr_in_momentum), mask,
                  P_DTYPE, HAS_MASTER)
    v = tl.where(mask, v, 0.0)  # lanes past the end: not in a block
    a, ok = block_top(v)
    p, q = q8_scaling(a, 1.0)
    ok3 = ok[:, :, None]
    top = tl.where(ok, float_bits(a).to(tl.int32, bitcast=True), NAN_WORD)[:, :, None]
    cv = q8_dynamic_code(tl.where(ok3, v, 0.0), p[:, :, None], q[:, :, None], top)  # 0: not ok
    tl.store(c_ptr, cv.to(tl.int8), mask=mask)
    tl.store(vw_ptr, top, mask=bmask)
    tl.store(vw_ptr + 1, tl.zeros_like(ok3.to(tl.int32)), mask=bmask)


@triton.jit
def _pass2_lowp(rec, start, n, fmt, w_ptr, p_ptr, g_ptr, v_ptr, gm, ratio, lam, lr, mu, keep, add,
                P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr,
                ROWS: tl.constexpr, BLOCK: tl.constexpr, nesterov, lr_in_momentum):
    """Pass 2 over the program's chunks when a row holds a low-precision buffer (float32
    compute): tiles of whole 8-bit blocks, each format present among the rows run with a mask per
    row. ``w_ptr`` ... ``v_ptr``: ``[ROWS, 1]`` at the chunks' starts; ``ratio``, ``keep``,
    ``add``: ``[ROWS]``."""
    o3, nb, start3 = tiles3(start, BLOCK, QBLOCK)
    n3 = n[:, None, None]
    w3 = w_ptr[:, :, None]
    p3 = p_ptr[:, :, None]
    g3 = g_ptr[:, :, None]
    vf3 = v_ptr[:, :, None]
    ratio = ratio[:, None, None]
    keep = keep[:, None, None]
    add = add[:, None, None]
    vh, vw, vc, _ = state_ptrs(rec, STATE0, ALIGNED, QBLOCK)
    full, half, q8, any_full, any_half, any_q8 = format_rows(fmt)
    for phase in tl.static_range(2):  # Note [whole tiles] in common.py
        lo, hi = tile_range(phase, n, BLOCK)
        for off in range(lo, hi, BLOCK):
            o = off + o3
            inside = tile_mask(phase, o, n3)
            if any_full:
                _pass2_tile(w3 + o, p3 + o, g3 + o, vf3 + o, inside & full, gm, ratio, lam, lr,
                            mu, keep, add, P_DTYPE, tl.float32, HAS_MASTER, nesterov,
                            lr_in_momentum)
            if any_half:
                _pass2_tile_bf16(w3 + o, p3 + o, g3 + o, vh + (start3 + o), inside & half, gm,
                                 ratio, lam, lr, mu, keep, add, P_DTYPE, HAS_MASTER, nesterov,
                                 lr_in_momentum)
            if any_q8:
                blk = (start3 + off) // QBLOCK + nb
                bmask = ((off + nb * QBLOCK) < n3) & q8
                _pass2_tile_q8(w3 + o, p3 + o, g3 + o, vw + 2 * blk, vc + (start3 + o), bmask,
                               inside & q8, gm, ratio, lam, lr, mu, keep, add, P_DTYPE,
                               HAS_MASTER, nesterov, lr_in_momentum)


@triton.jit(**PASS_KERNEL)
def lars_pass2_kernel(
    records,  # int64 [n, RECORD]: param, grad, master, momentum_buffer, -, step pointers
    owner,  # int32 [programs * ROWS]: tensor of each chunk, -1 for padding
    sums,  # [bucket size, 2]: by OUT row, the sums pass 1 returned (possibly all-reduced)
    grad_mult,  # CD scalar: every gradient is read as g·grad_mult
    found_inf,  # float32 scalar: nonzero skips the step
    lr_ptr,  # float64 scalar: the learning rate when it is a tensor (flag LR_TENSOR)
    lr: tl.float64,  # the learning rate when it is a number
    momentum: tl.float64,  # μ
    one_minus_dampening: tl.float64,
    weight_decay: tl.float64,  # λ
    trust_coefficient: tl.float64,  # κ
    eps: tl.float64,
    flags: tl.int32,  # LR_TENSOR, ADAPT, COMBINED, TRUST_CLIP, NESTEROV, LR_IN_MOMENTUM
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, CD: tl.constexpr,
    HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr, LOWP: tl.constexpr,
    CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Trust ratio from ``sums``, ``d = ratio·(g + λw)``, the momentum update and ``w ← w − step``."""
    c, valid, i, rec, start, n, first, count, inc = chunks_of(
        records, owner, found_inf, CHUNK, ROWS)
    t = tl.load(tl.load(rec + STEP).to(tl.pointer_type(tl.float32)), mask=valid, other=1.0)
    lam = tl.full((), weight_decay, CD)
    row = tl.load(rec + OUT)  # the tensor's row of sums
    w_sq = tl.load(sums + 2 * row, mask=valid, other=0.0).to(CD)
    g_sq = tl.load(sums + 2 * row + 1, mask=valid, other=0.0).to(CD)
    ratio = lars_trust_ratio(w_sq, g_sq, tl.full((), trust_coefficient, CD), lam, tl.full((), eps, CD),
                             flag(flags, ADAPT), flag(flags, COMBINED),
                             flag(flags, TRUST_CLIP))
    lr_c = tl.where(flag(flags, LR_TENSOR), tl.load(lr_ptr).to(CD), tl.full((), lr, CD))
    nesterov = flag(flags, NESTEROV)
    lr_in_momentum = flag(flags, LR_IN_MOMENTUM)
    mu, keep, add = lars_coef(t, lr_c, momentum, one_minus_dampening, CD, lr_in_momentum)  # t of pass 1
    gm = tl.load(grad_mult).to(CD)
    if HAS_MASTER:
        w_ptr = tensor_ptrs(rec, MASTER, CD, ALIGNED) + start[:, None]
    else:
        w_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    p_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    g_ptr = tensor_ptrs(rec, GRAD, G_DTYPE, ALIGNED) + start[:, None]
    v_ptr = tensor_ptrs(rec, STATE0, CD, ALIGNED) + start[:, None]
    if LOWP:  # Note [state formats in the tables]: float32 compute only
        fmt = tl.load(rec + FORMAT).to(tl.int32)
        if any_row(fmt != 0):
            _pass2_lowp(rec, start, n, fmt, w_ptr, p_ptr, g_ptr, v_ptr, gm, ratio, lam, lr_c, mu,
                        keep, add, P_DTYPE, HAS_MASTER, ALIGNED, ROWS, BLOCK, nesterov,
                        lr_in_momentum)
        else:
            _pass2_full(w_ptr, p_ptr, g_ptr, v_ptr, n, gm, ratio[:, None], lam, lr_c, mu,
                        keep[:, None], add[:, None], P_DTYPE, CD, HAS_MASTER, nesterov,
                        lr_in_momentum, BLOCK)
    else:
        _pass2_full(w_ptr, p_ptr, g_ptr, v_ptr, n, gm, ratio[:, None], lam, lr_c, mu, keep[:, None],
                    add[:, None], P_DTYPE, CD, HAS_MASTER, nesterov, lr_in_momentum, BLOCK)
