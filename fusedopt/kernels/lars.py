"""LARS's two launches (docs/math.md, the form of Paddle's ``lars_momentum``) over a bucket's tables.

Pass 1 (``lars_pass1_kernel``) reads w and g and writes ``sums[i] = (Σ w², Σ g²)``, or
``(Σ w², Σ (g + λw)²)`` for ``denominator="combined"``, finalised in the same launch by the
last program of each tensor (Note [two-stage norms] in common.py), which also advances the step
count. Pass 2 (``lars_pass2_kernel``) takes the trust ratio from ``sums`` (possibly all-reduced in
between), reads w, g, v and writes v and w (the fp32 master, and the param rounded to nearest
even). Memory traffic per element: 8 + 20 bytes, docs/math.md's 28 for float32.
"""
import triton
import triton.language as tl

from .math import lars_apply, lars_coef, lars_trust_ratio
from .common import (
    ADAPT, COMBINED, GRAD, LR_IN_MOMENTUM, LR_TENSOR, MASTER, NESTEROV, OUT, PARAM, STATE0, STEP,
    TRUST_CLIP, chunks_of, finish_rows, flag, load_tile, round_to, tensor_ptrs,
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


@triton.jit(do_not_specialize=["flags"])
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
    if tl.min(n, 0) == CHUNK:
        for off in range(0, CHUNK, BLOCK):
            o = off + cols
            sw, sg = _pass1_tile(w_ptr + o, g_ptr + o, None, gm, lam, CD, combined)
            acc_w += sw
            acc_g += sg
    else:
        for off in range(0, tl.max(n, 0), BLOCK):
            o = off + cols
            sw, sg = _pass1_tile(w_ptr + o, g_ptr + o, o < n[:, None], gm, lam, CD, combined)
            acc_w += sw
            acc_g += sg
    last = finish_rows(partials, counters, sums, c, valid, i, rec, first, count, tl.sum(acc_w, 1),
                       tl.sum(acc_g, 1), 2, ROWS, RBLOCK)
    tl.store(step_ptr, t, mask=last)


@triton.jit
def _pass2_tile(w_ptr, p_ptr, g_ptr, v_ptr, mask, gm, ratio, lam, lr, mu, keep, add,
                P_DTYPE: tl.constexpr, CD: tl.constexpr, HAS_MASTER: tl.constexpr, nesterov,
                lr_in_momentum):
    w = load_tile(w_ptr, mask).to(CD)
    g = load_tile(g_ptr, mask).to(CD) * gm
    v = load_tile(v_ptr, mask)
    w, v = lars_apply(w, g, v, ratio, lam, lr, mu, keep, add, nesterov, lr_in_momentum)
    tl.store(v_ptr, v, mask=mask)
    tl.store(w_ptr, round_to(w, w_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(p_ptr, round_to(w, P_DTYPE), mask=mask)


@triton.jit(do_not_specialize=["flags"])
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
    HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr,
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
                             flag(flags, TRUST_CLIP))[:, None]
    lr_c = tl.where(flag(flags, LR_TENSOR), tl.load(lr_ptr).to(CD), tl.full((), lr, CD))
    nesterov = flag(flags, NESTEROV)
    lr_in_momentum = flag(flags, LR_IN_MOMENTUM)
    mu, keep, add = lars_coef(t, lr_c, momentum, one_minus_dampening, CD, lr_in_momentum)  # t of pass 1
    keep = keep[:, None]
    add = add[:, None]
    gm = tl.load(grad_mult).to(CD)
    if HAS_MASTER:
        w_ptr = tensor_ptrs(rec, MASTER, CD, ALIGNED) + start[:, None]
    else:
        w_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    p_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    g_ptr = tensor_ptrs(rec, GRAD, G_DTYPE, ALIGNED) + start[:, None]
    v_ptr = tensor_ptrs(rec, STATE0, CD, ALIGNED) + start[:, None]

    cols = tl.arange(0, BLOCK)[None, :]
    if tl.min(n, 0) == CHUNK:
        for off in range(0, CHUNK, BLOCK):
            o = off + cols
            _pass2_tile(w_ptr + o, p_ptr + o, g_ptr + o, v_ptr + o, None, gm, ratio, lam, lr_c, mu, keep,
                        add, P_DTYPE, CD, HAS_MASTER, nesterov, lr_in_momentum)
    else:
        for off in range(0, tl.max(n, 0), BLOCK):
            o = off + cols
            _pass2_tile(w_ptr + o, p_ptr + o, g_ptr + o, v_ptr + o, o < n[:, None], gm, ratio, lam, lr_c,
                        mu, keep, add, P_DTYPE, CD, HAS_MASTER, nesterov, lr_in_momentum)
