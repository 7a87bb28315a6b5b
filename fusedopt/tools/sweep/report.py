"""The sweep's report: the tuning, run, fit and noise-scale tables, the notes under them, and the
plot (:func:`plot_sweep`).
"""
from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from ..common import md_table
from .config import OPTIMIZERS
from .fit import hyperbola_points, noise_verdict

# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------
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


def _ratio(v: float, lo: float, hi: float) -> str:
    if not math.isfinite(v):
        return "n/a"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{v:.2g}"
    return f"{v:.2g} [{lo:.2g}, {hi:.2g}]"


def format_noise_verdicts(summary: dict[str, Any]) -> str:
    """One plain sentence per optimizer on B_noise against B_crit (:func:`.fit.noise_verdict`)."""
    lines = []
    for name, s in summary.items():
        label = OPTIMIZERS[name]["label"]
        if s.get("noise_ratio"):
            lines.append("- " + noise_verdict(label, s["noise_ratio"]))
        elif "noise_by_level" in s:
            lines.append(f"- {label}: no B_noise / B_crit (no fit).")
    return "\n".join(lines)


TUNING_NOTE = ("x m: the rule's LR times m, steps to the target on the validation split (mean "
               "over the tuning seeds); slower: stopped as soon as it could no longer beat the "
               "best multiplier; diverged / not reached: at a tuning seed, within the cap; "
               "blank: not tried. tuned / rule: the chosen LR over the rule's (the rule's error "
               "at this batch size). choice: interior = a worse multiplier tried on each side; "
               "edge (low/high) = the smallest or largest tried, the best LR may lie beyond; "
               "cap = the search stopped at 2^±lr_cap times the rule's LR; "
               "'none reached' = the rule's LR is kept.")


def mult_label(m: float) -> str:
    """``x2``, ``x1``, ``x1/4`` (``x0.3`` for a multiplier that is not a power of 2)."""
    if m < 1 and abs(1 / m - round(1 / m)) < 1e-9:
        return f"x1/{round(1 / m)}"
    return f"x{m:g}"


def choice_label(cell: dict[str, Any]) -> str:
    """interior / edge (low|high) / cap / none reached, for a tuning cell."""
    if not cell["found"]:
        return "none reached" + (" (cap)" if cell.get("capped") else "")
    if cell["edge"]:
        return f"edge ({cell.get('side') or '?'})" + (", cap" if cell.get("capped") else "")
    return "interior" if len(cell["grid"]) > 1 else "single LR"


def _score(c: dict[str, Any]) -> str:
    if math.isfinite(c["steps"]):
        return f"{c['steps']:.0f}"
    st = c.get("status") or "not reached"
    return st if st in ("diverged", "slower") else "not reached"


def format_tuning_table(cfg: dict[str, Any], tuning: dict[str, Any]) -> str:
    mults = sorted({c["multiplier"] for pb in tuning.values() for cell in pb.values()
                    for c in cell["grid"]})
    head = (["optimizer", "batch", "rule LR"] + [mult_label(m) for m in mults]
            + ["tuned LR", "tuned / rule", "choice"])
    rows = []
    for name, per_batch in tuning.items():
        for cell in per_batch.values():
            by = {c["multiplier"]: c for c in cell["grid"]}
            scores = [_score(by[m]) if m in by else "" for m in mults]
            m = cell["multiplier"]
            tuned = (f"{cell['rule_lr'] * m:.3g}", mult_label(m)[1:]) if cell["found"] \
                else ("-", "-")
            rows.append([OPTIMIZERS[name]["label"], str(cell["batch"]),
                         f"{cell['rule_lr']:.3g}", *scores, *tuned, choice_label(cell)])
    return md_table(head, rows, {0})


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
                         mult_label(cell["multiplier"])[1:], " / ".join(per_seed), mean_s, ex, ep,
                         acc])
    return md_table(head, rows, {0, 4})


def format_summary_table(cfg: dict[str, Any], summary: dict[str, Any], noise: bool) -> str:
    head = ["optimizer", "batches fitted", "S_min", "E_min", "B_crit [16-84%]", "fit rms"]
    if noise:
        head += ["B_noise at target [16-84%]", "B_noise step-avg", "B_noise init",
                 "step-avg B_noise / B_crit [16-84%]"]
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
            q = s.get("noise_ratio")
            ratio = "n/a" if not q else _ratio(q["step_average"], q["step_average_lo"],
                                                 q["step_average_hi"])
            row += [_interval(t["value"], t["lo"], t["hi"]), _num(avg, ".0f"),
                    _num(init, ".0f"), ratio]
        rows.append(row)
    return md_table(head, rows, {0})


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
    return md_table(head, rows, {0})



def format_notes(cfg: dict[str, Any], results: dict[str, Any], n_train: int, n_test: int,
                 noise: bool) -> str:
    """The notes under the measurement tables: what was measured and how to read the columns."""
    max_res = max((r["resolution"] for pb in results.values() for c in pb.values()
                   for r in c["runs"] if r["status"] == "reached"), default=math.nan)
    notes = (
        f"Measured on {n_train} training / {n_test} test examples, seeds "
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
            "initialization to the target (McCandlish et al.'s B_noise for E_min/S_min); "
            "B_noise / B_crit: [16-84%] over a joint bootstrap that resamples the seeds of every "
            "batch size and refits both from the same runs.")
    return notes


def shown(text: str) -> str:
    """``text`` as stdout can print it (characters its encoding lacks replaced)."""
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        text.encode(enc)
        return text
    except (UnicodeEncodeError, LookupError):
        return text.encode("ascii", "replace").decode("ascii")


# --------------------------------------------------------------------------------------------
# the plot
# --------------------------------------------------------------------------------------------
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
