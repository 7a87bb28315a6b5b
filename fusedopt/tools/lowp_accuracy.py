"""How far 8-bit optimizer state moves a run from full state, beside the peers' 8-bit optimizers.

The same test for every optimizer: a weight, 50 steps of the same gradients (noise only, or a
fixed signal plus noise), once with full state and once with 8-bit state of the same optimizer;
the error is the relative distance of the 8-bit run's movement from the full-state run's,
``‖Δ8 − Δ32‖ / ‖Δ32‖``, the worst of the seeds. Rows: FusedLAMB and FusedLARS with
``state_precision="8bit"`` against their full state, and the peers that are installed:
bitsandbytes' AdamW8bit and torchao's AdamW8bit against torch's AdamW, bitsandbytes' SGD8bit
(momentum) against its 32-bit SGD. ``bench/low_precision.py --accuracy`` prints the table;
tests/test_low_precision_peers.py holds fusedopt to it.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Callable

import torch

import fusedopt

REGIMES = ("noise", "signal")


def gradients(shape, seed: int, regime: str):
    """(start weight, step -> gradient) of a run: unit noise, plus a fixed signal of standard
    deviation 0.3 per element for ``regime="signal"``."""
    gen0 = torch.Generator().manual_seed(seed)
    start = torch.randn(shape, generator=gen0)
    signal = torch.randn(shape, generator=gen0) * 0.3 if regime == "signal" else None
    gen = torch.Generator().manual_seed(seed + 1)
    cache: dict[int, torch.Tensor] = {}

    def grad(t: int) -> torch.Tensor:
        if t not in cache:
            g = torch.randn(shape, generator=gen)
            cache[t] = g + signal if signal is not None else g
        return cache[t]

    return start, grad


def movement(make: Callable, start: torch.Tensor, grad: Callable, steps: int) -> torch.Tensor:
    p = torch.nn.Parameter(start.clone())
    opt = make([p])
    for t in range(steps):
        p.grad = grad(t).clone()
        opt.step()
    return p.detach() - start


def error(make_full: Callable, make_8bit: Callable, regime: str, *, shape=(1024, 1024),
          seeds=(0, 1), steps: int = 50) -> float:
    """The worst over ``seeds`` of ``‖Δ8 − Δ32‖ / ‖Δ32‖``."""
    out = []
    for seed in seeds:
        start, grad = gradients(shape, seed, regime)
        a = movement(make_full, start, grad, steps)
        b = movement(make_8bit, start, grad, steps)
        out.append(float((b - a).norm() / a.norm()))
    return max(out)


LARS = dict(lr=0.1, weight_decay=1e-4)


def rows() -> dict[str, tuple[Callable, Callable]]:
    """name -> (full-state optimizer, 8-bit optimizer) for fusedopt and the installed peers."""
    out = {
        "FusedLAMB 8bit vs fp32 state": (
            lambda p: fusedopt.FusedLAMB(p, backend="cpp"),
            lambda p: fusedopt.FusedLAMB(p, backend="cpp", state_precision="8bit")),
        "FusedLARS 8bit vs fp32 state": (
            lambda p: fusedopt.FusedLARS(p, backend="cpp", **LARS),
            lambda p: fusedopt.FusedLARS(p, backend="cpp", state_precision="8bit", **LARS)),
    }
    for label, peer in peers().items():
        out[label] = peer
    return out


def peers() -> dict[str, tuple[Callable, Callable]]:
    """The peers' rows, those whose library imports (bitsandbytes, torchao)."""
    out = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bnb = importlib.import_module("bitsandbytes")
        out["bitsandbytes AdamW8bit vs torch AdamW"] = (
            lambda p: torch.optim.AdamW(p), lambda p: bnb.optim.AdamW8bit(p))
        out["bitsandbytes SGD8bit vs its SGD"] = (
            lambda p: bnb.optim.SGD(p, lr=0.1, momentum=0.9),
            lambda p: bnb.optim.SGD8bit(p, lr=0.1, momentum=0.9))
    except Exception:  # noqa: BLE001 - a peer that does not import is left out
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ao = importlib.import_module("torchao.optim")
        out["torchao AdamW8bit vs torch AdamW"] = (
            lambda p: torch.optim.AdamW(p), lambda p: ao.AdamW8bit(p))
    except Exception:  # noqa: BLE001
        pass
    return out


def table(shape=(1024, 1024), seeds=(0, 1), steps: int = 50) -> dict[str, dict[str, float]]:
    """name -> {regime: error} for every row."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: {r: error(a, b, r, shape=shape, seeds=seeds, steps=steps) for r in REGIMES}
                for name, (a, b) in rows().items()}
