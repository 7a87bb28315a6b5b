r"""The gradient noise scale of McCandlish, Kaplan, Amodei et al. 2018 ("An Empirical Model of
Large-Batch Training", appendix A.1), estimated from gradients at two batch sizes.

For per-example gradients with mean ``G`` (the true gradient) and covariance ``Σ``, the mean
gradient of a batch of ``B`` examples satisfies ``E|G_B|² = |G|² + tr(Σ)/B``. Measuring
``|G_B|²`` at a small batch ``b`` and a big batch ``B`` gives the unbiased estimates::

    |G|²  ≈  (B·|G_B|² − b·|G_b|²) / (B − b)
    tr(Σ) ≈  (|G_b|² − |G_B|²) / (1/b − 1/B)

and the "simple" noise scale ``B_simple = tr(Σ) / |G|²``, the batch size around which the
benefit of a larger batch starts to saturate (the critical batch size is of that order).
Because each single estimate is very noisy, the numerator and the denominator are smoothed
separately with an exponential moving average before the ratio is taken (the ratio of means,
not the mean of ratios, as recommended by the paper).

Three pieces:

* :class:`GradientNoiseScale` — the estimator; feed it squared norms.
* :class:`GradientAccumulationNoiseScale` — measures the squared norms during gradient
  accumulation (small batch = one micro-batch, big batch = the accumulated batch).
* :class:`DDPGradientNoiseScale` — measures them across DistributedDataParallel ranks (small
  batch = one rank's local batch, big batch = the global batch).

None of them reads a tensor value on the host while training; only the properties of
:class:`GradientNoiseScale` (``noise_scale``, ...) synchronize.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Sequence

import torch

from ._hyper import is_real

__all__ = ["GradientNoiseScale", "GradientAccumulationNoiseScale", "DDPGradientNoiseScale"]

ACCUMULATION_MODES = ("mean", "sum")


def _check_batch(name: str, x: Any) -> int:
    if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < 1:
        raise ValueError(f"Invalid {name}: {x!r}; expected an integer >= 1")
    return int(x)


def _work_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _check_grad_scale(grad_scale: Any) -> None:
    if grad_scale is not None and not isinstance(grad_scale, torch.Tensor) and not (
            is_real(grad_scale) and 0 < grad_scale < math.inf):
        raise ValueError(f"Invalid grad_scale: {grad_scale!r}; expected None, a finite number > 0 "
                         "or a tensor")


def _unscaled(grad_scale: Any, device: torch.device, *sq_norms: torch.Tensor) -> tuple:
    """``sq_norms`` of gradients multiplied by ``grad_scale`` (a loss scale, checked by
    ``_check_grad_scale``; a tensor's value is not read) as the unscaled gradients'."""
    if grad_scale is None:
        return sq_norms
    inv = _as_scalar_tensor("grad_scale", grad_scale, device).reciprocal().square()
    return tuple(x * inv for x in sq_norms)


def _as_scalar_tensor(name: str, x: Any, device: torch.device | None) -> torch.Tensor:
    """A 0-d float64 tensor from a Python number (validated: finite, >= 0) or a 1-element tensor
    (shape only: its value is not read, so no device synchronization)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex():
            raise ValueError(f"Invalid {name}: a tensor with {x.numel()} elements; expected a "
                             "real scalar (one element)")
        dev = x.device if device is None else device
        return x.detach().reshape(()).to(dev, _work_dtype(dev))
    if not is_real(x) or not math.isfinite(x) or x < 0:
        raise ValueError(f"Invalid {name}: {x!r}; expected a finite number >= 0")
    dev = torch.device("cpu") if device is None else device
    return torch.tensor(float(x), dtype=_work_dtype(dev), device=dev)


class GradientNoiseScale:
    r"""Estimator of ``|G|²``, ``tr(Σ)`` and ``B_simple = tr(Σ)/|G|²`` (McCandlish et al. 2018).

    Each :meth:`update_from_norms` call forms the two unbiased estimates of the module docstring
    from one measurement and folds them into exponential moving averages::

        S_n = β·S_{n−1} + (1 − β)·tr(Σ)_n ,      Ĝ_n = β·Ĝ_{n−1} + (1 − β)·|G|²_n
        trace_estimate   = S_n / (1 − β^n)       sq_norm_estimate = Ĝ_n / (1 − β^n)
        noise_scale      = trace_estimate / sq_norm_estimate

    (the ``1 − β^n`` bias correction of Adam; it cancels in the ratio). ``beta=0`` keeps only the
    last measurement. The smoothing is over *training steps*, so the estimate lags the true noise
    scale by about ``1/(1 − β)`` steps; the noise scale typically grows during training.

    Args:
        beta: EMA coefficient in ``[0, 1)``.

    Attributes (after at least one update): ``num_updates``, and for the last measurement
    ``last_small_sq_norm`` (mean ``|G_b|²``), ``last_big_sq_norm`` (``|G_B|²``),
    ``last_sq_norm`` and ``last_trace`` (the raw, unsmoothed estimates) as tensors.
    """

    def __init__(self, beta: float = 0.99) -> None:
        if not is_real(beta) or not (0.0 <= beta < 1.0):
            raise ValueError(f"Invalid beta: {beta!r}; expected a number in [0, 1)")
        self.beta = float(beta)
        self.reset()

    def reset(self) -> None:
        """Forget every measurement."""
        self._count: torch.Tensor | None = None  # measurements folded in, on their device
        self._ema_sq: torch.Tensor | None = None
        self._ema_trace: torch.Tensor | None = None
        self.last_small_sq_norm: torch.Tensor | None = None
        self.last_big_sq_norm: torch.Tensor | None = None
        self.last_sq_norm: torch.Tensor | None = None
        self.last_trace: torch.Tensor | None = None

    # ------------------------------------------------------------------ update
    def update_from_norms(
        self,
        *,
        small_batch: int,
        small_sq_norms: Sequence[float | torch.Tensor] | torch.Tensor,
        big_batch: int,
        big_sq_norm: float | torch.Tensor,
    ) -> None:
        r"""Fold in one measurement.

        Args:
            small_batch: examples behind each small-batch gradient (``b``).
            small_sq_norms: ``|G_b|²`` of each small batch (the micro-batches, or the ranks),
                each the squared norm of that batch's *mean* gradient; their mean is used.
            big_batch: examples behind the big-batch gradient (``B > b``; usually the number of
                small batches times ``b``).
            big_sq_norm: ``|G_B|²`` of the big batch's mean gradient.

        Python numbers are checked (finite, >= 0); tensors are used as they are, on their device,
        without reading their values. A measurement whose estimates are not finite (the inf or
        NaN gradients of a step that AMP's GradScaler skips) is left out, decided on the device:
        the averages and ``num_updates`` stay as they were.

        Raises:
            ValueError: a batch size not an integer >= 1, ``big_batch <= small_batch``, an empty
                ``small_sq_norms``, or a negative / non-finite Python number.
        """
        b = _check_batch("small_batch", small_batch)
        B = _check_batch("big_batch", big_batch)
        if B <= b:
            raise ValueError(
                f"Invalid big_batch: {B!r}; expected an integer > small_batch={b!r}"
            )
        device = big_sq_norm.device if isinstance(big_sq_norm, torch.Tensor) else None
        if isinstance(small_sq_norms, torch.Tensor):
            if small_sq_norms.numel() == 0:
                raise ValueError("Invalid small_sq_norms: empty; expected at least one value")
            dev = small_sq_norms.device if device is None else device
            small = small_sq_norms.detach().reshape(-1).to(dev, _work_dtype(dev)).mean()
        else:
            vals = list(small_sq_norms)
            if not vals:
                raise ValueError("Invalid small_sq_norms: empty; expected at least one value")
            if device is None:
                device = next((v.device for v in vals if isinstance(v, torch.Tensor)), None)
            small = torch.stack([
                _as_scalar_tensor(f"small_sq_norms[{i}]", v, device) for i, v in enumerate(vals)
            ]).mean()
        big = _as_scalar_tensor("big_sq_norm", big_sq_norm, small.device)

        sq = (B * big - b * small) / (B - b)
        trace = (small - big) / (1.0 / b - 1.0 / B)

        beta = self.beta
        ok = torch.isfinite(sq) & torch.isfinite(trace)
        if self._ema_sq is None:
            self._ema_sq, self._ema_trace = torch.zeros_like(sq), torch.zeros_like(sq)
            self._count = torch.zeros_like(sq)
        old_sq, old_trace = (t.to(sq.device, sq.dtype) for t in (self._ema_sq, self._ema_trace))
        self._ema_sq = torch.where(ok, beta * old_sq + (1.0 - beta) * sq, old_sq)
        self._ema_trace = torch.where(ok, beta * old_trace + (1.0 - beta) * trace, old_trace)
        self._count = self._count.to(sq.device, sq.dtype) + ok
        self.last_small_sq_norm, self.last_big_sq_norm = small, big
        self.last_sq_norm, self.last_trace = sq, trace

    # ------------------------------------------------------------------ read-out
    @property
    def num_updates(self) -> int:
        """Measurements folded in so far (without those left out as not finite)."""
        return 0 if self._count is None else int(self._count)

    def _corrected(self, ema: torch.Tensor | None) -> float:
        n = self.num_updates
        if ema is None or n == 0:
            return math.nan
        return float(ema) / (1.0 - self.beta ** n)

    @property
    def sq_norm_estimate(self) -> float:
        """Smoothed, bias-corrected estimate of ``|G|²`` (nan before the first update)."""
        return self._corrected(self._ema_sq)

    @property
    def trace_estimate(self) -> float:
        """Smoothed, bias-corrected estimate of ``tr(Σ)`` (nan before the first update)."""
        return self._corrected(self._ema_trace)

    @property
    def noise_scale(self) -> float:
        """``B_simple = trace_estimate / sq_norm_estimate``.

        nan before the first update and while the smoothed ``|G|²`` estimate is <= 0 (the
        signal is not resolved yet: keep measuring). A value <= 0 means the smoothed ``tr(Σ)``
        estimate is <= 0 (the noise is not resolved)."""
        if self.num_updates == 0:
            return math.nan
        g = float(self._ema_sq)
        if not g > 0.0:
            return math.nan
        return float(self._ema_trace) / g

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The smoothing state (tensors moved to CPU) for ``torch.save``."""
        def cpu(t):
            return None if t is None else t.detach().cpu().clone()

        return {
            "beta": self.beta,
            "num_updates": self.num_updates,
            "ema_sq_norm": cpu(self._ema_sq),
            "ema_trace": cpu(self._ema_trace),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the ``last_*`` attributes are not restored)."""
        missing = {"beta", "num_updates", "ema_sq_norm", "ema_trace"} - set(state_dict)
        if missing:
            raise ValueError(f"Invalid state_dict: missing keys {sorted(missing)}")
        beta = state_dict["beta"]
        if not is_real(beta) or not (0.0 <= beta < 1.0):
            raise ValueError(f"Invalid beta in state_dict: {beta!r}; expected a number in [0, 1)")
        n = state_dict["num_updates"]
        if not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"Invalid num_updates in state_dict: {n!r}; expected an integer >= 0")
        self.reset()
        self.beta = float(beta)

        def tensor(x):
            return None if x is None else torch.as_tensor(x, dtype=torch.float64).clone()

        self._ema_sq = tensor(state_dict["ema_sq_norm"])
        self._ema_trace = tensor(state_dict["ema_trace"])
        if self._ema_sq is not None:
            self._count = torch.tensor(float(n), dtype=self._ema_sq.dtype)

    def __repr__(self) -> str:
        return (f"GradientNoiseScale(beta={self.beta}, num_updates={self.num_updates}, "
                f"noise_scale={self.noise_scale:.4g})")


def _sq_norm_total(tensors: list[torch.Tensor]) -> torch.Tensor:
    from .functional import sq_norms

    return sq_norms(tensors).sum()


class GradientAccumulationNoiseScale:
    r"""Measure the noise scale during gradient accumulation.

    The small batch is one micro-batch, the big batch the accumulated batch::

        acc = GradientAccumulationNoiseScale(model.parameters(), micro_batch_size=32)
        for batch in loader:
            for micro in batch.split(32):
                (loss_fn(model(micro)) / n_micro).backward()
                acc.micro_batch_done()
            acc.step()            # before clipping / optimizer.step() / zero_grad()
            optimizer.step(); optimizer.zero_grad()
        print(acc.noise_scale.noise_scale)

    **How the micro-batch norms are measured, and the memory cost.** The contribution of
    micro-batch ``i`` to ``p.grad`` is the gradient autograd computes for ``p`` in that
    backward, before it is added into ``p.grad`` (``grad_i = grad_now − grad_before``). A hook
    on each parameter (``Tensor.register_hook``) sees exactly that tensor and reduces it to its
    sum of squares right away (:func:`fusedopt.functional.sq_norms`), keeping a 1-element
    tensor per parameter until :meth:`micro_batch_done` sums them: no copy of the gradients, no
    snapshot of ``p.grad``, and no reference that would keep the incoming gradient alive after
    autograd has accumulated it. The extra cost is one reduction per parameter per backward
    (a read of the gradient) and ``O(#params)`` scalars. (The alternative via the accumulated
    gradient alone, ``|a + g|² − |a|² = |g|² + 2⟨a, g⟩``, needs the inner product with the
    previous accumulation, i.e. a full snapshot copy of the gradients; it is not used.)
    :meth:`step` then takes the squared norm of the accumulated ``p.grad`` (one
    ``sq_norms`` call) as the big-batch measurement.

    Requirements: exactly one ``backward()`` per micro-batch (two backwards would be measured as
    two micro-batches' worth of contributions), dense gradients, equal micro-batch sizes, and
    each micro-batch loss being the *mean* over its examples. Under AMP's ``GradScaler``, pass
    its scale to :meth:`step` (``grad_scale=scaler.get_scale()``): the scale changes during
    training, and unscaled measurements keep each step's weight in the averages; the inf or NaN
    gradients of a step the scaler skips are left out (``update_from_norms``). ``accumulation``
    says how the micro-batch losses are combined: ``"mean"`` if each is divided by the number of
    micro-batches (the usual practice: ``p.grad`` ends as the big-batch mean gradient), ``"sum"``
    if not. A wrong setting scales ``sq_norm_estimate`` and ``trace_estimate`` by the same factor
    (``n²``), so ``noise_scale`` itself does not depend on it; for the same reason a constant AMP
    loss scale does not change ``noise_scale`` either. Not for use under
    DistributedDataParallel (use :class:`DDPGradientNoiseScale`).

    Args:
        params: the parameters (those with ``requires_grad`` are used).
        micro_batch_size: examples per micro-batch (``b``); the big batch is ``n·b`` for ``n``
            micro-batches per step (at least 2).
        noise_scale: the estimator to feed (a new ``GradientNoiseScale()`` if None); available
            as ``.noise_scale``.
        accumulation: ``"mean"`` or ``"sum"``, see above.

    Raises:
        ValueError: bad ``micro_batch_size`` or ``accumulation``, or no parameter requiring grad.
    """

    def __init__(self, params: Iterable[torch.Tensor], micro_batch_size: int,
                 noise_scale: GradientNoiseScale | None = None, *,
                 accumulation: str = "mean") -> None:
        self.micro_batch_size = _check_batch("micro_batch_size", micro_batch_size)
        if accumulation not in ACCUMULATION_MODES:
            raise ValueError(
                f"Invalid accumulation: {accumulation!r}; expected one of {ACCUMULATION_MODES}"
            )
        self.accumulation = accumulation
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("Invalid params: no parameter with requires_grad=True")
        self.noise_scale = GradientNoiseScale() if noise_scale is None else noise_scale
        self._pending: list[torch.Tensor] = []  # per-parameter Σg² of the running backward(s)
        self._micro: list[torch.Tensor] = []  # |g_i|² of each finished micro-batch
        self._handles = [p.register_hook(self._hook) for p in self.params]

    def _hook(self, grad: torch.Tensor) -> None:
        from .functional import sq_norms

        if grad.is_sparse:
            raise RuntimeError("GradientAccumulationNoiseScale supports dense gradients only")
        self._pending.append(sq_norms([grad]))
        return None  # the gradient is not modified

    def micro_batch_done(self) -> None:
        """Record the squared norm of the gradient contributed by the backward just finished.

        Raises:
            RuntimeError: no backward reached the parameters since the last call.
        """
        if not self._pending:
            raise RuntimeError(
                "micro_batch_done() called but no gradient reached the parameters since the last "
                "call; call it once after each micro-batch's backward()"
            )
        dev = self._pending[0].device
        self._micro.append(torch.cat([t.to(dev) for t in self._pending]).sum())
        self._pending.clear()

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches recorded since the last :meth:`step`."""
        return len(self._micro)

    def step(self, grad_scale: float | torch.Tensor | None = None) -> None:
        """Feed the estimator with this accumulation window and start a new one.

        Call after the last :meth:`micro_batch_done` and before anything modifies the gradients
        (clipping, unscaling, ``optimizer.step()``, ``zero_grad()``). ``grad_scale``: the loss
        scale the gradients carry (AMP's ``GradScaler``), divided out of the measurements.

        Raises:
            RuntimeError: a backward without its :meth:`micro_batch_done`, or fewer than 2
                micro-batches (no big batch to compare with).
            ValueError: a ``grad_scale`` that is not a finite number > 0 or a tensor (the
                window is kept).
        """
        _check_grad_scale(grad_scale)
        if self._pending:
            raise RuntimeError(
                "a backward() was not followed by micro_batch_done(); call it after each "
                "micro-batch's backward()"
            )
        n = len(self._micro)
        if n < 2:
            self._micro.clear()
            raise RuntimeError(
                f"step() needs at least 2 micro-batches per accumulation window, got {n}"
            )
        grads = [p.grad for p in self.params if p.grad is not None]
        big = _sq_norm_total(grads)
        dev = big.device
        micro = torch.stack([m.to(dev) for m in self._micro])
        self._micro.clear()
        if self.accumulation == "mean":
            # contributions are g_i / n; p.grad is the big-batch mean gradient
            micro = micro * float(n * n)
        else:
            # contributions are g_i; p.grad is n times the big-batch mean gradient
            big = big / float(n * n)
        micro, big = _unscaled(grad_scale, dev, micro, big)
        self.noise_scale.update_from_norms(
            small_batch=self.micro_batch_size, small_sq_norms=micro,
            big_batch=self.micro_batch_size * n, big_sq_norm=big,
        )

    def discard(self) -> None:
        """Drop the measurements of the current window (e.g. for a step skipped by AMP)."""
        self._pending.clear()
        self._micro.clear()

    def remove(self) -> None:
        """Remove the gradient hooks (the estimator keeps its state)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.discard()

    def __enter__(self) -> GradientAccumulationNoiseScale:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class DDPGradientNoiseScale:
    r"""Measure the noise scale across the ranks of a ``DistributedDataParallel`` model.

    The small batch is one rank's local batch, the big batch the global batch. A DDP
    communication hook (``register_comm_hook``) takes, for every gradient bucket, the squared
    norm of the *local* gradients before the all-reduce and of the *averaged* gradients after
    it (two extra reads of each bucket, no copy). :meth:`step`, called once per optimizer step
    after the synchronizing backward, all-reduces the per-rank local squared norms (one scalar
    collective, the only extra communication) and feeds the estimator on every rank, so every
    rank holds the same estimate::

        model = DDP(net)
        gns = DDPGradientNoiseScale(model, local_batch_size=64)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            gns.step()
            optimizer.step(); optimizer.zero_grad()

    With gradient accumulation under ``model.no_sync()``, only the synchronizing backward runs
    the hook, so the local measurement covers the whole local accumulation: pass the local
    examples per optimizer step as ``local_batch_size``.

    Args:
        ddp_model: the ``DistributedDataParallel`` module (no comm hook registered yet; DDP
            accepts only one).
        local_batch_size: examples per rank per optimizer step (``b``); the big batch is
            ``world_size·b``.
        noise_scale: the estimator to feed (a new ``GradientNoiseScale()`` if None).
        comm_hook, comm_state: the communication hook to wrap (default: PyTorch's
            ``allreduce_hook``, i.e. DDP's default averaging, with the model's process group);
            its future must yield the averaged bucket tensor.

    Raises:
        ValueError: bad ``local_batch_size``, or a process group of fewer than 2 ranks.
    """

    def __init__(self, ddp_model: torch.nn.parallel.DistributedDataParallel,
                 local_batch_size: int, noise_scale: GradientNoiseScale | None = None, *,
                 comm_hook: Callable | None = None, comm_state: Any = None) -> None:
        import torch.distributed as dist

        self.local_batch_size = _check_batch("local_batch_size", local_batch_size)
        self.noise_scale = GradientNoiseScale() if noise_scale is None else noise_scale
        self.process_group = getattr(ddp_model, "process_group", None) or dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        if self.world_size < 2:
            raise ValueError(
                f"Invalid process group: world size {self.world_size}; the DDP noise scale "
                "needs at least 2 ranks (use GradientAccumulationNoiseScale on one process)"
            )
        if comm_hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            comm_hook, comm_state = allreduce_hook, self.process_group
        self._inner_hook, self._inner_state = comm_hook, comm_state
        self._local: list[torch.Tensor] = []
        self._big: list[torch.Tensor] = []
        ddp_model.register_comm_hook(None, self._hook)

    # no annotations: DDP checks them and `from __future__ import annotations` makes them strings
    def _hook(self, _state, bucket):
        from .functional import sq_norms

        self._local.append(sq_norms([bucket.buffer()]))  # before the hook averages in place
        fut = self._inner_hook(self._inner_state, bucket)

        def after(f: torch.futures.Future) -> torch.Tensor:
            avg = f.value()
            if isinstance(avg, (list, tuple)):
                avg = avg[0]
            self._big.append(sq_norms([avg]))
            return avg

        return fut.then(after)

    def step(self, grad_scale: float | torch.Tensor | None = None) -> None:
        """All-reduce the local squared norms and feed the estimator (call on every rank).
        ``grad_scale``: the loss scale the gradients carry (AMP's ``GradScaler``), divided out
        of the measurements, as for :meth:`GradientAccumulationNoiseScale.step`.

        Raises:
            RuntimeError: no synchronizing backward since the last call.
            ValueError: a ``grad_scale`` that is not a finite number > 0 or a tensor (the
                measurements are kept).
        """
        import torch.distributed as dist

        _check_grad_scale(grad_scale)
        if not self._local or len(self._big) != len(self._local):
            self._local.clear()
            self._big.clear()
            raise RuntimeError(
                "DDPGradientNoiseScale.step() called without a completed synchronizing "
                "backward() since the last call"
            )
        dev = self._local[0].device
        local = torch.stack([t.to(dev) for t in self._local]).sum()
        big = torch.stack([t.to(dev) for t in self._big]).sum()
        self._local.clear()
        self._big.clear()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.process_group)
        local, big = _unscaled(grad_scale, dev, local, big)
        self.noise_scale.update_from_norms(
            small_batch=self.local_batch_size, small_sq_norms=local / self.world_size,
            big_batch=self.local_batch_size * self.world_size, big_sq_norm=big,
        )
