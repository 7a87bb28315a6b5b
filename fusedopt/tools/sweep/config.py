"""The sweep's configuration: its hyper-parameters (:data:`SWEEP`, :data:`QUICK`,
:data:`OPTIMIZERS`, with how each was chosen), and the command line's options and ``--set``
values turned into a checked configuration (:func:`make_config`) before anything runs.
"""
from __future__ import annotations

import argparse
import copy
import math
from typing import Any

from ...schedules import SCALING_RULES, scale_lr
from .. import digits
from ..common import (MAX_EPOCHS, PROBE_WINDOWS, SEED, Check, Choice, DemoError, Number, Text,
                      check_option, parse_overrides)

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
    # Multipliers of the rule's LR tried first at every batch size: one factor of 2 either side.
    lr_grid=(0.5, 1.0, 2.0),
    # "wide": the LR is tuned per batch size, not only checked around the rule: while the best
    # multiplier is at an end of those tried (or none reached the target), the search goes on in
    # factor-2 steps beyond it until the choice has a worse neighbour on each side, never beyond
    # 2**±lr_cap times the rule's LR (the table says when a choice is at the edge or the cap).
    # "rule": lr_grid only, the rule's LR × {1/2, 1, 2} (the sweep before the LR was tuned per
    # batch), for comparison: where all of it diverges, that batch size drops out of the fit.
    tuning="wide",
    # 2**6 = 64: in the default run the rule's LR is off by at most 8x (LARS's linear rule at
    # 1024 and the full batch: best LR 1/8 of it), so the cap is not what stops the search; it
    # bounds the cost where no LR reaches the target.
    lr_cap=6,
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
    # averages probe_windows big batches of 16 x 32 examples (see digits.noise_probe).
    probe_windows=4,
    bootstrap=1000,        # bootstrap resamples of the seeds for the B_crit interval
)

# --quick: a look at the shape in a fraction of the default's time (the smallest batches are the
# slowest runs, so it starts at 64, every factor 4; one tuning seed, shorter probes).
QUICK: dict[str, Any] = dict(batches=(64, 256, 1024, "full"), tune_seeds=(100,), probe_windows=2,
                             bootstrap=200)

OPTIMIZERS: dict[str, dict[str, Any]] = {
    # Goyal et al. 2017: LR x k for batch x k, warm-up from the base LR. Momentum, weight decay
    # (none on biases) as in the demo's SGD recipes.
    "sgd": dict(label="SGD (linear rule + warm-up)", optimizer="sgd", rule="linear",
                base_lr=0.04, momentum=0.9, weight_decay=5e-4),
    # You, Gitman, Ginsburg 2017: trust coefficient 0.001, momentum 0.9, biases excluded from
    # decay and adaptation (fusedopt.param_groups); the LR scaled linearly, as the paper does.
    "lars": dict(label="LARS", optimizer="lars", rule="linear", base_lr=1.25, momentum=0.9,
                 weight_decay=5e-4, trust_coefficient=0.001, state_precision="full"),
    # You et al. 2019: betas (0.9, 0.999), eps 1e-6, weight decay 0.01 on matrices, LR scaled
    # with the square root of the batch (the paper's rule).
    "lamb": dict(label="LAMB", optimizer="lamb", rule="sqrt", base_lr=0.007, weight_decay=0.01,
                 betas=(0.9, 0.999), eps=1e-6, state_precision="full"),
}
# base_lr: chosen at base_batch on the validation split (fewest steps to the target, as in the
# tuning phase, tuning seed) from the factor-2 grid x {1/8, ..., 16} around the demo's tuned LR
# carried to batch 16 by the same rule (SGD 0.02 at 32 -> 0.01; LARS 5 at 512 -> 0.15625;
# LAMB 0.02 at 512 -> 0.0035):
#   python -m fusedopt demo sweep --tune-only --batches 16 --lr-grid 0.125,0.25,0.5,1,2,4,8,16 \
#       --set sgd.base_lr=0.01 --set lars.base_lr=0.15625 --set lamb.base_lr=0.0035

# What --set OPT.KEY=VALUE may set (label and optimizer are fixed), and the check of each value.
SPEC_SETTINGS: dict[str, Check] = dict(
    digits.OPTIMIZER_SETTINGS,
    label=Text(),
    optimizer=Choice(*digits.OPTIMIZERS),
    rule=Choice(*SCALING_RULES),
    base_lr=digits.LR_VALUE,
)
FIXED_KEYS = ("label", "optimizer")
TUNING = Choice("wide", "rule")


# --------------------------------------------------------------------------------------------
# the LR of a batch size
# --------------------------------------------------------------------------------------------
def rule_lr(spec: dict[str, Any], batch: int, base_batch: int) -> float:
    """The LR the optimizer's scaling rule predicts at ``batch`` from ``base_lr`` at
    ``base_batch`` (:func:`fusedopt.schedules.scale_lr`)."""
    return scale_lr(spec["base_lr"], batch, base_batch, spec["rule"])


def batch_size(b: int | str, n: int) -> int:
    """A batch of ``cfg["batches"]`` on a training set of ``n`` examples."""
    return n if b == "full" else min(int(b), n)


# --------------------------------------------------------------------------------------------
# options -> configuration
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


def make_config(args: argparse.Namespace) -> dict[str, Any]:
    """:data:`SWEEP` (with :data:`QUICK` under ``--quick``) updated by the options, and
    ``specs``: :data:`OPTIMIZERS` updated by ``--set``. Every value is checked; a bad one is a
    DemoError naming the option or key and the value. What needs the data (a batch larger than
    the tuning split, an LR that overflows) is checked by :func:`check_for_data`."""
    cfg = copy.deepcopy(SWEEP)
    if args.quick:
        cfg.update(QUICK)
    for key in ("target_loss", "target_accuracy", "max_epochs", "eval_ratio", "warmup_epochs",
                "probe_windows", "bootstrap", "tuning", "lr_cap"):
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
    cfg["optimizers"] = tuple(dict.fromkeys(_parse_list("--optimizers", args.optimizers, str)))
    specs = copy.deepcopy(OPTIMIZERS)
    parse_overrides(args.set, specs, what="optimizer", example="lars.base_lr=2.0",
                    settings=SPEC_SETTINGS, fixed=FIXED_KEYS)
    cfg["specs"] = specs
    unknown = [o for o in cfg["optimizers"] if o not in OPTIMIZERS]
    if unknown:
        raise DemoError(f"--optimizers: unknown {unknown}; expected names from {list(OPTIMIZERS)}")
    check_option("--target-loss", cfg["target_loss"], Number(0, lo_open=True),
                 "the cross-entropy is > 0, so a target <= 0 is never reached")
    check_option("--target-accuracy", cfg["target_accuracy"], Number(0, 1),
                 "accuracy lies in [0, 1], so a target above 1 is never reached")
    check_option("--max-epochs", cfg["max_epochs"], Number(0, MAX_EPOCHS, lo_open=True))
    check_option("--eval-ratio", cfg["eval_ratio"], Number(0, 1, lo_open=True))
    check_option("--warmup-epochs", cfg["warmup_epochs"], Number(0, MAX_EPOCHS))
    check_option("--probe-windows", cfg["probe_windows"], PROBE_WINDOWS)
    check_option("--bootstrap", cfg["bootstrap"], Number(0, 10 ** 5, integer=True))
    check_option("--tuning", cfg["tuning"], TUNING)
    check_option("--lr-cap", cfg["lr_cap"], Number(1, 20, integer=True),
                 "factor-2 steps either side of the rule's LR")
    for option, key in (("--seeds", "seeds"), ("--tune-seeds", "tune_seeds")):
        for seed in cfg[key]:
            check_option(option, seed, SEED)
    if any(not (m > 0 and math.isfinite(m)) for m in cfg["lr_grid"]):
        raise DemoError(f"--lr-grid {cfg['lr_grid']}: multipliers must be finite and > 0")
    cfg["lr_grid"] = tuple(sorted(set(cfg["lr_grid"])))
    cfg["seeds"] = tuple(dict.fromkeys(cfg["seeds"]))
    cfg["tune_seeds"] = tuple(dict.fromkeys(cfg["tune_seeds"]))
    return cfg


def check_for_data(cfg: dict[str, Any], n_tune: int, n_train: int) -> None:
    """What :func:`make_config` cannot check without the data: every batch fits the tuning split
    (``n_tune`` examples), and every LR the sweep will try (each optimizer, batch size and
    multiplier, at the tuning and the measurement sizes) passes ``digits.LR_VALUE``."""
    too_big = [b for b in cfg["batches"] if b != "full" and b > n_tune]
    if too_big:
        raise DemoError(f"--batches: {too_big} larger than the tuning split ({n_tune} examples); "
                        "use 'full' for the whole training set")
    mults = set(cfg["lr_grid"])
    if cfg["tuning"] == "wide":  # the ends the search may reach
        mults |= {2.0 ** -cfg["lr_cap"], 2.0 ** cfg["lr_cap"]}
    for name in cfg["optimizers"]:
        spec = cfg["specs"][name]
        for n in (n_tune, n_train):
            for b in cfg["batches"]:
                for m in sorted(mults):
                    lr = rule_lr(spec, batch_size(b, n), cfg["base_batch"]) * m
                    try:
                        digits.LR_VALUE(lr)
                    except ValueError as e:
                        raise DemoError(
                            f"--set / --lr-grid / --lr-cap: the LR of {name} at batch "
                            f"{batch_size(b, n)} "
                            f"(base_lr {spec['base_lr']:g} by the {spec['rule']} rule, times "
                            f"{m:g}) is {lr:g}; expected {e}") from None
