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


class _Reference:
    spec: dict[str, Any]

    def __init__(self, groups: list[dict[str, Any]]):
        self.groups = [{**self.spec, **g} for g in groups]
        self.state: dict[tuple[int, int], dict[str, Any]] = {}

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
                self._update(h, st, w, g.double() / clip[gi])


class ReferenceLAMB(_Reference):
    spec = LAMB_SPEC

    def _update(self, h, st, w, g):
        b1, b2 = h["betas"]
        lam = h["weight_decay"]
        t = st["step"]
        m = st.setdefault("exp_avg", torch.zeros_like(w))
        v = st.setdefault("exp_avg_sq", torch.zeros_like(w))
        b3 = (1.0 - b1) if h["grad_averaging"] else 1.0
        m.mul_(b1).add_(b3 * g)
        v.mul_(b2).add_((1.0 - b2) * g * g)
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
            step = lr * d + mu * v if h["nesterov"] else v.clone()
        else:
            if st["step"] == 1:
                v.copy_(d)
            else:
                v.mul_(mu).add_((1.0 - h["dampening"]) * d)
            step = lr * (d + mu * v) if h["nesterov"] else lr * v
        w.sub_(step)
