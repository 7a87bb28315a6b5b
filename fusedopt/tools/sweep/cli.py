"""The sweep's command line: ``python -m fusedopt demo sweep [options]`` (:func:`main`).

Every option and ``--set`` value is checked (:func:`validate`) before anything is trained: most
before the data is loaded, the rest (batches that must fit the data, LRs at its batch sizes) right
after it (:func:`~fusedopt.tools.sweep.config.check_for_data`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from ..common import (DemoError, check_option, cli_main, make_out_dir, plotting_available,
                      threads_check,
                      torch_threads)
from ..digits import load_data
from . import training
from .config import OPTIMIZERS, QUICK, SWEEP, check_for_data, make_config
from .fit import summarize
from .report import (TUNING_NOTE, format_noise_table, format_noise_verdicts, format_notes,
                     format_runs_table, format_summary_table, format_tuning_table, plot_sweep,
                     shown)


def build_parser() -> argparse.ArgumentParser:
    d = SWEEP
    p = argparse.ArgumentParser(
        prog="fusedopt demo sweep",
        description="Batch-size sweep on scikit-learn's digits: steps and examples to a fixed "
                    "target for SGD (linear scaling + warm-up), LARS and LAMB at every batch "
                    "size, LR tuned per batch on a validation split (widened until the choice "
                    "is interior); fits "
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
                   help="multipliers of the scaling rule's LR tried first at every batch size "
                        f"(default {','.join(f'{m:g}' for m in d['lr_grid'])})")
    p.add_argument("--tuning", default=None,
                   help="'wide': widen the grid in factor-2 steps until the tuned LR is interior "
                        "(or the cap); 'rule': --lr-grid only (the rule's LR x {1/2, 1, 2}) "
                        f"(default {d['tuning']})")
    p.add_argument("--lr-cap", type=int, default=None,
                   help="with --tuning wide, never go beyond 2^±N times the rule's LR "
                        f"(default {d['lr_cap']})")
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

def validate(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration of :func:`make_config`, with ``--threads`` checked and the ``--out``
    folder made; DemoError for any bad option or ``--set`` value."""
    check_option("--threads", args.threads, threads_check())
    cfg = make_config(args)
    make_out_dir("--out", args.out)
    return cfg


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = validate(args)
    cfg["figure"] = plotting_available("fusedopt demo sweep")
    with torch_threads(args.threads):
        return _run(args, cfg)


def _run(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    noise = not args.no_noise_scale
    progress = not args.no_progress and sys.stderr.isatty()
    t_start = time.perf_counter()
    tune_data = load_data(None, "val")
    n_tune = len(tune_data[1])
    # the validation split is carved out of the training set: together they are the training
    # set of the measurement
    check_for_data(cfg, n_tune, n_tune + len(tune_data[3]))
    print(f"data: {tune_data[5]}; tuning on {n_tune} train / {len(tune_data[3])} validation "
          f"examples; target: training loss <= {cfg['target_loss']:g} and held-out accuracy >= "
          f"{cfg['target_accuracy']:g}; batches {','.join(map(str, cfg['batches']))}; "
          f"torch threads {torch.get_num_threads()}")
    tuning = training.tune(cfg, tune_data[:5], progress)
    t_tune = time.perf_counter() - t_start
    tuning_table = format_tuning_table(cfg, tuning)
    print(f"\nLR tuning on the validation split ({cfg['tuning']}): steps to the target at each "
          "multiplier of the rule's LR tried (mean over tuning seeds "
          f"{','.join(map(str, cfg['tune_seeds']))})\n")
    print(shown(tuning_table))
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

    data = load_data(None, "test")
    n = len(data[1])
    results = training.measure(cfg, data[:5], tuning, progress, noise)
    summary = summarize(cfg, results, noise)
    runs_table = format_runs_table(cfg, results, n)
    summary_table = format_summary_table(cfg, summary, noise)
    notes = format_notes(cfg, results, n, len(data[3]), noise)
    print("\nMeasurement: steps and examples to the target\n")
    print(shown(runs_table))
    print("\nFit of (S/S_min - 1)(E/E_min - 1) = 1 per optimizer\n")
    print(shown(summary_table))
    noise_table = verdicts = ""
    if noise:
        noise_table = format_noise_table(summary)
        print("\nB_noise at each probe point (training-loss level), pooled over the runs\n")
        print(shown(noise_table))
        verdicts = format_noise_verdicts(summary)
        print("\nB_noise against B_crit\n")
        print(shown(verdicts))
    print()
    print(notes)

    total = time.perf_counter() - t_start
    # the results first: a figure that fails to draw leaves them written
    with open(os.path.join(args.out, "sweep.md"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(t for t in (tuning_table, TUNING_NOTE, runs_table, summary_table,
                                         noise_table, verdicts, notes)
                            if t) + "\n")
    record.update(results=results, summary=summary, n_train=n, data=data[5], wall_time_s=total,
                  tuning_time_s=t_tune)
    with open(os.path.join(args.out, "sweep.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=str)
    written = ["sweep.md", "sweep.json"]
    if cfg.get("figure", True):
        png = os.path.join(args.out, "sweep.png")
        plot_sweep(cfg, results, summary, png,
                   f"{data[5]}: to training loss {cfg['target_loss']:g} and test accuracy "
                   f"{cfg['target_accuracy']:g}, {len(cfg['seeds'])} seeds, LR tuned per batch "
                   f"({cfg['tuning']})", noise)
        written.insert(0, png)
    print(f"wrote {', '.join(written)} (tuning {t_tune:.0f} s, total {total:.0f} s)")
    if not any(r["status"] == "reached" for pb in results.values() for c in pb.values()
               for r in c["runs"]):
        raise DemoError(
            f"no run reached the target (training loss <= {cfg['target_loss']:g} and test "
            f"accuracy >= {cfg['target_accuracy']:g}) within {cfg['max_epochs']:g} epochs; "
            "loosen --target-loss / --target-accuracy or raise --max-epochs")
    return record


def main(argv: list[str] | None = None) -> int:
    """``python -m fusedopt demo sweep``; returns the exit status."""
    return cli_main("fusedopt demo sweep", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
