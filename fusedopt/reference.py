"""A plain float64 evaluation of docs/math.md: the test oracle.

One tensor at a time, written straight from the formulas, with no code shared with the backends
(it imports nothing from fusedopt). State is a dict per param index. Use it to check any backend:

    ref = ReferenceLAMB(hyper_per_group)                  # list of dicts of docs/math.md hyper-parameters
    ref.step(weights_per_group, grads_per_group)          # lists of float64 tensors, updated in place
"""
from __future__ import annotations

import math
from typing import Any

import torch

LAMB_SPEC = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
                 grad_averaging=True, max_grad_norm=None, trust_ratio_bounds=None,
                 decoupled_weight_decay=False, adapt=True)
LARS_SPEC = dict(momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=1e-8, nesterov=False,
                 dampening=0.0, trust_clip=False, denominator="sum", lr_in_momentum=True,
                 max_grad_norm=None, adapt=True)


def _norm(x: torch.Tensor) -> float:
    return math.sqrt(float((x.double() * x.double()).sum()))


def _ratio(num: float, den: float) -> float:
    return 1.0 if num == 0.0 or den == 0.0 else num / den


def _clip_divisor(groups, grads) -> list[float]:
    """``c = max(1, G / max_grad_norm)`` per group; NaN when G is (Python's ``max(1.0, nan)``
    would give 1: Note [NaN propagation])."""
    total = math.sqrt(sum(_norm(g) ** 2 for gs in grads for g in gs))
    out = []
    for h in groups:
        r = 1.0 if h["max_grad_norm"] is None else total / h["max_grad_norm"]
        out.append(1.0 if r <= 1.0 else r)
    return out


# ---------------------------------------------------------------- low-precision state
# docs/math.md "Low-precision state", written from its definitions in terms of values (frexp,
# floor) rather than bit patterns: a second statement of the formats beside fusedopt/lowp.py.
# A stored moment is kept here as its float64 value; the scales and products the formats define
# as float32 operations are evaluated in float32.
_BLOCK = 256


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def _random_bits(step: int, key: int, n: int) -> list[int]:
    base = _mix(_mix(0x9E3779B9 ^ (step & 0xFFFFFFFF)) ^ (key & 0xFFFFFFFF))
    first = key >> 32  # docs/math.md, "Random bits": the index of the first element stepped
    return [_mix(base ^ ((first + e) & 0xFFFFFFFF)) for e in range(n)]


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _minifloat(y: float, mant: int, frac_round) -> int | None:
    """Code ``(k + 15)·2^mant + j`` of ``y`` ≈ ``2^k·(1 + j/2^mant)`` (``frac_round`` rounds
    ``j``); None below the smallest magnitude ``2^-15``."""
    if y == 0.0:
        return None
    fr, e = math.frexp(y)  # y = fr·2^e, fr in [0.5, 1)
    k, j = e - 1, frac_round((2.0 * fr - 1.0) * (1 << mant))
    return (k + 15) * (1 << mant) + j


def _rne(x: float) -> int:
    return round(x)  # Python rounds halves to even


def _quantize_signed(x: list[float]) -> list[float]:
    """One block of a signed moment through the E4M3 map, values out."""
    a = max(abs(_f32(v)) for v in x)
    if not math.isfinite(a):
        return [math.nan] * len(x)
    f = _f32(a / 1.875) if a > 0 else 0.0
    q = _f32(1.875 / _f32(a)) if a > 0 else 0.0
    out = []
    for v in x:
        c = _minifloat(_f32(abs(_f32(v)) * q), 3, _rne)
        c = 0 if c is None or c < 1 else min(c, 127)
        mag = 0.0 if c == 0 else 2.0 ** (c // 8 - 15) * (1 + (c % 8) / 8)
        out.append(_f32(math.copysign(mag, v) * f))
    return out


def _quantize_root(v: list[float], bits: list[int] | None) -> list[float]:
    """One block of LAMB's v through the E4M4 map of √v: the square roots ``s`` out."""
    s = [_f32(math.sqrt(_f32(x))) if math.isfinite(x) else x for x in v]
    top = max(s)
    if not math.isfinite(top):
        return [math.nan] * len(v)
    f = _f32(top / 1.9375) if top > 0 else 0.0
    q = _f32(1.9375 / _f32(top)) if top > 0 else 0.0
    out = []
    for i, x in enumerate(s):
        if bits is None:
            c = _minifloat(_f32(x * q), 4, _rne)
        else:
            r = (bits[i] >> 13) / 2.0 ** 19
            c = _minifloat(_f32(x * q), 4, lambda j: math.floor(j + r))
        c = 0 if c is None or c < 0 else min(c, 255)
        out.append(_f32(2.0 ** (c // 16 - 15) * (1 + (c % 16) / 16) * f))
    return out


def _bf16_stochastic(x: float, bits: int) -> float:
    """float32 ``x`` to bf16: down to a multiple of bf16's spacing, up with probability equal to
    the fraction of the spacing above it (``(bits >> 16) / 2^16`` decides)."""
    if not math.isfinite(x) or x == 0.0:
        return x
    _, e = math.frexp(abs(x))
    ulp = 2.0 ** (max(e - 1, -126) - 7)
    y = math.floor(abs(x) / ulp + (bits >> 16) / 2.0 ** 16) * ulp
    return _f32(math.copysign(y, x))


def _store(fmt: str, x: torch.Tensor, *, root: bool, step: int = 0, key: int = 0) -> torch.Tensor:
    """A moment rounded to its format (values, float64; ``root``: LAMB's v, returned as v)."""
    if fmt == "full":
        return x
    # bf16 v draws its bits by the order of the param's elements in memory (x has the layout of
    # the param it was made like: its dims by decreasing stride), 8-bit blocks hold them in
    # row-major order
    dims = sorted(range(x.dim()), key=lambda d: -x.stride(d)) if fmt == "bf16" else range(x.dim())
    xm = x.permute(*dims)
    flat = [_f32(float(v)) for v in xm.reshape(-1)]
    bits = _random_bits(step, key, len(flat)) if root else None
    if fmt == "bf16":
        if root:
            out = [_bf16_stochastic(v, b) for v, b in zip(flat, bits)]
        else:
            out = [float(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16)) for v in flat]
    else:
        out = []
        for lo in range(0, len(flat), _BLOCK):
            blk = flat[lo:lo + _BLOCK]
            if root:
                out += [s * s for s in _quantize_root(blk, bits[lo:lo + _BLOCK])]
            else:
                out += _quantize_signed(blk)
    return torch.tensor(out, dtype=torch.float64).view(xm.shape).permute(
        *sorted(range(x.dim()), key=list(dims).__getitem__))


class _Reference:
    spec: dict[str, Any]

    def __init__(self, groups: list[dict[str, Any]]):
        self.groups = [{"state_precision": "full", "state_min_numel": 4096, **self.spec, **g}
                       for g in groups]
        self.state: dict[tuple[int, int], dict[str, Any]] = {}

    @staticmethod
    def _format(h, w: torch.Tensor) -> str:
        return "full" if w.numel() < h["state_min_numel"] else h["state_precision"]

    def step(self, weights: list[list[torch.Tensor]], grads: list[list[torch.Tensor | None]]):
        """Update float64 ``weights`` in place; a None grad skips that param (as torch does)."""
        present = [[g.double() for g in gs if g is not None] for gs in grads]
        clip = _clip_divisor(self.groups, present)
        for gi, (h, ws, gs) in enumerate(zip(self.groups, weights, grads)):
            for pi, (w, g) in enumerate(zip(ws, gs)):
                if g is None:
                    continue
                st = self.state.setdefault((gi, pi), {"step": 0})
                st["step"] += 1
                st["key"] = pi
                self._update(h, st, w, g.double() / clip[gi])


class ReferenceLAMB(_Reference):
    spec = LAMB_SPEC

    def _update(self, h, st, w, g):
        b1, b2 = h["betas"]
        t = st["step"]
        m = st.setdefault("exp_avg", torch.zeros_like(w))
        v = st.setdefault("exp_avg_sq", torch.zeros_like(w))
        b3 = (1.0 - b1) if h["grad_averaging"] else 1.0
        m.mul_(b1).add_(b3 * g)
        v.mul_(b2).add_((1.0 - b2) * g * g)
        fmt = self._format(h, w)
        m.copy_(_store(fmt, m, root=False))
        v.copy_(_store(fmt, v, root=True, step=t, key=st["key"]))
        self.apply(h, st, w)

    @staticmethod
    def apply(h, st, w):
        """The update of ``w`` from the moments as stored (``st``: ``step``, ``exp_avg``,
        ``exp_avg_sq`` after this step's moment update): the second half of a step."""
        t, m, v, b1, b2 = st["step"], st["exp_avg"], st["exp_avg_sq"], *h["betas"]
        lam = h["weight_decay"]
        if h["bias_correction"]:
            m_hat, v_hat = m / (1.0 - b1 ** t), v / (1.0 - b2 ** t)
        else:
            m_hat, v_hat = m, v
        u = m_hat / (v_hat.sqrt() + h["eps"])
        if not h["decoupled_weight_decay"]:
            u = u + lam * w
        phi = _ratio(_norm(w), _norm(u))
        if h["trust_ratio_bounds"] is not None:
            lo, hi = h["trust_ratio_bounds"]
            phi = min(max(phi, lo), hi)
        if not h["adapt"]:
            phi = 1.0
        if h["decoupled_weight_decay"]:
            w.mul_(1.0 - h["lr"] * lam)
        w.sub_(h["lr"] * phi * u)


class ReferenceLARS(_Reference):
    spec = LARS_SPEC

    def _update(self, h, st, w, g):
        lam, kappa, mu, lr = h["weight_decay"], h["trust_coefficient"], h["momentum"], h["lr"]
        w_n = _norm(w)
        if h["denominator"] == "sum":
            g_n = _norm(g)
            ratio = 1.0 if w_n == 0.0 or g_n == 0.0 else kappa * w_n / (g_n + lam * w_n + h["eps"])
        else:
            g_n = _norm(g + lam * w)
            ratio = 1.0 if w_n == 0.0 or g_n == 0.0 else kappa * w_n / (g_n + h["eps"])
        if h["trust_clip"]:
            ratio = min(ratio, 1.0)
        if not h["adapt"]:
            ratio = 1.0
        d = ratio * (g + lam * w)
        v = st.setdefault("momentum_buffer", torch.zeros_like(w))
        if h["lr_in_momentum"]:
            v.mul_(mu).add_(lr * d)
        elif st["step"] == 1:
            v.copy_(d)
        else:
            v.mul_(mu).add_((1.0 - h["dampening"]) * d)
        v.copy_(_store(self._format(h, w), v, root=False))  # the step uses the buffer as stored
        if h["lr_in_momentum"]:
            step = lr * d + mu * v if h["nesterov"] else v
        else:
            step = lr * (d + mu * v) if h["nesterov"] else lr * v
        w.sub_(step)
