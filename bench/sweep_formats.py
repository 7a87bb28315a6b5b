"""Convergence of the state formats in the batch-size sweep (docs/large-batch.md, "Sweep with the
8-bit format"): the sweeps of one command run once per format, compared seed by seed.

    for P in full bf16 8bit; do
      python -m fusedopt demo sweep --quick --optimizers lars,lamb --seeds 0,1,...,19 \\
          --tuning rule --lr-grid 1 --no-noise-scale \\
          --set lars.state_precision=$P --set lamb.state_precision=$P --out sweep_$P
    done
    python bench/sweep_formats.py sweep_full sweep_bf16 sweep_8bit

For every optimizer and batch size: the seeds that reached the target, the median steps to it and
their quartiles (a run that did not reach it counts as the slowest), and against the first folder
(fp32 state) Fisher's exact test of the reached counts and the Mann-Whitney U test of the steps
(scipy), so that "within the seed spread" is a number.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from scipy.stats import fisher_exact, mannwhitneyu


def steps_per_seed(results: dict, opt: str, batch: str) -> list[float]:
    return [r["steps"] if r["status"] == "reached" else math.inf
            for r in results[opt][batch]["runs"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", help="sweep output folders; the first is the baseline")
    args = ap.parse_args()
    runs = {f: json.loads((Path(f) / "sweep.json").read_text())["results"] for f in args.folders}
    base = args.folders[0]
    print("| optimizer | batch | sweep | reached | median steps [quartiles] | vs the first: "
          "Fisher p, Mann-Whitney p |")
    print("|---|--:|---|--:|---|---|")
    for opt in runs[base]:
        for batch in runs[base][opt]:
            ref = steps_per_seed(runs[base], opt, batch)
            for folder in args.folders:
                x = steps_per_seed(runs[folder], opt, batch)
                # a run that did not reach the target ranks as the slowest: a large finite stand-in
                worst = 10 * max([v for v in x + ref if math.isfinite(v)] or [1])
                y = [min(v, worst) for v in x]
                q1, med, q3 = statistics.quantiles(y, n=4, method="inclusive")
                reached = sum(map(math.isfinite, x))
                vs = ""
                if folder != base:
                    ref_reached = sum(map(math.isfinite, ref))
                    p_reached = fisher_exact([[reached, len(x) - reached],
                                              [ref_reached, len(ref) - ref_reached]])[1]
                    p_steps = mannwhitneyu(y, [min(v, worst) for v in ref]).pvalue
                    vs = f"{p_reached:.2f}, {p_steps:.2f}"
                shown = [">cap" if v > worst / 10 else f"{v:g}" for v in (med, q1, q3)]
                print(f"| {opt.upper()} | {batch} | {Path(folder).name} | {reached}/{len(x)} | "
                      f"{shown[0]} [{shown[1]}-{shown[2]}] | {vs} |")


if __name__ == "__main__":
    main()
