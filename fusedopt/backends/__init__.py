"""Backends and the one function that chooses among them.

A backend runs the passes of a trust-ratio step for one :class:`~fusedopt.functional.Bucket`
(tensors of one param group sharing device, param dtype and grad dtype). The engine
(:func:`fusedopt.functional.trust_ratio_step`) calls, per bucket and step:

* ``bind(b, check)`` once the bucket is made: take the step's lists (a native handle may hold
  them); with ``check=False`` it answers whether they are the tensors a kept handle checked
  (True: the step skips the Python checks; None: the backend keeps no handle), with
  ``check=True`` after the Python checks;
* ``prepare(b, kind, ...)``: make ready (compile) what the passes will launch, nothing written;
* ``grad_sq_norms(b)``: the grads' per-tensor ``Σg²`` (global clipping, ``skip_nonfinite``);
* ``pass1(kind, b, h, hyper, grad_mult, found_inf)``: increment the step counts (unless
  ``found_inf`` is nonzero) and return the per-tensor sums of squares ``[n, 2]`` of the trust
  ratio (LAMB: ``‖w‖², ‖u‖²``, updating the moments; LARS: ``‖w‖², ‖g‖²`` or ``‖g + λw‖²``);
* ``pass2(kind, b, h, hyper, sums, grad_mult, found_inf)``: the trust ratios from the (possibly
  all-reduced) sums with the zero-norm rule, and the update;
* ``end(b)``, always, also after an error: let go of what ``bind`` took.

``h`` is the group's :class:`~fusedopt._hyper.LambHyper` / ``LarsHyper`` and ``hyper`` the same
values encoded as one float64 tensor (Note [hyper fields] in csrc/cpu/ops.h), which the fused
kernels read. ``grad_mult`` (0-dim tensor or None) multiplies every gradient as it is read
(GradScaler unscale and global clipping, ``1 / (scale · c)``); ``found_inf`` (0-dim tensor or
None), when nonzero, makes the whole step a no-op. Neither is ever read on the host.
``sq_norms(tensors)`` gives per-tensor sums of squares outside a step (the noise scale).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

# the leaf error and the CPU-lr capture refusal (fusedopt/_errors.py), named here for the backends
from .._errors import BackendCompileError, refuse_cpu_lr_in_capture  # noqa: F401

if TYPE_CHECKING:
    from .._bucket import Bucket


class Backend:
    """Interface every backend implements (see the module docstring)."""

    name: str = ""
    # the state formats (docs/math.md "Low-precision state") this backend's passes implement
    state_formats: tuple[str, ...] = ("full",)

    def unavailable_reason(self, device: torch.device, param_dtype: torch.dtype,
                           grad_dtype: torch.dtype) -> str | None:
        """None if this backend can run on these tensors, else why not (device, dtype, missing piece)."""
        raise NotImplementedError

    def bind(self, b: Bucket, check: bool) -> bool | None:
        """Take ``b``'s lists for this step. ``check=False``: True when they are what a handle kept
        in ``b.cache`` checked (the engine then skips its own checks), False when they are not
        (nothing taken), None when the backend keeps no checked lists (the engine decides, Note
        [kept buckets] in fusedopt/functional.py). ``check=True``: the engine has checked them;
        the return value is not used."""
        return None

    def end(self, b: Bucket) -> None:
        """Let go of what :meth:`bind` took (called once per bucket and step, also after an error)."""

    def prepare(self, b: Bucket, kind: str, h, has_grad_mult: bool, has_found_inf: bool,
                clip: bool) -> None:
        """Make ready (compile) whatever the step's passes will launch for ``b``, or raise
        :class:`BackendCompileError` with nothing modified. ``clip``: the step computes the grads'
        norms. Backends without a compile step keep this no-op."""

    def sq_norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def grad_sq_norms(self, b: Bucket) -> torch.Tensor:
        """Per-tensor Σg² of the bucket's grads, ``[n]``."""
        return self.sq_norms(b.grads)

    def pass1(self, kind: str, b: Bucket, h, hyper: torch.Tensor, grad_mult,
              found_inf) -> torch.Tensor:
        raise NotImplementedError

    def pass2(self, kind: str, b: Bucket, h, hyper: torch.Tensor, sums: torch.Tensor, grad_mult,
              found_inf) -> None:
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


def set_backend(name: str, backend: Backend | None) -> Backend | None:
    """Use ``backend`` for the name ``name`` in this process (None: construct the registered one
    again on next use) and return the one it replaces, e.g. to run the engine on an instrumented
    or deliberately wrong backend (``python -m fusedopt check`` tests itself this way)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; expected one of {tuple(_REGISTRY)}")
    old = _instances.pop(name, None)
    _load_errors.pop(name, None)
    if backend is not None:
        _instances[name] = backend
    return old


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
