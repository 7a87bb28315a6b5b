"""The training problem the demo and the batch-size sweep share: the data (scikit-learn's digits,
or an ImageFolder), the MLP, the optimizers, and the gradient-noise-scale probes.

:data:`OPTIMIZER_SETTINGS` checks the optimizer settings of a recipe (``--set`` values of
``fusedopt demo`` and ``fusedopt demo sweep``) before anything runs.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from .common import Check, Choice, DemoError, Number, Pair

# The MLP: 64 -> 256 -> 256 -> 10 on digits, ReLU.
HIDDEN = (256, 256)
# Gradient-noise-scale probes: B_small = 32, B_big = 512 (16 micro-batches of 32, drawn with
# replacement, i.e. i.i.d. from the training set as the estimator assumes).
PROBE_MICRO_BATCH = 32
PROBE_MICRO_BATCHES = 16

OPTIMIZERS = ("sgd", "lars", "lamb")
# The MLP trains in float32: the fused optimizers refuse (at their first step) a hyper-parameter
# that float32 cannot hold, and an eps below its smallest normal number.
F32_MAX = float(torch.finfo(torch.float32).max)
F32_TINY = float(torch.finfo(torch.float32).tiny)
# The check of an LR (the peak LR a run starts from, after any scaling rule).
LR_VALUE = Number(0, F32_MAX, lo_open=True)
# The check of each optimizer setting make_optimizer reads (sgd: momentum, weight_decay; lars:
# the same and trust_coefficient; lamb: weight_decay, betas, eps).
OPTIMIZER_SETTINGS: dict[str, Check] = dict(
    momentum=Number(0, 1, hi_open=True),
    weight_decay=Number(0, F32_MAX),
    trust_coefficient=Number(0, F32_MAX, lo_open=True),
    betas=Pair(Number(0, 1, hi_open=True), "beta1, beta2"),
    eps=Number(F32_TINY, F32_MAX),
    # LARS/LAMB moment state (docs/math.md "Low-precision state"); SGD has none to set
    state_precision=Choice("full", "bf16", "8bit"),
)


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
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
# model, optimizers
# --------------------------------------------------------------------------------------------
def make_model(n_in: int, n_classes: int, hidden=HIDDEN) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for h in hidden:
        layers += [torch.nn.Linear(n_in, h), torch.nn.ReLU()]
        n_in = h
    layers.append(torch.nn.Linear(n_in, n_classes))
    return torch.nn.Sequential(*layers)


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
                                  trust_coefficient=r["trust_coefficient"],
                                  state_precision=r.get("state_precision", "full"))
    if kind == "lamb":
        return fusedopt.FusedLAMB(groups, lr=lr, betas=tuple(r["betas"]), eps=r["eps"],
                                  state_precision=r.get("state_precision", "full"))
    raise DemoError(f"unknown optimizer {kind!r}; expected one of {list(OPTIMIZERS)}")


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(1) == y).float().mean().item()


def noise_probe(model, x, y, generator: torch.Generator, windows: int, *,
                micro_batch: int = PROBE_MICRO_BATCH,
                micro_batches: int = PROBE_MICRO_BATCHES) -> dict[str, float]:
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
    from ..noise_scale import GradientAccumulationNoiseScale, GradientNoiseScale

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
    training set, which is what :func:`noise_probe` samples)."""
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

