r"""Learning-rate scaling rules and warm-up schedules for large-batch training.

* :func:`scale_lr` — the linear (Goyal et al. 2017) and square-root (Krizhevsky 2014) rules.
* :class:`WarmupDecayLR` — linear gradual warm-up, then polynomial (power 2 is the LARS
  paper's choice), cosine or no decay; :class:`WarmupPolyDecayLR` and :class:`WarmupCosineLR`
  fix the decay.
* :class:`LEGWLR` — Linear-Epoch Gradual Warm-up (You et al. 2019): when the batch grows by
  ``k``, warm up for ``k`` times as many epochs and scale the peak LR by ``sqrt(k)``.

All schedulers are :class:`torch.optim.lr_scheduler.LRScheduler` subclasses, stepped once per
*optimizer step* (not per epoch): ``state_dict``/``load_state_dict``, ``get_last_lr``,
``SequentialLR`` and ``ChainedScheduler`` work as for the built-in schedulers. Each one multiplies
the learning rate a group had when the scheduler was created (``base_lr``, stored by PyTorch as
``group["initial_lr"]``) by a factor ``f(t)``, ``t`` = number of ``step()`` calls so far::

    lr(t) = base_lr · f(t)

The update is written in the recursive ("chainable") form of the built-in schedulers,
``lr(t) = lr(t-1) · f(t) / f(t-1)``, so that other multiplicative schedulers in a
``ChainedScheduler`` compose with it. Where ``f(t-1)`` is 0, or below ``1e-12`` of the peak,
it restarts from the closed form ``base_lr · f(t)``; the factors that other chained schedulers
applied before that step are lost then. With a warm-up that starts from 0 this happens at step 1
only, where the built-in schedulers' factors are usually still 1. ``step(epoch)`` and
``SequentialLR`` use the closed form.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ._hyper import is_real

__all__ = [
    "scale_lr",
    "WarmupDecayLR",
    "WarmupPolyDecayLR",
    "WarmupCosineLR",
    "LEGWLR",
    "SCALING_RULES",
    "DECAYS",
]

SCALING_RULES = ("linear", "sqrt")
# Below this factor (relative to the peak) the recursive update restarts from the closed form.
_RECURSION_FLOOR = 1e-12
DECAYS = ("poly", "cosine", "none")


# --------------------------------------------------------------------------- validation helpers
def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_positive_int(name: str, x: Any) -> int:
    if not _is_int(x) or x < 1:
        raise ValueError(f"Invalid {name}: {x!r}; expected an integer >= 1")
    return int(x)


def _check_real(name: str, x: Any, lo: float, hi: float, *, lo_open=False, hi_open=False) -> float:
    """Finite real in the interval; the message names the value and the allowed range."""
    ok = is_real(x) and math.isfinite(x)
    if ok:
        ok = (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        rng = rng.replace("inf]", "inf)")
        raise ValueError(f"Invalid {name}: {x!r}; expected a finite number in {rng}")
    return float(x)


# --------------------------------------------------------------------------- scaling rules
def scale_lr(base_lr: float, batch_size: int, base_batch_size: int, rule: str = "linear") -> float:
    r"""Scale a learning rate tuned at ``base_batch_size`` to ``batch_size``.

    With ``k = batch_size / base_batch_size``::

        rule="linear":  lr = base_lr · k          (Goyal et al. 2017, "Accurate, Large Minibatch
                                                   SGD: Training ImageNet in 1 Hour")
        rule="sqrt":    lr = base_lr · sqrt(k)    (Krizhevsky 2014, "One weird trick for
                                                   parallelizing convolutional neural networks";
                                                   the LEGW/LAMB choice for adaptive optimizers)

    The linear rule keeps the expected update per *example* constant for SGD and holds only up to
    a problem-dependent batch size (roughly the gradient noise scale, see
    :mod:`fusedopt.noise_scale`); it needs a warm-up at large ``k``.

    Raises:
        ValueError: ``base_lr`` not a finite number >= 0, a batch size not an integer >= 1, or
            ``rule`` not one of ``"linear"``, ``"sqrt"``.
    """
    base_lr = _check_real("base_lr", base_lr, 0.0, math.inf)
    batch_size = _check_positive_int("batch_size", batch_size)
    base_batch_size = _check_positive_int("base_batch_size", base_batch_size)
    if rule not in SCALING_RULES:
        raise ValueError(f"Invalid rule: {rule!r}; expected one of {SCALING_RULES}")
    k = batch_size / base_batch_size
    return base_lr * (k if rule == "linear" else math.sqrt(k))


# --------------------------------------------------------------------------- schedulers
class WarmupDecayLR(LRScheduler):
    r"""Linear gradual warm-up followed by a decay, as a factor of each group's initial LR.

    With ``W = warmup_steps``, ``T = total_steps``, ``s = warmup_start_factor``,
    ``e = end_factor``, ``P = peak_factor`` and ``t`` the number of ``step()`` calls::

        f(t) = P · (s + (1 − s) · t / W)                   0 <= t < W     (warm-up)
        f(t) = P · (e + (1 − e) · d((t − W) / (T − W)))    W <= t <= T    (decay)
        f(t) = P · e                                       t > T

        decay="poly":    d(x) = (1 − x)^power           (power=2: You et al. 2017, LARS)
        decay="cosine":  d(x) = (1 + cos(π·x)) / 2      (Loshchilov & Hutter 2017, no restarts)
        decay="none":    d(x) = 1                       (hold the peak; ``total_steps`` may be None)

    so the LR rises linearly from ``s·P·base_lr`` to the peak ``P·base_lr`` reached at step ``W``,
    then decays to ``e·P·base_lr`` at step ``T`` and stays there. ``warmup_start_factor=1/k``
    gives Goyal et al.'s warm-up from the small-batch LR ``η`` to ``kη`` when ``base_lr = kη``.
    ``peak_factor`` lets :class:`LEGWLR` scale the peak without changing the optimizer's LR.

    Call ``step()`` once per optimizer step (after ``optimizer.step()``). Construct the scheduler
    before ``optimizer.load_state_dict`` when resuming, as for any PyTorch scheduler.

    Raises:
        ValueError: ``warmup_steps`` not an integer in ``[0, total_steps − 1]``, ``total_steps``
            not an integer >= 1, ``decay`` unknown, ``power`` not a finite number > 0, a factor
            outside ``[0, 1]``, or ``peak_factor`` not a finite number > 0.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int | None,
        *,
        decay: str = "poly",
        power: float = 2.0,
        warmup_start_factor: float = 0.0,
        end_factor: float = 0.0,
        peak_factor: float = 1.0,
        last_epoch: int = -1,
    ) -> None:
        if decay not in DECAYS:
            raise ValueError(f"Invalid decay: {decay!r}; expected one of {DECAYS}")
        if total_steps is None and decay != "none":
            raise ValueError(
                f"Invalid total_steps: None; expected an integer >= 1 (None is only allowed "
                f"with decay='none', got decay={decay!r})"
            )
        if total_steps is not None:
            total_steps = _check_positive_int("total_steps", total_steps)
        if not _is_int(warmup_steps) or warmup_steps < 0 or (
            total_steps is not None and warmup_steps >= total_steps
        ):
            hi = "total_steps - 1" if total_steps is None else f"{total_steps - 1}"
            raise ValueError(
                f"Invalid warmup_steps: {warmup_steps!r}; expected an integer in [0, {hi}] "
                f"(total_steps={total_steps!r})"
            )
        self.warmup_steps = int(warmup_steps)
        self.total_steps = total_steps
        self.decay = decay
        self.power = _check_real("power", power, 0.0, math.inf, lo_open=True)
        self.warmup_start_factor = _check_real("warmup_start_factor", warmup_start_factor, 0.0, 1.0)
        self.end_factor = _check_real("end_factor", end_factor, 0.0, 1.0)
        self.peak_factor = _check_real("peak_factor", peak_factor, 0.0, math.inf, lo_open=True)
        if not _is_int(last_epoch) or last_epoch < -1:
            raise ValueError(f"Invalid last_epoch: {last_epoch!r}; expected an integer >= -1")
        super().__init__(optimizer, last_epoch)

    # The schedule itself, usable without an optimizer (plots, tests).
    def factor(self, t: int) -> float:
        """``f(t)`` of the class docstring (the LR at step ``t`` divided by the initial LR)."""
        if t < 0:
            raise ValueError(f"Invalid step: {t!r}; expected an integer >= 0")
        W, T, P = self.warmup_steps, self.total_steps, self.peak_factor
        if t < W:
            s = self.warmup_start_factor
            return P * (s + (1.0 - s) * t / W)
        e = self.end_factor
        if self.decay == "none":
            return P
        assert T is not None
        if t >= T:
            return P * e
        x = (t - W) / (T - W)
        d = (1.0 - x) ** self.power if self.decay == "poly" else 0.5 * (1.0 + math.cos(math.pi * x))
        return P * (e + (1.0 - e) * d)

    def get_lr(self) -> list[float | torch.Tensor]:
        t = self.last_epoch
        f_t = self.factor(t)
        if t == 0:
            # Initial step: multiply what the group holds now (its initial LR unless another
            # scheduler of a ChainedScheduler already scaled it).
            return [group["lr"] * f_t for group in self.optimizer.param_groups]
        f_prev = self.factor(t - 1)
        if f_prev <= _RECURSION_FLOOR * self.peak_factor:
            # 0 (or so close to 0 that lr(t-1) may have underflowed): restart from the closed form
            return [base_lr * f_t for base_lr in self.base_lrs]
        ratio = f_t / f_prev
        return [group["lr"] * ratio for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self) -> list[float | torch.Tensor]:
        f_t = self.factor(self.last_epoch)
        return [base_lr * f_t for base_lr in self.base_lrs]


class WarmupPolyDecayLR(WarmupDecayLR):
    r"""Linear warm-up for ``warmup_steps``, then polynomial decay to ``end_factor`` at
    ``total_steps`` (the LARS paper's schedule with ``power=2``)::

        f(t) = s + (1 − s)·t/W                           t < W
        f(t) = e + (1 − e)·(1 − (t − W)/(T − W))^power   W <= t <= T
        f(t) = e                                         t > T

    See :class:`WarmupDecayLR` for the arguments and the errors raised.
    """

    def __init__(self, optimizer, warmup_steps: int, total_steps: int, power: float = 2.0, *,
                 warmup_start_factor: float = 0.0, end_factor: float = 0.0,
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, warmup_steps, total_steps, decay="poly", power=power,
                         warmup_start_factor=warmup_start_factor, end_factor=end_factor,
                         last_epoch=last_epoch)


class WarmupCosineLR(WarmupDecayLR):
    r"""Linear warm-up for ``warmup_steps``, then half-cosine decay to ``end_factor`` at
    ``total_steps``::

        f(t) = s + (1 − s)·t/W                                     t < W
        f(t) = e + (1 − e)·(1 + cos(π·(t − W)/(T − W)))/2          W <= t <= T
        f(t) = e                                                   t > T

    See :class:`WarmupDecayLR` for the arguments and the errors raised.
    """

    def __init__(self, optimizer, warmup_steps: int, total_steps: int, *,
                 warmup_start_factor: float = 0.0, end_factor: float = 0.0,
                 last_epoch: int = -1) -> None:
        super().__init__(optimizer, warmup_steps, total_steps, decay="cosine",
                         warmup_start_factor=warmup_start_factor, end_factor=end_factor,
                         last_epoch=last_epoch)


class LEGWLR(WarmupDecayLR):
    r"""Linear-Epoch Gradual Warm-up (You, Hseu, Ying, Demmel, Keutzer, Hsieh 2019, "Large-batch
    training for LSTM and beyond").

    Build the optimizer with the LR tuned at the *base* batch size ``B0``; for a batch ``k·B0``
    (``k = batch_multiple``) LEGW warms up for ``k`` times the base warm-up epochs and uses the
    square-root-scaled peak ``sqrt(k)·base_lr``::

        W = round(k · base_warmup_epochs · steps_per_epoch)     warm-up steps
        T = round(total_epochs · steps_per_epoch)               total steps
        f(t) = sqrt(k) · g(t)

    where ``g`` is the warm-up + ``decay`` factor of :class:`WarmupDecayLR` with those ``W`` and
    ``T``; ``steps_per_epoch`` is counted at the *large* batch. With ``decay="poly"`` and
    ``power=2`` (defaults) it is the paper's warm-up followed by poly decay.

    Raises:
        ValueError: ``base_warmup_epochs`` not a finite number >= 0, ``batch_multiple`` not a
            finite number > 0, ``steps_per_epoch`` not an integer >= 1, ``total_epochs`` not a
            finite number > 0, or a warm-up of ``W >= T`` steps (longer than the training run);
            and the errors of :class:`WarmupDecayLR`.
    """

    def __init__(self, optimizer, base_warmup_epochs: float, batch_multiple: float,
                 steps_per_epoch: int, total_epochs: float, *, decay: str = "poly",
                 power: float = 2.0, warmup_start_factor: float = 0.0, end_factor: float = 0.0,
                 last_epoch: int = -1) -> None:
        e_w = _check_real("base_warmup_epochs", base_warmup_epochs, 0.0, math.inf)
        k = _check_real("batch_multiple", batch_multiple, 0.0, math.inf, lo_open=True)
        spe = _check_positive_int("steps_per_epoch", steps_per_epoch)
        e_t = _check_real("total_epochs", total_epochs, 0.0, math.inf, lo_open=True)
        total = max(1, round(e_t * spe))
        warmup = round(k * e_w * spe)
        if warmup >= total:
            raise ValueError(
                f"Invalid LEGW warm-up: batch_multiple * base_warmup_epochs = {k * e_w!r} epochs "
                f"({warmup} steps) must be shorter than total_epochs={e_t!r} ({total} steps)"
            )
        self.batch_multiple = k
        self.base_warmup_epochs = e_w
        self.steps_per_epoch = spe
        self.total_epochs = e_t
        super().__init__(optimizer, warmup, total, decay=decay, power=power,
                         warmup_start_factor=warmup_start_factor, end_factor=end_factor,
                         peak_factor=math.sqrt(k), last_epoch=last_epoch)
