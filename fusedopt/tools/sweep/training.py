"""The sweep's training: one run to the target (:func:`train_to_target`), the LR tuning on the
validation split (:func:`tune`) and the measurement runs (:func:`measure`).
"""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from ..digits import make_model, make_optimizer, noise_probe
from .config import batch_size, rule_lr
from .tuner import search_lr

# --------------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------------
def probe_levels(target_loss: float, initial_loss: float) -> list[float]:
    """Loss levels ``target_loss * 10^(k/2)``, k = 0, 1, ..., below ``initial_loss``, largest
    first."""
    levels, k = [], 0
    while True:
        level = target_loss * 10 ** (k / 2)
        if level >= initial_loss:
            break
        levels.append(level)
        k += 1
    return levels[::-1]


class _BatchStream:
    """Batches of exactly ``batch`` indices from a stream of shuffled epochs (an epoch boundary
    may fall inside a batch), so every step sees ``batch`` examples and ``E = B·S`` exactly."""

    def __init__(self, n: int, batch: int, generator: torch.Generator) -> None:
        self.n, self.batch, self.gen = n, batch, generator
        self.buf = torch.empty(0, dtype=torch.long)
        self.pos = 0

    def next(self) -> torch.Tensor | None:
        if self.batch >= self.n:
            return None  # the whole training set
        if self.pos + self.batch > len(self.buf):
            self.buf = torch.cat([self.buf[self.pos:], torch.randperm(self.n, generator=self.gen)])
            self.pos = 0
        idx = self.buf[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return idx


@torch.no_grad()
def _evaluate(model, x, y, x_ev, y_ev) -> tuple[float, float]:
    loss = torch.nn.functional.cross_entropy(model(x), y).item()
    acc = (model(x_ev).argmax(1) == y_ev).float().mean().item()
    return loss, acc


def train_to_target(spec: dict[str, Any], batch: int, lr: float, data, *, seed: int,
                    cfg: dict[str, Any], noise: bool = False,
                    init_probe: dict[str, float] | None = None,
                    step_cap: int | None = None) -> dict[str, Any]:
    """Train from the seed's initialization with peak LR ``lr`` until the target of ``cfg``,
    divergence, or the example cap. ``data = (x, y, x_eval, y_eval, n_classes)``; ``batch`` is
    clipped to the training set. With ``noise``, probe the gradient noise scale at the loss
    levels of :func:`probe_levels` (``init_probe``: an already measured probe at initialization).
    ``step_cap``: stop after this many steps with status "slower" (used by the tuning, where a
    run past it cannot win)."""
    from ...schedules import WarmupDecayLR

    x, y, x_ev, y_ev, n_classes = data
    n = len(y)
    batch = min(batch, n)
    base_batch = cfg["base_batch"]
    torch.manual_seed(seed)  # the same initialization for every run of this seed
    model = make_model(x.shape[1], n_classes)
    opt = make_optimizer(model, spec, lr)
    warmup = 0
    start = 1.0
    if batch > base_batch and cfg["warmup_epochs"] > 0:
        warmup = max(1, round(cfg["warmup_epochs"] * n / batch))
        start = rule_lr(spec, base_batch, base_batch) / rule_lr(spec, batch, base_batch)
    sched = WarmupDecayLR(opt, warmup, None, decay="none", warmup_start_factor=min(1.0, start))
    stream = _BatchStream(n, batch, torch.Generator().manual_seed(seed + 1))
    probe_gen = torch.Generator().manual_seed(seed + 2)
    max_steps = max(1, math.ceil(cfg["max_epochs"] * n / batch))
    capped = step_cap is not None and step_cap < max_steps
    if capped:
        max_steps = max(0, step_cap)

    t_start = time.perf_counter()
    loss0, acc0 = _evaluate(model, x, y, x_ev, y_ev)
    probes: list[dict[str, Any]] = []
    levels: list[float] = []
    if noise:
        p0 = init_probe or noise_probe(model, x, y, probe_gen, cfg["probe_windows"])
        probes.append(dict(level="init", step=0, loss=loss0, **p0))
        levels = probe_levels(cfg["target_loss"], loss0)
    status, steps, train_s = "not reached", 0, 0.0
    loss_step = acc_step = reached_step = None
    prev_eval, next_eval, resolution = 0, 1, math.nan
    loss, acc = loss0, acc0
    while steps < max_steps:
        t0 = time.perf_counter()
        idx = stream.next()
        opt.zero_grad(set_to_none=True)
        xb, yb = (x, y) if idx is None else (x[idx], y[idx])
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        sched.step()
        steps += 1
        train_s += time.perf_counter() - t0
        if steps < next_eval and steps < max_steps:
            continue
        loss, acc = _evaluate(model, x, y, x_ev, y_ev)
        if not math.isfinite(loss) or loss > cfg["diverge_factor"] * loss0:
            status = "diverged"
            break
        if loss_step is None and loss <= cfg["target_loss"]:
            loss_step = steps
        if acc_step is None and acc >= cfg["target_accuracy"]:
            acc_step = steps
        crossed = [lv for lv in levels if loss <= lv]
        if crossed:
            p = noise_probe(model, x, y, probe_gen, cfg["probe_windows"])
            probes += [dict(level=lv, step=steps, loss=loss, **p) for lv in crossed]
            levels = [lv for lv in levels if lv not in crossed]
        if loss <= cfg["target_loss"] and acc >= cfg["target_accuracy"]:
            status, reached_step = "reached", steps
            # the crossing happened at one of the steps prev_eval + 1 ... steps
            resolution = (steps - prev_eval - 1) / steps
            break
        prev_eval, next_eval = steps, steps + max(1, int(cfg["eval_ratio"] * steps))
    if capped and status == "not reached":
        status = "slower"
    return dict(
        batch=batch, lr=lr, seed=seed, status=status, steps=reached_step,
        examples=None if reached_step is None else reached_step * batch,
        loss_steps=loss_step, accuracy_steps=acc_step, steps_run=steps, max_steps=max_steps,
        warmup_steps=warmup, warmup_start_factor=min(1.0, start), resolution=resolution,
        initial_loss=loss0, final_loss=loss, final_accuracy=acc, train_time_s=train_s,
        wall_time_s=time.perf_counter() - t_start, probes=probes,
    )


# --------------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------------
def _bar(total: int, desc: str, progress: bool, unit: str = "run"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not progress, unit=unit, dynamic_ncols=True,
                leave=True)


def tune(cfg: dict[str, Any], data, progress: bool) -> dict[str, Any]:
    """For every (optimizer, batch): the validation steps-to-target at each multiplier of the
    rule's LR tried, and the chosen multiplier (fewest steps, mean over the tuning seeds, every
    seed must reach the target; ties to the multiplier closest to 1), by :func:`.tuner.search_lr`:
    ``lr_grid`` first, then (``tuning == "wide"``) factor-2 steps beyond it until the choice is
    interior or the multiplier reaches ``2**±lr_cap``.

    A multiplier is stopped ("slower") as soon as its mean can no longer beat the best so far:
    the choice is the same as running every multiplier to the end, at a fraction of the cost."""
    n = len(data[1])
    seeds = cfg["tune_seeds"]
    out: dict[str, Any] = {}
    bar = _bar(len(cfg["optimizers"]) * len(cfg["batches"]), "tuning (validation)", progress,
               unit="batch size")
    for name in cfg["optimizers"]:
        spec = cfg["specs"][name]
        out[name] = {}
        for b in cfg["batches"]:
            batch = batch_size(b, n)
            rule = rule_lr(spec, batch, cfg["base_batch"])

            def evaluate(m: float, best: float, spec=spec, batch=batch, rule=rule):
                lr = rule * m
                runs: list[dict[str, Any]] = []
                for seed in seeds:
                    if runs and runs[-1]["status"] != "reached":
                        runs.append(dict(status="skipped", steps=None, steps_run=0))
                        continue  # this multiplier has lost already
                    cap = None
                    if math.isfinite(best):  # the most steps this seed may take and still win
                        cap = math.floor(best * len(seeds) - sum(r["steps"] for r in runs))
                    bar.set_postfix_str(f"{name} B={batch} lr={lr:.3g}")
                    r = train_to_target(spec, batch, lr, data, seed=seed, cfg=cfg, step_cap=cap)
                    runs.append(dict(status=r["status"], steps=r["steps"],
                                     steps_run=r["steps_run"]))
                st = [r["status"] for r in runs]
                reached = all(s == "reached" for s in st)
                status = ("reached" if reached else "diverged" if "diverged" in st
                          else "slower" if "slower" in st else "not reached")
                return dict(lr=lr, status=status, runs=runs,
                            steps=float(np.mean([r["steps"] for r in runs])) if reached
                            else math.inf)

            res = search_lr(evaluate, cfg["lr_grid"], widen=cfg["tuning"] == "wide",
                            max_doublings=cfg["lr_cap"])
            bar.update()
            m = res["multiplier"]
            out[name][str(b)] = dict(batch=batch, rule_lr=rule, grid=res["cells"],
                                     multiplier=m, lr=rule * m, found=res["found"],
                                     edge=res["edge"], side=res["side"], capped=res["capped"])
    bar.close()
    return out


def measure(cfg: dict[str, Any], data, tuning: dict[str, Any], progress: bool,
            noise: bool) -> dict[str, Any]:
    """Measurement runs at every seed with the tuned multipliers."""
    n = len(data[1])
    init_probes: dict[int, dict[str, float]] = {}
    if noise:
        for seed in cfg["seeds"]:  # every run of a seed starts from the same parameters
            torch.manual_seed(seed)
            model0 = make_model(data[0].shape[1], data[4])
            init_probes[seed] = noise_probe(model0, data[0], data[1],
                                            torch.Generator().manual_seed(seed + 2),
                                            cfg["probe_windows"])
    out: dict[str, Any] = {}
    bar = _bar(len(cfg["optimizers"]) * len(cfg["batches"]) * len(cfg["seeds"]),
               "measuring (test)", progress)
    for name in cfg["optimizers"]:
        spec = cfg["specs"][name]
        out[name] = {}
        for b in cfg["batches"]:
            batch = batch_size(b, n)
            m = tuning[name][str(b)]["multiplier"]
            lr = rule_lr(spec, batch, cfg["base_batch"]) * m
            runs = []
            for seed in cfg["seeds"]:
                bar.set_postfix_str(f"{name} B={batch} lr={lr:.3g}")
                runs.append(train_to_target(spec, batch, lr, data, seed=seed, cfg=cfg,
                                            noise=noise, init_probe=init_probes.get(seed)))
                bar.update()
            out[name][str(b)] = dict(batch=batch, lr=lr, multiplier=m, runs=runs)
    bar.close()
    return out
