"""Eager backend: multi-tensor PyTorch (``torch._foreach_*``), runs on every device.

Per-tensor scalars (step counts, bias corrections, trust ratios) stay on the device as ``[n]``
tensors; nothing is read on the host. The update is computed out of place and committed at the end
of pass 2 (``torch.where(found_inf, old, new)`` under GradScaler), so an overflowing step leaves every
tensor bit-identical. This is the readable statement of the math that the fused backends fuse.
"""
from __future__ import annotations

import torch

from . import Backend
from .. import lowp
from .._bucket import Bucket, bias_correction
from .._hyper import LAMB_FIELDS, LARS_FIELDS, LambHyper
from ..flat import in_memory_order, memory_to_row_major


def zero_norm_rule(w_norm: torch.Tensor, other_norm: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """docs/math.md's zero-norm rule: the trust ratio is exactly 1 where ``‖w‖`` or the other norm of its
    formula (``‖u‖`` for LAMB, the gradient norm for LARS) is 0; a NaN norm gives a NaN ratio
    (Note [NaN propagation] in csrc/fusedopt/math.h; ``clamp`` keeps NaN too)."""
    return torch.where((w_norm == 0) | (other_norm == 0), torch.ones_like(ratio), ratio)


class _Scalars:
    """The hyper-parameters as this backend's ops take them: the values of ``h`` (a
    LambHyper / LarsHyper), or under torch.compile the 0-dim float64 tensors of the step's hyper
    tensor (Note [hyper fields] in csrc/cpu/ops.h). Note [traced options] in fusedopt/_hyper.py:
    a Python scalar of a foreach op is a constant of the graph (a recompile per value), and so is
    an option that no op reads as a tensor; read from the one hyper tensor, every float option
    is an input of the graph. Booleans and a tensor lr are ``h``'s."""

    def __init__(self, h, hyper: torch.Tensor):
        self._h = h
        self._hyper = hyper if torch.compiler.is_compiling() else None
        self._names = LAMB_FIELDS if isinstance(h, LambHyper) else LARS_FIELDS

    def nonzero(self, name: str) -> bool:
        """Whether an option is not 0, decided on its value (under torch.compile: a guard)."""
        return getattr(self._h, name) != 0

    def __getattr__(self, name: str):
        value = getattr(self._h, name)
        if self._hyper is None or isinstance(value, (bool, torch.Tensor)) or value is None:
            return value
        return self._hyper[self._names.index(name)]


def _added(xs: list[torch.Tensor], ys: list[torch.Tensor], a, inplace: bool = False):
    """``xs + a·ys`` (in place into ``xs`` when ``inplace``); ``a`` a number or a 0-dim tensor.
    The product is rounded before the sum, as every backend rounds it (docs/math.md): torch's
    ``add(..., alpha=)`` and ``addcmul`` fuse the two into one rounding on the CPU."""
    ys = torch._foreach_mul(ys, a)
    if inplace:
        torch._foreach_add_(xs, ys)
        return xs
    return torch._foreach_add(xs, ys)


def lamb_trust_ratio(w_sq: torch.Tensor, u_sq: torch.Tensor, h: _Scalars) -> torch.Tensor:
    """``φ = ‖w‖ / ‖u‖`` (zero-norm rule), clamped to the bounds; 1 when not adapting."""
    if not h.adapt:
        return torch.ones_like(w_sq)
    w_n, u_n = lowp.sqrt_rn(w_sq), lowp.sqrt_rn(u_sq)
    phi = zero_norm_rule(w_n, u_n, w_n / u_n)
    if h.bounded:
        lo, hi = h.ratio_lo, h.ratio_hi
        if isinstance(lo, torch.Tensor):
            lo, hi = lo.to(phi.dtype), hi.to(phi.dtype)
        phi = phi.clamp(lo, hi)
    return phi


def lars_trust_ratio(w_sq: torch.Tensor, g_sq: torch.Tensor, h: _Scalars) -> torch.Tensor:
    """``κ‖w‖ / (‖g‖ + λ‖w‖ + eps)`` or ``κ‖w‖ / (‖g + λw‖ + eps)`` with the zero-norm rule."""
    if not h.adapt:
        return torch.ones_like(w_sq)
    w_n, g_n = lowp.sqrt_rn(w_sq), lowp.sqrt_rn(g_sq)
    den = g_n + h.eps if h.combined else g_n + h.weight_decay * w_n + h.eps
    ratio = zero_norm_rule(w_n, g_n, h.trust_coefficient * w_n / den)
    if h.trust_clip:
        ratio = ratio.clamp(max=1.0)
    return ratio


# Note [chunked norms]: torch._foreach_norm accumulates a tensor in float32 in one sequence on the
# CPU and loses ~1e-3 of Σx² at 16M elements. Norms of views of at most _NORM_CHUNK elements, whose
# squares are summed in float64, stay within ~1e-7 of Σx² for varied values and within ~1.4e-5
# for the worst case, a constant tensor (whose float32 sum within a chunk rounds the same way at
# every addition), at the cost of a few small tensors per large one and no copy of any
# (docs/performance.md). The fused backends' sums are within ~1e-7 for both.
_NORM_CHUNK = 1 << 14


def _sq(tensors: list[torch.Tensor], dtype: torch.dtype, cache: dict | None = None) -> torch.Tensor:
    """Per-tensor Σx² as ``dtype``, ``[n]`` (Note [chunked norms]). ``cache`` (a bucket's
    workspace) keeps the chunk-to-tensor index on the device between steps: built once, it is no
    host-to-device copy inside a step (nor inside a captured CUDA graph)."""
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    if all(t.numel() <= _NORM_CHUNK for t in tensors):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype)).square()
    parts, counts = [], []
    for t in tensors:
        chunks = in_memory_order(t).split(_NORM_CHUNK) if t.numel() > _NORM_CHUNK else (t,)
        parts.extend(chunks)
        counts.append(len(chunks))
    sq = torch.stack(torch._foreach_norm(parts, 2, dtype)).to(torch.float64).square()
    owners = {} if cache is None else cache.setdefault("eager chunk owners", {})
    key = (sq.device, tuple(counts))
    owner = owners.get(key)
    if owner is None:
        if len(owners) >= 4:  # the lists of one bucket: w, u or g, grads
            owners.clear()
        owner = owners[key] = torch.repeat_interleave(
            torch.arange(len(counts)), torch.tensor(counts)).to(sq.device)
    out = torch.zeros(len(tensors), dtype=torch.float64, device=sq.device)
    return out.index_add_(0, owner, sq).to(dtype)


def _sq_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    return torch.float64 if tensors and tensors[0].dtype == torch.float64 else torch.float32


def _new_steps(b: Bucket, found_inf) -> torch.Tensor:
    t = torch.stack(b.steps)
    return t + (1.0 if found_inf is None else (found_inf == 0).to(t.dtype))


def _compute_weights(b: Bucket) -> list[torch.Tensor]:
    cd = b.compute_dtype
    return [w if w.dtype == cd else w.to(cd) for w in b.weights]


def _compute_grads(b: Bucket, grad_mult) -> list[torch.Tensor]:
    cd = b.compute_dtype
    g = [x if x.dtype == cd else x.to(cd) for x in b.grads]
    return torch._foreach_mul(g, grad_mult) if grad_mult is not None else g


def _commit(dst: list[torch.Tensor], new: list[torch.Tensor], found_inf) -> None:
    if found_inf is not None:
        skip = found_inf != 0
        new = [torch.where(skip, d.to(n.dtype), n) for d, n in zip(dst, new)]
    torch._foreach_copy_(dst, new)


def _commit_weights(b: Bucket, w_new: list[torch.Tensor], found_inf) -> None:
    if b.masters is not None:
        _commit(b.masters, w_new, found_inf)
        torch._foreach_copy_(b.params, b.masters)
    else:
        _commit(b.params, w_new, found_inf)


def _per_tensor(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.unbind())


def _low_precision(states: list[torch.Tensor]) -> list[tuple[int, str]]:
    """(index, format) of the state tensors stored in a low-precision format."""
    if all(x.dtype.is_floating_point and x.dtype != torch.bfloat16 for x in states):
        return []
    return [(i, lowp.format_of(x)) for i, x in enumerate(states) if lowp.format_of(x) != "full"]


def _read(states: list[torch.Tensor], w: list[torch.Tensor], low) -> list:
    """The float32 values of LARS's low-precision buffers ``low`` of ``states`` (of the shapes of
    ``w``)."""
    out = list(states)
    for i, fmt in low:
        out[i] = states[i].to(torch.float32) if fmt == "bf16" else lowp.step_read(states[i],
                                                                                   w[i].shape)
    return out


def _read_lamb(ms: list[torch.Tensor], vs: list[torch.Tensor], w: list[torch.Tensor], low):
    """LAMB's float32 moments ``(m, v)`` of the low-precision entries ``low`` (docs/math.md: an
    8-bit ``exp_avg`` holds the direction ``d``, read back as ``m = d·(s + ε)``)."""
    m, v = list(ms), list(vs)
    for i, fmt in low:
        if fmt == "bf16":
            m[i], v[i] = ms[i].to(torch.float32), vs[i].to(torch.float32)
        else:
            m[i], v[i] = lowp.step_read_lamb(ms[i], vs[i], w[i].shape)
    return m, v


def _bits(b: Bucket, t: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """The random bits of the ``n`` elements of entry ``i``, drawn by the elements' order in the
    param's memory (docs/math.md, "Random bits")."""
    key = i if b.keys is None else b.keys[i]
    return memory_to_row_major(lowp.random_bits(t[i], key, n), b.params[i])


class EagerBackend(Backend):
    name = "eager"
    state_formats = ("full", "bf16", "8bit")

    def unavailable_reason(self, device, param_dtype, grad_dtype):
        return None

    def grad_sq_norms(self, b: Bucket) -> torch.Tensor:
        return _sq(b.grads, _sq_dtype(b.grads), b.workspace)

    def sq_norms(self, tensors):
        tensors = list(tensors)
        return _sq(tensors, _sq_dtype(tensors))

    def pass1(self, kind, b: Bucket, h, hyper, grad_mult, found_inf):
        s = _Scalars(h, hyper)
        if kind == "lamb":
            return self.lamb_pass1(b, s, grad_mult, found_inf)
        return self.lars_pass1(b, s, grad_mult, found_inf)

    def pass2(self, kind, b: Bucket, h, hyper, sums, grad_mult, found_inf):
        s = _Scalars(h, hyper)
        if kind == "lamb":
            return self.lamb_pass2(b, s, sums, found_inf)
        return self.lars_pass2(b, s, sums, grad_mult, found_inf)

    # ----------------------------------------------------------------- LAMB
    def lamb_pass1(self, b: Bucket, h: _Scalars, grad_mult, found_inf):
        cd = b.compute_dtype
        t = _new_steps(b, found_inf)
        w = _compute_weights(b)
        g = _compute_grads(b, grad_mult)
        low = _low_precision(b.exp_avgs)
        m_old, v_old = b.exp_avgs, b.exp_avg_sqs
        if low:
            m_old, v_old = _read_lamb(m_old, v_old, w, low)
        m = _added(torch._foreach_mul(m_old, h.beta1), g, h.beta3, inplace=True)
        v = torch._foreach_mul(v_old, h.beta2)
        gg = torch._foreach_mul(g, h.one_minus_beta2)
        torch._foreach_mul_(gg, g)  # (1 - β2)·g·g in the order of docs/math.md
        torch._foreach_add_(v, gg)
        # u = (m·r1) / (sqrt(v)·r2 + eps) + λ·w: Note [bias-correction factors] in math.h, from
        # the moments as stored (docs/math.md, "Low-precision state")
        den = list(map(lowp.sqrt_rn, v))
        m_store, v_store = m, v
        if low:
            m_store, v_store, m = list(m), list(v), list(m)
            for i, fmt in low:
                if fmt == "bf16":
                    m_store[i], m[i] = lowp.write_bf16(m[i])
                    v_store[i], held = lowp.write_bf16(v[i], _bits(b, t, i, v[i].numel()))
                    den[i] = lowp.sqrt_rn(held)
        if h.bias_correction:
            r1 = _per_tensor(bias_correction(h.beta1, t).reciprocal().to(cd))
            r2 = _per_tensor(lowp.sqrt_rn(bias_correction(h.beta2, t)).reciprocal().to(cd))
            m_hat = torch._foreach_mul(m, r1)
            torch._foreach_mul_(den, r2)
        else:
            m_hat = m
        eps = h.eps
        torch._foreach_add_(den, [eps] * len(den) if isinstance(eps, torch.Tensor) else eps)
        u = list(torch._foreach_div(m_hat, den))
        for i, fmt in low:
            if fmt == "8bit":
                # docs/math.md, "8-bit": u = c·d + λ·w, c = r1 / r2, with d stored as m / (s + ε),
                # ε = eps / r2 (float32 divisions)
                e = (eps.to(torch.float32) if isinstance(eps, torch.Tensor)
                     else torch.tensor(eps, dtype=torch.float32)).to(w[i].device)
                c = torch.ones((), dtype=cd, device=w[i].device)
                if h.bias_correction:
                    e, c = e / r2[i], r1[i] / r2[i]
                bits = _bits(b, t, i, v[i].numel())
                m_store[i], v_store[i], d = lowp.step_write_lamb(m[i], v[i], e, bits)
                u[i] = c * d
        # λ·w also for λ = 0: 0·inf is NaN, as in every backend (Note [NaN propagation])
        _added(u, w, h.lambda_in_u, inplace=True)
        b.scratch.update(t=t, w=w, u=u, m=m_store, v=v_store)
        return torch.stack([_sq(w, cd, b.workspace), _sq(u, cd, b.workspace)], dim=1)

    def lamb_pass2(self, b: Bucket, h: _Scalars, sums, found_inf):
        s = b.scratch
        phi = lamb_trust_ratio(sums[:, 0], sums[:, 1], h)
        w = s["w"]
        if h.nonzero("decoupled_lambda"):
            decay = (1.0 - h.lr * h.decoupled_lambda if torch.compiler.is_compiling()
                     else h._h.decay_factor(b.compute_dtype))
            w = torch._foreach_mul(w, decay)
        step = torch._foreach_mul(s["u"], _per_tensor(-h.lr * phi))
        w_new = torch._foreach_add(w, step)
        _commit(b.exp_avgs, s["m"], found_inf)
        _commit(b.exp_avg_sqs, s["v"], found_inf)
        _commit_weights(b, w_new, found_inf)
        torch._foreach_copy_(b.steps, _per_tensor(s["t"]))
        b.scratch.clear()

    # ----------------------------------------------------------------- LARS
    def lars_pass1(self, b: Bucket, h: _Scalars, grad_mult, found_inf):
        cd = b.compute_dtype
        t = _new_steps(b, found_inf)
        w = _compute_weights(b)
        g = _compute_grads(b, grad_mult)
        d = _added(g, w, h.weight_decay)  # λ·w also for λ = 0 (Note [NaN propagation])
        b.scratch.update(t=t, w=w, d=d)
        return torch.stack([_sq(w, cd, b.workspace), _sq(d if h.combined else g, cd, b.workspace)],
                           dim=1)

    def lars_pass2(self, b: Bucket, h: _Scalars, sums, grad_mult, found_inf):
        s = b.scratch
        t, w = s["t"], s["w"]
        ratio = lars_trust_ratio(sums[:, 0], sums[:, 1], h)
        d = torch._foreach_mul(s["d"], _per_tensor(ratio))
        mu, buf, lr = h.momentum, b.momentum_buffers, h.lr
        low = _low_precision(buf)
        old = _read(buf, w, low) if low else buf
        if h.lr_in_momentum:
            lr_d = torch._foreach_mul(d, lr)  # h.lr may be a tensor (capturable steps)
            v = torch._foreach_mul(old, mu)
            torch._foreach_add_(v, lr_d)
        else:
            later = (t != 1).to(b.compute_dtype)  # torch SGD: the buffer starts as d at t = 1
            a = _per_tensor(later * mu)
            c = _per_tensor((torch.ones_like(later) * h.one_minus_dampening).where(
                later != 0, 1.0))
            v = torch._foreach_mul(old, a)
            torch._foreach_add_(v, torch._foreach_mul(d, c))
        v_store = v = list(v)
        if low:  # the step moves by the buffer computed, stored rounded (docs/math.md)
            v_store = list(v)
            for i, fmt in low:
                v_store[i] = (lowp.write_bf16(v[i])[0] if fmt == "bf16"
                              else lowp.step_write(v[i])[0])
        if h.lr_in_momentum:
            step = _added(lr_d, v, mu) if h.nesterov else v
        else:
            step = _added(d, v, mu) if h.nesterov else v
            step = torch._foreach_mul(step, lr)
        w_new = torch._foreach_sub(w, step)
        _commit(buf, v_store, found_inf)
        _commit_weights(b, w_new, found_inf)
        torch._foreach_copy_(b.steps, _per_tensor(t))
        b.scratch.clear()
