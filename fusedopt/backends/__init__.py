"""Backends and the one function that chooses among them.

A backend implements the two passes of a trust-ratio step for one :class:`~fusedopt.functional.Bucket`
(tensors of one param group sharing device, param dtype and grad dtype):

* ``sq_norms(tensors)``: per-tensor sums of squares, shape ``[n]`` (global clipping, noise scale).
* ``lamb_pass1`` / ``lars_pass1``: increment the step counts (unless ``found_inf`` is nonzero) and
  return the per-tensor sums of squares ``[n, 2]`` that the trust ratio needs
  (LAMB: ``‖w‖², ‖u‖²``; LARS: ``‖w‖², ‖g‖²`` or ``‖g + λw‖²``). LAMB's pass 1 also updates the moments.
* ``lamb_pass2`` / ``lars_pass2``: turn the (possibly all-reduced) sums into trust ratios with the
  zero-norm rule and apply the update.

``grad_mult`` (0-dim tensor or None) multiplies every gradient as it is read (GradScaler unscale and
global clipping, ``1 / (scale · c)``); ``found_inf`` (0-dim tensor or None), when nonzero, makes the
whole step a no-op. Neither is ever read on the host.

``accepts_grads(b)`` answers whether a bucket kept from an earlier step (Note [list cache] in
fusedopt/optim.py) can take this step's grads; ``grad_sq_norms`` gives the grads' ``Σg²``.
"""
from __future__ import annotations

import importlib
from operator import attrgetter, methodcaller
from typing import TYPE_CHECKING

import torch

_DTYPE = attrgetter("dtype")
_DEVICE = attrgetter("device")
_SHAPE = attrgetter("shape")
_LAYOUT = attrgetter("layout")
_CONTIGUOUS = methodcaller("is_contiguous")

if TYPE_CHECKING:
    from .._bucket import Bucket
    from .._hyper import LambHyper, LarsHyper


class BackendCompileError(RuntimeError):
    """A backend could not compile a kernel it needs for a step (raised by ``Backend.prepare``,
    before anything is modified). ``str()`` names the backend, the kernel and its specialization."""


class Backend:
    """Interface every backend implements (see the module docstring)."""

    name: str = ""

    def prepare(self, b: Bucket, kind: str, h, has_grad_mult: bool, has_found_inf: bool,
                clip: bool) -> None:
        """Called for every bucket of a step before any pass runs: make ready (compile) whatever
        the step's passes will launch for ``b``, or raise :class:`BackendCompileError` with
        nothing modified. ``kind`` is "lamb" or "lars"; ``clip``: the step computes the grads'
        norms (global clipping). Backends without a compile step keep this no-op."""

    def unavailable_reason(self, device: torch.device, param_dtype: torch.dtype,
                           grad_dtype: torch.dtype) -> str | None:
        """None if this backend can run on these tensors, else why not (device, dtype, missing piece)."""
        raise NotImplementedError

    def sq_norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def grad_sq_norms(self, b: Bucket) -> torch.Tensor:
        """Per-tensor Σg² of the bucket's grads, ``[n]`` (global clipping)."""
        return self.sq_norms(b.grads)

    def accepts_grads(self, b: Bucket, grad_dtype: torch.dtype) -> bool:
        """Whether ``b``, kept from an earlier step with its lists unchanged, can take its new
        ``grads``: strided, contiguous, of ``grad_dtype`` and the bucket's device, one per param and
        of its shape; and whether its params still have one dtype and the shapes of their state
        (``p.data`` may have been replaced). False sends the step down the path that checks
        everything and says what is wrong."""
        ps, gs = b.params, b.grads
        shapes = list(map(_SHAPE, ps))
        states = [xs for xs in (b.exp_avgs, b.exp_avg_sqs, b.momentum_buffers, b.masters) if xs]
        return (len(gs) == len(ps) and set(map(_DTYPE, gs)) == {grad_dtype}
                and set(map(_LAYOUT, gs)) == {torch.strided} and all(map(_CONTIGUOUS, gs))
                and set(map(_DEVICE, gs)) == {b.device} and list(map(_SHAPE, gs)) == shapes
                and set(map(_DTYPE, ps)) == {b.param_dtype}
                and all(list(map(_SHAPE, xs)) == shapes for xs in states))

    def finish(self, b: Bucket) -> None:
        """Called once ``b``'s step is over, also when it raised: let go of what the step held
        (the cpp backend's taken grads)."""

    def lamb_pass1(self, b: Bucket, h: LambHyper, grad_mult, found_inf) -> torch.Tensor:
        raise NotImplementedError

    def lamb_pass2(self, b: Bucket, h: LambHyper, sums: torch.Tensor, found_inf) -> None:
        raise NotImplementedError

    def lars_pass1(self, b: Bucket, h: LarsHyper, grad_mult, found_inf) -> torch.Tensor:
        raise NotImplementedError

    def lars_pass2(self, b: Bucket, h: LarsHyper, sums: torch.Tensor, grad_mult, found_inf) -> None:
        raise NotImplementedError


# name -> "module:attribute" of a zero-argument factory; imported lazily so that a missing
# compiled extension or Triton only matters when that backend is used.
_REGISTRY = {
    "eager": "fusedopt.backends.eager:EagerBackend",
    "cpp": "fusedopt.backends.cpp:CppBackend",
    "triton": "fusedopt.backends.triton_backend:TritonBackend",
    "cuda": "fusedopt.backends.cuda:CudaBackend",
}
# Preference of backend="auto", per device type; eager is always last and always works.
# Rule for CUDA tensors: the compiled CUDA extension when it is built (no JIT, no compile on first
# step), otherwise Triton, otherwise eager.
_AUTO_ORDER = {"cpu": ("cpp", "eager"), "cuda": ("cuda", "triton", "eager")}

_instances: dict[str, Backend] = {}
_load_errors: dict[str, str] = {}


def get_backend(name: str) -> Backend | None:
    """The backend object, or None if its module cannot be imported (the reason is kept)."""
    if name in _instances:
        return _instances[name]
    if name in _load_errors:
        return None
    module_name, attr = _REGISTRY[name].split(":")
    try:
        inst = getattr(importlib.import_module(module_name), attr)()
    except Exception as e:  # noqa: BLE001 - any import/build failure makes the backend unusable
        _load_errors[name] = f"{type(e).__name__}: {e}"
        return None
    _instances[name] = inst
    return inst


def load_error(name: str) -> str | None:
    return _load_errors.get(name)


# (backend name, device type, param dtype, grad dtype) whose kernels failed to compile in this
# process: backend="auto" skips them (fall_back)
_broken: dict[tuple, str] = {}


def fall_back(failed: Backend, b: Bucket, error: BaseException) -> Backend:
    """The backend that takes over ``b`` after ``failed`` could not compile for it (``"auto"``
    only): the next one of ``resolve``, with one warning per backend, device type and dtypes."""
    import warnings

    key = (failed.name, b.device.type, b.param_dtype, b.grad_dtype)
    if failed.name == "eager":
        raise error  # nothing left to fall back to
    first = key not in _broken
    _broken[key] = str(error)
    nxt = resolve("auto", b.device, b.param_dtype, b.grad_dtype)
    if first:
        warnings.warn(f"{error}; backend='auto' falls back from {failed.name!r} to {nxt.name!r} "
                      f"for {b.device.type} params of dtype {b.param_dtype} with grads of dtype "
                      f"{b.grad_dtype} in this process", RuntimeWarning, stacklevel=4)
    return nxt


def resolve(requested: str, device: torch.device, param_dtype: torch.dtype,
            grad_dtype: torch.dtype) -> Backend:
    """Pick the backend for one bucket. ``"auto"`` falls back quietly (past a backend whose
    kernels failed to compile for these dtypes in this process); an explicit name raises."""
    if requested == "auto":
        for name in _AUTO_ORDER.get(device.type, ("eager",)):
            if (name, device.type, param_dtype, grad_dtype) in _broken:
                continue
            b = get_backend(name)
            if b is not None and b.unavailable_reason(device, param_dtype, grad_dtype) is None:
                return b
        return get_backend("eager")
    b = get_backend(requested)
    if b is None:
        raise RuntimeError(
            f"backend={requested!r} is not available in this process: {load_error(requested)}"
        )
    reason = b.unavailable_reason(device, param_dtype, grad_dtype)
    if reason is not None:
        raise RuntimeError(
            f"backend={requested!r} cannot run on {device.type} tensors with param dtype "
            f"{param_dtype} and grad dtype {grad_dtype}: {reason}"
        )
    return b


def available_backends() -> list[str]:
    """Backends usable in this process (on at least one device type present), in preference order."""
    out = []
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for name in _REGISTRY:
        b = get_backend(name)
        if b is None:
            continue
        if any(b.unavailable_reason(d, torch.float32, torch.float32) is None for d in devices):
            out.append(name)
    return out
