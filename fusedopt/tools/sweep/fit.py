"""The analysis of the sweep: the fit of McCandlish et al.'s ``(S/S_min − 1)(E/E_min − 1) = 1``
(:func:`fit_hyperbola`, :func:`bootstrap_fit`, :func:`hyperbola_points`), and per optimizer the
fit with its bootstrap interval beside the pooled gradient noise scale (:func:`summarize`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

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
# per optimizer: the fit and the noise scale
# --------------------------------------------------------------------------------------------
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


def _key(p: dict[str, Any]) -> str:
    return "init" if p["level"] == "init" else f"{p['level']:.3g}"


def _noise_point(runs: list[dict[str, Any]], big_runs: list[dict[str, Any]],
                 target_key: str) -> tuple[float, float]:
    """(B_noise at the target, step-averaged B_noise) of these runs, as :func:`summarize`
    computes them (pooled ratio of means per level; steps of ``big_runs``), without intervals."""
    tr: dict[str, float] = {}
    sq: dict[str, float] = {}
    for r in runs:
        for p in r["probes"]:
            if math.isfinite(p["trace"]) and math.isfinite(p["sq_norm"]):
                k = _key(p)
                tr[k] = tr.get(k, 0.0) + p["trace"]
                sq[k] = sq.get(k, 0.0) + p["sq_norm"]
    levels = {k: dict(value=tr[k] / sq[k] if sq[k] > 0 else math.nan) for k in tr}
    at: dict[str, list[float]] = {}
    for r in big_runs:
        for p in r["probes"]:
            at.setdefault(_key(p), []).append(p["step"])
    steps_at = {k: float(np.mean(v)) for k, v in at.items()}
    return (levels.get(target_key, {}).get("value", math.nan),
            _step_average(levels, steps_at))


def noise_ratio(cells: list[dict[str, Any]], big: int, target_key: str, n_boot: int,
                rng: np.random.Generator) -> dict[str, Any]:
    """B_noise / B_crit (step-averaged and at the target) with 16-84% intervals from a joint
    bootstrap: each resample draws the seeds of every batch size with replacement, and refits
    the hyperbola and recomputes B_noise from the same resampled runs. ``cells``: the
    optimizer's (batch, runs) cells; the fit uses those reached at every seed, the step average
    the runs at batch ``big``."""
    fitted = [all(r["status"] == "reached" for r in c["runs"]) for c in cells]

    def ratios(sample: list[list[dict[str, Any]]]) -> tuple[float, float]:
        fit_cells = [(c["batch"], runs) for c, runs, ok in zip(cells, sample, fitted) if ok]
        s = np.array([np.mean([r["steps"] for r in runs]) for _, runs in fit_cells], dtype=float)
        b = np.array([bb for bb, _ in fit_cells], dtype=float)
        s_min, e_min = fit_hyperbola(s, s * b)
        b_crit = e_min / s_min
        big_runs = next(runs for c, runs in zip(cells, sample) if c["batch"] == big)
        at, avg = _noise_point([r for runs in sample for r in runs], big_runs, target_key)
        return avg / b_crit, at / b_crit

    avg, at = ratios([c["runs"] for c in cells])
    reps = []
    for _ in range(n_boot):
        sample = [[c["runs"][i] for i in rng.integers(0, len(c["runs"]), len(c["runs"]))]
                  for c in cells]
        try:
            reps.append(ratios(sample))
        except FitError:
            continue
    out: dict[str, Any] = dict(step_average=avg, at_target=at, boot_ok=len(reps))
    r = np.array(reps, dtype=float).reshape(-1, 2)
    for j, name in enumerate(("step_average", "at_target")):
        col = r[:, j][np.isfinite(r[:, j])] if len(r) else r[:, j]
        lo, hi = (float(v) for v in np.percentile(col, [16, 84])) if len(col) > 1 \
            else (math.nan, math.nan)
        out[f"{name}_lo"], out[f"{name}_hi"] = lo, hi
    return out


def noise_verdict(label: str, ratio: dict[str, Any]) -> str:
    """One plain sentence on the step-averaged B_noise / B_crit of ``ratio``
    (:func:`noise_ratio`): whether its interval contains 1, and whether it is within a factor
    of 2 (McCandlish et al.'s model has B_crit ≈ B_noise)."""
    v, lo, hi = ratio["step_average"], ratio["step_average_lo"], ratio["step_average_hi"]
    if not math.isfinite(v) or v <= 0:
        return f"{label}: no B_noise / B_crit (no step-averaged noise scale)."
    head = f"{label}: step-averaged B_noise / B_crit = {v:.2f}"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return head + " (no interval)."
    head += f" [{lo:.2f}, {hi:.2f}]"
    far = not (0.5 <= v <= 2.0)
    if lo <= 1 <= hi:
        return (head + ": the interval contains 1, the noise scale predicts this optimizer's "
                "B_crit within the seed-to-seed spread.")
    if lo > 1:
        tail = (f": B_noise is {v:.1f}x B_crit, so this optimizer's steps stop falling at a "
                "smaller batch than the noise scale predicts")
    else:
        tail = (f": B_crit is {1 / v:.1f}x B_noise, so this optimizer keeps gaining from "
                "larger batches beyond the noise scale")
    return head + tail + (" (more than a factor of 2: B_noise ≈ B_crit does not hold for it "
                          "here)." if far else " (within a factor of 2, as the model predicts, "
                          "though not within the seed-to-seed spread).")


def summarize(cfg: dict[str, Any], results: dict[str, Any], noise: bool) -> dict[str, Any]:
    """Per optimizer: the fit (+ bootstrap), B_noise at every probe level, at the target and
    averaged over the steps of the largest-batch runs in the fit, and B_noise / B_crit with its
    joint bootstrap interval (:func:`noise_ratio`)."""
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
                    by_level.setdefault(_key(p), []).append(p)
            s["noise_by_level"] = {k: _pooled(v, cfg["bootstrap"], rng)
                                   for k, v in by_level.items()}
            target_key = f"{cfg['target_loss']:.3g}"
            s["noise_at_target"] = s["noise_by_level"].get(target_key)
            if steps:
                # In McCandlish et al.'s model with a noise scale that changes during training,
                # E_min/S_min is B_noise averaged over the optimizer steps of the large-batch
                # limit; the runs at the largest batch size in the fit are the closest to it.
                big = max(steps)
                cell = next(c for c in per_batch.values() if c["batch"] == big)
                at: dict[str, list[float]] = {}
                for r in cell["runs"]:
                    for p in r["probes"]:
                        at.setdefault(_key(p), []).append(p["step"])
                steps_at = {k: float(np.mean(v)) for k, v in at.items()}
                s["noise_step_average"] = dict(
                    value=_step_average(s["noise_by_level"], steps_at), batch=big,
                    steps_at=steps_at)
                if "fit_error" not in s:
                    s["noise_ratio"] = noise_ratio(list(per_batch.values()), big, target_key,
                                                   cfg["bootstrap"], rng)
        out[name] = s
    return out
