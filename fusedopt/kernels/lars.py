"""LARS's two launches (SPEC.md, the form of Paddle's ``lars_momentum``), one program per chunk.

Pass 1 (``lars_pass1_kernel``) reads w and g and writes ``sums[i] = (Σ w², Σ g²)``, or
``(Σ w², Σ (g + λw)²)`` for ``denominator="combined"``, finalised in the same launch by the
last program of each tensor (Note [two-stage norms] in norms.py), which also advances the step
count. Pass 2 (``lars_pass2_kernel``) takes the trust ratio from ``sums`` (possibly all-reduced in
between), reads w, g, v and writes v and w (the fp32 master, and the param rounded to nearest
even). Memory traffic per element: 8 + 20 bytes, SPEC.md's 28 for float32.
"""
import triton
import triton.language as tl

from .math import lars_apply, lars_trust_ratio, to_compute
from .norms import (
    GRAD, MASTER, PARAM, STATE0, STEP, chunk_of, finish_chunk, grad_multiplier, live_elements, masked_sq,
    tensor_ptr,
)


@triton.jit
def _pass1_tile(w_ptr, g_ptr, mask, gm, lam, CD: tl.constexpr, COMBINED: tl.constexpr):
    """One tile of pass 1; returns its ``(w², g²)`` or ``(w², (g + λw)²)``."""
    w = tl.load(w_ptr, mask=mask, other=0.0).to(CD)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(CD) * gm
    if COMBINED:
        g = g + lam * w
    return masked_sq(w, mask), masked_sq(g, mask)


@triton.jit
def lars_pass1_kernel(
    records,  # int64 [n, RECORD]: param, grad, master, momentum_buffer, -, step pointers
    owner,  # int32 [C]: tensor of each chunk
    partials,  # CD [C, 2]: chunk partial sums
    counters,  # int32 [n]: finished chunks per tensor (zero between launches)
    sums,  # CD [n, 2]: output, (‖w‖², ‖g‖²) or (‖w‖², ‖g + λw‖²) per tensor
    grad_mult,  # CD scalar or None: every gradient is read as g·grad_mult
    found_inf,  # float32 scalar or None: nonzero skips the step
    weight_decay: tl.float64,  # λ
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, CD: tl.constexpr,
    HAS_MASTER: tl.constexpr, HAS_GRAD_MULT: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
    COMBINED: tl.constexpr, ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
):
    """Step count and the per-tensor sums of squares of one LARS step."""
    i, rec, start, n_here, first, count = chunk_of(records, owner, CHUNK)
    n_here, inc = live_elements(n_here, found_inf, HAS_FOUND_INF)
    step_ptr = tensor_ptr(rec, STEP, tl.float32, False)
    t = tl.load(step_ptr) + inc  # Note [step counts] in norms.py
    gm = grad_multiplier(grad_mult, CD, HAS_GRAD_MULT)
    lam = to_compute(weight_decay, CD)
    if HAS_MASTER:
        w_ptr = tensor_ptr(rec, MASTER, CD, ALIGNED) + start
    else:
        w_ptr = tensor_ptr(rec, PARAM, P_DTYPE, ALIGNED) + start
    g_ptr = tensor_ptr(rec, GRAD, G_DTYPE, ALIGNED) + start

    lanes = tl.arange(0, BLOCK)
    acc_w = tl.zeros([BLOCK], CD)
    acc_g = tl.zeros([BLOCK], CD)
    n_full = n_here // BLOCK * BLOCK
    for off in range(0, n_full, BLOCK):
        o = tl.multiple_of(off, BLOCK) + lanes
        sw, sg = _pass1_tile(w_ptr + o, g_ptr + o, None, gm, lam, CD, COMBINED)
        acc_w += sw
        acc_g += sg
    if n_full < n_here:
        o = n_full + lanes
        sw, sg = _pass1_tile(w_ptr + o, g_ptr + o, lanes < n_here - n_full, gm, lam, CD, COMBINED)
        acc_w += sw
        acc_g += sg
    last = finish_chunk(partials, counters, sums, i, first, count, tl.sum(acc_w, 0), tl.sum(acc_g, 0),
                        2, RBLOCK)
    tl.store(step_ptr, t, mask=last)


@triton.jit
def _pass2_tile(w_ptr, p_ptr, g_ptr, v_ptr, mask, gm, ratio, lam, lr, mu, keep, add,
                P_DTYPE: tl.constexpr, CD: tl.constexpr, HAS_MASTER: tl.constexpr,
                NESTEROV: tl.constexpr, LR_IN_MOMENTUM: tl.constexpr):
    w = tl.load(w_ptr, mask=mask, other=0.0).to(CD)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(CD) * gm
    v = tl.load(v_ptr, mask=mask, other=0.0)
    w, v = lars_apply(w, g, v, ratio, lam, lr, mu, keep, add, NESTEROV, LR_IN_MOMENTUM)
    tl.store(v_ptr, v, mask=mask)
    tl.store(w_ptr, w.to(w_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(p_ptr, w.to(P_DTYPE), mask=mask)


@triton.jit
def lars_pass2_kernel(
    records,  # int64 [n, RECORD]: param, grad, master, momentum_buffer, -, step pointers
    owner,  # int32 [C]: tensor of each chunk
    sums,  # [n, 2]: the sums pass 1 returned (possibly all-reduced)
    grad_mult,  # CD scalar or None: every gradient is read as g·grad_mult
    found_inf,  # float32 scalar or None: nonzero skips the step
    lr_ptr,  # scalar tensor or None: the learning rate when it is a tensor (LR_IS_TENSOR)
    lr: tl.float64,  # the learning rate when it is a number
    momentum: tl.float64,  # μ
    one_minus_dampening: tl.float64,
    weight_decay: tl.float64,  # λ
    trust_coefficient: tl.float64,  # κ
    eps: tl.float64,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, CD: tl.constexpr,
    HAS_MASTER: tl.constexpr, HAS_GRAD_MULT: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
    ADAPT: tl.constexpr, COMBINED: tl.constexpr, TRUST_CLIP: tl.constexpr, NESTEROV: tl.constexpr,
    LR_IN_MOMENTUM: tl.constexpr, LR_IS_TENSOR: tl.constexpr, ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Trust ratio from ``sums``, ``d = ratio·(g + λw)``, the momentum update and ``w ← w − step``."""
    i, rec, start, n_here, first, count = chunk_of(records, owner, CHUNK)
    n_here, _ = live_elements(n_here, found_inf, HAS_FOUND_INF)
    t = tl.load(tensor_ptr(rec, STEP, tl.float32, False))  # already advanced by pass 1
    lam = to_compute(weight_decay, CD)
    mu = to_compute(momentum, CD)
    ratio = lars_trust_ratio(tl.load(sums + 2 * i).to(CD), tl.load(sums + 2 * i + 1).to(CD),
                             to_compute(trust_coefficient, CD), lam, to_compute(eps, CD),
                             ADAPT, COMBINED, TRUST_CLIP)
    if LR_IS_TENSOR:
        lr_c = tl.load(lr_ptr).to(CD)
    else:
        lr_c = to_compute(lr, CD)
    if LR_IN_MOMENTUM:
        keep = mu
        add = lr_c
    else:  # torch SGD: the buffer starts as d on the first step
        first_step = t == 1.0
        keep = tl.where(first_step, 0.0, mu).to(CD)
        add = tl.where(first_step, 1.0, to_compute(one_minus_dampening, CD)).to(CD)
    gm = grad_multiplier(grad_mult, CD, HAS_GRAD_MULT)
    if HAS_MASTER:
        w_ptr = tensor_ptr(rec, MASTER, CD, ALIGNED) + start
    else:
        w_ptr = tensor_ptr(rec, PARAM, P_DTYPE, ALIGNED) + start
    p_ptr = tensor_ptr(rec, PARAM, P_DTYPE, ALIGNED) + start
    g_ptr = tensor_ptr(rec, GRAD, G_DTYPE, ALIGNED) + start
    v_ptr = tensor_ptr(rec, STATE0, CD, ALIGNED) + start

    lanes = tl.arange(0, BLOCK)
    n_full = n_here // BLOCK * BLOCK
    for off in range(0, n_full, BLOCK):
        o = tl.multiple_of(off, BLOCK) + lanes
        _pass2_tile(w_ptr + o, p_ptr + o, g_ptr + o, v_ptr + o, None, gm, ratio, lam, lr_c, mu, keep, add,
                    P_DTYPE, CD, HAS_MASTER, NESTEROV, LR_IN_MOMENTUM)
    if n_full < n_here:
        o = n_full + lanes
        _pass2_tile(w_ptr + o, p_ptr + o, g_ptr + o, v_ptr + o, lanes < n_here - n_full, gm, ratio, lam,
                    lr_c, mu, keep, add, P_DTYPE, CD, HAS_MASTER, NESTEROV, LR_IN_MOMENTUM)
