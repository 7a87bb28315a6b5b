"""A plain float64 evaluation of docs/math.md: the test oracle.

One tensor at a time, written straight from the formulas, with no code shared with the backends
(it imports nothing from fusedopt). State is a dict per param index. Use it to check any backend:

    ref = ReferenceLAMB(hyper_per_group)                  # list of dicts of docs/math.md hyper-parameters
    ref.step(weights_per_group, grads_per_group)          # lists of float64 tensors, updated in place
"""
from __future__ import annotations

import math
import struct
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
    return [(base + ((first + e) & 0xFFFFFFFF) * 0x9E3779B9) & 0xFFFFFFFF for e in range(n)]


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _rne(x: float) -> int:
    return round(x)  # Python rounds halves to even


_P_TINY = 2.0 ** -64


def _prescaled(a: float, c: float) -> tuple[float, float]:
    """``P`` and ``q = c / (a·P)`` of a block whose largest magnitude is ``a`` (docs/math.md)."""
    p = 2.0 ** 64 if a < _P_TINY else 1.0
    return p, (_f32(c / _f32(a * p)) if a > 0 else 0.0)


def _quantize_direction(x: list[float]) -> list[float]:
    """One block of LAMB's direction ``d`` through the linear map, values out."""
    a = max(abs(_f32(v)) for v in x)
    if not math.isfinite(a):
        return [math.nan] * len(x)
    f = _f32(a / 127.0)
    p, q = _prescaled(a, 127.0)
    return [_f32(max(-127, min(127, _rne(_f32(_f32(_f32(v) * p) * q)))) * f) for v in x]


def _float_of(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bits_of(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0] & 0x7FFFFFFF


def _quantize_root(s: list[float], bits: list[int] | None) -> list[float]:
    """One block of roots ``s = √v`` (float32 values) through the root map, values out: the bit
    patterns of the stored values lie ``2^sh`` apart below the block's largest."""
    b = [_bits_of(x) if not math.isnan(x) else 0x7FC00000 for x in s]
    top = max(b)
    if top >= 0x7F800000:
        return [math.nan] * len(s)
    low = min((x for x in b if x > 0), default=top)
    low = max(low, top - (24 << 23))
    sh = next(k for k in range(21) if top - low <= 254 << k)
    out = []
    for i, x in enumerate(b):
        if x == 0:
            out.append(0.0)
            continue
        r = ((bits[i] >> 1) >> (31 - sh)) if bits is not None else (1 << sh) >> 1
        k = min((top - x + r) >> sh, 254)
        out.append(_float_of(max(top - (k << sh), 0)))
    return out


def _dynamic_value(mag: int) -> float:
    """``V[mag]`` of LARS's dynamic map (docs/math.md), float32 operations."""
    if mag == 0 or mag == 127:
        return float(mag // 127)
    level = mag.bit_length() - 1
    n = 63 if level == 6 else 1 << level
    return _f32(_f32(1.0 + _f32((7.0 * (mag - (1 << level) + 0.5)) / n)) * 8.0 ** -(7 - level))


def _quantize_dynamic(x: list[float]) -> list[float]:
    """One block of LARS's buffer through the dynamic map of base 8, values out."""
    a = max(abs(_f32(v)) for v in x)
    if not math.isfinite(a):
        return [math.nan] * len(x)
    p, q = _prescaled(a, 1.0)
    out = []
    for v in x:
        y = _f32(_f32(abs(_f32(v)) * p) * q)
        if abs(_f32(v)) == a and a > 0:
            mag = 127
        elif y == 0.0 or y < 8.0 ** -7:
            mag = 0
        else:
            e2 = math.frexp(y)[1] - 1  # y in [2^e2, 2^(e2+1))
            t = (-e2 - 1) // 3
            level, n = 6 - t, (63 if t == 0 else 1 << (6 - t))
            z = y * 8.0 ** (t + 1)
            j = min(math.floor(_f32((z - 1.0) * _f32(n / 7.0))), n - 1)
            mag = (1 << level) + j
        # to the nearest value (docs/math.md): a decade's part, or at its edge the neighbour
        if mag >= 1 and y < _f32((_dynamic_value(mag - 1) + _dynamic_value(mag)) * 0.5):
            mag -= 1
        elif mag <= 126 and y >= _f32((_dynamic_value(mag) + _dynamic_value(mag + 1)) * 0.5):
            mag += 1
        out.append(_f32(math.copysign(_dynamic_value(mag) * a, v) if mag else 0.0))
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


def _store(fmt: str, x: torch.Tensor, how: str, *, step: int = 0, key: int = 0) -> torch.Tensor:
    """A moment rounded to its format (values, float64). ``how``: for bf16 "nearest" or
    "stochastic"; for 8-bit the map, "direction", "root" (``x`` holds roots) or "dynamic"."""
    if fmt == "full":
        return x
    # bf16 v draws its bits by the order of the param's elements in memory (x has the layout of
    # the param it was made like: its dims by decreasing stride), 8-bit blocks hold them in
    # row-major order
    dims = sorted(range(x.dim()), key=lambda d: -x.stride(d)) if fmt == "bf16" else range(x.dim())
    xm = x.permute(*dims)
    flat = [_f32(float(v)) for v in xm.reshape(-1)]
    bits = _random_bits(step, key, len(flat)) if how in ("stochastic", "root") else None
    if how == "stochastic":
        out = [_bf16_stochastic(v, b) for v, b in zip(flat, bits)]
    elif how == "nearest":
        out = [float(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16)) for v in flat]
    else:
        block = {"direction": _quantize_direction, "dynamic": _quantize_dynamic}.get(how)
        out = []
        for lo in range(0, len(flat), _BLOCK):
            blk = flat[lo:lo + _BLOCK]
            out += (_quantize_root(blk, bits[lo:lo + _BLOCK]) if how == "root" else block(blk))
    return torch.tensor(out, dtype=torch.float64).view(xm.shape).permute(
        *sorted(range(x.dim()), key=list(dims).__getitem__))


_FLT_MAX = 3.4028234663852886e38


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
        fmt = self._format(h, w)
        m = st.setdefault("exp_avg", torch.zeros_like(w))
        v = st.setdefault("exp_avg_sq", torch.zeros_like(w))
        if fmt == "8bit":  # the state holds d and s (docs/math.md, "8-bit")
            d, s = m, v
            m, v = d * (s + st.get("eps", 0.0)), s * s
        b3 = (1.0 - b1) if h["grad_averaging"] else 1.0
        m = m * b1 + b3 * g
        v = v * b2 + (1.0 - b2) * g * g
        if fmt == "8bit":
            r1, r2 = self.factors(h, t)
            eps = _f32(_f32(h["eps"]) / r2)
            s = _store(fmt, v.clamp(max=_FLT_MAX).sqrt(), "root", step=t, key=st["key"])
            d = _store(fmt, m / (s + eps), "direction")
            st.update(exp_avg=d, exp_avg_sq=s, eps=eps, direction=d * _f32(r1 / r2))
        else:
            st["exp_avg"] = _store(fmt, m, "nearest")
            st["exp_avg_sq"] = _store(fmt, v, "stochastic", step=t, key=st["key"])
        self.apply(h, st, w)

    @staticmethod
    def factors(h, t: int) -> tuple[float, float]:
        """``r1`` and ``r2`` rounded to float32, as the backends compute them."""
        if not h["bias_correction"]:
            return 1.0, 1.0
        b1, b2 = h["betas"]
        return _f32(1.0 / (1.0 - b1 ** t)), _f32(1.0 / math.sqrt(1.0 - b2 ** t))

    @staticmethod
    def apply(h, st, w):
        """The update of ``w`` from the moments as stored (``st``: ``step``, ``exp_avg``,
        ``exp_avg_sq`` after this step's moment update): the second half of a step."""
        t, m, v, b1, b2 = st["step"], st["exp_avg"], st["exp_avg_sq"], *h["betas"]
        lam = h["weight_decay"]
        if "direction" in st:  # 8-bit: u = (r1 / r2)·d + λ·w
            u = st["direction"].clone()
        elif h["bias_correction"]:
            m_hat, v_hat = m / (1.0 - b1 ** t), v / (1.0 - b2 ** t)
            u = m_hat / (v_hat.sqrt() + h["eps"])
        else:
            u = m / (v.sqrt() + h["eps"])
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
        fmt = self._format(h, w)
        # the step moves by the buffer computed; the state keeps it rounded (docs/math.md)
        st["momentum_buffer"] = _store(fmt, v, "dynamic" if fmt == "8bit" else "nearest")
        if h["lr_in_momentum"]:
            step = lr * d + mu * v if h["nesterov"] else v
        else:
            step = lr * (d + mu * v) if h["nesterov"] else lr * v
        w.sub_(step)
