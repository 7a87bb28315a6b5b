"""Large-batch training demo: ``python -m fusedopt demo`` and ``python -m fusedopt demo sweep``.

``demo sweep`` (:mod:`fusedopt.tools.sweep`) is the batch-size sweep: steps and examples to a fixed
target at every batch size from 16 to the whole training set, for SGD with the linear scaling
rule, LARS and LAMB, with the fit of McCandlish et al.'s ``(S/S_min − 1)(E/E_min − 1) = 1`` and
the critical batch size next to the measured gradient noise scale.

``demo`` without a sub-command is the five-run comparison below. It trains the same small MLP
on scikit-learn's ``load_digits`` (8x8 handwritten digits, 1797 images, shipped with
scikit-learn) five times, all for the same number of epochs from the same initialization and
the same data order:

1. momentum SGD at a small batch (32);
2. momentum SGD at a 16x larger batch (512) with the *same* LR;
3. momentum SGD at batch 512 with the linear scaling rule and a gradual warm-up (Goyal et al.);
4. LARS (:class:`fusedopt.FusedLARS`) at batch 512, warm-up + polynomial decay (power 2);
5. LAMB (:class:`fusedopt.FusedLAMB`) at batch 512, warm-up + polynomial decay.

It prints a table (final test accuracy, optimizer steps, training wall time, the measured
gradient noise scale early and late in training), writes ``accuracy.png`` (test accuracy per
epoch and per optimizer step for every run), ``table.md`` and ``results.json`` to ``--out``.

Every hyper-parameter is in :data:`COMMON` and :data:`RECIPES` below, with how it was chosen.
The test set is only used for the reported numbers; the LR grids were searched with
``--eval-on val`` (a validation split carved out of the training set).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from typing import Any

import torch

from ..schedules import DECAYS
from . import digits
from .common import (MAX_EPOCHS, PROBE_WINDOWS, SEED, Check, Choice, DemoError, Number, Text,
                     cli_main, plotting_available,
                     check_option, make_out_dir, md_table, parse_device, parse_overrides,
                     threads_check, torch_threads)
from .digits import (accuracy, exact_noise_scale, load_data, make_model, make_optimizer,
                     noise_probe)

# --------------------------------------------------------------------------------------------
# Hyper-parameters. Searched on the validation split (``--eval-on val``, 20% of the training
# set, seeds 0 and 1), never on the test set; each tunable recipe got the same LR grid size,
# see docs/large-batch.md. Everything else is shared or set by the recipe's published rule.
# --------------------------------------------------------------------------------------------
COMMON: dict[str, Any] = dict(
    epochs=30,            # same budget (epochs = examples seen) for every run
    hidden=digits.HIDDEN,  # MLP 64 -> 256 -> 256 -> 10, ReLU (the sweep's too)
    small_batch=32,
    large_batch=512,      # 16x
    # Gradient-noise-scale probes: B_small = 32, B_big = 512 (16 micro-batches of 32, drawn
    # with replacement, i.e. i.i.d. from the training set as the estimator assumes), averaged
    # over `probe_windows` big batches at a fixed parameter vector.
    probe_micro_batch=digits.PROBE_MICRO_BATCH,      # 32
    probe_micro_batches=digits.PROBE_MICRO_BATCHES,  # 16
    probe_windows=32,
    early_epoch_fraction=0.1,  # "early" probe after this fraction of the epochs (at least 1)
)

RECIPES: dict[str, dict[str, Any]] = {
    # Baseline. LR from the grid {0.01, 0.02, 0.05, 0.1, 0.2} on validation.
    "sgd_b32": dict(
        label="SGD b=32", optimizer="sgd", batch="small", lr=0.02, momentum=0.9,
        weight_decay=5e-4, warmup_epochs=0.0, decay="poly", power=2.0,
    ),
    # Same LR and schedule as the baseline, 16x batch: 16x fewer steps of the same size.
    "sgd_b512": dict(
        label="SGD b=512 same LR", optimizer="sgd", batch="large", lr="=sgd_b32",
        momentum=0.9, weight_decay=5e-4, warmup_epochs=0.0, decay="poly", power=2.0,
    ),
    # Goyal et al. 2017: LR x k (k = 16) with a linear warm-up from the small-batch LR
    # (warmup_start_factor = 1/k) over their 5 epochs (here 5 of 30 epochs = 15 steps; the same
    # 5-epoch warm-up is used for LARS and LAMB; not tuned). The rule sets the LR: not tuned.
    "sgd_b512_scaled": dict(
        label="SGD b=512 linear+warmup", optimizer="sgd", batch="large", lr="=sgd_b32*16",
        momentum=0.9, weight_decay=5e-4, warmup_epochs=5.0, warmup_start_factor=1 / 16,
        decay="poly", power=2.0,
    ),
    # LARS (You et al. 2017): trust coefficient 0.001 (paper), biases excluded from weight decay
    # and adaptation (fusedopt.param_groups), warm-up + poly(2) decay. LR from the grid
    # {1, 2, 5, 10, 20}.
    "lars_b512": dict(
        label="LARS b=512", optimizer="lars", batch="large", lr=5.0, momentum=0.9,
        weight_decay=5e-4, trust_coefficient=0.001, warmup_epochs=5.0, decay="poly", power=2.0,
        state_precision="full",
    ),
    # LAMB (You et al. 2019): betas (0.9, 0.999), eps 1e-6, weight decay 0.01 on matrices,
    # warm-up + poly decay. LR from the grid {0.002, 0.005, 0.01, 0.02, 0.05}.
    "lamb_b512": dict(
        label="LAMB b=512", optimizer="lamb", batch="large", lr=0.02, weight_decay=0.01,
        betas=(0.9, 0.999), eps=1e-6, warmup_epochs=5.0, decay="poly", power=2.0,
        state_precision="full",
    ),
}

RUN_ORDER = list(RECIPES)


# --------------------------------------------------------------------------------------------
# what --set RUN.KEY=VALUE may set, and the check of each value
# --------------------------------------------------------------------------------------------
class LR(Check):
    """A recipe's LR: a finite number > 0, or ``"=other"`` / ``"=other*k"``: another recipe's
    LR (times a finite ``k > 0``). :func:`resolve_lr` follows the references."""

    expected = (f"{digits.LR_VALUE.expected}, or '=RECIPE' / '=RECIPE*FACTOR' (another "
                "recipe's LR, times a finite FACTOR > 0)")

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            lr_reference(value)
            return value
        try:
            return digits.LR_VALUE(value)
        except ValueError:
            raise ValueError(self.expected) from None


def lr_reference(text: str) -> tuple[str, float]:
    """``"=ref*factor"`` -> ``(ref, factor)`` (factor 1 without ``*``); ValueError if malformed."""
    ref, star, factor = text[1:].partition("*")
    if not text.startswith("=") or not ref.strip():
        raise ValueError(LR.expected)
    k = 1.0
    if star:
        try:
            k = float(factor)
        except ValueError:
            raise ValueError(LR.expected) from None
        if not (math.isfinite(k) and k > 0):
            raise ValueError(LR.expected)
    return ref.strip(), k


RECIPE_SETTINGS: dict[str, Check] = dict(
    digits.OPTIMIZER_SETTINGS,
    label=Text(),
    optimizer=Choice(*digits.OPTIMIZERS),
    batch=Choice("small", "large"),  # COMMON's small_batch or large_batch
    lr=LR(),
    warmup_epochs=Number(0, MAX_EPOCHS),
    warmup_start_factor=Number(0, 1),
    decay=Choice(*DECAYS),
    power=Number(0, lo_open=True),
)
# Settings any recipe may be given (make_schedule has defaults for those it lacks).
SCHEDULE_KEYS = ("warmup_epochs", "warmup_start_factor", "decay", "power")
# The optimizer of a run is fixed: its other settings are those of that optimizer.
FIXED_KEYS = ("optimizer",)


# --------------------------------------------------------------------------------------------
# recipes: LR and schedule
# --------------------------------------------------------------------------------------------
def resolve_lr(recipes: dict[str, dict[str, Any]], name: str,
               _chain: tuple[str, ...] = ()) -> float:
    """A recipe's LR; ``"=other"`` / ``"=other*k"`` refers to another recipe's LR (scaling rules
    are written as a reference, so tuning the baseline carries over). Raises DemoError for an
    unknown reference, a cycle of references, or an LR outside ``digits.LR_VALUE``."""
    lr = recipes[name]["lr"]
    chain = (*_chain, name)
    if isinstance(lr, str):
        try:
            ref, factor = lr_reference(lr)
        except ValueError as e:
            raise DemoError(f"recipe {name}: lr {lr!r}: expected {e}") from None
        if ref not in recipes:
            raise DemoError(f"recipe {name}: lr {lr!r} refers to unknown recipe {ref!r}; expected "
                            f"one of {list(recipes)}")
        if ref in chain:
            raise DemoError(f"recipe {name}: lr {lr!r} makes a cycle of LR references: "
                            + " -> ".join((*chain[chain.index(ref):], ref))
                            + "; give one of them a number")
        value = resolve_lr(recipes, ref, chain) * factor
    elif isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise DemoError(f"recipe {name}: lr {lr!r}: expected {LR.expected}")
    else:
        value = float(lr)
    try:
        return digits.LR_VALUE(value)
    except ValueError as e:
        raise DemoError(f"recipe {name}: lr {lr!r} is {value:g}; expected {e}") from None


def make_schedule(opt, r: dict[str, Any], steps_per_epoch: int, epochs: int):
    from ..schedules import WarmupDecayLR

    total = steps_per_epoch * epochs
    warmup = min(round(r.get("warmup_epochs", 0.0) * steps_per_epoch), total - 1)
    return WarmupDecayLR(opt, warmup, total, decay=r.get("decay", "poly"),
                         power=r.get("power", 2.0),
                         warmup_start_factor=r.get("warmup_start_factor", 0.0))


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------
def probe_noise_scale(model, x, y, generator: torch.Generator,
                      probe_windows: int | None = None) -> tuple[float, float]:
    """``(B_simple, standard error)`` at the current parameters; see :func:`noise_probe`."""
    p = noise_probe(model, x, y, generator, probe_windows or COMMON["probe_windows"])
    return p["b_simple"], p["se"]


def run_recipe(name: str, recipes: dict[str, dict[str, Any]], data, *, epochs: int, seed: int,
               device: torch.device, progress: bool, noise: bool = True,
               probe_windows: int | None = None) -> dict[str, Any]:
    from tqdm.auto import tqdm

    r = recipes[name]
    x_tr, y_tr, x_ev, y_ev, n_classes, _ = data
    bs = COMMON["small_batch"] if r["batch"] == "small" else COMMON["large_batch"]
    n = len(y_tr)
    steps_per_epoch = math.ceil(n / bs)
    lr = resolve_lr(recipes, name)

    torch.manual_seed(seed)  # same initialization for every run
    model = make_model(x_tr.shape[1], n_classes).to(device)
    opt = make_optimizer(model, r, lr)
    sched = make_schedule(opt, r, steps_per_epoch, epochs)
    order_gen = torch.Generator().manual_seed(seed + 1)  # same data order for every run
    probe_gen = torch.Generator().manual_seed(seed + 2)  # probes do not perturb training
    early_epoch = max(1, round(COMMON["early_epoch_fraction"] * epochs))

    acc_curve: list[float] = []
    steps_curve: list[int] = []
    noise_scale = {"early": (math.nan, math.nan), "late": (math.nan, math.nan)}
    exact = {"early": math.nan, "late": math.nan}
    train_time = 0.0
    steps = 0
    diverged = False
    bar = tqdm(range(1, epochs + 1), desc=f"{r['label']:<24}", leave=True,
               disable=not progress, unit="ep", dynamic_ncols=True)
    for epoch in bar:
        model.train()
        perm = torch.randperm(n, generator=order_gen).to(device)
        t0 = time.perf_counter()
        for i in range(steps_per_epoch):
            idx = perm[i * bs:(i + 1) * bs]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time += time.perf_counter() - t0
        if not math.isfinite(loss.item()):
            diverged = True
        model.eval()
        acc = accuracy(model, x_ev, y_ev)
        acc_curve.append(acc)
        steps_curve.append(steps)
        if noise and epoch == early_epoch:
            noise_scale["early"] = probe_noise_scale(model, x_tr, y_tr, probe_gen, probe_windows)
            exact["early"] = exact_noise_scale(model, x_tr, y_tr)
        bar.set_postfix(acc=f"{acc:.3f}", loss=f"{loss.item():.3f}")
    bar.close()
    if noise:
        noise_scale["late"] = probe_noise_scale(model, x_tr, y_tr, probe_gen, probe_windows)
        exact["late"] = exact_noise_scale(model, x_tr, y_tr)
    return dict(
        name=name, label=r["label"], optimizer=r["optimizer"], batch_size=bs, peak_lr=lr,
        steps=steps, train_time_s=train_time, final_accuracy=acc_curve[-1],
        best_accuracy=max(acc_curve), accuracy_per_epoch=acc_curve, steps_per_epoch=steps_curve,
        noise_scale_early=noise_scale["early"][0], noise_scale_early_se=noise_scale["early"][1],
        noise_scale_late=noise_scale["late"][0], noise_scale_late_se=noise_scale["late"][1],
        exact_noise_scale_early=exact["early"], exact_noise_scale_late=exact["late"],
        early_epoch=early_epoch, diverged=diverged,
    )


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------
def _fmt_noise(v: float, se: float) -> str:
    if not math.isfinite(v):
        return "n/a"
    return f"{v:.0f}" + (f" ± {se:.0f}" if math.isfinite(se) else "")


def format_table(results: list[dict[str, Any]], eval_name: str) -> str:
    head = ["run", "batch", "peak LR", "steps", "train s", f"{eval_name} acc",
            "B_noise early", "(exact)", "B_noise late", "(exact)"]
    rows = [[
        r["label"], str(r["batch_size"]), f"{r['peak_lr']:g}", str(r["steps"]),
        f"{r['train_time_s']:.1f}", f"{r['final_accuracy']:.3f}" + (" (diverged)" if r["diverged"] else ""),
        _fmt_noise(r["noise_scale_early"], r["noise_scale_early_se"]),
        _fmt_noise(r["exact_noise_scale_early"], math.nan),
        _fmt_noise(r["noise_scale_late"], r["noise_scale_late_se"]),
        _fmt_noise(r["exact_noise_scale_late"], math.nan),
    ] for r in results]
    return md_table(head, rows, {0})


def plot(results: list[dict[str, Any]], path: str, eval_name: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        epochs = range(1, len(r["accuracy_per_epoch"]) + 1)
        style = "--" if r["batch_size"] == COMMON["small_batch"] else "-"
        a1.plot(epochs, r["accuracy_per_epoch"], style, label=r["label"], lw=1.6)
        a2.plot(r["steps_per_epoch"], r["accuracy_per_epoch"], style, label=r["label"], lw=1.6)
    a1.set_xlabel("epoch")
    a2.set_xlabel("optimizer steps (log)")
    a2.set_xscale("log")
    for a in (a1, a2):
        a.set_ylabel(f"{eval_name} accuracy")
        a.set_ylim(0.0, 1.0)
        a.grid(alpha=0.3)
    a1.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusedopt demo",
        description="Small batch vs large batch (SGD, linear scaling + warm-up, LARS, LAMB) on "
                    "scikit-learn's digits; prints a table and writes a plot.",
        epilog="'fusedopt demo sweep' runs the batch-size sweep instead: steps and examples to "
               "a target at every batch size, the fit of (S/S_min-1)(E/E_min-1)=1, B_crit "
               "and B_noise (fusedopt demo sweep --help).")
    p.add_argument("--epochs", type=int, default=COMMON["epochs"],
                   help=f"epochs for every run (default {COMMON['epochs']})")
    p.add_argument("--seed", type=int, default=0, help="initialization / data-order seed")
    p.add_argument("--out", default="demo_out", help="output folder (default demo_out/)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    p.add_argument("--dataset", default=None, metavar="PATH",
                   help="an ImageFolder-style folder (PATH/<class>/<image>) instead of digits; "
                        "needs torchvision")
    p.add_argument("--image-size", type=int, default=16,
                   help="--dataset images are resized to this square size, grayscale")
    p.add_argument("--runs", default=",".join(RUN_ORDER),
                   help=f"comma-separated subset of {','.join(RUN_ORDER)}")
    p.add_argument("--eval-on", choices=("test", "val"), default="test",
                   help="'val' evaluates on a validation split of the training set (for tuning)")
    p.add_argument("--set", action="append", default=[], metavar="RUN.KEY=VALUE",
                   help="override a recipe hyper-parameter, e.g. --set lars_b512.lr=2")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: this MLP is too small to gain from "
                        "more, and extra threads only contend on a busy machine)")
    p.add_argument("--probe-windows", type=int, default=COMMON["probe_windows"],
                   help="big batches per noise-scale probe (default %(default)s)")
    p.add_argument("--no-noise-scale", action="store_true",
                   help="skip the gradient-noise-scale probes (faster, e.g. for tuning)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """Every option and ``--set`` value checked, before any work: ``device``, ``recipes`` (with
    the overrides; every LR resolves) and ``runs``. Raises DemoError naming the option / key and
    the value."""
    check_option("--threads", args.threads, threads_check())
    check_option("--epochs", args.epochs, Number(1, MAX_EPOCHS, integer=True))
    check_option("--seed", args.seed, SEED)
    check_option("--probe-windows", args.probe_windows, PROBE_WINDOWS)
    check_option("--image-size", args.image_size, Number(1, 1024, integer=True))
    device = parse_device("--device", args.device)
    if args.dataset is not None and not os.path.isdir(args.dataset):
        raise DemoError(f"--dataset {args.dataset!r} is not a directory (expected an ImageFolder "
                        "layout: PATH/<class name>/<image files>)")
    recipes = copy.deepcopy(RECIPES)
    parse_overrides(args.set, recipes, what="run", example="lars_b512.lr=2.0",
                    settings=RECIPE_SETTINGS, fixed=FIXED_KEYS, optional=SCHEDULE_KEYS)
    for name in recipes:
        try:
            resolve_lr(recipes, name)
        except DemoError as e:
            raise DemoError(f"--set: {e}") from None
    runs = [s.strip() for s in args.runs.split(",") if s.strip()]
    unknown = [s for s in runs if s not in recipes]
    if unknown or not runs:
        raise DemoError(f"--runs: unknown {unknown or runs!r}; expected names from {RUN_ORDER}")
    make_out_dir("--out", args.out)
    return dict(device=device, recipes=recipes, runs=runs)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    plan = validate(args)
    plan["figure"] = plotting_available("fusedopt demo")
    with torch_threads(args.threads):
        return _run(args, **plan)


def _run(args: argparse.Namespace, *, device: torch.device, recipes: dict[str, dict[str, Any]],
         runs: list[str], figure: bool = True) -> list[dict[str, Any]]:
    data = load_data(args.dataset, args.eval_on, args.image_size)
    x_tr, y_tr, x_ev, y_ev, n_classes, desc = data
    data = (x_tr.to(device), y_tr.to(device), x_ev.to(device), y_ev.to(device), n_classes, desc)
    progress = not args.no_progress and sys.stderr.isatty()
    eval_name = args.eval_on
    print(f"data: {desc}; {len(y_tr)} train / {len(y_ev)} {eval_name} examples; "
          f"{args.epochs} epochs, seed {args.seed}, device {device}, "
          f"torch threads {torch.get_num_threads()}")

    init_noise = (math.nan, math.nan)
    if not args.no_noise_scale:
        torch.manual_seed(args.seed)  # the initialization every run starts from
        model0 = make_model(x_tr.shape[1], n_classes).to(device)
        init_noise = probe_noise_scale(model0, data[0], data[1],
                                       torch.Generator().manual_seed(args.seed + 2),
                                       args.probe_windows)
        init_exact = exact_noise_scale(model0, data[0], data[1])
        print(f"gradient noise scale at initialization: {_fmt_noise(*init_noise)} "
              f"(exact {_fmt_noise(init_exact, math.nan)})")

    results = []
    for name in runs:
        results.append(run_recipe(name, recipes, data, epochs=args.epochs, seed=args.seed,
                                  device=device, progress=progress,
                                  noise=not args.no_noise_scale,
                                  probe_windows=args.probe_windows))
    table = format_table(results, eval_name)
    notes = (
        f"train s: training wall time only (no evaluation, no noise-scale probes). "
        f"B_noise: measured gradient noise scale B_simple = tr(Sigma)/|G|^2 "
        f"(McCandlish et al. 2018) from {args.probe_windows} windows of "
        f"{COMMON['probe_micro_batches']}x{COMMON['probe_micro_batch']} examples "
        f"(± standard error); (exact): the same quantity from all per-example gradients of the "
        f"training set. early = after epoch {results[0]['early_epoch']}, "
        f"late = after the last epoch."
    )
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "±".encode(enc)
        shown = table
    except (UnicodeEncodeError, LookupError):
        shown = table.replace("±", "+-")
    print()
    print(shown)
    print()
    print(notes)

    os.makedirs(args.out, exist_ok=True)
    # the results first: a figure that fails to draw leaves them written
    with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n\n" + notes + "\n")
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(dict(common=COMMON, recipes={k: recipes[k] for k in runs},
                       noise_scale_init=init_noise[0], noise_scale_init_se=init_noise[1],
                       epochs=args.epochs, seed=args.seed, device=str(device), data=desc,
                       eval_on=eval_name, results=results), f, indent=1, default=str)
    written = ["table.md", "results.json"]
    if figure:
        png = os.path.join(args.out, "accuracy.png")
        plot(results, png, eval_name,
             f"{desc}: {eval_name} accuracy, {args.epochs} epochs, seed {args.seed}")
        written.insert(0, png)
    print(f"wrote {', '.join(written)}" + ("" if figure else f" in {args.out}"))
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m fusedopt demo`` (``fusedopt demo sweep`` is routed to
    :mod:`fusedopt.tools.sweep` by ``fusedopt.__main__``)."""
    return cli_main("fusedopt demo", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
