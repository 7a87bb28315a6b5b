"""Hyper-parameters: defaults (written once), validation, and the host-side scalars of a step.

Every backend receives the frozen :class:`LambHyper` / :class:`LarsHyper` built here, so the values
derived on the host (``beta3``, the bound switches, ...) are computed in exactly one place.
Per-tensor values that depend on the step count (the bias corrections ``1 - beta^t``) are computed
by the backends from the step tensors, with the formula of :func:`bias_correction`.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

BACKEND_NAMES = ("auto", "eager", "cpp", "triton", "cuda")
DENOMINATORS = ("sum", "combined")

LAMB_DEFAULTS: dict[str, Any] = dict(
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-6,
    weight_decay=0.01,
    bias_correction=True,
    grad_averaging=True,
    max_grad_norm=None,
    trust_ratio_bounds=None,
    decoupled_weight_decay=False,
    adapt=True,
)

LARS_DEFAULTS: dict[str, Any] = dict(
    momentum=0.9,
    weight_decay=0.0,
    trust_coefficient=0.001,
    eps=1e-8,
    nesterov=False,
    dampening=0.0,
    trust_clip=False,
    denominator="sum",
    lr_in_momentum=True,
    max_grad_norm=None,
    adapt=True,
)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_lr(lr: Any) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.is_complex() or not lr.is_floating_point():
            raise ValueError(f"Invalid lr: a tensor lr must be a real floating-point scalar, got {lr!r}")
        return
    if not _is_real(lr) or not (lr >= 0.0) or math.isinf(lr):
        raise ValueError(f"Invalid lr: {lr!r}; expected a finite number >= 0")


def _check_nonneg(name: str, x: Any) -> None:
    if not _is_real(x) or not (x >= 0.0) or math.isinf(x):
        raise ValueError(f"Invalid {name}: {x!r}; expected a finite number >= 0")


def _check_bool(name: str, x: Any) -> None:
    if not isinstance(x, bool):
        raise ValueError(f"Invalid {name}: {x!r}; expected True or False")


def _check_max_grad_norm(x: Any) -> None:
    if x is None:
        return
    if not _is_real(x) or not (x > 0.0):
        raise ValueError(
            f"Invalid max_grad_norm: {x!r}; expected None (no clipping) or a number > 0"
        )


def check_backend_name(backend: Any) -> None:
    if backend not in BACKEND_NAMES:
        raise ValueError(f"Invalid backend: {backend!r}; expected one of {BACKEND_NAMES}")


def validate_lamb_group(g: dict[str, Any]) -> None:
    """Raise ValueError naming the first invalid LAMB hyper-parameter of a param group."""
    _check_lr(g["lr"])
    betas = g["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r}; expected a pair (beta1, beta2)")
    for i, b in enumerate(betas, start=1):
        if not _is_real(b) or not (0.0 <= b < 1.0):
            raise ValueError(f"Invalid beta{i}: {b!r}; expected 0 <= beta{i} < 1")
    _check_nonneg("eps", g["eps"])
    _check_nonneg("weight_decay", g["weight_decay"])
    for name in ("bias_correction", "grad_averaging", "decoupled_weight_decay", "adapt"):
        _check_bool(name, g[name])
    _check_max_grad_norm(g["max_grad_norm"])
    bounds = g["trust_ratio_bounds"]
    if bounds is not None:
        if not isinstance(bounds, (tuple, list)) or len(bounds) != 2 or not all(map(_is_real, bounds)):
            raise ValueError(
                f"Invalid trust_ratio_bounds: {bounds!r}; expected None or a pair (lo, hi)"
            )
        lo, hi = bounds
        if not (0.0 <= lo <= hi):
            raise ValueError(
                f"Invalid trust_ratio_bounds: {bounds!r}; expected 0 <= lo <= hi"
            )


def validate_lars_group(g: dict[str, Any]) -> None:
    """Raise ValueError naming the first invalid LARS hyper-parameter of a param group."""
    _check_lr(g["lr"])
    _check_nonneg("momentum", g["momentum"])
    _check_nonneg("weight_decay", g["weight_decay"])
    _check_nonneg("eps", g["eps"])
    tc = g["trust_coefficient"]
    if not _is_real(tc) or not (tc > 0.0) or math.isinf(tc):
        raise ValueError(f"Invalid trust_coefficient: {tc!r}; expected a finite number > 0")
    damp = g["dampening"]
    if not _is_real(damp) or not (0.0 <= damp <= 1.0):
        raise ValueError(f"Invalid dampening: {damp!r}; expected 0 <= dampening <= 1")
    for name in ("nesterov", "trust_clip", "lr_in_momentum", "adapt"):
        _check_bool(name, g[name])
    if g["nesterov"] and (g["momentum"] <= 0 or damp != 0):
        raise ValueError(
            f"Invalid nesterov=True with momentum={g['momentum']!r}, dampening={damp!r}; "
            "Nesterov momentum requires momentum > 0 and dampening = 0"
        )
    if g["denominator"] not in DENOMINATORS:
        raise ValueError(
            f"Invalid denominator: {g['denominator']!r}; expected one of {DENOMINATORS}"
        )
    _check_max_grad_norm(g["max_grad_norm"])


@dataclass(frozen=True)
class LambHyper:
    """Host-side scalars of one LAMB param group (docs/math.md symbols)."""

    lr: float | torch.Tensor
    beta1: float
    beta2: float
    beta3: float  # (1 - beta1) if grad_averaging else 1
    eps: float
    weight_decay: float  # lambda; 0 for excluded params
    bias_correction: bool
    adapt: bool
    decoupled: bool
    bounded: bool  # trust_ratio_bounds given
    ratio_lo: float
    ratio_hi: float
    max_grad_norm: float | None


@dataclass(frozen=True)
class LarsHyper:
    """Host-side scalars of one LARS param group (docs/math.md symbols)."""

    lr: float | torch.Tensor
    momentum: float  # mu
    dampening: float
    weight_decay: float  # lambda
    trust_coefficient: float  # kappa
    eps: float
    nesterov: bool
    trust_clip: bool
    combined: bool  # denominator == "combined"
    lr_in_momentum: bool
    adapt: bool
    max_grad_norm: float | None


def lamb_hyper(g: dict[str, Any]) -> LambHyper:
    beta1, beta2 = (float(b) for b in g["betas"])
    bounds = g["trust_ratio_bounds"]
    return LambHyper(
        lr=g["lr"] if isinstance(g["lr"], torch.Tensor) else float(g["lr"]),
        beta1=beta1,
        beta2=beta2,
        beta3=(1.0 - beta1) if g["grad_averaging"] else 1.0,
        eps=float(g["eps"]),
        weight_decay=float(g["weight_decay"]),
        bias_correction=bool(g["bias_correction"]),
        adapt=bool(g["adapt"]),
        decoupled=bool(g["decoupled_weight_decay"]),
        bounded=bounds is not None,
        ratio_lo=float(bounds[0]) if bounds is not None else 0.0,
        ratio_hi=float(bounds[1]) if bounds is not None else math.inf,
        max_grad_norm=None if g["max_grad_norm"] is None else float(g["max_grad_norm"]),
    )


def lars_hyper(g: dict[str, Any]) -> LarsHyper:
    return LarsHyper(
        lr=g["lr"] if isinstance(g["lr"], torch.Tensor) else float(g["lr"]),
        momentum=float(g["momentum"]),
        dampening=float(g["dampening"]),
        weight_decay=float(g["weight_decay"]),
        trust_coefficient=float(g["trust_coefficient"]),
        eps=float(g["eps"]),
        nesterov=bool(g["nesterov"]),
        trust_clip=bool(g["trust_clip"]),
        combined=g["denominator"] == "combined",
        lr_in_momentum=bool(g["lr_in_momentum"]),
        adapt=bool(g["adapt"]),
        max_grad_norm=None if g["max_grad_norm"] is None else float(g["max_grad_norm"]),
    )
