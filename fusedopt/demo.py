"""Large-batch training demo: ``python -m fusedopt demo`` and ``python -m fusedopt demo sweep``.

``demo sweep`` (:mod:`fusedopt.sweep`) is the batch-size sweep: steps and examples to a fixed
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
import ast
import copy
import json
import math
import os
import sys
import time
from typing import Any

import torch

# --------------------------------------------------------------------------------------------
# Hyper-parameters. Searched on the validation split (``--eval-on val``, 20% of the training
# set, seeds 0 and 1), never on the test set; each tunable recipe got the same LR grid size,
# see docs/large-batch.md. Everything else is shared or set by the recipe's published rule.
# --------------------------------------------------------------------------------------------
COMMON: dict[str, Any] = dict(
    epochs=30,            # same budget (epochs = examples seen) for every run
    hidden=(256, 256),    # MLP 64 -> 256 -> 256 -> 10, ReLU
    small_batch=32,
    large_batch=512,      # 16x
    # Gradient-noise-scale probes: B_small = 32, B_big = 512 (16 micro-batches of 32, drawn
    # with replacement, i.e. i.i.d. from the training set as the estimator assumes), averaged
    # over `probe_windows` big batches at a fixed parameter vector.
    probe_micro_batch=32,
    probe_micro_batches=16,
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
    ),
    # LAMB (You et al. 2019): betas (0.9, 0.999), eps 1e-6, weight decay 0.01 on matrices,
    # warm-up + poly decay. LR from the grid {0.002, 0.005, 0.01, 0.02, 0.05}.
    "lamb_b512": dict(
        label="LAMB b=512", optimizer="lamb", batch="large", lr=0.02, weight_decay=0.01,
        betas=(0.9, 0.999), eps=1e-6, warmup_epochs=5.0, decay="poly", power=2.0,
    ),
}

RUN_ORDER = list(RECIPES)


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
class DemoError(Exception):
    """A user-facing error of the demo (bad option, missing optional dependency)."""


def _stratified_split(y: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (keep, held_out) with ``fraction`` of every class held out."""
    g = torch.Generator().manual_seed(seed)
    keep, held = [], []
    for c in torch.unique(y):
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_held = max(1, round(fraction * len(idx)))
        held.append(idx[:n_held])
        keep.append(idx[n_held:])
    return torch.cat(keep).sort().values, torch.cat(held).sort().values


def load_data(dataset: str | None, eval_on: str, image_size: int = 16):
    """(x_train, y_train, x_eval, y_eval, n_classes, description), features standardized with
    training statistics. The test split (20%, stratified, fixed seed) does not depend on
    ``--seed``; with ``eval_on="val"`` 20% of the remaining training set is the evaluation set
    and the test set is not touched."""
    if dataset is None:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32)
        y = torch.tensor(d.target, dtype=torch.long)
        name = "sklearn load_digits (8x8)"
    else:
        x, y, name = _load_image_folder(dataset, image_size)
    train_idx, test_idx = _stratified_split(y, 0.2, seed=0)
    if eval_on == "val":
        sub_train, val = _stratified_split(y[train_idx], 0.2, seed=1)
        train_idx, eval_idx = train_idx[sub_train], train_idx[val]
    else:
        eval_idx = test_idx
    x_tr, y_tr, x_ev, y_ev = x[train_idx], y[train_idx], x[eval_idx], y[eval_idx]
    mean, std = x_tr.mean(0), x_tr.std(0)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    x_tr, x_ev = (x_tr - mean) / std, (x_ev - mean) / std
    n_classes = int(y.max()) + 1
    return x_tr, y_tr, x_ev, y_ev, n_classes, name


def _load_image_folder(path: str, image_size: int):
    if not os.path.isdir(path):
        raise DemoError(f"--dataset {path!r} is not a directory (expected an ImageFolder layout: "
                        "PATH/<class name>/<image files>)")
    try:
        from torchvision import datasets, transforms
    except ImportError as e:
        raise DemoError("--dataset needs torchvision, which is not installed "
                        "(pip install torchvision), or run without --dataset to use "
                        "scikit-learn's digits") from e
    tf = transforms.Compose([
        transforms.Resize((image_size, image_size)),
        transforms.Grayscale(num_output_channels=1),
        transforms.ToTensor(),
    ])
    try:
        ds = datasets.ImageFolder(path, transform=tf)
    except (FileNotFoundError, RuntimeError) as e:
        raise DemoError(f"--dataset {path!r}: {e}") from e
    if len(ds.classes) < 2:
        raise DemoError(f"--dataset {path!r}: found {len(ds.classes)} class folder(s), need >= 2")
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    x = torch.stack(xs).flatten(1)
    y = torch.tensor(ys, dtype=torch.long)
    return x, y, f"ImageFolder {path} ({len(ds.classes)} classes, {image_size}x{image_size} gray)"


# --------------------------------------------------------------------------------------------
# model, optimizers, schedules
# --------------------------------------------------------------------------------------------
def make_model(n_in: int, n_classes: int, hidden=COMMON["hidden"]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for h in hidden:
        layers += [torch.nn.Linear(n_in, h), torch.nn.ReLU()]
        n_in = h
    layers.append(torch.nn.Linear(n_in, n_classes))
    return torch.nn.Sequential(*layers)


def resolve_lr(recipes: dict[str, dict[str, Any]], name: str) -> float:
    """A recipe's LR; ``"=other"`` / ``"=other*k"`` refers to another recipe's LR (scaling rules
    are written as a reference, so tuning the baseline carries over)."""
    lr = recipes[name]["lr"]
    if isinstance(lr, str):
        if not lr.startswith("="):
            raise DemoError(f"recipe {name}: lr {lr!r} must be a number or '=recipe[*factor]'")
        ref, _, factor = lr[1:].partition("*")
        if ref not in recipes:
            raise DemoError(f"recipe {name}: lr refers to unknown recipe {ref!r}")
        return resolve_lr(recipes, ref) * (float(factor) if factor else 1.0)
    return float(lr)


def make_optimizer(model: torch.nn.Module, r: dict[str, Any], lr: float):
    import fusedopt

    groups = fusedopt.param_groups(model, weight_decay=r["weight_decay"])
    kind = r["optimizer"]
    if kind == "sgd":
        # torch SGD ignores the 'adapt' key; biases get no weight decay, as for LARS/LAMB
        groups = [{k: v for k, v in g.items() if k != "adapt"} for g in groups]
        return torch.optim.SGD(groups, lr=lr, momentum=r["momentum"])
    if kind == "lars":
        return fusedopt.FusedLARS(groups, lr=lr, momentum=r["momentum"],
                                  trust_coefficient=r["trust_coefficient"])
    if kind == "lamb":
        return fusedopt.FusedLAMB(groups, lr=lr, betas=tuple(r["betas"]), eps=r["eps"])
    raise DemoError(f"unknown optimizer {kind!r}; expected sgd, lars or lamb")


def make_schedule(opt, r: dict[str, Any], steps_per_epoch: int, epochs: int):
    from .schedules import WarmupDecayLR

    total = steps_per_epoch * epochs
    warmup = min(round(r.get("warmup_epochs", 0.0) * steps_per_epoch), total - 1)
    return WarmupDecayLR(opt, warmup, total, decay=r.get("decay", "poly"),
                         power=r.get("power", 2.0),
                         warmup_start_factor=r.get("warmup_start_factor", 0.0))


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(1) == y).float().mean().item()


def probe_noise_scale(model, x, y, generator: torch.Generator,
                      probe_windows: int | None = None) -> tuple[float, float]:
    """``(B_simple, standard error)`` at the current parameters; see :func:`noise_probe`."""
    p = noise_probe(model, x, y, generator, probe_windows or COMMON["probe_windows"])
    return p["b_simple"], p["se"]


def noise_probe(model, x, y, generator: torch.Generator, windows: int, *,
                micro_batch: int = COMMON["probe_micro_batch"],
                micro_batches: int = COMMON["probe_micro_batches"]) -> dict[str, float]:
    """The gradient noise scale at the current parameters, from ``windows`` big batches of
    ``micro_batches`` x ``micro_batch`` examples drawn with replacement, through
    :class:`fusedopt.GradientAccumulationNoiseScale`. Gradients are cleared before and after;
    the optimizer state is not touched.

    Returns ``b_simple`` (``trace / sq_norm``), ``se`` (its standard error), ``trace`` and
    ``sq_norm`` (the averaged ``tr(Σ)`` and ``|G|²`` estimates, for pooling several probes as a
    ratio of means).

    The parameters are fixed during a probe, so the windows are i.i.d. measurements of the same
    quantity and are weighted (almost) equally (bias-corrected EMA with beta close to 1). The
    standard error is the delta-method one of a ratio of means: with ``r_i = tr_i − B·|G|²_i``
    over the windows' raw estimates, ``se = sd(r) / sqrt(n) / mean(|G|²_i)``.
    """
    from .noise_scale import GradientAccumulationNoiseScale, GradientNoiseScale

    b, n = micro_batch, micro_batches
    est = GradientNoiseScale(beta=1.0 - 1.0 / (100 * windows))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    raw: list[tuple[float, float]] = []
    with GradientAccumulationNoiseScale(params, b, est, accumulation="mean") as acc:
        for _ in range(windows):
            idx = torch.randint(0, len(y), (n * b,), generator=generator).to(y.device)
            for i in range(n):
                j = idx[i * b:(i + 1) * b]
                loss = torch.nn.functional.cross_entropy(model(x[j]), y[j])
                (loss / n).backward()
                acc.micro_batch_done()
            acc.step()
            raw.append((float(est.last_trace), float(est.last_sq_norm)))
            for p in params:
                p.grad = None
    b_simple = est.noise_scale
    tr = torch.tensor([t for t, _ in raw], dtype=torch.float64)
    sq = torch.tensor([g for _, g in raw], dtype=torch.float64)
    se = math.nan
    if math.isfinite(b_simple) and windows > 1 and float(sq.mean()) > 0:
        se = float((tr - b_simple * sq).std() / math.sqrt(windows) / sq.mean())
    return dict(b_simple=b_simple, se=se, trace=est.trace_estimate, sq_norm=est.sq_norm_estimate)


def exact_noise_scale(model, x, y, chunk: int = 32) -> float:
    """The true ``B_simple`` of the training set at the current parameters, for comparison:
    per-example gradients ``g_j`` (``torch.func.vmap``, in chunks) give ``G = mean_j g_j`` and
    ``tr(Σ) = mean_j |g_j|² − |G|²`` (the covariance of one example drawn uniformly from the
    training set, which is what :func:`probe_noise_scale` samples)."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p, xi, yi):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per_example = vmap(grad(loss_fn), in_dims=(None, 0, 0))
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in params.items()}
    sum_sq = torch.zeros((), dtype=torch.float64, device=x.device)
    with torch.no_grad():
        for i in range(0, len(y), chunk):
            g = per_example(params, x[i:i + chunk], y[i:i + chunk])
            for k, v in g.items():
                sum_sq += torch.linalg.vector_norm(v).double().square()
                total[k] += v.sum(0)
    n = len(y)
    g2 = sum(float((t / n).square().sum()) for t in total.values())
    trace = float(sum_sq) / n - g2
    return trace / g2 if g2 > 0 else math.nan


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
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    left = {0}

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 2)) if i in left else ("-" * (w + 1) + ":")
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep, *map(line, rows)])


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
def parse_overrides(items: list[str], table: dict[str, dict[str, Any]], *, what: str,
                    example: str, fixed: tuple[str, ...] | None = None) -> None:
    """Apply ``--set NAME.KEY=VALUE`` overrides to ``table[NAME][KEY]`` (VALUE as a Python
    literal, else as a string). ``what`` names the entries in messages ("run", "optimizer");
    with ``fixed`` given, only existing keys outside it may be set."""
    for item in items:
        key, eq, value = item.partition("=")
        name, dot, field = key.partition(".")
        if not eq or not dot:
            raise DemoError(f"--set {item!r}: expected {what.upper()}.KEY=VALUE, e.g. {example}")
        if name not in table:
            raise DemoError(f"--set {item!r}: unknown {what} {name!r}; expected one of {list(table)}")
        if fixed is not None and (field not in table[name] or field in fixed):
            keys = [k for k in table[name] if k not in fixed]
            raise DemoError(f"--set {item!r}: {name} has no setting {field!r}; expected one of "
                            f"{keys}")
        try:
            table[name][field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            table[name][field] = value


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


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.threads < 1:
        raise DemoError(f"--threads {args.threads}: expected an integer >= 1")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(previous_threads)


def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.epochs < 1:
        raise DemoError(f"--epochs {args.epochs}: expected an integer >= 1")
    if args.probe_windows < 2:
        raise DemoError(f"--probe-windows {args.probe_windows}: expected an integer >= 2")
    if args.image_size < 1:
        raise DemoError(f"--image-size {args.image_size}: expected an integer >= 1")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise DemoError(f"--device {args.device!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: CUDA is not available on this machine")
    recipes = copy.deepcopy(RECIPES)
    parse_overrides(args.set, recipes, what="run", example="lars_b512.lr=2.0")
    runs = [s.strip() for s in args.runs.split(",") if s.strip()]
    unknown = [s for s in runs if s not in recipes]
    if unknown or not runs:
        raise DemoError(f"--runs: unknown {unknown or runs!r}; expected names from {RUN_ORDER}")

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
    png = os.path.join(args.out, "accuracy.png")
    plot(results, png, eval_name,
         f"{desc}: {eval_name} accuracy, {args.epochs} epochs, seed {args.seed}")
    with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n\n" + notes + "\n")
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(dict(common=COMMON, recipes={k: recipes[k] for k in runs},
                       noise_scale_init=init_noise[0], noise_scale_init_se=init_noise[1],
                       epochs=args.epochs, seed=args.seed, device=str(device), data=desc,
                       eval_on=eval_name, results=results), f, indent=1, default=str)
    print(f"wrote {png}, table.md, results.json")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sweep"]:
        from . import sweep

        return sweep.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except DemoError as e:
        print(f"fusedopt demo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
