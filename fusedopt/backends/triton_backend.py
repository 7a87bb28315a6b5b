"""Triton backend: each pass of a bucket is one Triton launch over pointer tables.

Launches per ``step()`` for one bucket (one param group, device and dtype), whatever its number of
tensors up to ``fusedopt.kernels.tables.MAX_TENSORS_PER_LAUNCH``: LAMB 2, LARS 2, plus 1 for
global clipping (``sq_norms`` of the grads); twice that when some of its tensors are not 16-byte
aligned (Note [per-tensor alignment] in kernels/tables.py). Outside the launches ``step()`` makes
O(1) torch calls per bucket (allocating ``sums``); the tables live with the bucket (Note [table
ownership]). Nothing is read on the host. Every launch runs on its bucket's device and that
device's current stream (Note [device guard]); before the first launch of a step, ``prepare``
compiles whatever the step needs, so a compile failure changes nothing.

Dtypes: float16, bfloat16, float32 and float64 params and grads; the math runs in float32, and in
float64 for float64 params (hyper-parameters travel as float64 kernel arguments).

Devices: CUDA tensors (compiled kernels); CPU tensors only under Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment before triton is imported), which the tests use.

Note [triton operators]: under ``torch.compile`` the passes go through the ``torch.library``
operators ``fusedopt::triton_{lamb,lars}_pass{1,2}`` and ``fusedopt::triton_sq_norms`` (opaque
custom ops with fake implementations), so dynamo records one operator call per pass instead of
breaking the graph at the pointer tables, and the compiled graph launches the same kernels as
eager mode. An operator builds its bucket again from its tensor lists and hyper-parameters;
its tables are kept in a workspace keyed by the params' data pointers (at most
``_OP_WORKSPACES`` of them, least recently used first out), so a compiled step whose tensors
stay where they are builds nothing after its first step. Pass 1's operator compiles every
kernel of the step before it runs one, as ``prepare`` does in eager mode; with
``backend="auto"`` a compile failure inside a compiled graph raises (there is no fall-back from
inside a graph).

Note [lazy import]: importing this module does not import triton, and neither does constructing
the backend (``fusedopt.available_backends()`` constructs every backend): triton decides
between compiling and interpreting when its modules are first imported, so the first import
must happen after a test has had the chance to set TRITON_INTERPRET. The kernels are imported
on first use.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
from collections import OrderedDict
from typing import Optional

import torch

from . import Backend
from .._bucket import Bucket
from .._hyper import LambHyper, LarsHyper
from ..flat import _dense_layout

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NEED_INTERPRETER = ("Triton kernels need a CUDA device; CPU tensors run only under "
                     "TRITON_INTERPRET=1 (set before importing triton)")


def interpreter_reason() -> str | None:
    """None if Triton kernels run in the interpreter in this process, else why not."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return _NEED_INTERPRETER
    tl = sys.modules.get("triton.language")
    if tl is not None:
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(tl.sum, InterpretedFunction):
            return ("TRITON_INTERPRET=1 was set after triton was imported, so its kernels compile "
                    "for a GPU; set it before the first import of triton to run on CPU tensors")
    return None


class _Kernels:
    """The kernel modules and the torch → Triton dtype map, imported on first use."""

    def __init__(self):
        import triton.language as tl

        from ..kernels import common, lamb, lars, tables
        self.common, self.lamb, self.lars, self.tables = common, lamb, lars, tables
        self.dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                      torch.float32: tl.float32, torch.float64: tl.float64}


def _lr_args(lr, device) -> dict:
    """``lr`` and ``lr_ptr`` of a pass-2 launch (Note [runtime flags] in kernels/tables.py): a
    tensor lr as float64 on ``device`` (exact from any floating dtype), a number in ``lr``."""
    if isinstance(lr, torch.Tensor):
        return dict(lr=0.0, lr_ptr=lr.to(device=device, dtype=torch.float64))
    from ..kernels.tables import operand
    return dict(lr=lr, lr_ptr=operand(device, torch.float64, 0.0))


class TritonBackend(Backend):
    name = "triton"

    def __init__(self):
        if importlib.util.find_spec("triton") is None:
            raise ImportError("backend='triton' needs the triton package: pip install triton")
        self._k: _Kernels | None = None
        self._compiled: set = set()  # specializations compiled by prepare()

    @property
    def k(self) -> _Kernels:
        if self._k is None:
            self._k = _Kernels()
        return self._k

    def unavailable_reason(self, device, param_dtype, grad_dtype):
        for what, dt in (("param", param_dtype), ("grad", grad_dtype)):
            if dt not in _FLOAT_DTYPES:
                return (f"the Triton kernels support float16, bfloat16, float32 and float64, not "
                        f"{what} dtype {dt}")
        if device.type == "cuda":
            if os.environ.get("TRITON_INTERPRET") == "1":
                return ("TRITON_INTERPRET=1 runs Triton kernels on the host, which cannot follow "
                        "the pointer tables into CUDA memory; unset it to compile for the GPU")
            return None
        if device.type == "cpu":
            return interpreter_reason()
        return f"Triton kernels need a CUDA device, not {device.type}"

    # -------------------------------------------------------------- shared
    @staticmethod
    def _store(workspace: dict | None):
        """The TableStore of a bucket's workspace (Note [table ownership] in kernels/tables.py),
        or None for a one-off bucket (no workspace)."""
        if workspace is None:
            return None
        store = workspace.get("triton")
        if store is None:
            from ..kernels.tables import TableStore
            store = workspace["triton"] = TableStore()
        return store

    def _structure(self, b: Bucket, table, found_inf) -> dict:
        """Table arguments and constexprs common to the kernels of one launch; a step without
        ``found_inf`` passes a 0 (Note [runtime flags] in kernels/tables.py)."""
        t = self.k.tables
        if found_inf is None:
            found_inf = t.operand(b.device, torch.float32, 0.0)
        return dict(
            records=table.records, owner=table.owner, found_inf=found_inf,
            P_DTYPE=self.k.dtype[b.param_dtype], CD=self.k.dtype[b.compute_dtype],
            HAS_MASTER=b.masters is not None,
            ALIGNED=table.aligned, CHUNK=t.CHUNK_SIZE, ROWS=t.ROWS, BLOCK=t.BLOCK_SIZE,
        )

    def _grad_mult(self, b: Bucket, grad_mult):
        """``grad_mult``, or a 1 when the step has none (Note [runtime flags])."""
        if grad_mult is None:
            return self.k.tables.operand(b.device, b.compute_dtype, 1.0)
        return grad_mult

    def _tables(self, b: Bucket, state: list) -> list:
        """The tables of both passes over ``b`` (``state``: the kind's two state lists)."""
        return self.k.tables.tables([b.params, b.grads, b.masters, *state, b.steps],
                                    self._store(b.workspace))

    def _pass1(self, kernel, b: Bucket, state: list, grad_mult, found_inf, run=None,
               **scalars) -> torch.Tensor:
        """Launch a pass-1 kernel on every table of the bucket; returns the ``[n, 2]`` sums.
        ``run`` (default ``tables.launch``) takes each launch: :meth:`prepare` compiles instead."""
        t = self.k.tables
        cd = b.compute_dtype
        sums = torch.empty(len(b.params), 2, dtype=cd, device=b.device)
        tabs = self._tables(b, state)
        run = run or t.launch
        for table in tabs:
            run(kernel, table, **self._structure(b, table, found_inf),
                partials=table.partials(cd), counters=table.counters, sums=sums,
                grad_mult=self._grad_mult(b, grad_mult), G_DTYPE=self.k.dtype[b.grad_dtype],
                RBLOCK=t.REDUCE_BLOCK, **scalars)
        b.scratch["tables"] = tabs
        return sums

    def _pass2(self, kernel, b: Bucket, sums: torch.Tensor, found_inf, run=None, **args) -> None:
        sums = sums.contiguous()
        run = run or self.k.tables.launch
        for table in b.scratch.pop("tables"):
            run(kernel, table, **self._structure(b, table, found_inf), sums=sums, **args)

    def sq_norms(self, tensors, store=None, run=None):
        """Per-tensor Σx², one launch per dtype present (a tensor that is not dense is copied)."""
        tensors = list(tensors)
        if not tensors:
            return torch.zeros(0, dtype=torch.float32)
        t = self.k.tables
        run = run or t.launch
        out_dtype = torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32
        out = torch.empty(len(tensors), dtype=out_dtype, device=tensors[0].device)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, x in enumerate(tensors):
            by_dtype.setdefault(x.dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            group = [tensors[i] if _dense_layout(tensors[i]) else tensors[i].contiguous()
                     for i in idx]
            cd = torch.float64 if dtype == torch.float64 else torch.float32
            part = out if len(by_dtype) == 1 and cd == out_dtype else torch.empty(
                len(group), dtype=cd, device=out.device)
            for table in t.tables([group], store, role=f"sq_norms:{dtype}"):
                run(self.k.common.sq_norms_kernel, table,
                    records=table.records, owner=table.owner, partials=table.partials(cd),
                    counters=table.counters, sums=part,
                    X_DTYPE=self.k.dtype[dtype], CD=self.k.dtype[cd], ALIGNED=table.aligned,
                    CHUNK=t.CHUNK_SIZE, ROWS=t.ROWS, BLOCK=t.BLOCK_SIZE, RBLOCK=t.REDUCE_BLOCK)
            if part is not out:
                out[torch.tensor(idx, device=out.device)] = part.to(out_dtype)
        return out

    def grad_sq_norms(self, b: Bucket, run=None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # Note [triton operators]
            return torch.ops.fusedopt.triton_sq_norms(b.grads)
        return self.sq_norms(b.grads, self._store(b.workspace), run)

    def prepare(self, b: Bucket, kind: str, h, has_grad_mult: bool, has_found_inf: bool,
                clip: bool) -> None:
        """Compile every kernel this step will launch for ``b`` before anything runs, so that a
        compile failure leaves every tensor as it was (Backend.prepare). Each specialization is
        compiled once per process; the check of a known one is a pass over the launch arguments.
        Under torch.compile pass 1's operator does this when the graph runs (Note [triton
        operators])."""
        if torch.compiler.is_compiling():
            return
        dev = b.device
        # the launches take a 1 and a 0 where the step has no grad_mult and found_inf (Note
        # [runtime flags]), so these stand for both cases
        gm = fi = None
        seen = self._compiled

        def compile_once(kernel, table, **kwargs):
            key = (kernel, dev.type, tuple((k, v) for k, v in kwargs.items() if k.isupper()),
                   tuple(str(v.dtype) for v in kwargs.values() if isinstance(v, torch.Tensor)))
            if key not in seen:
                self.k.tables.compile_only(kernel, table, **kwargs)
                seen.add(key)

        try:
            if clip:
                self.grad_sq_norms(b, run=compile_once)
            if kind == "lamb":
                sums = self.lamb_pass1(b, h, gm, fi, run=compile_once)
                self.lamb_pass2(b, h, sums, fi, run=compile_once)
            else:
                sums = self.lars_pass1(b, h, gm, fi, run=compile_once)
                self.lars_pass2(b, h, sums, gm, fi, run=compile_once)
        finally:
            b.scratch.pop("tables", None)

    # ----------------------------------------------------------------- LAMB
    @staticmethod
    def _lamb_scalars(h: LambHyper) -> dict:
        """Kernel arguments of math.h's ``lamb_coef``, shared by both passes."""
        return dict(beta1=h.beta1, beta2=h.beta2, beta3=h.beta3, one_minus_beta2=h.one_minus_beta2,
                    eps=h.eps, lambda_in_u=h.lambda_in_u)

    def lamb_pass1(self, b: Bucket, h: LambHyper, grad_mult, found_inf, run=None):
        if torch.compiler.is_compiling():
            return torch.ops.fusedopt.triton_lamb_pass1(
                b.params, b.grads, b.masters or [], b.exp_avgs, b.exp_avg_sqs, b.steps,
                _floats(h), grad_mult, found_inf)
        return self._pass1(self.k.lamb.lamb_pass1_kernel, b, [b.exp_avgs, b.exp_avg_sqs], grad_mult,
                           found_inf, run, **self._lamb_scalars(h),
                           flags=self.k.tables.flags(BIAS_CORRECTION=h.bias_correction))

    def lamb_pass2(self, b: Bucket, h: LambHyper, sums, found_inf, run=None):
        if torch.compiler.is_compiling():
            return torch.ops.fusedopt.triton_lamb_pass2(
                b.params, b.grads, b.masters or [], b.exp_avgs, b.exp_avg_sqs, b.steps, sums,
                _floats(h), _tensor_lr(h), found_inf)
        self._pass2(
            self.k.lamb.lamb_pass2_kernel, b, sums, found_inf, run, **self._lamb_scalars(h),
            decoupled_wd=h.decoupled_lambda, ratio_lo=h.ratio_lo, ratio_hi=h.ratio_hi,
            flags=self.k.tables.flags(LR_TENSOR=isinstance(h.lr, torch.Tensor),
                                      BIAS_CORRECTION=h.bias_correction, ADAPT=h.adapt,
                                      BOUNDED=h.bounded),
            **_lr_args(h.lr, b.device),
        )

    # ----------------------------------------------------------------- LARS
    def lars_pass1(self, b: Bucket, h: LarsHyper, grad_mult, found_inf, run=None):
        if torch.compiler.is_compiling():
            return torch.ops.fusedopt.triton_lars_pass1(
                b.params, b.grads, b.masters or [], b.momentum_buffers, b.steps, _floats(h),
                grad_mult, found_inf)
        return self._pass1(self.k.lars.lars_pass1_kernel, b, [b.momentum_buffers, None], grad_mult,
                           found_inf, run, weight_decay=h.weight_decay,
                           flags=self.k.tables.flags(COMBINED=h.combined))

    def lars_pass2(self, b: Bucket, h: LarsHyper, sums, grad_mult, found_inf, run=None):
        if torch.compiler.is_compiling():
            return torch.ops.fusedopt.triton_lars_pass2(
                b.params, b.grads, b.masters or [], b.momentum_buffers, b.steps, sums, _floats(h),
                _tensor_lr(h), grad_mult, found_inf)
        self._pass2(
            self.k.lars.lars_pass2_kernel, b, sums, found_inf, run,
            grad_mult=self._grad_mult(b, grad_mult), G_DTYPE=self.k.dtype[b.grad_dtype],
            momentum=h.momentum, one_minus_dampening=h.one_minus_dampening,
            weight_decay=h.weight_decay, trust_coefficient=h.trust_coefficient, eps=h.eps,
            flags=self.k.tables.flags(LR_TENSOR=isinstance(h.lr, torch.Tensor), ADAPT=h.adapt,
                                      COMBINED=h.combined, TRUST_CLIP=h.trust_clip,
                                      NESTEROV=h.nesterov, LR_IN_MOMENTUM=h.lr_in_momentum),
            **_lr_args(h.lr, b.device),
        )


# ------------------------------------------------------------------------ operators
# Note [triton operators]
_HYPER = {"lamb": LambHyper, "lars": LarsHyper}
_OP_WORKSPACES = 64
_op_workspaces: OrderedDict = OrderedDict()


def _floats(h) -> list[float]:
    """``h``'s fields in declaration order as floats (True 1, None and a tensor lr NaN); a
    tensor lr travels beside them (:func:`_tensor_lr`)."""
    return [math.nan if v is None or isinstance(v, torch.Tensor) else float(v)
            for v in (getattr(h, f.name) for f in dataclasses.fields(h))]


def _tensor_lr(h) -> torch.Tensor | None:
    return h.lr if isinstance(h.lr, torch.Tensor) else None


def _hyper(kind: str, floats: list[float], lr: torch.Tensor | None):
    """The inverse of :func:`_floats`, with ``lr`` the tensor lr (None: a number lr)."""
    values = {}
    for f, v in zip(dataclasses.fields(_HYPER[kind]), floats):
        kind_of = str(f.type)
        values[f.name] = (bool(v) if kind_of == "bool"
                          else None if "None" in kind_of and math.isnan(v) else v)
    if lr is not None:
        values["lr"] = lr
    return _HYPER[kind](**values)


def _op_workspace(tensors) -> dict:
    """The workspace of an operator call on ``tensors`` (keyed by their data pointers)."""
    key = tuple(t.data_ptr() for t in tensors)
    workspace = _op_workspaces.pop(key, None)
    if workspace is None:
        workspace = {}
        while len(_op_workspaces) >= _OP_WORKSPACES:
            _op_workspaces.popitem(last=False)
    _op_workspaces[key] = workspace
    return workspace


def _op_bucket(params, grads, masters, steps, **state) -> Bucket:
    """A bucket for an operator call, with the workspace of its params' pointers."""
    return Bucket(params=list(params), grads=list(grads), steps=list(steps),
                  masters=list(masters) or None, workspace=_op_workspace(params),
                  **{k: list(v) for k, v in state.items()})


def _backend() -> TritonBackend:
    from . import get_backend
    return get_backend("triton")


@torch.library.custom_op("fusedopt::triton_sq_norms", mutates_args=())
def _sq_norms_op(tensors: list[torch.Tensor]) -> torch.Tensor:
    be = _backend()
    return be.sq_norms(tensors, be._store(_op_workspace(tensors)))


@_sq_norms_op.register_fake
def _(tensors):
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return tensors[0].new_empty((len(tensors),), dtype=dtype)


def _sums_fake(params, *_):
    cd = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    return params[0].new_empty((len(params), 2), dtype=cd)


@torch.library.custom_op("fusedopt::triton_lamb_pass1",
                         mutates_args=("exp_avgs", "exp_avg_sqs", "steps"))
def _lamb_pass1_op(params: list[torch.Tensor], grads: list[torch.Tensor],
                   masters: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], hyper: list[float],
                   grad_mult: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]
                   ) -> torch.Tensor:
    be, h = _backend(), _hyper("lamb", hyper, None)
    b = _op_bucket(params, grads, masters, steps, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    be.prepare(b, "lamb", h, grad_mult is not None, found_inf is not None, False)
    return be.lamb_pass1(b, h, grad_mult, found_inf)


@torch.library.custom_op("fusedopt::triton_lamb_pass2", mutates_args=("params", "masters"))
def _lamb_pass2_op(params: list[torch.Tensor], grads: list[torch.Tensor],
                   masters: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], sums: torch.Tensor,
                   hyper: list[float], lr: Optional[torch.Tensor],
                   found_inf: Optional[torch.Tensor]) -> None:
    be, h = _backend(), _hyper("lamb", hyper, lr)
    b = _op_bucket(params, grads, masters, steps, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    b.scratch["tables"] = be._tables(b, [b.exp_avgs, b.exp_avg_sqs])  # pass 1's, from the store
    be.lamb_pass2(b, h, sums, found_inf)


@torch.library.custom_op("fusedopt::triton_lars_pass1", mutates_args=("steps",))
def _lars_pass1_op(params: list[torch.Tensor], grads: list[torch.Tensor],
                   masters: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
                   steps: list[torch.Tensor], hyper: list[float],
                   grad_mult: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]
                   ) -> torch.Tensor:
    be, h = _backend(), _hyper("lars", hyper, None)
    b = _op_bucket(params, grads, masters, steps, momentum_buffers=momentum_buffers)
    be.prepare(b, "lars", h, grad_mult is not None, found_inf is not None, False)
    return be.lars_pass1(b, h, grad_mult, found_inf)


@torch.library.custom_op("fusedopt::triton_lars_pass2",
                         mutates_args=("params", "masters", "momentum_buffers"))
def _lars_pass2_op(params: list[torch.Tensor], grads: list[torch.Tensor],
                   masters: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
                   steps: list[torch.Tensor], sums: torch.Tensor, hyper: list[float],
                   lr: Optional[torch.Tensor], grad_mult: Optional[torch.Tensor],
                   found_inf: Optional[torch.Tensor]) -> None:
    be, h = _backend(), _hyper("lars", hyper, lr)
    b = _op_bucket(params, grads, masters, steps, momentum_buffers=momentum_buffers)
    b.scratch["tables"] = be._tables(b, [b.momentum_buffers, None])  # pass 1's, from the store
    be.lars_pass2(b, h, sums, grad_mult, found_inf)


_lamb_pass1_op.register_fake(_sums_fake)
_lars_pass1_op.register_fake(_sums_fake)


@_lamb_pass2_op.register_fake
def _(*_):
    return None


@_lars_pass2_op.register_fake
def _(*_):
    return None
