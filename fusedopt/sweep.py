r"""The large-batch trade-off, measured: ``python -m fusedopt demo sweep``.

For every batch size ``B`` (powers of two from :data:`SWEEP` ``["batches"]`` up to the whole
training set) and three optimizers (momentum SGD with the linear scaling rule and warm-up,
:class:`fusedopt.FusedLARS`, :class:`fusedopt.FusedLAMB`), train the demo's MLP on scikit-learn's
digits until it reaches a fixed target, and record the optimizer steps ``S`` and the training
examples ``E = B·S`` it took. Then, per optimizer, fit the model of McCandlish, Kaplan, Amodei et
al. 2018 ("An empirical model of large-batch training")::

    (S / S_min − 1) · (E / E_min − 1) = 1,        B_crit = E_min / S_min

and compare ``B_crit`` with the gradient noise scale ``B_noise`` measured by
:class:`fusedopt.GradientNoiseScale` during the same runs, at the same points in training.

Three phases:

1. **Tuning** (train/validation split: 80% of the training set / 20% held out; the test set is
   not loaded). For each optimizer and batch size, the peak LR is the value the optimizer's
   scaling rule predicts from its base LR at :data:`SWEEP` ``["base_batch"]``, times each
   multiplier of ``lr_grid``; the multiplier with the fewest steps to the target (training loss
   on the 80%, accuracy on the validation 20%) is kept. Ties go to the multiplier closest to 1.
2. **Measurement** (the whole training set, accuracy on the test set), at ``seeds``: the kept
   multiplier times the rule's LR at this batch size. Gradient-noise-scale probes run when the
   training loss first falls below each of a fixed ladder of loss levels (the same levels for
   every run) and at initialization.
3. **Fit** (:func:`fit_hyperbola`), bootstrap over the seeds, tables, and the plot.

A run ends at the first evaluation where the target holds ("reached"), when its loss becomes
non-finite or grows past ``diverge_factor`` times its initial loss ("diverged"), or after
``max_epochs`` epochs' worth of examples ("not reached"). A (batch, optimizer) pair that does not
reach the target is kept in every table and in the right-hand panel of the plot, and left out of
the fit (its steps are only known to exceed the cap).

Every hyper-parameter is in :data:`SWEEP` and :data:`OPTIMIZERS` below with how it was chosen.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from typing import Any, Sequence

import numpy as np
import torch

from . import demo
from .demo import DemoError, parse_overrides

# --------------------------------------------------------------------------------------------
# Hyper-parameters
# --------------------------------------------------------------------------------------------
SWEEP: dict[str, Any] = dict(
    # Powers of two from 16, then the whole training set ("full"; the tuning split is 80% of the
    # measurement training set, so its "full" batch is smaller).
    batches=(16, 32, 64, 128, 256, 512, 1024, "full"),
    # The batch at which each optimizer's base LR was chosen; the scaling rules extrapolate from
    # it, and warm-up is used above it.
    base_batch=16,
    # Measurement seeds (initialization, data order, probe draws). Four rather than the minimum
    # of two: a bootstrap over two seeds per batch size understates the spread.
    seeds=(0, 1, 2, 3),
    # Tuning seeds, disjoint from the measurement seeds; a grid LR counts only if it reaches
    # the target at every one (the fastest LR is often next to the divergent one, and one seed
    # can be lucky there).
    tune_seeds=(100, 101),
    # Multipliers of the rule's LR tried at every batch size: one factor of 2 either side. A
    # choice at the edge of the grid says the rule is off there; the grid is deliberately not
    # widened to hide it.
    lr_grid=(0.5, 1.0, 2.0),
    # Target: training loss (cross-entropy over the whole training set) at most target_loss AND
    # held-out accuracy (validation in tuning, test in measurement) at least target_accuracy,
    # both at the same evaluation. target_loss: low enough that the largest batches need tens of
    # steps (each one evaluated), high enough that all three optimizers reach it at the smallest
    # batch in a small fraction of max_epochs at every seed (a lower target leaves LARS, at a
    # constant LR, stuck on a loss floor above it at batch 16 for some seeds).
    # target_accuracy: a floor, not the binding part: it only stops an LR that fits the
    # training set without generalizing from winning the tuning (each run records both
    # crossings).
    target_loss=0.03,
    target_accuracy=0.95,
    # Cap on examples per run, in epochs: several times what the slowest optimizer needs at the
    # smallest batch with its tuned LR.
    max_epochs=60,
    # Evaluate when the step count has grown by this fraction since the previous evaluation, and
    # after every step while that is less than one step: steps-to-target is exact below
    # 1/eval_ratio steps and resolved within eval_ratio above.
    eval_ratio=0.03,
    # Linear warm-up (Goyal et al.) over this many epochs for batches above base_batch, from
    # the peak divided by the rule's scale factor (Goyal's η to kη) up to the peak; the LR is
    # then constant (a run ends at the target, so there is no planned length for a decay to end
    # at). Longer warm-ups were checked with --warmup-epochs, see docs/large-batch.md.
    warmup_epochs=1.0,
    # A loss above this times the initial loss (or non-finite): diverged, stop early. High
    # enough that a transient spike that recovers is not cut short.
    diverge_factor=10.0,
    # Noise-scale probes: at initialization and when the training loss first falls below each
    # level target_loss * 10^(k/2), k = 0, 1, ... (levels below the initial loss); each probe
    # averages probe_windows big batches of 16 x 32 examples (see demo.noise_probe).
    probe_windows=4,
    bootstrap=1000,        # bootstrap resamples of the seeds for the B_crit interval
)

# --quick: a look at the shape in a fraction of the default's time (the smallest batches are the
# slowest runs, so it starts at 32; one tuning seed, shorter probes).
QUICK: dict[str, Any] = dict(batches=(32, 128, 512, "full"), tune_seeds=(100,), probe_windows=2,
                             bootstrap=200)

OPTIMIZERS: dict[str, dict[str, Any]] = {
    # Goyal et al. 2017: LR x k for batch x k, warm-up from the base LR. Momentum, weight decay
    # (none on biases) as in the demo's SGD recipes.
    "sgd": dict(label="SGD (linear rule + warm-up)", optimizer="sgd", rule="linear",
                base_lr=0.04, momentum=0.9, weight_decay=5e-4),
    # You, Gitman, Ginsburg 2017: trust coefficient 0.001, momentum 0.9, biases excluded from
    # decay and adaptation (fusedopt.param_groups); the LR scaled linearly, as the paper does.
    "lars": dict(label="LARS", optimizer="lars", rule="linear", base_lr=1.25, momentum=0.9,
                 weight_decay=5e-4, trust_coefficient=0.001),
    # You et al. 2019: betas (0.9, 0.999), eps 1e-6, weight decay 0.01 on matrices, LR scaled
    # with the square root of the batch (the paper's rule).
    "lamb": dict(label="LAMB", optimizer="lamb", rule="sqrt", base_lr=0.007, weight_decay=0.01,
                 betas=(0.9, 0.999), eps=1e-6),
}
# base_lr: chosen at base_batch on the validation split (fewest steps to the target, as in the
# tuning phase, tuning seed) from the factor-2 grid x {1/8, ..., 16} around the demo's tuned LR
# carried to batch 16 by the same rule (SGD 0.02 at 32 -> 0.01; LARS 5 at 512 -> 0.15625;
# LAMB 0.02 at 512 -> 0.0035):
#   python -m fusedopt demo sweep --tune-only --batches 16 --lr-grid 0.125,0.25,0.5,1,2,4,8,16 \
#       --set sgd.base_lr=0.01 --set lars.base_lr=0.15625 --set lamb.base_lr=0.0035


# --------------------------------------------------------------------------------------------
# the fit
# --------------------------------------------------------------------------------------------
class FitError(ValueError):
    """The points do not determine a hyperbola with positive S_min and E_min."""


def fit_hyperbola(steps: Sequence[float], examples: Sequence[float]) -> tuple[float, float]:
    r"""``(S_min, E_min)`` of ``(S/S_min − 1)(E/E_min − 1) = 1`` through the points ``(S, E)``.

    Multiplying out, that hyperbola is exactly ``S_min/S + E_min/E = 1``, which is *linear* in
    the unknowns ``(S_min, E_min)``: this is an ordinary linear least-squares problem (numpy's
    ``lstsq``) on the rows ``[1/S_i, 1/E_i]`` with right-hand side 1. A point measured with a
    relative error ``δ`` in ``S`` (and so in ``E = B·S``) has a residual of about ``δ``, so the
    fit weighs every batch size by the relative error of its step count.

    Raises:
        FitError: fewer than 2 points, a non-positive or non-finite value, or a solution with
            ``S_min <= 0`` or ``E_min <= 0`` (the points do not bend: no trade-off visible).
    """
    s = np.asarray(steps, dtype=np.float64).reshape(-1)
    e = np.asarray(examples, dtype=np.float64).reshape(-1)
    if s.shape != e.shape:
        raise FitError(f"{len(s)} step counts but {len(e)} example counts")
    if len(s) < 2:
        raise FitError(f"need at least 2 (S, E) points to fit S_min and E_min, got {len(s)}")
    if not (np.all(np.isfinite(s)) and np.all(np.isfinite(e)) and np.all(s > 0)
            and np.all(e > 0)):
        raise FitError("steps and examples must be finite and > 0")
    a = np.stack([1.0 / s, 1.0 / e], axis=1)
    (s_min, e_min), *_ = np.linalg.lstsq(a, np.ones_like(s), rcond=None)
    # (a vanishing S_min or E_min, from rounding on points without a bend, counts as <= 0)
    if not (s_min > 1e-9 * s.min() and e_min > 1e-9 * e.min()):
        raise FitError(f"no trade-off in these points: least squares gives S_min = {s_min:.4g}, "
                       f"E_min = {e_min:.4g} (both must be > 0)")
    return float(s_min), float(e_min)


def hyperbola_points(s_min: float, e_min: float,
                     batches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(S, E)`` on the fitted hyperbola at batch sizes ``batches``:
    ``S = S_min(1 + B_crit/B)``, ``E = E_min(1 + B/B_crit)``."""
    b_crit = e_min / s_min
    b = np.asarray(batches, dtype=np.float64)
    return s_min * (1 + b_crit / b), e_min * (1 + b / b_crit)


def bootstrap_fit(steps_per_batch: dict[int, list[float]], n_boot: int,
                  rng: np.random.Generator) -> dict[str, Any]:
    """Fit the seed-mean steps of every batch size, and ``n_boot`` refits where each batch
    size's seeds are resampled with replacement. ``steps_per_batch``: ``{B: [S per seed]}``.
    Returns S_min, E_min, B_crit, the 16th/84th percentiles of each over the resamples, and the
    rms residual of the fit (about the rms relative error of the steps)."""
    batches = sorted(steps_per_batch)
    mean_s = np.array([np.mean(steps_per_batch[b]) for b in batches])
    s_min, e_min = fit_hyperbola(mean_s, mean_s * np.array(batches, dtype=np.float64))
    reps = []
    for _ in range(n_boot):
        s = np.array([np.mean(rng.choice(steps_per_batch[b], size=len(steps_per_batch[b])))
                      for b in batches])
        try:
            reps.append(fit_hyperbola(s, s * np.array(batches, dtype=np.float64)))
        except FitError:
            continue
    # relative misfit of each batch size's steps (the residual of the linear fit, see
    # fit_hyperbola): how well the hyperbola describes the points at all
    resid = 1.0 - s_min / mean_s - e_min / (mean_s * np.array(batches, dtype=np.float64))
    out: dict[str, Any] = dict(s_min=s_min, e_min=e_min, b_crit=e_min / s_min,
                               rms_residual=float(np.sqrt(np.mean(resid ** 2))),
                               boot_ok=len(reps), boot_total=n_boot)
    if reps:
        r = np.array(reps)
        for name, col in (("s_min", r[:, 0]), ("e_min", r[:, 1]), ("b_crit", r[:, 1] / r[:, 0])):
            out[f"{name}_lo"], out[f"{name}_hi"] = (float(v) for v in np.percentile(col, [16, 84]))
    return out


# --------------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------------
def rule_lr(spec: dict[str, Any], batch: int, base_batch: int) -> float:
    """The LR the optimizer's scaling rule predicts at ``batch`` from ``base_lr`` at
    ``base_batch`` (:func:`fusedopt.schedules.scale_lr`)."""
    from .schedules import scale_lr

    return scale_lr(spec["base_lr"], batch, base_batch, spec["rule"])


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
    from .schedules import WarmupDecayLR

    x, y, x_ev, y_ev, n_classes = data
    n = len(y)
    batch = min(batch, n)
    base_batch = cfg["base_batch"]
    torch.manual_seed(seed)  # the same initialization for every run of this seed
    model = demo.make_model(x.shape[1], n_classes)
    opt = demo.make_optimizer(model, spec, lr)
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
        p0 = init_probe or demo.noise_probe(model, x, y, probe_gen, cfg["probe_windows"])
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
            p = demo.noise_probe(model, x, y, probe_gen, cfg["probe_windows"])
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
def parse_batches(text: str) -> list[int | str]:
    """``"16,32,full"`` -> ``[16, 32, "full"]`` (sorted, unique); clear errors otherwise."""
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not items:
        raise DemoError(f"--batches {text!r}: empty; give batch sizes like 16,64,256,full")
    out: list[int | str] = []
    for t in items:
        if t == "full":
            out.append("full")
            continue
        try:
            b = int(t)
        except ValueError:
            raise DemoError(f"--batches: {t!r} is not an integer or 'full'") from None
        if b < 1:
            raise DemoError(f"--batches: {b} must be >= 1")
        out.append(b)
    ints = sorted({b for b in out if b != "full"})
    return ints + (["full"] if "full" in out else [])


def _parse_list(name: str, text: str, kind) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise DemoError(f"{name} {text!r}: empty")
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise DemoError(
            f"{name} {text!r}: expected comma-separated {kind.__name__} values") from None


def _config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = copy.deepcopy(SWEEP)
    if args.quick:
        cfg.update(QUICK)
    for key in ("target_loss", "target_accuracy", "max_epochs", "eval_ratio", "warmup_epochs",
                "probe_windows", "bootstrap"):
        v = getattr(args, key)
        if v is not None:
            cfg[key] = v
    if args.batches is not None:
        cfg["batches"] = tuple(parse_batches(args.batches))
    if args.seeds is not None:
        cfg["seeds"] = tuple(_parse_list("--seeds", args.seeds, int))
    if args.tune_seeds is not None:
        cfg["tune_seeds"] = tuple(_parse_list("--tune-seeds", args.tune_seeds, int))
    if args.lr_grid is not None:
        cfg["lr_grid"] = tuple(_parse_list("--lr-grid", args.lr_grid, float))
    cfg["optimizers"] = tuple(_parse_list("--optimizers", args.optimizers, str))
    specs = copy.deepcopy(OPTIMIZERS)
    parse_overrides(args.set, specs, what="optimizer", example="lars.base_lr=2.0",
                    fixed=("label", "optimizer"))
    cfg["specs"] = specs
    unknown = [o for o in cfg["optimizers"] if o not in OPTIMIZERS]
    if unknown:
        raise DemoError(f"--optimizers: unknown {unknown}; expected names from {list(OPTIMIZERS)}")
    if not (cfg["target_loss"] > 0 and math.isfinite(cfg["target_loss"])):
        raise DemoError(f"--target-loss {cfg['target_loss']}: the cross-entropy is > 0, so this "
                        "target is never reached; expected a number > 0")
    if not 0.0 <= cfg["target_accuracy"] <= 1.0:
        raise DemoError(f"--target-accuracy {cfg['target_accuracy']}: accuracy lies in [0, 1], "
                        "so this target is never reached")
    if cfg["max_epochs"] <= 0:
        raise DemoError(f"--max-epochs {cfg['max_epochs']}: expected a number > 0")
    if not 0 < cfg["eval_ratio"] <= 1:
        raise DemoError(f"--eval-ratio {cfg['eval_ratio']}: expected a number in (0, 1]")
    if cfg["warmup_epochs"] < 0:
        raise DemoError(f"--warmup-epochs {cfg['warmup_epochs']}: expected a number >= 0")
    if cfg["probe_windows"] < 2:
        raise DemoError(f"--probe-windows {cfg['probe_windows']}: expected an integer >= 2")
    if cfg["bootstrap"] < 0:
        raise DemoError(f"--bootstrap {cfg['bootstrap']}: expected an integer >= 0")
    if any(not (m > 0 and math.isfinite(m)) for m in cfg["lr_grid"]):
        raise DemoError(f"--lr-grid {cfg['lr_grid']}: multipliers must be finite and > 0")
    cfg["lr_grid"] = tuple(sorted(set(cfg["lr_grid"])))
    cfg["seeds"] = tuple(dict.fromkeys(cfg["seeds"]))
    cfg["tune_seeds"] = tuple(dict.fromkeys(cfg["tune_seeds"]))
    return cfg


def _batch_size(b: int | str, n: int) -> int:
    return n if b == "full" else min(int(b), n)


def _bar(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not progress, unit="run", dynamic_ncols=True,
                leave=True)


def tune(cfg: dict[str, Any], data, progress: bool) -> dict[str, Any]:
    """For every (optimizer, batch): the validation steps-to-target at each grid multiplier and
    the chosen multiplier (fewest steps, mean over the tuning seeds, every seed must reach the
    target; ties to the multiplier closest to 1).

    The multipliers run closest-to-1 first, and a later one is stopped ("slower") as soon as
    its mean can no longer beat the best so far: the choice is the same as running every
    multiplier to the end, at a fraction of the cost."""
    n = len(data[1])
    grid = cfg["lr_grid"]
    seeds = cfg["tune_seeds"]
    order = sorted(grid, key=lambda m: (abs(math.log(m)), m))
    out: dict[str, Any] = {}
    bar = _bar(len(cfg["optimizers"]) * len(cfg["batches"]) * len(grid) * len(seeds),
               "tuning (validation)", progress)
    for name in cfg["optimizers"]:
        spec = cfg["specs"][name]
        out[name] = {}
        for b in cfg["batches"]:
            batch = _batch_size(b, n)
            cells: dict[float, dict[str, Any]] = {}
            best = math.inf
            for m in order:
                lr = rule_lr(spec, batch, cfg["base_batch"]) * m
                runs: list[dict[str, Any]] = []
                for seed in seeds:
                    if runs and runs[-1]["status"] != "reached":
                        runs.append(dict(status="skipped", steps=None, steps_run=0))
                        bar.update()
                        continue  # this multiplier has lost already
                    cap = None
                    if math.isfinite(best):  # the most steps this seed may take and still win
                        cap = math.floor(best * len(seeds) - sum(r["steps"] for r in runs))
                    bar.set_postfix_str(f"{name} B={batch} lr={lr:.3g}")
                    r = train_to_target(spec, batch, lr, data, seed=seed, cfg=cfg, step_cap=cap)
                    runs.append(dict(status=r["status"], steps=r["steps"],
                                     steps_run=r["steps_run"]))
                    bar.update()
                reached = all(r["status"] == "reached" for r in runs)
                score = float(np.mean([r["steps"] for r in runs])) if reached else math.inf
                best = min(best, score)
                cells[m] = dict(multiplier=m, lr=lr, steps=score, runs=runs)
            cells_list = [cells[m] for m in grid]
            winner = min((cells[m] for m in order), key=lambda c: c["steps"])  # stable: order
            found = math.isfinite(winner["steps"])
            chosen = winner["multiplier"] if found else 1.0
            edge = found and len(grid) > 1 and chosen in (grid[0], grid[-1])
            out[name][str(b)] = dict(batch=batch, rule_lr=rule_lr(spec, batch, cfg["base_batch"]),
                                     grid=cells_list, multiplier=chosen, found=found, edge=edge)
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
            model0 = demo.make_model(data[0].shape[1], data[4])
            init_probes[seed] = demo.noise_probe(model0, data[0], data[1],
                                                 torch.Generator().manual_seed(seed + 2),
                                                 cfg["probe_windows"])
    out: dict[str, Any] = {}
    bar = _bar(len(cfg["optimizers"]) * len(cfg["batches"]) * len(cfg["seeds"]),
               "measuring (test)", progress)
    for name in cfg["optimizers"]:
        spec = cfg["specs"][name]
        out[name] = {}
        for b in cfg["batches"]:
            batch = _batch_size(b, n)
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


def _pooled(probes: list[dict[str, Any]], n_boot: int,
            rng: np.random.Generator) -> dict[str, float]:
    """Ratio of means ``sum tr / sum |G|²`` over probes, with a bootstrap 16-84% interval."""
    tr = np.array([p["trace"] for p in probes], dtype=np.float64)
    sq = np.array([p["sq_norm"] for p in probes], dtype=np.float64)
    ok = np.isfinite(tr) & np.isfinite(sq)
    tr, sq = tr[ok], sq[ok]
    if len(tr) == 0 or sq.sum() <= 0:
        return dict(value=math.nan, lo=math.nan, hi=math.nan, n=int(len(tr)))
    value = float(tr.sum() / sq.sum())
    lo = hi = math.nan
    if len(tr) > 1 and n_boot > 0:
        idx = rng.integers(0, len(tr), size=(n_boot, len(tr)))
        den = sq[idx].sum(1)
        reps = tr[idx].sum(1)[den > 0] / den[den > 0]
        if len(reps):
            lo, hi = (float(v) for v in np.percentile(reps, [16, 84]))
    return dict(value=value, lo=lo, hi=hi, n=int(len(tr)))


def _step_average(levels: dict[str, dict[str, float]], steps_at: dict[str, float]) -> float:
    """The pooled B_noise of each probe level, averaged over the steps of a run: trapezoids
    between the (mean) steps at which the run reached each level, from initialization
    (step 0) to the target."""
    pts = sorted((steps_at[k], levels[k]["value"]) for k in steps_at if k in levels)
    pts = [(s, v) for s, v in pts if math.isfinite(v)]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return math.nan
    area = sum(0.5 * (v0 + v1) * (s1 - s0) for (s0, v0), (s1, v1) in zip(pts, pts[1:]))
    return area / (pts[-1][0] - pts[0][0])


def summarize(cfg: dict[str, Any], results: dict[str, Any], noise: bool) -> dict[str, Any]:
    """Per optimizer: the fit (+ bootstrap), B_noise at every probe level, at the target and
    averaged over the steps of the largest-batch runs in the fit."""
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for name, per_batch in results.items():
        steps = {}
        for cell in per_batch.values():
            if all(r["status"] == "reached" for r in cell["runs"]):
                steps[cell["batch"]] = [float(r["steps"]) for r in cell["runs"]]
        s: dict[str, Any] = dict(batches_in_fit=sorted(steps))
        try:
            s.update(bootstrap_fit(steps, cfg["bootstrap"], rng))
        except FitError as e:
            s["fit_error"] = (f"only {len(steps)} batch size(s) reached the target at every seed"
                              if len(steps) < 2 else str(e))
        if noise:
            runs = [r for cell in per_batch.values() for r in cell["runs"]]
            by_level: dict[str, list] = {}
            for r in runs:
                for p in r["probes"]:
                    key = "init" if p["level"] == "init" else f"{p['level']:.3g}"
                    by_level.setdefault(key, []).append(p)
            s["noise_by_level"] = {k: _pooled(v, cfg["bootstrap"], rng)
                                   for k, v in by_level.items()}
            s["noise_at_target"] = s["noise_by_level"].get(f"{cfg['target_loss']:.3g}")
            if steps:
                # In McCandlish et al.'s model with a noise scale that changes during training,
                # E_min/S_min is B_noise averaged over the optimizer steps of the large-batch
                # limit; the runs at the largest batch size in the fit are the closest to it.
                big = max(steps)
                cell = next(c for c in per_batch.values() if c["batch"] == big)
                at: dict[str, list[float]] = {}
                for r in cell["runs"]:
                    for p in r["probes"]:
                        key = "init" if p["level"] == "init" else f"{p['level']:.3g}"
                        at.setdefault(key, []).append(p["step"])
                steps_at = {k: float(np.mean(v)) for k, v in at.items()}
                s["noise_step_average"] = dict(
                    value=_step_average(s["noise_by_level"], steps_at), batch=big,
                    steps_at=steps_at)
        out[name] = s
    return out


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------
def _md_table(head: list[str], rows: list[list[str]], left: set[int]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 2)) if i in left else ("-" * (w + 1) + ":")
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep, *map(line, rows)])


def _num(v: float | None, fmt: str = ".3g") -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    return format(v, fmt)


def _interval(v: float, lo: float | None, hi: float | None) -> str:
    if not math.isfinite(v):
        return "n/a"
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{v:.0f}"
    return f"{v:.0f} [{lo:.0f}, {hi:.0f}]"


TUNING_NOTE = ("slower: stopped as soon as it could no longer beat the best multiplier; "
               "diverged / not reached: at a tuning seed, within the cap; chosen: the fewest "
               "steps, (edge) = at the end of the grid, 'none reached' = the rule's LR is kept.")


def format_tuning_table(cfg: dict[str, Any], tuning: dict[str, Any]) -> str:
    grid = cfg["lr_grid"]
    head = ["optimizer", "batch", "rule LR"] + [f"x{m:g}" for m in grid] + ["chosen"]
    rows = []
    for name, per_batch in tuning.items():
        for cell in per_batch.values():
            scores = []
            for c in cell["grid"]:
                st = [r["status"] for r in c["runs"]]
                if math.isfinite(c["steps"]):
                    scores.append(f"{c['steps']:.0f}")
                elif "diverged" in st:
                    scores.append("diverged")
                elif "slower" in st:
                    scores.append("slower")
                else:
                    scores.append("not reached")
            chosen = (f"x{cell['multiplier']:g}" + (" (edge)" if cell["edge"] else "")
                      if cell["found"] else "none reached: x1")
            rows.append([OPTIMIZERS[name]["label"], str(cell["batch"]),
                         f"{cell['rule_lr']:.3g}", *scores, chosen])
    return _md_table(head, rows, {0})


def format_runs_table(cfg: dict[str, Any], results: dict[str, Any], n_train: int) -> str:
    """One row per (optimizer, batch), every pair kept: steps and examples to the target (mean
    over the seeds, per-seed steps), or why it was not reached."""
    seeds = cfg["seeds"]
    head = ["optimizer", "batch", "peak LR", "x rule", "steps (per seed)", "steps", "examples",
            "epochs", "test acc"]
    rows = []
    for name, per_batch in results.items():
        for cell in per_batch.values():
            runs = cell["runs"]
            per_seed = []
            for r in runs:
                if r["status"] == "reached":
                    per_seed.append(str(r["steps"]))
                elif r["status"] == "diverged":
                    per_seed.append("diverged")
                else:
                    per_seed.append(f">{r['steps_run']}")
            ok = [r for r in runs if r["status"] == "reached"]
            if len(ok) == len(runs):
                s = float(np.mean([r["steps"] for r in ok]))
                mean_s, ex = f"{s:.0f}", f"{s * cell['batch']:.0f}"
                ep = f"{s * cell['batch'] / n_train:.1f}"
                acc = f"{np.mean([r['final_accuracy'] for r in ok]):.3f}"
            else:
                mean_s = f"not reached ({len(ok)}/{len(seeds)})"
                ex = ep = acc = "-"
            rows.append([OPTIMIZERS[name]["label"], str(cell["batch"]), f"{cell['lr']:.3g}",
                         f"{cell['multiplier']:g}", " / ".join(per_seed), mean_s, ex, ep, acc])
    return _md_table(head, rows, {0, 4})


def format_summary_table(cfg: dict[str, Any], summary: dict[str, Any], noise: bool) -> str:
    head = ["optimizer", "batches fitted", "S_min", "E_min", "B_crit [16-84%]", "fit rms"]
    if noise:
        head += ["B_noise at target [16-84%]", "B_noise step-avg", "B_noise init"]
    rows = []
    for name, s in summary.items():
        if "fit_error" in s:
            fit = [f"n/a: {s['fit_error']}", "", "", ""]
        else:
            fit = [_interval(s["s_min"], s.get("s_min_lo"), s.get("s_min_hi")),
                   _interval(s["e_min"], s.get("e_min_lo"), s.get("e_min_hi")),
                   _interval(s["b_crit"], s.get("b_crit_lo"), s.get("b_crit_hi")),
                   f"{100 * s['rms_residual']:.0f}%"]
        row = [OPTIMIZERS[name]["label"], f"{len(s['batches_in_fit'])}/{len(cfg['batches'])}",
               *fit]
        if noise:
            t = s.get("noise_at_target") or dict(value=math.nan, lo=None, hi=None)
            avg = s.get("noise_step_average", {}).get("value", math.nan)
            init = s.get("noise_by_level", {}).get("init", {}).get("value", math.nan)
            row += [_interval(t["value"], t["lo"], t["hi"]), _num(avg, ".0f"),
                    _num(init, ".0f")]
        rows.append(row)
    return _md_table(head, rows, {0})


def format_noise_table(summary: dict[str, Any]) -> str:
    levels: list[str] = []
    for s in summary.values():
        for k in s.get("noise_by_level", {}):
            if k not in levels:
                levels.append(k)
    levels = ["init"] + sorted((k for k in levels if k != "init"), key=float, reverse=True)
    head = ["optimizer"] + [("B_noise at init" if k == "init" else f"loss {k}") for k in levels]
    rows = []
    for name, s in summary.items():
        by = s.get("noise_by_level", {})
        rows.append([OPTIMIZERS[name]["label"]] +
                    [_interval(by[k]["value"], by[k]["lo"], by[k]["hi"]) if k in by else "-"
                     for k in levels])
    return _md_table(head, rows, {0})


_COLORS = {"sgd": "tab:blue", "lars": "tab:orange", "lamb": "tab:green"}


def plot_sweep(cfg: dict[str, Any], results: dict[str, Any], summary: dict[str, Any],
               path: str, title: str, noise: bool) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12.5, 5.2))
    all_batches = sorted({c["batch"] for pb in results.values() for c in pb.values()})
    bmin, bmax = all_batches[0], all_batches[-1]
    reached_steps = [r["steps"] for pb in results.values() for c in pb.values()
                     for r in c["runs"] if r["status"] == "reached"]
    # unreached pairs are drawn in a band above every measured point
    y_top = 1.6 * max(reached_steps, default=10)
    for i, (name, per_batch) in enumerate(results.items()):
        col = _COLORS.get(name, None)
        label = OPTIMIZERS[name]["label"]
        s = summary[name]
        xs, ys, lo, hi, capped = [], [], [], [], []
        for cell in per_batch.values():
            runs = cell["runs"]
            if all(r["status"] == "reached" for r in runs):
                st = np.array([r["steps"] for r in runs], dtype=float)
                xs.append(cell["batch"])
                ys.append(st.mean())
                lo.append(st.mean() - st.min())
                hi.append(st.max() - st.mean())
                a1.scatter(st * cell["batch"], st, s=10, color=col, alpha=0.35, lw=0)
            else:
                capped.append(cell["batch"])
        xs_a, ys_a = np.array(xs, dtype=float), np.array(ys, dtype=float)
        if len(xs):
            a1.errorbar(xs_a * ys_a, ys_a, yerr=[lo, hi], fmt="o", color=col, ms=5, capsize=2,
                        label=label)
            a2.errorbar(xs_a, ys_a, yerr=[lo, hi], fmt="o-", color=col, ms=5, capsize=2, lw=1.4,
                        label=label)
            # perfect scaling from this optimizer's smallest batch: S ∝ 1/B
            b_line = np.array([xs_a[0], bmax], dtype=float)
            a2.plot(b_line, ys_a[0] * xs_a[0] / b_line, ":", color=col, lw=1.2)
            for b, st_b, st_s in zip(xs, xs_a * ys_a, ys_a):
                a1.annotate(f"{b}", (st_b, st_s), textcoords="offset points", xytext=(4, 3),
                            fontsize=6.5, color=col)
        if capped:
            a2.scatter(capped, [y_top * 1.3 ** i] * len(capped), marker="x", s=60, color=col,
                       zorder=5)
        if "fit_error" not in s:
            bb = np.geomspace(bmin / 2, bmax * 2, 200)
            hs, he = hyperbola_points(s["s_min"], s["e_min"], bb)
            a1.plot(he, hs, "-", color=col, lw=1.2, alpha=0.8)
            a2.plot(bb[(bb >= bmin) & (bb <= bmax)], hs[(bb >= bmin) & (bb <= bmax)], "--",
                    color=col, lw=1.0, alpha=0.7)
            a1.scatter([2 * s["e_min"]], [2 * s["s_min"]], marker="*", s=180, color=col,
                       edgecolor="k", zorder=6)
            a2.axvline(s["b_crit"], color=col, lw=0.8, alpha=0.5, ls="-.")
            if noise:
                for key, marker in (("noise_at_target", "D"), ("noise_step_average", "^")):
                    v = (s.get(key) or {}).get("value", math.nan)
                    if math.isfinite(v) and v > 0:
                        ns, ne = hyperbola_points(s["s_min"], s["e_min"], np.array([v]))
                        a1.scatter(ne, ns, marker=marker, s=60, facecolor="white",
                                   edgecolor=col, lw=1.6, zorder=6)
    a1.set_xscale("log")
    a1.set_yscale("log")
    a1.set_xlabel("E: training examples to target")
    a1.set_ylabel("S: optimizer steps to target")
    a1.grid(alpha=0.3, which="both")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("batch size B")
    a2.set_ylabel("S: optimizer steps to target")
    a2.grid(alpha=0.3, which="both")
    marks = [Line2D([], [], color="gray", lw=1.2, label="fit (S/S_min-1)(E/E_min-1)=1"),
             Line2D([], [], marker="*", color="gray", mec="k", ls="", ms=12,
                    label="B_crit = E_min/S_min")]
    if noise:
        marks += [Line2D([], [], marker="D", mfc="white", mec="gray", ls="", ms=7,
                         label="B = B_noise at target"),
                  Line2D([], [], marker="^", mfc="white", mec="gray", ls="", ms=7,
                         label="B = B_noise step-average")]
    h, lab = a1.get_legend_handles_labels()
    a1.legend(handles=h + marks, fontsize=7.5, loc="upper right")
    a2.legend(handles=a2.get_legend_handles_labels()[0] + [
        Line2D([], [], color="gray", ls=":", label="perfect scaling S ∝ 1/B"),
        Line2D([], [], color="gray", ls="--", label="fit S_min(1+B_crit/B)"),
        Line2D([], [], color="gray", ls="-.", label="B_crit"),
        Line2D([], [], color="gray", marker="x", ls="", label="not reached (diverged or cap)")],
        fontsize=7.5, loc="lower left")
    a1.set_title("steps vs examples (points: mean and each seed)", fontsize=9)
    a2.set_title("steps to target vs batch size (bars: min-max over seeds)", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    d = SWEEP
    p = argparse.ArgumentParser(
        prog="fusedopt demo sweep",
        description="Batch-size sweep on scikit-learn's digits: steps and examples to a fixed "
                    "target for SGD (linear scaling + warm-up), LARS and LAMB at every batch "
                    "size, LR tuned per batch on a validation split; fits "
                    "(S/S_min-1)(E/E_min-1)=1 and compares B_crit = E_min/S_min with the "
                    "measured gradient noise scale. Writes sweep.png, sweep.md, sweep.json.")
    p.add_argument("--quick", action="store_true",
                   help=f"a quick look: batches {','.join(map(str, QUICK['batches']))}, one "
                        f"tuning seed, {QUICK['probe_windows']} probe windows")
    p.add_argument("--batches", default=None,
                   help="comma-separated batch sizes, 'full' = the whole training set "
                        f"(default {','.join(map(str, d['batches']))})")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help="comma-separated subset of %(default)s")
    p.add_argument("--seeds", default=None,
                   help=f"measurement seeds (default {','.join(map(str, d['seeds']))})")
    p.add_argument("--tune-seeds", default=None,
                   help=f"tuning seeds (default {','.join(map(str, d['tune_seeds']))})")
    p.add_argument("--lr-grid", default=None,
                   help="multipliers of the scaling rule's LR tried at every batch size "
                        f"(default {','.join(f'{m:g}' for m in d['lr_grid'])})")
    p.add_argument("--target-loss", type=float, default=None,
                   help=f"training-loss target (default {d['target_loss']})")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help=f"held-out accuracy target (default {d['target_accuracy']})")
    p.add_argument("--max-epochs", type=float, default=None,
                   help=f"cap per run, in epochs of examples (default {d['max_epochs']})")
    p.add_argument("--eval-ratio", type=float, default=None,
                   help=f"evaluate every this fraction of the steps so far (default "
                        f"{d['eval_ratio']})")
    p.add_argument("--warmup-epochs", type=float, default=None,
                   help=f"warm-up above the base batch, in epochs (default {d['warmup_epochs']})")
    p.add_argument("--probe-windows", type=int, default=None,
                   help=f"big batches per noise-scale probe (default {d['probe_windows']})")
    p.add_argument("--bootstrap", type=int, default=None,
                   help=f"bootstrap resamples for the intervals (default {d['bootstrap']})")
    p.add_argument("--set", action="append", default=[], metavar="OPT.KEY=VALUE",
                   help="override an optimizer setting, e.g. --set lars.base_lr=2")
    p.add_argument("--no-noise-scale", action="store_true", help="skip the noise-scale probes")
    p.add_argument("--tune-only", action="store_true",
                   help="stop after the tuning phase (e.g. to choose base LRs)")
    p.add_argument("--out", default="demo_out", help="output folder (default demo_out/)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1, as for the demo)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _shown(text: str) -> str:
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        text.encode(enc)
        return text
    except (UnicodeEncodeError, LookupError):
        return text.encode("ascii", "replace").decode("ascii")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads < 1:
        raise DemoError(f"--threads {args.threads}: expected an integer >= 1")
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(previous)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(args)
    noise = not args.no_noise_scale
    progress = not args.no_progress and sys.stderr.isatty()
    t_start = time.perf_counter()
    tune_data = demo.load_data(None, "val")
    n_tune = len(tune_data[1])
    too_big = [b for b in cfg["batches"] if b != "full" and b > n_tune]
    if too_big:
        raise DemoError(f"--batches: {too_big} larger than the tuning split ({n_tune} examples); "
                        "use 'full' for the whole training set")
    print(f"data: {tune_data[5]}; tuning on {n_tune} train / {len(tune_data[3])} validation "
          f"examples; target: training loss <= {cfg['target_loss']:g} and held-out accuracy >= "
          f"{cfg['target_accuracy']:g}; batches {','.join(map(str, cfg['batches']))}; "
          f"torch threads {torch.get_num_threads()}")
    tuning = tune(cfg, tune_data[:5], progress)
    t_tune = time.perf_counter() - t_start
    tuning_table = format_tuning_table(cfg, tuning)
    print("\nLR tuning on the validation split: steps to the target at each multiplier of the "
          f"rule's LR (mean over tuning seeds {','.join(map(str, cfg['tune_seeds']))})\n")
    print(_shown(tuning_table))
    print(f"\n{TUNING_NOTE}")
    os.makedirs(args.out, exist_ok=True)
    record: dict[str, Any] = dict(config={k: v for k, v in cfg.items() if k != "specs"},
                                  optimizers={k: cfg["specs"][k] for k in cfg["optimizers"]},
                                  tuning=tuning)
    if args.tune_only:
        with open(os.path.join(args.out, "sweep_tuning.md"), "w", encoding="utf-8") as f:
            f.write(tuning_table + "\n\n" + TUNING_NOTE + "\n")
        with open(os.path.join(args.out, "sweep.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, default=str)
        return record

    data = demo.load_data(None, "test")
    n = len(data[1])
    results = measure(cfg, data[:5], tuning, progress, noise)
    summary = summarize(cfg, results, noise)
    runs_table = format_runs_table(cfg, results, n)
    summary_table = format_summary_table(cfg, summary, noise)
    max_res = max((r["resolution"] for pb in results.values() for c in pb.values()
                   for r in c["runs"] if r["status"] == "reached"), default=math.nan)
    notes = (
        f"Measured on {n} training / {len(data[3])} test examples, seeds "
        f"{','.join(map(str, cfg['seeds']))}. steps: the first evaluated step with training "
        f"loss <= {cfg['target_loss']:g} and test accuracy >= {cfg['target_accuracy']:g} "
        f"(evaluated after every step up to {math.ceil(1 / cfg['eval_ratio'])} steps, then every "
        f"{cfg['eval_ratio']:.0%} of the steps so far: the largest uncertainty of a reached "
        f"step count is {_num(100 * max_res, '.1f')}% of it); '>N': not reached within the cap of "
        f"{cfg['max_epochs']:g} epochs (N steps); examples = batch x steps. Fit: linear least "
        f"squares of S_min/S + E_min/E = 1 over the batch sizes reached at every seed, on the "
        f"seed-mean steps; [16-84%]: percentiles over {cfg['bootstrap']} bootstrap resamples "
        "of the seeds at each batch size; fit rms: the rms relative misfit of the steps."
    )
    if noise:
        notes += (
            f" B_noise: B_simple = tr(Sigma)/|G|^2 from fusedopt.GradientNoiseScale probes "
            f"({cfg['probe_windows']} windows of 16x32 examples) when the training loss first "
            f"fell below each level (pooled over all runs of the optimizer as a ratio of means, "
            f"[16-84%] bootstrap over runs); at target: at loss {cfg['target_loss']:g}; "
            "step-avg: averaged over the steps of the largest fitted batch's runs, from "
            "initialization to the target.")
    print("\nMeasurement: steps and examples to the target\n")
    print(_shown(runs_table))
    print("\nFit of (S/S_min - 1)(E/E_min - 1) = 1 per optimizer\n")
    print(_shown(summary_table))
    noise_table = ""
    if noise:
        noise_table = format_noise_table(summary)
        print("\nB_noise at each probe point (training-loss level), pooled over the runs\n")
        print(_shown(noise_table))
    print()
    print(notes)

    png = os.path.join(args.out, "sweep.png")
    plot_sweep(cfg, results, summary, png,
               f"{data[5]}: to training loss {cfg['target_loss']:g} and test accuracy "
               f"{cfg['target_accuracy']:g}, {len(cfg['seeds'])} seeds", noise)
    total = time.perf_counter() - t_start
    with open(os.path.join(args.out, "sweep.md"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(t for t in (tuning_table, TUNING_NOTE, runs_table, summary_table,
                                         noise_table, notes)
                            if t) + "\n")
    record.update(results=results, summary=summary, n_train=n, data=data[5], wall_time_s=total,
                  tuning_time_s=t_tune)
    with open(os.path.join(args.out, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=str)
    print(f"wrote {png}, sweep.md, sweep.json (tuning {t_tune:.0f} s, total {total:.0f} s)")
    if not any(r["status"] == "reached" for pb in results.values() for c in pb.values()
               for r in c["runs"]):
        raise DemoError(
            f"no run reached the target (training loss <= {cfg['target_loss']:g} and test "
            f"accuracy >= {cfg['target_accuracy']:g}) within {cfg['max_epochs']:g} epochs; "
            "loosen --target-loss / --target-accuracy or raise --max-epochs")
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except DemoError as e:
        print(f"fusedopt demo sweep: error: {e}", file=sys.stderr)
        return 2
    return 0
