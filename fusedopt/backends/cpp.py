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
from .._hyper import LambHyper, LarsHyper

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


def _hyper_args(h, fields: tuple[str, ...], device: torch.device):
    """``hyper`` as a list of doubles in the order of ``fields``, and a tensor ``lr`` (None when
    lr is a number)."""
    lr = h.lr if isinstance(h.lr, torch.Tensor) else None
    values = [0.0 if (name == "lr" and lr is not None) else float(getattr(h, name))
              for name in fields]
    if lr is not None:
        lr = lr.to(device=device, dtype=torch.float64)
    return values, lr


def _low_precision_params(b: Bucket) -> list[torch.Tensor]:
    """The params written beside fp32 masters (empty when the weights are the params)."""
    return b.params if b.masters is not None else []


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
    def _(weights, grads, exp_avgs, exp_avg_sqs, steps, hyper, grad_mult, found_inf):
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
    name = "cpp"
    _has_static_lists = True  # BucketLists calls the CPU kernels directly

    def __init__(self):
        global _fakes_registered
        load_extension("_C", "C++ extension", "Reinstall with `pip install --no-build-isolation "
                       "-e .` (needs a C++20 compiler).")
        if not _fakes_registered:
            _register_fakes()
            _fakes_registered = True
        self._ops = torch.ops.fusedopt
        from .. import _C
        # the names of the doubles of the operators' ``hyper`` argument in the order the C++ side
        # reads them (generated from the LambField / LarsField enums of csrc/cpu/ops.h): Python
        # fills them by name from LambHyper / LarsHyper
        self.fields = {"lamb": tuple(_C.lamb_fields()), "lars": tuple(_C.lars_fields())}

    def unavailable_reason(self, device, param_dtype, grad_dtype):
        if device.type != "cpu":
            return f"the cpp backend runs on CPU tensors only, not on {device.type}"
        for what, dtype in (("param", param_dtype), ("grad", grad_dtype)):
            if dtype not in _SUPPORTED:
                return (f"the cpp backend has no kernel for {what} dtype {dtype} "
                        "(float32, float64, bfloat16 and float16 are supported)")
        return None

    def sq_norms(self, tensors):
        return self._ops.sq_norms(list(tensors))

    def _static_lists(self, b: Bucket):
        """The bucket's lists but grads, held by a C++ ``BucketLists`` (Note [static lists] in
        csrc/cpu/ops.h) kept in ``b.handles`` while the lists stay the same; None for a one-off
        bucket and under torch.compile, which go through the operators."""
        if b.handles is None or not self._has_static_lists or torch.compiler.is_compiling():
            return None
        lists = b.handles.get(self.name)
        if lists is None:
            from .. import _C
            lists = b.handles[self.name] = _C.BucketLists(
                b.weights, _low_precision_params(b), b.exp_avgs or [], b.exp_avg_sqs or [],
                b.momentum_buffers or [], b.steps)
        return lists

    def accepts_grads(self, b: Bucket, grad_dtype) -> bool:
        lists = self._static_lists(b)
        if lists is None:
            return super().accepts_grads(b, grad_dtype)
        # dtype, layout, numel and strides, in C++; the grads accepted are held there for this
        # step (Note [taken grads] in csrc/cpu/ops.h) until finish()
        if not lists.accepts(b.grads, grad_dtype):
            return False
        b.scratch["taken"] = lists
        return True

    def _taken(self, b: Bucket):
        """The BucketLists holding this step's grads, or None (Note [taken grads])."""
        lists = b.scratch.get("taken")
        return None if lists is None or torch.compiler.is_compiling() else lists

    def grad_sq_norms(self, b: Bucket):
        lists = self._taken(b)
        if lists is not None:
            return lists.grad_sq_norms_taken()
        return super().grad_sq_norms(b)

    def finish(self, b: Bucket) -> None:
        lists = b.scratch.pop("taken", None)
        if lists is not None:
            lists.release()

    # ----------------------------------------------------------------- LAMB
    def lamb_pass1(self, b: Bucket, h: LambHyper, grad_mult, found_inf):
        hyper, _ = _hyper_args(h, self.fields["lamb"], b.device)
        lists = self._static_lists(b)
        if lists is not None:
            if self._taken(b) is lists:
                return lists.lamb_pass1_taken(hyper, grad_mult, found_inf)
            return lists.lamb_pass1(b.grads, hyper, grad_mult, found_inf)
        return self._ops.lamb_pass1(b.weights, b.grads, b.exp_avgs, b.exp_avg_sqs, b.steps, hyper,
                                    grad_mult, found_inf)

    def lamb_pass2(self, b: Bucket, h: LambHyper, sums, found_inf):
        hyper, lr = _hyper_args(h, self.fields["lamb"], b.device)
        lists = self._static_lists(b)
        if lists is not None:
            return lists.lamb_pass2(sums, hyper, lr, found_inf)
        self._ops.lamb_pass2(b.weights, _low_precision_params(b), b.exp_avgs, b.exp_avg_sqs,
                             b.steps, sums, hyper, lr, found_inf)

    # ----------------------------------------------------------------- LARS
    def lars_pass1(self, b: Bucket, h: LarsHyper, grad_mult, found_inf):
        hyper, _ = _hyper_args(h, self.fields["lars"], b.device)
        lists = self._static_lists(b)
        if lists is not None:
            if self._taken(b) is lists:
                return lists.lars_pass1_taken(hyper, grad_mult, found_inf)
            return lists.lars_pass1(b.grads, hyper, grad_mult, found_inf)
        return self._ops.lars_pass1(b.weights, b.grads, b.steps, hyper, grad_mult, found_inf)

    def lars_pass2(self, b: Bucket, h: LarsHyper, sums, grad_mult, found_inf):
        hyper, lr = _hyper_args(h, self.fields["lars"], b.device)
        lists = self._static_lists(b)
        if lists is not None:
            if self._taken(b) is lists:
                return lists.lars_pass2_taken(sums, hyper, lr, grad_mult, found_inf)
            return lists.lars_pass2(b.grads, sums, hyper, lr, grad_mult, found_inf)
        self._ops.lars_pass2(b.weights, _low_precision_params(b), b.grads, b.momentum_buffers,
                             b.steps, sums, hyper, lr, grad_mult, found_inf)
