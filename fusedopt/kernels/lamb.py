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

Hyper-parameters are float64 runtime arguments (Note [float64 scalars] in math.py) and the
variant flags bits of the runtime ``flags`` (Note [runtime flags] in kernels/tables.py);
constexprs are structural only: dtypes, whether fp32 masters exist, alignment, tile sizes.
"""
import triton
import triton.language as tl

from .math import lamb_apply, lamb_coef, lamb_direction, lamb_moments, lamb_trust_ratio
from .common import (
    ADAPT, BIAS_CORRECTION, BOUNDED, GRAD, LR_TENSOR, MASTER, OUT, PARAM, STATE0, STATE1, STEP,
    chunks_of, finish_rows, flag, load_tile, masked_sq, round_to, tensor_ptrs,
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


@triton.jit(do_not_specialize=["flags"])
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
    HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr,
):
    """Moments, step counts and the per-tensor ``(‖w‖², ‖u‖²)`` of one LAMB step."""
    c, valid, i, rec, start, n, first, count, inc = chunks_of(
        records, owner, found_inf, CHUNK, ROWS)
    step_ptr = tl.load(rec + STEP).to(tl.pointer_type(tl.float32))
    t = tl.load(step_ptr, mask=valid, other=0.0) + inc  # Note [step counts] in common.py
    b1, b2, b3, omb2, eps_c, r1, r2, lam = lamb_coef(t, beta1, beta2, beta3, one_minus_beta2, eps,
                                                     lambda_in_u, CD, flag(flags, BIAS_CORRECTION))
    r1 = r1[:, None]
    r2 = r2[:, None]
    gm = tl.load(grad_mult).to(CD)
    if HAS_MASTER:
        w_ptr = tensor_ptrs(rec, MASTER, CD, ALIGNED) + start[:, None]
    else:
        w_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    g_ptr = tensor_ptrs(rec, GRAD, G_DTYPE, ALIGNED) + start[:, None]
    m_ptr = tensor_ptrs(rec, STATE0, CD, ALIGNED) + start[:, None]
    v_ptr = tensor_ptrs(rec, STATE1, CD, ALIGNED) + start[:, None]

    cols = tl.arange(0, BLOCK)[None, :]
    acc_w = tl.full([ROWS, BLOCK], 0.0, CD)
    acc_u = tl.full([ROWS, BLOCK], 0.0, CD)
    if tl.min(n, 0) == CHUNK:
        for off in range(0, CHUNK, BLOCK):
            o = off + cols
            sw, su = _pass1_tile(w_ptr + o, g_ptr + o, m_ptr + o, v_ptr + o, None, gm, b1, b2, b3, omb2,
                                 r1, r2, eps_c, lam, CD)
            acc_w += sw
            acc_u += su
    else:
        for off in range(0, tl.max(n, 0), BLOCK):
            o = off + cols
            sw, su = _pass1_tile(w_ptr + o, g_ptr + o, m_ptr + o, v_ptr + o, o < n[:, None], gm, b1, b2,
                                 b3, omb2, r1, r2, eps_c, lam, CD)
            acc_w += sw
            acc_u += su
    last = finish_rows(partials, counters, sums, c, valid, i, rec, first, count, tl.sum(acc_w, 1),
                       tl.sum(acc_u, 1), 2, ROWS, RBLOCK)
    tl.store(step_ptr, t, mask=last)


@triton.jit
def _pass2_tile(w_ptr, p_ptr, m_ptr, v_ptr, mask, r1, r2, eps, lambda_in_u, lr_phi, decay,
                P_DTYPE: tl.constexpr, CD: tl.constexpr, HAS_MASTER: tl.constexpr):
    w = load_tile(w_ptr, mask).to(CD)
    m = load_tile(m_ptr, mask)
    v = load_tile(v_ptr, mask)
    u = lamb_direction(w, m, v, r1, r2, eps, lambda_in_u)
    w = lamb_apply(w, u, lr_phi, decay)
    tl.store(w_ptr, round_to(w, w_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(p_ptr, round_to(w, P_DTYPE), mask=mask)


@triton.jit(do_not_specialize=["flags"])
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
    CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Trust ratio ``φ`` from ``sums`` and the update ``w ← w·(1 − lr·λ_decoupled) − lr·φ·u``."""
    c, valid, i, rec, start, n, first, count, inc = chunks_of(
        records, owner, found_inf, CHUNK, ROWS)
    t = tl.load(tl.load(rec + STEP).to(tl.pointer_type(tl.float32)), mask=valid, other=1.0)
    _, _, _, _, eps_c, r1, r2, lam = lamb_coef(t, beta1, beta2, beta3, one_minus_beta2, eps,
                                               lambda_in_u, CD, flag(flags, BIAS_CORRECTION))  # t of pass 1
    r1 = r1[:, None]
    r2 = r2[:, None]
    row = tl.load(rec + OUT)  # the tensor's row of sums
    w_sq = tl.load(sums + 2 * row, mask=valid, other=0.0).to(CD)
    u_sq = tl.load(sums + 2 * row + 1, mask=valid, other=0.0).to(CD)
    phi = lamb_trust_ratio(w_sq, u_sq, tl.full((), ratio_lo, CD), tl.full((), ratio_hi, CD),
                           flag(flags, ADAPT), flag(flags, BOUNDED))
    lr64 = tl.where(flag(flags, LR_TENSOR), tl.load(lr_ptr), tl.full((), lr, tl.float64))
    lr_phi = (lr64.to(CD) * phi)[:, None]
    decay = (1.0 - lr64 * tl.full((), decoupled_wd, tl.float64)).to(CD)
    if HAS_MASTER:
        w_ptr = tensor_ptrs(rec, MASTER, CD, ALIGNED) + start[:, None]
    else:
        w_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    p_ptr = tensor_ptrs(rec, PARAM, P_DTYPE, ALIGNED) + start[:, None]
    m_ptr = tensor_ptrs(rec, STATE0, CD, ALIGNED) + start[:, None]
    v_ptr = tensor_ptrs(rec, STATE1, CD, ALIGNED) + start[:, None]

    cols = tl.arange(0, BLOCK)[None, :]
    if tl.min(n, 0) == CHUNK:
        for off in range(0, CHUNK, BLOCK):
            o = off + cols
            _pass2_tile(w_ptr + o, p_ptr + o, m_ptr + o, v_ptr + o, None, r1, r2, eps_c, lam, lr_phi,
                        decay, P_DTYPE, CD, HAS_MASTER)
    else:
        for off in range(0, tl.max(n, 0), BLOCK):
            o = off + cols
            _pass2_tile(w_ptr + o, p_ptr + o, m_ptr + o, v_ptr + o, o < n[:, None], r1, r2, eps_c, lam,
                        lr_phi, decay, P_DTYPE, CD, HAS_MASTER)
