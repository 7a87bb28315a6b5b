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
   scaling rule predicts from its base LR at :data:`SWEEP` ``["base_batch"]``, times a
   multiplier: first each of ``lr_grid`` (½, 1, 2), then, with ``tuning="wide"`` (the default),
   factor-2 steps beyond the grid while the best multiplier is at an end of those tried, until
   it has a worse neighbour on each side or the search reaches ``2**±lr_cap``
   (:func:`.tuner.search_lr`); ``tuning="rule"`` keeps the grid only. The multiplier with the
   fewest steps to the target (training loss on the 80%, accuracy on the validation 20%) is
   kept; ties go to the multiplier closest to 1. The table reports the tuned LR beside the
   rule's, their ratio, and whether the choice is interior, at an edge, or at the cap.
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

Every hyper-parameter is in ``SWEEP`` and ``OPTIMIZERS`` of :mod:`.config`, with how it was chosen.

The modules, by job: :mod:`.config` (the hyper-parameters; options and ``--set`` values turned
into a checked configuration), :mod:`.training` (one run to the target, the tuning, the
measurement), :mod:`.tuner` (the LR search, on any "steps at this LR" callable), :mod:`.fit` (the
hyperbola fit, its bootstrap, the per-optimizer summary with the noise scale and
B_noise / B_crit), :mod:`.report` (tables, notes, plot), :mod:`.cli` (the parser and ``main``).
"""
from __future__ import annotations

from .cli import build_parser, main, run
from .config import OPTIMIZERS, QUICK, SWEEP, make_config, rule_lr
from .fit import (FitError, bootstrap_fit, fit_hyperbola, hyperbola_points, noise_ratio,
                  summarize)
from .training import measure, train_to_target, tune
from .tuner import search_lr

__all__ = [
    "SWEEP", "QUICK", "OPTIMIZERS", "make_config", "rule_lr",
    "FitError", "fit_hyperbola", "bootstrap_fit", "hyperbola_points", "summarize",
    "noise_ratio",
    "train_to_target", "tune", "measure", "search_lr",
    "build_parser", "run", "main",
]
