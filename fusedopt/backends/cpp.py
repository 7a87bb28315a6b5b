"""C++ CPU backend: the multi-tensor kernels of ``csrc/cpu``, called as ``torch.ops.fusedopt.*``.

Each pass is one operator call per bucket; inside it the per-tensor scalars are computed serially
and the elements of all tensors run in one OpenMP region over fixed-size chunks, whose partial
sums are reduced per tensor in a fixed order (bit-identical for any thread count). The extension
``fusedopt._C`` is imported when this backend is first constructed; if it is missing, the
constructor raises ImportError with the recorded build error, which ``backend="auto"`` treats as
"use eager" and an explicit ``backend="cpp"`` reports.

This module also registers the fake (meta) implementations of the operators, so that
``torch.compile`` and FakeTensorMode can trace through them.
"""
from __future__ import annotations

import importlib
import os

import torch

from . import Backend
from .._bucket import Bucket

_SUPPORTED = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_BUILD_ERRORS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_build_errors.txt")

def load_extension(module: str, what: str, guidance: str) -> None:
    """Import ``fusedopt.<module>``, or raise ImportError naming it, the build error recorded at
    install (setup.py keeps a failed build from failing the install), and ``guidance``."""
    try:
        importlib.import_module(f"fusedopt.{module}")
    except ImportError as e:
        msg = f"the fusedopt {what} (fusedopt.{module}) is not importable: {e}."
        if os.path.exists(_BUILD_ERRORS):
            with open(_BUILD_ERRORS) as f:
                msg += f" Build errors recorded at install: {f.read().strip()}."
        raise ImportError(f"{msg} {guidance}") from e


def _low_precision_params(b: Bucket) -> list[torch.Tensor]:
    """The params written beside fp32 masters (empty when the weights are the params)."""
    return b.params if b.masters is not None else []


def _tensor_lr(h) -> torch.Tensor | None:
    """A tensor lr as the operators take it (a number lr travels in ``hyper``)."""
    return h.lr if isinstance(h.lr, torch.Tensor) else None


# ------------------------------------------------------------------------- fake implementations

def _sums_like(weights):
    if not weights:
        return torch.empty((0, 2), dtype=torch.float32)
    dtype = torch.float64 if weights[0].dtype == torch.float64 else torch.float32
    return weights[0].new_empty((len(weights), 2), dtype=dtype)


def _register_fakes() -> None:
    lib = torch.library

    @lib.register_fake("fusedopt::sq_norms")
    def _(tensors):
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        if not tensors:
            return torch.empty((0,), dtype=dtype)
        return tensors[0].new_empty((len(tensors),), dtype=dtype)

    @lib.register_fake("fusedopt::lamb_pass1")
    def _(weights, grads, exp_avgs, exp_avg_sqs, steps, hyper, grad_mult, found_inf, keys=None):
        return _sums_like(weights)

    @lib.register_fake("fusedopt::lamb_pass2")
    def _(weights, params, exp_avgs, exp_avg_sqs, steps, sums, hyper, lr, found_inf):
        return None

    @lib.register_fake("fusedopt::lars_pass1")
    def _(weights, grads, steps, hyper, grad_mult, found_inf):
        return _sums_like(weights)

    @lib.register_fake("fusedopt::lars_pass2")
    def _(weights, params, grads, momentum_buffers, steps, sums, hyper, lr, grad_mult, found_inf):
        return None


_fakes_registered = False


class CppBackend(Backend):
    """Note [kept layout] in csrc/cpu/ops.h: an uncompiled step binds each bucket's lists to a
    native ``KeptLayout`` (kept in the step cache, or made for one call) and runs its passes on
    it; a traced step calls the ``torch.ops.fusedopt`` operators, which torch.compile records."""

    name = "cpp"
    state_formats = ("full", "bf16", "8bit")

    def __init__(self):
        global _fakes_registered
        load_extension("_C", "C++ extension", "Reinstall with `pip install --no-build-isolation "
                       "-e .` (needs a C++20 compiler).")
        if not _fakes_registered:
            _register_fakes()
            _fakes_registered = True
        self._ops = torch.ops.fusedopt

    def unavailable_reason(self, device, param_dtype, grad_dtype):
        if device.type != "cpu":
            return f"the cpp backend runs on CPU tensors only, not on {device.type}"
        for what, dtype in (("param", param_dtype), ("grad", grad_dtype)):
            if dtype not in _SUPPORTED:
                return (f"the cpp backend has no kernel for {what} dtype {dtype} "
                        "(float32, float64, bfloat16 and float16 are supported)")
        return None

    def bind(self, b: Bucket, check: bool) -> bool:
        if torch.compiler.is_compiling():
            return False
        layouts = b.cache.layouts if b.cache is not None else None
        layout = layouts.get(b.slot) if layouts is not None else None
        if layout is None:
            if not check:
                return False
            from .. import _C
            layout = _C.KeptLayout()
            if layouts is not None:
                layouts[b.slot] = layout
        lamb = b.exp_avgs is not None
        try:
            ok = layout.bind(b.weights, _low_precision_params(b),
                             b.exp_avgs if lamb else b.momentum_buffers, b.exp_avg_sqs or [],
                             b.steps, b.grads, b.grad_dtype, check)
        except TypeError:  # an entry that is not a tensor: the engine's checks name it
            if check:
                raise
            return False
        if ok:
            b.scratch["layout"] = layout
        return ok

    def end(self, b: Bucket) -> None:
        layout = b.scratch.pop("layout", None)
        if layout is not None:
            layout.end()

    def sq_norms(self, tensors):
        return self._ops.sq_norms(list(tensors))

    def grad_sq_norms(self, b: Bucket):
        layout = b.scratch.get("layout")
        return layout.grad_sq_norms() if layout is not None else self.sq_norms(b.grads)

    def pass1(self, kind, b: Bucket, h, hyper, grad_mult, found_inf):
        layout = b.scratch.get("layout")
        if kind == "lamb":
            if layout is not None:
                return layout.lamb_pass1(hyper, grad_mult, found_inf, b.keys)
            return self._ops.lamb_pass1(b.weights, b.grads, b.exp_avgs, b.exp_avg_sqs, b.steps,
                                        hyper, grad_mult, found_inf, b.keys)
        if layout is not None:
            return layout.lars_pass1(hyper, grad_mult, found_inf)
        return self._ops.lars_pass1(b.weights, b.grads, b.steps, hyper, grad_mult, found_inf)

    def pass2(self, kind, b: Bucket, h, hyper, sums, grad_mult, found_inf):
        layout, lr = b.scratch.get("layout"), _tensor_lr(h)
        if kind == "lamb":
            if layout is not None:
                return layout.lamb_pass2(sums, hyper, lr, found_inf)
            return self._ops.lamb_pass2(b.weights, _low_precision_params(b), b.exp_avgs,
                                        b.exp_avg_sqs, b.steps, sums, hyper, lr, found_inf)
        if layout is not None:
            return layout.lars_pass2(sums, hyper, lr, grad_mult, found_inf)
        return self._ops.lars_pass2(b.weights, _low_precision_params(b), b.grads,
                                    b.momentum_buffers, b.steps, sums, hyper, lr, grad_mult,
                                    found_inf)
