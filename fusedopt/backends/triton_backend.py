"""Triton backend: each pass of a bucket is one Triton launch over pointer tables.

Launches per ``step()`` for one bucket (one param group, device and dtype), whatever its number of
tensors up to ``fusedopt.kernels.tables.MAX_TENSORS_PER_LAUNCH``: LAMB 2, LARS 2, plus 1 for
global clipping (``sq_norms`` of the grads); twice that when some of its tensors are not 16-byte
aligned (Note [per-tensor alignment] in kernels/tables.py). Outside the launches ``step()`` makes
O(1) torch calls per bucket (allocating ``sums``); the tables live with the bucket (Note [table
ownership]). No device tensor is read on the host (a CPU tensor ``lr`` of CUDA params is read
as a number: Note [CPU tensor lr] at :func:`host_lr`). Every launch runs on its bucket's device
and that device's current stream (Note [device guard]); before the first launch of a step,
``prepare`` builds the arguments of every launch of the step, once, and compiles whatever they
need, so a compile failure changes nothing (Note [triton operators]).

Dtypes: float16, bfloat16, float32 and float64 params and grads; the math runs in float32, and in
float64 for float64 params (hyper-parameters travel as float64 kernel arguments).

State formats: full, bf16 and 8-bit state (docs/math.md, "Low-precision state"), per tensor, in
the same launches (Note [state formats in the tables] in kernels/tables.py); the keys of the
random bits of stochastic rounding are the bucket's ``keys`` (LAMB only: LARS rounds its buffer
to nearest), as the cpp backend takes them, and the results equal the cpp backend's bit for bit
under the interpreter (tests/test_triton_lowp.py).

Devices: CUDA tensors (compiled kernels); CPU tensors only under Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment before triton is imported), which the tests use.

Note [triton operators]: the launches of a step are built once (:func:`step_launches`: every
``(kernel, table, kwargs)`` of its passes over a bucket's lists, its hyper-parameters (Note
[hyper fields] in csrc/cpu/ops.h) and a ``TableStore``), their kernels compiled, then launched
with the step's runtime operands (:func:`launch_all`). An uncompiled step builds them in
``prepare``; under ``torch.compile`` the backend calls the ``torch.library`` operators
``fusedopt::triton_{lamb,lars}_pass{1,2}`` and ``fusedopt::triton_sq_norms`` (opaque custom ops
with fake implementations) instead, so dynamo records one operator call per pass instead of
breaking the graph at the pointer tables. Pass 1's operator builds the step's launches (every
kernel compiled before it runs one, as ``prepare`` does in eager mode; with ``backend="auto"`` a
compile failure inside a compiled graph raises: there is no fall-back from inside a graph) and
leaves pass 2's in the bucket's workspace for pass 2's operator, which the graph calls next for
that bucket. An operator finds its bucket's workspace through the ids it is given (the
optimizer's step cache and the bucket's slot, Note [step cache] in fusedopt/_bucket.py): the
compiled step keeps its tables where the uncompiled one does, for as long as the optimizer.

Note [lazy import]: importing this module does not import triton, and neither does constructing
the backend (``fusedopt.available_backends()`` constructs every backend): triton decides
between compiling and interpreting when its modules are first imported, so the first import
must happen after a test has had the chance to set TRITON_INTERPRET. The kernels are imported
on first use.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from . import Backend, refuse_cpu_lr_in_capture
from .._bucket import Bucket, StepCache, compute_dtype
from .._hyper import LAMB_FIELDS, LARS_FIELDS
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


_kernels: _Kernels | None = None


def _k() -> _Kernels:
    global _kernels
    if _kernels is None:
        _kernels = _Kernels()
    return _kernels


def _store(workspace: dict | None):
    """The TableStore of a bucket's workspace (Note [table ownership] in kernels/tables.py), or
    None for a one-off bucket (tables built per call)."""
    if workspace is None:
        return None
    store = workspace.get("triton")
    if store is None:
        store = workspace["triton"] = _k().tables.TableStore()
    return store


def _workspace_of(cache_id: int, slot: str) -> dict | None:
    """An operator's bucket workspace: the one of the bucket ``slot`` of the step cache
    ``cache_id`` (None: a one-off bucket)."""
    cache = StepCache.find(cache_id)
    return None if cache is None else cache.workspace(slot)


def _store_of(cache_id: int, slot: str):
    """An operator's TableStore (Note [table ownership] in kernels/tables.py)."""
    return _store(_workspace_of(cache_id, slot))


# A bucket's lists as the launches take them: params, grads, masters (None: no masters), the two
# state lists of the kind (LARS: momentum buffers and None), steps.
Lists = tuple


def _values(kind: str, hyper) -> dict:
    """The hyper-parameters by field name: of a LambHyper / LarsHyper (an uncompiled step), or
    read from its hyper tensor (an operator: a CPU tensor, no device sync; Note [hyper fields])."""
    names = LAMB_FIELDS if kind == "lamb" else LARS_FIELDS
    if isinstance(hyper, torch.Tensor):
        return dict(zip(names, hyper.tolist()))
    return {name: getattr(hyper, name) for name in names}


def _common(lists: Lists, table) -> dict:
    """Table arguments and constexprs common to the kernels of one launch."""
    k, t = _k(), _k().tables
    p_dtype = lists[0][0].dtype
    return dict(records=table.records, owner=table.owner, P_DTYPE=k.dtype[p_dtype],
                CD=k.dtype[compute_dtype(p_dtype)], HAS_MASTER=lists[2] is not None,
                ALIGNED=table.aligned, CHUNK=t.CHUNK_SIZE, ROWS=t.ROWS, BLOCK=t.BLOCK_SIZE)


def _runtime(kind: str, lists: Lists, which: int, grad_mult, found_inf, lr=None) -> dict:
    """The arguments of a pass's launches that change from step to step (Note [runtime flags]):
    ``grad_mult`` (a 1 when the step has none; pass 1, and LARS's pass 2), ``found_inf`` (a 0),
    and pass 2's lr (:func:`_lr_args`)."""
    t, p = _k().tables, lists[0][0]
    out = dict(found_inf=t.operand(p.device, torch.float32, 0.0) if found_inf is None
               else found_inf)
    if which == 1 or kind == "lars":
        out["grad_mult"] = t.operand(p.device, compute_dtype(p.dtype), 1.0) \
            if grad_mult is None else grad_mult
    if which == 2:
        out.update(_lr_args(lr, p.device))
    return out


def host_lr(lr, device):
    """Note [CPU tensor lr]: ``lr`` as the launches take it. A CPU tensor lr with params on
    another device (torch's compiled-optimizer tutorial uses one with CUDA params) is read on the
    host, which is no device sync (a copy to the device would be a pageable upload that blocks the
    host at every step), and travels by value as a number lr does: the kernels read the same
    float64, so the result is bit-identical to reading it on the device. During CUDA-graph capture
    it is refused: the captured launches would keep this step's value at every replay. Any other
    lr is returned as it is."""
    if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and device.type != "cpu":
        refuse_cpu_lr_in_capture("triton", lr, device)
        return float(lr.detach().reshape(()).item())  # a host read of host memory: no sync
    return lr


def _lr_args(lr, device) -> dict:
    """``lr``, ``lr_ptr`` and the flag LR_TENSOR (``lr_flag``, or-ed into ``flags`` at the launch)
    of a pass-2 launch (Note [runtime flags]): a tensor lr on the params' device as float64 there
    (exact from any floating dtype; a device-side cast at most, never a host copy), a number lr
    or a CPU tensor lr of CUDA params (read on the host, Note [CPU tensor lr]) in ``lr`` with a 0
    in ``lr_ptr``."""
    lr = host_lr(lr, device)
    if isinstance(lr, torch.Tensor):
        return dict(lr=0.0, lr_ptr=lr.to(device=device, dtype=torch.float64),
                    lr_flag=_k().tables.LR_TENSOR)
    return dict(lr=float(lr), lr_ptr=_k().tables.operand(device, torch.float64, 0.0), lr_flag=0)


def tables_of(lists: Lists, store, keys=None) -> list:
    """The tables of both passes over a bucket's lists (kept in ``store`` while they stay);
    ``keys``: the bucket's keys of stochastic rounding (None: the index in the lists)."""
    return _k().tables.tables(list(lists), store, keys=keys)


def pass1_launches(kind: str, lists: Lists, hyper, sums, tabs) -> list:
    """The ``(kernel, table, kwargs)`` of pass 1 over ``tabs`` into ``sums``, without the
    runtime operands (:func:`_runtime`)."""
    k, t, h = _k(), _k().tables, _values(kind, hyper)
    cd = sums.dtype
    out = []
    for table in tabs:
        kw = dict(_common(lists, table), partials=table.partials(cd), counters=table.counters,
                  sums=sums, G_DTYPE=k.dtype[lists[1][0].dtype], RBLOCK=t.REDUCE_BLOCK)
        if kind == "lamb":
            kernel = k.lamb.lamb_pass1_kernel
            kw.update(LOWP=table.lowp, beta1=h["beta1"], beta2=h["beta2"], beta3=h["beta3"],
                      one_minus_beta2=h["one_minus_beta2"], eps=h["eps"],
                      lambda_in_u=h["lambda_in_u"],
                      flags=t.flags(BIAS_CORRECTION=h["bias_correction"] != 0))
        else:
            kernel = k.lars.lars_pass1_kernel
            kw.update(weight_decay=h["weight_decay"], flags=t.flags(COMBINED=h["combined"] != 0))
        out.append((kernel, table, kw))
    return out


def pass2_launches(kind: str, lists: Lists, hyper, tabs) -> list:
    """The ``(kernel, table, kwargs)`` of pass 2 over ``tabs``, without the runtime operands and
    the sums (given at the launch)."""
    k, t, h = _k(), _k().tables, _values(kind, hyper)
    on = {name: h[field] != 0 for name, field in (
        ("BIAS_CORRECTION", "bias_correction"), ("ADAPT", "adapt"), ("BOUNDED", "bounded"),
        ("COMBINED", "combined"), ("TRUST_CLIP", "trust_clip"), ("NESTEROV", "nesterov"),
        ("LR_IN_MOMENTUM", "lr_in_momentum")) if field in h}
    out = []
    for table in tabs:
        kw = dict(_common(lists, table), LOWP=table.lowp, flags=t.flags(**on))
        if kind == "lamb":
            kernel = k.lamb.lamb_pass2_kernel
            kw.update(beta1=h["beta1"], beta2=h["beta2"], beta3=h["beta3"],
                      one_minus_beta2=h["one_minus_beta2"], eps=h["eps"],
                      lambda_in_u=h["lambda_in_u"], decoupled_wd=h["decoupled_lambda"],
                      ratio_lo=h["ratio_lo"], ratio_hi=h["ratio_hi"])
        else:
            kernel = k.lars.lars_pass2_kernel
            kw.update(G_DTYPE=k.dtype[lists[1][0].dtype], momentum=h["momentum"],
                      one_minus_dampening=h["one_minus_dampening"],
                      weight_decay=h["weight_decay"], trust_coefficient=h["trust_coefficient"],
                      eps=h["eps"])
        out.append((kernel, table, kw))
    return out


def launch_all(launches: list, **runtime) -> None:
    """Launch each ``(kernel, table, kwargs)`` with ``runtime`` added (``lr_flag`` or-ed into
    ``flags``)."""
    t = _k().tables
    lr_flag = runtime.pop("lr_flag", 0)
    for kernel, table, kw in launches:
        args = kw | runtime
        if lr_flag:
            args["flags"] = kw["flags"] | lr_flag
        t.launch(kernel, table, **args)


def sq_tables_of(tensors: list[torch.Tensor], store) -> list:
    """The tables of per-tensor Σx² over dense tensors of one dtype (kept in ``store``)."""
    return _k().tables.tables([tensors], store, role=f"sq_norms:{tensors[0].dtype}")


def sq_norms_launches(tensors: list[torch.Tensor], out: torch.Tensor, tabs) -> list:
    """The ``(kernel, table, kwargs)`` of per-tensor Σx² over dense tensors of one dtype into
    ``out`` (float64 for float64 tensors, else float32)."""
    k, t = _k(), _k().tables
    dtype, cd = tensors[0].dtype, out.dtype
    return [(k.common.sq_norms_kernel, table,
             dict(records=table.records, owner=table.owner, partials=table.partials(cd),
                  counters=table.counters, sums=out, X_DTYPE=k.dtype[dtype], CD=k.dtype[cd],
                  ALIGNED=table.aligned, CHUNK=t.CHUNK_SIZE, ROWS=t.ROWS, BLOCK=t.BLOCK_SIZE,
                  RBLOCK=t.REDUCE_BLOCK))
            for table in tabs]


def _sums(lists: Lists) -> torch.Tensor:
    p = lists[0][0]
    return torch.empty(len(lists[0]), 2, dtype=compute_dtype(p.dtype), device=p.device)


def run_sq_norms(tensors: list[torch.Tensor], store) -> torch.Tensor:
    """Per-tensor Σx², one launch per dtype present (a tensor that is not dense is copied)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    out_dtype = torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32
    out = torch.empty(len(tensors), dtype=out_dtype, device=tensors[0].device)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(tensors):
        by_dtype.setdefault(x.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        group = [tensors[i] if _dense_layout(tensors[i]) else tensors[i].contiguous()
                 for i in idx]
        part = out if len(by_dtype) == 1 and compute_dtype(dtype) == out_dtype else torch.empty(
            len(group), dtype=compute_dtype(dtype), device=out.device)
        launch_all(sq_norms_launches(group, part, sq_tables_of(group, store)))
        if part is not out:
            out[torch.tensor(idx, device=out.device)] = part.to(out_dtype)
    return out


# specializations compiled in this process (compiled kernels are process-wide and immutable)
_compiled: set = set()


def _loose_alignment(kernel) -> tuple:
    """The arguments whose alignment ``kernel`` does not specialize on (Note [scalar operands] in
    kernels/tables.py): a JITFunction's ``do_not_specialize_on_alignment``, or the keyword an
    interpreted one was declared with."""
    names = getattr(kernel, "do_not_specialize_on_alignment", None)
    if names is None:
        names = getattr(kernel, "kwargs", {}).get("do_not_specialize_on_alignment")
    return tuple(names or ())


def specialization_key(kernel, table, kw: dict) -> tuple:
    """What Triton compiles a launch of ``kernel`` with ``kw`` for: the kernel, the device type,
    the constexprs, and the dtype of each tensor argument with whether it is 16-byte aligned,
    except for the arguments the kernel does not specialize on (Note [scalar operands])."""
    loose = _loose_alignment(kernel)
    return (kernel, table.device.type, tuple((k, v) for k, v in kw.items() if k.isupper()),
            tuple((k, str(v.dtype), k in loose or v.data_ptr() % 16 == 0)
                  for k, v in kw.items() if isinstance(v, torch.Tensor)))


@dataclass
class StepLaunches:
    """Every launch of one step over a bucket's lists, built once per step (:func:`step_launches`):
    the ``(kernel, table, kwargs)`` of pass 1 (into ``sums``), of pass 2, and of the grads' norms
    (into ``grad_sq``; empty without global clipping). The runtime operands (:func:`_runtime`)
    and pass 2's sums are added at the launch."""

    pass1: list
    pass2: list
    sq: list
    sums: torch.Tensor
    grad_sq: torch.Tensor | None = None


def step_launches(kind: str, lists: Lists, hyper, clip: bool, store, tabs=None, sq_tabs=None,
                  keys=None) -> StepLaunches:
    """The launches of a step of ``kind`` over ``lists``, every kernel of them compiled before any
    runs, so that a compile failure changes nothing. A specialization is the kernel, its
    constexprs, the dtypes of its tensor arguments and whether each is 16-byte aligned (Triton
    specializes on it, except on the scalar operands: Note [scalar operands] in
    kernels/tables.py), each compiled once per process (a no-op under the interpreter); the
    runtime operands of a step without them (a grad_mult of 1, a found_inf of 0, a number lr)
    stand in for this step's."""
    t = _k().tables
    tabs = tables_of(lists, store, keys) if tabs is None else tabs
    sums = _sums(lists)
    out = StepLaunches(pass1_launches(kind, lists, hyper, sums, tabs),
                       pass2_launches(kind, lists, hyper, tabs), [], sums)
    if clip:
        grads = lists[1]
        out.grad_sq = torch.empty(len(grads), dtype=compute_dtype(grads[0].dtype),
                                  device=grads[0].device)
        out.sq = sq_norms_launches(grads, out.grad_sq,
                                   sq_tables_of(grads, store) if sq_tabs is None else sq_tabs)
    stand_in2 = _runtime(kind, lists, 2, None, None, lr=0.0)
    del stand_in2["lr_flag"]
    for launches, stand_in in ((out.pass1, _runtime(kind, lists, 1, None, None)),
                               (out.pass2, dict(sums=sums, **stand_in2)), (out.sq, {})):
        for kernel, table, kw in launches:
            args = kw | stand_in
            key = specialization_key(kernel, table, args)
            if key not in _compiled:
                t.compile_only(kernel, table, **args)
                _compiled.add(key)
    return out


def _lists(b: Bucket) -> Lists:
    if b.exp_avgs is not None:
        return b.params, b.grads, b.masters, b.exp_avgs, b.exp_avg_sqs, b.steps
    return b.params, b.grads, b.masters, b.momentum_buffers, None, b.steps


def _keys(b: Bucket):
    """The keys of the random bits of stochastic rounding: LAMB's (LARS draws none)."""
    return b.keys if b.exp_avgs is not None else None


class TritonBackend(Backend):
    name = "triton"
    state_formats = ("full", "bf16", "8bit")

    def __init__(self):
        if importlib.util.find_spec("triton") is None:
            raise ImportError("backend='triton' needs the triton package: pip install triton")

    @property
    def k(self) -> _Kernels:
        return _k()

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

    def end(self, b: Bucket) -> None:
        b.scratch.pop("launches", None)

    def prepare(self, b: Bucket, kind: str, h, has_grad_mult: bool, has_found_inf: bool,
                clip: bool) -> None:
        if not torch.compiler.is_compiling():  # Note [triton operators]: pass 1's operator does
            host_lr(h.lr, b.device)  # Note [CPU tensor lr]: refused in a capture before a launch
            b.scratch["launches"] = step_launches(kind, _lists(b), h, clip, _store(b.workspace),
                                                  keys=_keys(b))

    def sq_norms(self, tensors):
        return run_sq_norms(list(tensors), None)

    def grad_sq_norms(self, b: Bucket) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.fusedopt.triton_sq_norms(b.grads, *_ids(b))
        launches = b.scratch["launches"]
        if not launches.sq:  # skip_nonfinite without global clipping
            return run_sq_norms(b.grads, _store(b.workspace))
        launch_all(launches.sq)
        return launches.grad_sq

    def pass1(self, kind, b: Bucket, h, hyper, grad_mult, found_inf):
        lists = _lists(b)
        if torch.compiler.is_compiling():
            op = torch.ops.fusedopt.triton_lamb_pass1 if kind == "lamb" else \
                torch.ops.fusedopt.triton_lars_pass1
            if kind == "lamb":
                return op(*_op_lists(lists), hyper, grad_mult, found_inf, b.keys, *_ids(b))
            return op(*_op_lists(lists), hyper, grad_mult, found_inf, *_ids(b))
        launches = b.scratch["launches"]
        launch_all(launches.pass1, **_runtime(kind, lists, 1, grad_mult, found_inf))
        return launches.sums

    def pass2(self, kind, b: Bucket, h, hyper, sums, grad_mult, found_inf):
        lists, lr = _lists(b), (h.lr if isinstance(h.lr, torch.Tensor) else None)
        if torch.compiler.is_compiling():
            if kind == "lamb":
                return torch.ops.fusedopt.triton_lamb_pass2(*_op_lists(lists), sums, hyper, lr,
                                                            found_inf, b.keys, *_ids(b))
            return torch.ops.fusedopt.triton_lars_pass2(*_op_lists(lists), sums, hyper, lr,
                                                        grad_mult, found_inf, *_ids(b))
        launch_all(b.scratch["launches"].pass2, sums=sums.contiguous(),
                   **_runtime(kind, lists, 2, grad_mult, found_inf, lr=h.lr))


# ------------------------------------------------------------------------ operators
# Note [triton operators]
def _ids(b: Bucket) -> tuple[int, str]:
    """The step cache id and slot that an operator finds the bucket's tables by (-1: none)."""
    return (-1 if b.cache is None else b.cache.id), b.slot


def _op_lists(lists: Lists) -> tuple:
    """The lists as operator arguments: an empty list for masters and state the bucket has not."""
    params, grads, masters, s0, s1, steps = lists
    return (params, grads, masters or [], s0) + ((s1,) if s1 is not None else ()) + (steps,)


def _from_op(params, grads, masters, s0, s1, steps) -> Lists:
    return list(params), list(grads), list(masters) or None, list(s0), \
        None if s1 is None else list(s1), list(steps)


@torch.library.custom_op("fusedopt::triton_sq_norms", mutates_args=())
def _sq_norms_op(tensors: list[torch.Tensor], cache_id: int, slot: str) -> torch.Tensor:
    return run_sq_norms(list(tensors), _store_of(cache_id, slot))


@_sq_norms_op.register_fake
def _(tensors, cache_id, slot):
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return tensors[0].new_empty((len(tensors),), dtype=dtype)


def _sums_fake(params, *_):
    cd = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    return params[0].new_empty((len(params), 2), dtype=cd)


def _op_pass1(kind: str, lists: Lists, hyper, grad_mult, found_inf, cache_id: int, slot: str,
              keys=None) -> torch.Tensor:
    """Pass 1's operator: every kernel of the step compiled, then pass 1; the step's pass-2
    launches are kept in the bucket's workspace for pass 2's operator, which the graph calls next
    for this bucket."""
    work = _workspace_of(cache_id, slot)
    launches = step_launches(kind, lists, hyper, False, _store(work), keys=keys)
    if work is not None:
        work["pass2"] = launches.pass2
    launch_all(launches.pass1, **_runtime(kind, lists, 1, grad_mult, found_inf))
    return launches.sums


def _op_pass2(kind: str, lists: Lists, hyper, lr, sums, grad_mult, found_inf, cache_id: int,
              slot: str, keys=None) -> None:
    work = _workspace_of(cache_id, slot)
    launches = None if work is None else work.pop("pass2", None)
    if launches is None:
        launches = pass2_launches(kind, lists, hyper, tables_of(lists, _store(work), keys))
    lr = _values(kind, hyper)["lr"] if lr is None else lr
    launch_all(launches, sums=sums.contiguous(),
               **_runtime(kind, lists, 2, grad_mult, found_inf, lr=lr))


@torch.library.custom_op("fusedopt::triton_lamb_pass1",
                         mutates_args=("exp_avgs", "exp_avg_sqs", "steps"))
def _lamb_pass1_op(params: list[torch.Tensor], grads: list[torch.Tensor],
                   masters: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor],
                   hyper: torch.Tensor, grad_mult: Optional[torch.Tensor],
                   found_inf: Optional[torch.Tensor], keys: Optional[torch.Tensor], cache_id: int,
                   slot: str) -> torch.Tensor:
    return _op_pass1("lamb", _from_op(params, grads, masters, exp_avgs, exp_avg_sqs, steps),
                     hyper, grad_mult, found_inf, cache_id, slot, keys)


@torch.library.custom_op("fusedopt::triton_lamb_pass2", mutates_args=("params", "masters"))
def _lamb_pass2_op(params: list[torch.Tensor], grads: list[torch.Tensor],
                   masters: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], sums: torch.Tensor,
                   hyper: torch.Tensor, lr: Optional[torch.Tensor],
                   found_inf: Optional[torch.Tensor], keys: Optional[torch.Tensor], cache_id: int,
                   slot: str) -> None:
    _op_pass2("lamb", _from_op(params, grads, masters, exp_avgs, exp_avg_sqs, steps), hyper, lr,
              sums, None, found_inf, cache_id, slot, keys)


@torch.library.custom_op("fusedopt::triton_lars_pass1", mutates_args=("steps",))
def _lars_pass1_op(params: list[torch.Tensor], grads: list[torch.Tensor],
                   masters: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
                   steps: list[torch.Tensor], hyper: torch.Tensor,
                   grad_mult: Optional[torch.Tensor], found_inf: Optional[torch.Tensor],
                   cache_id: int, slot: str) -> torch.Tensor:
    return _op_pass1("lars", _from_op(params, grads, masters, momentum_buffers, None, steps),
                     hyper, grad_mult, found_inf, cache_id, slot)


@torch.library.custom_op("fusedopt::triton_lars_pass2",
                         mutates_args=("params", "masters", "momentum_buffers"))
def _lars_pass2_op(params: list[torch.Tensor], grads: list[torch.Tensor],
                   masters: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
                   steps: list[torch.Tensor], sums: torch.Tensor, hyper: torch.Tensor,
                   lr: Optional[torch.Tensor], grad_mult: Optional[torch.Tensor],
                   found_inf: Optional[torch.Tensor], cache_id: int, slot: str) -> None:
    _op_pass2("lars", _from_op(params, grads, masters, momentum_buffers, None, steps), hyper, lr,
              sums, grad_mult, found_inf, cache_id, slot)


_lamb_pass1_op.register_fake(_sums_fake)
_lars_pass1_op.register_fake(_sums_fake)


@_lamb_pass2_op.register_fake
def _(*_):
    return None


@_lars_pass2_op.register_fake
def _(*_):
    return None
