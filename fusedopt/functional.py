"""The functional layer: LAMB and LARS steps over lists of tensors, in the manner of
``torch.optim.adam.adam``, and the one engine every step runs through.

:func:`lamb` and :func:`lars` step one group of tensors with one set of hyper-parameters and are
usable without the optimizer classes. :func:`trust_ratio_step` steps several
:class:`TensorGroup` objects together: global gradient clipping spans them all, and a cross-rank
reducer runs one collective per phase. ``FusedLAMB.step`` / ``FusedLARS.step`` gather each param
group's lists and make one call to it.

A step runs the phases of docs/math.md, each delegated to a backend per :class:`Bucket` (tensors
of one group that share device, param dtype and grad dtype; the protocol is in
:mod:`fusedopt.backends`):

0. every check of every group, the buckets bound and their kernels prepared: a step that raises
   has changed nothing;
1. the grads' total ``Σg²`` when a group sets ``max_grad_norm`` or ``skip_nonfinite`` is on,
   ``c = max(1, sqrt(Σ) / max_grad_norm)``;
2. pass 1 per bucket (steps, LAMB moments, the two sums of squares of each trust ratio);
3. the optional cross-rank reduction of those sums (sharded training);
4. pass 2 per bucket (trust ratios with the zero-norm rule, the update).

Nothing here reads a tensor value on the host, and under ``torch.compile`` the whole step traces
into one graph: the fused backends are ``torch.ops.fusedopt`` operators with fake kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import is_
from typing import Protocol, Sequence, TypedDict, Unpack

import torch

from . import backends as _backends
from . import lowp
from ._bucket import (Bucket, StepCache, TensorLists, bias_correction, compute_dtype, dense, numels,
                      slot_of)
from ._hyper import (LAMB_DEFAULTS, LARS_DEFAULTS, LambHyper, LarsHyper, check_options,
                     check_representable, encode, lamb_hyper, lars_hyper)
from .flat import _dense_layout, laid_out_as

__all__ = ["Bucket", "SqSumReducer", "StepCache", "StepOptions", "TensorGroup", "bias_correction",
           "compute_dtype", "lamb", "lars", "sq_norms", "trust_ratio_step"]

_STATE_FIELDS = ("exp_avgs", "exp_avg_sqs", "momentum_buffers")
# the optimizers' state key of each list (the names errors use)
_STATE_KEYS = {"steps": "step", "exp_avgs": "exp_avg", "exp_avg_sqs": "exp_avg_sq",
               "momentum_buffers": "momentum_buffer", "masters": "master_param"}
# the names of the lists of TensorLists (dataclasses.fields does not trace under torch.compile)
_LIST_FIELDS = ("params", "grads", "steps", *_STATE_FIELDS, "masters", "sources")


@dataclass
class TensorGroup(TensorLists):
    """One group of tensors (the lists of :class:`TensorLists`, where ``masters`` may hold None
    entries for params that are their own weight) stepped with one set of hyper-parameters."""

    hyper: LambHyper | LarsHyper = field(kw_only=True)
    # a backend name of fusedopt.backends.resolve, or a Backend object used as it is
    backend: str | _backends.Backend = "auto"
    # step against the gradient's sign (torch.optim's maximize): the grads are read times -1
    maximize: bool = False


class SqSumReducer(Protocol):
    """Completes per-rank partial sums of squares into full-tensor sums (sharded training)."""

    def reduce_grad_sq(self, total: torch.Tensor) -> None: ...

    def reduce_trust_sums(self, sums: list[torch.Tensor], buckets: list[Bucket]) -> None: ...


def sq_norms(tensors: Sequence[torch.Tensor], backend: str = "auto") -> torch.Tensor:
    """Per-tensor sums of squares ``Σx²`` as a float32 tensor ``[n]`` (float64 for float64 input).

    Tensors are grouped by (device, dtype) and each group goes to the fastest usable backend; the
    result is on the device of the first tensor. No copy of the tensors is made by fused backends.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.zeros(0)
    out_dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    out = torch.empty(len(tensors), dtype=out_dtype, device=tensors[0].device)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for (device, dtype), idx in groups.items():
        be = _backends.resolve(backend, device, dtype, dtype)
        part = be.sq_norms([tensors[i] for i in idx])
        out[torch.tensor(idx, device=out.device)] = part.to(out.device, out_dtype)
    return out


# ------------------------------------------------------------------------------- checks
def _name(kind: str) -> str:
    return "FusedLAMB" if kind == "lamb" else "FusedLARS"


def _check_group(kind: str, gi: int, g: TensorGroup) -> None:
    """Raise, naming the group and the entry, on lists that no backend can step: lengths, entries
    that are not tensors, sparse, non-floating or complex tensors, devices, shapes, and tensors
    that overlap in memory. Set-based where it can be: cheap for thousands of tensors."""
    name = _name(kind)
    n = len(g.params)
    lists = {f: getattr(g, f) for f in ("grads", "steps", *_STATE_FIELDS, "masters")}
    for f, xs in (*lists.items(), ("keys", g.keys)):
        if xs is not None and len(xs) != n:
            raise ValueError(f"{name}: param group {gi} has {n} params but {len(xs)} {f}")
    for f, xs in {"params": g.params, **lists}.items():
        if xs is None or all(isinstance(x, torch.Tensor) for x in xs):
            continue
        bad = next(((i, x) for i, x in enumerate(xs) if not isinstance(x, torch.Tensor)
                    and not (x is None and f == "masters")), None)  # None: no master
        if bad is not None:
            i, x = bad
            key = _STATE_KEYS.get(f)
            if key is None:
                what = "None (a param without a gradient?)" if x is None else type(x).__name__
                raise TypeError(f"{name}: param group {gi}: {f}[{i}] is {what}, not a tensor")
            raise TypeError(f"{name}: param group {gi}, param {i} of those with grads: state "
                            f"{key!r} is {type(x).__name__}, not a tensor")
    params, grads = g.params, g.grads
    check_tensors(kind, gi, params, grads)
    if torch.compiler.is_compiling():
        return  # traced tensors have no addresses; the optimizers check new params eagerly
    written = [("params", params), *((f, xs) for f, xs in lists.items() if f != "grads")]
    _refuse_overlap(name, gi, _overlap(written, [("grads", grads)]))


def check_tensors(kind: str, gi: int, params: list[torch.Tensor],
                  grads: list[torch.Tensor]) -> None:
    """Raise, naming the group, on params and grads that no backend can step (layouts, dtypes,
    devices, shapes). Set-based where it can be: cheap for thousands of tensors."""
    name = _name(kind)
    if any(lay is not torch.strided for lay in {t.layout for t in (*params, *grads)}):
        raise RuntimeError(f"{name} does not support sparse params or gradients (param group {gi})")
    for what, dtypes in (("params", {t.dtype for t in params}), ("grads", {t.dtype for t in grads})):
        if not all(d.is_floating_point for d in dtypes):
            kinds = "complex" if any(d.is_complex for d in dtypes) else "non-floating-point"
            raise RuntimeError(f"{name} does not support {kinds} {what} (param group {gi}: "
                               f"{sorted(map(str, dtypes))})")
    devices = {t.device for t in params}
    if len(devices) > 1:
        raise RuntimeError(f"params of one group must be on one device; param group {gi} has "
                           f"params on {sorted(str(d) for d in devices)}")
    if {t.device for t in grads} != devices:
        raise RuntimeError(f"{name}: param group {gi} has grads on another device than its params")
    for i, (p, gr) in enumerate(zip(params, grads)):
        if p.shape != gr.shape:
            raise RuntimeError(f"{name}: param group {gi} has a grad of shape {tuple(gr.shape)} "
                               f"for a param of shape {tuple(p.shape)} (param {i})")


def check_new_params(kind: str, gi: int, params: list[torch.Tensor], grads: list[torch.Tensor],
                     h, backend) -> set[str]:
    """What would refuse a step over ``params`` (a group's params that have grads), checked by
    the optimizers before they make state for any that has none (Note [refused steps] in
    fusedopt/optim.py): tensors, shapes, params that share memory, the backends (returns their
    names) and hyper-parameters their compute dtypes cannot hold."""
    name = _name(kind)
    check_tensors(kind, gi, params, grads)
    _refuse_overlap(name, gi, _overlap([("params", params)], []))
    chosen = set()
    for device, p_dtype, g_dtype in {(p.device, p.dtype, gr.dtype) for p, gr in zip(params, grads)}:
        be = backend if isinstance(backend, _backends.Backend) else _backends.resolve(
            backend, device, p_dtype, g_dtype)
        chosen.add(be.name)
        try:
            check_representable(h, compute_dtype(p_dtype))
        except ValueError as e:
            raise ValueError(f"{name}: param group {gi}: {e}") from None
    return chosen


def _refuse_overlap(name: str, gi: int, clash) -> None:
    if clash is None:
        return
    (a, t), (b, u) = clash
    if t is u:
        what = "param" if a.startswith("params") and b.startswith("params") else "tensor"
        raise ValueError(f"{name}: param group {gi} holds the same {what} twice ({a} and {b}, "
                         "counted among the params with grads)")
    raise ValueError(f"{name}: param group {gi}: {a} and {b} overlap in memory (views of one "
                     "tensor); a step writes them, so each must have memory of its own")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of ``t``'s storage that its elements lie in."""
    size = t.element_size()
    start = t.storage_offset() * size
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return start, start + extent * size


def _elements_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one storage share an element (exact; for the rare spans that meet)."""
    def offsets(t):
        idx = torch.zeros((), dtype=torch.int64)
        for n, s in zip(t.shape, t.stride()):
            idx = idx.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s
        return idx.reshape(-1) + t.storage_offset()
    if a.dtype.itemsize != b.dtype.itemsize:
        return True  # different element grids: the spans meeting is answer enough
    return bool(torch.isin(offsets(a), offsets(b)).any())


def _overlap(written, read) -> tuple | None:
    """``(name, tensor)`` of two tensors that share memory, one of them in ``written`` (lists of
    ``(name, tensors)``; None entries skipped), or None. Tensors of one storage are compared by
    their byte spans, and spans that meet by their elements."""
    by_storage: dict[tuple, list] = {}
    for is_written, named in ((True, written), (False, read)):
        for f, xs in named:
            for i, t in enumerate(xs or ()):
                if t is not None and t.numel() and t.device.type != "meta":
                    key = (t.device, t.untyped_storage().data_ptr())
                    by_storage.setdefault(key, []).append((*_span(t), is_written, f"{f}[{i}]", t))
    for spans in by_storage.values():
        if len(spans) < 2:
            continue
        spans.sort(key=lambda s: s[0])
        open_spans: list = []
        for start, end, is_written, label, t in spans:
            open_spans = [s for s in open_spans if s[1] > start]
            for _, _, other_written, other, u in open_spans:
                if (is_written or other_written) and (t is u or _elements_meet(t, u)):
                    return (other, u), (label, t)
            open_spans.append((start, end, is_written, label, t))
    return None


def _check_bucket(kind: str, gi: int, b: Bucket) -> None:
    """Raise, naming the group, the row and the state key, on state that does not fit its param:
    every backend needs the same layout, so a step refuses it before any tensor is written.
    Set-based over the bucket's rows (one param dtype, one device), a loop only to name the row."""
    name = _name(kind)
    dev, cd = b.device, b.compute_dtype

    def bad(i: int, what: str):
        p = b.params[i]
        return RuntimeError(f"{name}: param group {gi}, param {i} of those with grads (shape "
                            f"{tuple(p.shape)}, {p.dtype}): {what}")

    step_ok = (torch.float32, 0, dev)
    if {(s.dtype, s.dim(), s.device) for s in b.steps} != {step_ok}:
        i, s = next((i, s) for i, s in enumerate(b.steps)
                    if (s.dtype, s.dim(), s.device) != step_ok)
        raise bad(i, f"state 'step' must be a 0-dim float32 tensor on {dev}, got {s.dtype} of "
                     f"shape {list(s.shape)} on {s.device} (load_state_dict converts other step "
                     "formats)")
    shapes = [p.shape for p in b.params]
    for key, xs in (("exp_avg", b.exp_avgs), ("exp_avg_sq", b.exp_avg_sqs),
                    ("momentum_buffer", b.momentum_buffers), ("master_param", b.masters)):
        if xs is None or ({(x.dtype, x.device) for x in xs} == {(cd, dev)}
                          and [x.shape for x in xs] == shapes):
            continue
        for i, x in enumerate(xs):
            if (x.dtype, x.device, x.shape) == (cd, dev, shapes[i]):
                continue
            problem = _state_format_problem(key, x, b.params[i], cd, dev)
            if problem is not None:
                raise bad(i, problem)
    if b.exp_avgs is not None and b.exp_avg_sqs is not None:
        for i, (m, v) in enumerate(zip(b.exp_avgs, b.exp_avg_sqs)):
            if m.dtype != v.dtype:
                raise bad(i, f"state 'exp_avg' ({m.dtype}) and 'exp_avg_sq' ({v.dtype}) must "
                             "share a format (docs/math.md, \"Low-precision state\")")
    for i, p in enumerate(b.params):
        # torch's has_internal_overlap "yes", in sizes and strides that a trace reads as
        # constants (torch._debug_has_internal_overlap breaks a torch.compile graph)
        if not p.is_contiguous() and any(s == 0 and n > 1 for n, s in zip(p.shape, p.stride())):
            raise bad(i, "its elements overlap in memory (stride 0, e.g. an expand()ed tensor): "
                         "an update cannot be written in place")


def _state_format_problem(key: str, x: torch.Tensor, p: torch.Tensor, cd: torch.dtype,
                          dev: torch.device) -> str | None:
    """Why state ``x`` (not of the compute dtype ``cd`` and the param's shape) does not fit the
    param ``p``, or None when it is a low-precision moment that fits (docs/math.md,
    "Low-precision state"): bf16 of the param's shape, or a packed 8-bit uint8 tensor."""
    if x.device == dev and key != "master_param" and cd == torch.float32:
        if x.dtype == torch.bfloat16 and x.shape == p.shape:
            return None
        if x.dtype == torch.uint8:
            want = lowp.packed_numel(p.numel())
            if (x.dim() == 1 and x.numel() == want and x.is_contiguous()
                    and (torch.compiler.is_compiling() or x.data_ptr() % 4 == 0)):
                return None
            return (f"state {key!r} is uint8 but not the packed 8-bit state of this param (one "
                    f"contiguous dimension of {want} bytes from a 4-byte boundary), got shape "
                    f"{tuple(x.shape)}")
    low = (", bfloat16 or packed 8-bit uint8" if cd == torch.float32 and key != "master_param"
           else "")
    return (f"state {key!r} must be a {cd}{low} tensor of the param's shape on {dev}, got "
            f"{x.dtype} of shape {tuple(x.shape)} on {x.device}")


def _check_step_tensors(grad_scale, found_inf, skipped_steps) -> None:
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf),
                    ("skipped_steps", skipped_steps)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor of one element or None, got "
                            f"{type(t).__name__}")
        if t.numel() != 1 or (name != "skipped_steps" and not t.is_floating_point()):
            raise ValueError(f"{name} must be a {'' if name == 'skipped_steps' else 'floating '}"
                             f"tensor of one element, got {t.dtype} of shape {list(t.shape)}")


def _check_hyper(kind: str, gi: int, h, entries) -> None:
    """What a group's hyper-parameters need of its buckets: values their compute dtype holds, and
    a tensor lr on the CPU or the bucket's device."""
    for _, b in entries:
        try:
            check_representable(h, b.compute_dtype)
        except ValueError as e:
            raise ValueError(f"{_name(kind)}: param group {gi}: {e}") from None
        lr = h.lr
        if isinstance(lr, torch.Tensor) and lr.device not in (torch.device("cpu"), b.device):
            raise ValueError(f"{_name(kind)}: param group {gi}: a tensor lr must be on the CPU or "
                             f"on the params' device ({b.device}), not {lr.device}")


# ------------------------------------------------------------------------------ buckets
def _buckets(kind: str, gi: int, g: TensorGroup, cache: StepCache | None, bound: list) -> list:
    """The group's ``[backend, bucket]`` pairs, bound for the step (each appended to ``bound`` as
    soon as it is, so that the step ends it whatever happens next); raises before anything is
    modified. Note [kept buckets]: a group that was one bucket when last checked is not checked
    in Python again while it is what was checked: its backend's native handle says so (the cpp
    backend's kept layout looks at every tensor in C++), or else its lists are the very list
    objects that were checked (the optimizer's group plans, Note [group plans] in
    fusedopt/_plan.py, hand the same ones while nothing changed) and the grads and the params'
    dtypes and shapes are as they were (C-level passes over the lists)."""
    requested = getattr(g.backend, "name", g.backend)
    if cache is not None and not torch.compiler.is_compiling():
        hit = cache.single.get(gi)
        if (hit is not None and hit[2] == requested
                and (g.masters is None or not any(map(is_, g.masters, repeat(None))))):
            slot, be, _, seen = hit
            b = Bucket(**{f: getattr(g, f) for f in _LIST_FIELDS}, keys=g.keys, cache=cache,
                       slot=slot, requested_backend=requested)
            entry = [be, b]
            bound.append(entry)
            kept = be.bind(b, check=False)
            if kept or (kept is None and _as_checked(b, seen)):
                return [entry]
            bound.pop()
            be.end(b)
    _check_group(kind, gi, g)
    keys: dict[tuple, list[int]] = {}
    if len({t.dtype for t in g.params}) == 1 and len({t.dtype for t in g.grads}) == 1:
        keys[(g.params[0].device, g.params[0].dtype, g.grads[0].dtype)] = list(range(len(g.params)))
    else:
        for i, (p, gr) in enumerate(zip(g.params, g.grads)):
            keys.setdefault((p.device, p.dtype, gr.dtype), []).append(i)
    out = []
    for key, idx in keys.items():
        be = g.backend if isinstance(g.backend, _backends.Backend) else _backends.resolve(
            g.backend, *key)
        b = _bucket(kind, gi, g, idx)
        be = _for_formats(kind, gi, be, b, requested)
        b.cache, b.slot, b.requested_backend = cache, slot_of(gi, key), requested
        b.scratch["checked"] = True  # what Note [kept buckets] keeps, once the step prepared
        entry = [be, b]
        bound.append(entry)
        be.bind(b, check=True)
        out.append(entry)
    return out


def _for_formats(kind: str, gi: int, be: _backends.Backend, b: Bucket,
                 requested: str) -> _backends.Backend:
    """``be``, or eager where ``be`` does not implement a state format that ``b`` holds
    (``"auto"``; a backend asked for by name raises)."""
    states = b.exp_avgs if kind == "lamb" else b.momentum_buffers
    missing = {lowp.format_of(x) for x in states} - set(be.state_formats)
    if not missing:
        return be
    if requested == "auto":
        return _backends.get_backend("eager")
    raise RuntimeError(f"{_name(kind)}: param group {gi}: backend={be.name!r} does not implement "
                       f"{' or '.join(sorted(missing))} state (state_precision); use "
                       "backend='auto', 'cpp' or 'eager'")


_STATIC = ("params", "steps", *_STATE_FIELDS, "masters")  # the lists a step does not replace


def _seen(b: Bucket) -> tuple:
    """What Note [kept buckets] compares a later step's bucket with."""
    return (tuple(getattr(b, f) for f in _STATIC), b.grad_dtype, b.param_dtype, numels(b.params))


def _as_checked(b: Bucket, seen: tuple) -> bool:
    """Note [kept buckets]: ``b`` holds the lists that were checked (``seen``), its params are
    contiguous tensors on its device with the dtype and sizes they had (``p.data`` may be
    replaced), and its grads are contiguous strided tensors of the checked dtype on its device,
    of their params' sizes: what the kernels, which walk each tensor as a flat array, need. One
    C loop per list (Note [native scans] in csrc/cpu/register.cpp)."""
    lists, grad_dtype, param_dtype, sizes = seen
    return (all(map(is_, (getattr(b, f) for f in _STATIC), lists))
            and dense(b.params, param_dtype, b.device) and dense(b.grads, grad_dtype, b.device)
            and numels(b.params) == sizes == numels(b.grads))


def _bucket(kind: str, gi: int, g: TensorGroup, idx: list[int]) -> Bucket:
    """A Bucket of the rows ``idx`` of ``g``, with stand-ins (written back after the step) for
    the tensors of a row that are not laid out as its param: in the param's layout, or
    contiguous when the param is not dense or has packed 8-bit state."""
    def pick(xs):  # the group's own list when the bucket is the whole group (Note [kept buckets])
        return None if xs is None else xs if len(idx) == len(g.params) else [xs[i] for i in idx]

    lists = {f: pick(getattr(g, f)) for f in _LIST_FIELDS}
    masters = lists["masters"]  # None entries: params without masters
    if masters is not None and any(m is None for m in masters):
        if not all(m is None for m in masters):
            i = next(i for i, m in enumerate(masters) if m is None)
            raise RuntimeError(f"{_name(kind)}: param group {gi}, param {idx[i]} of those with "
                               "grads: state 'master_param' is None where the other params of "
                               "its dtype have master weights")
        lists["masters"] = None
    whole = len(idx) == len(g.params)
    keys = g.keys if whole or g.keys is None else g.keys[idx]
    b = Bucket(**lists, keys=keys if whole or keys is not None else torch.tensor(idx))
    _check_bucket(kind, gi, b)
    rows = [b.params, b.grads] + [xs for xs in (b.exp_avgs, b.exp_avg_sqs, b.momentum_buffers,
                                                 b.masters) if xs is not None]
    if all(x.is_contiguous() for xs in rows for x in xs):
        return b
    rows = [list(xs) for xs in rows]  # stand-ins go into copies, never into the caller's lists
    b.params, b.grads = rows[:2]
    for name, xs in zip([f for f in ("exp_avgs", "exp_avg_sqs", "momentum_buffers", "masters")
                         if getattr(b, f) is not None], rows[2:]):
        setattr(b, name, xs)
    for i, p in enumerate(b.params):
        # the kernels walk each tensor's memory: a row steps copies of the tensors laid out
        # otherwise than its param, so that the param's memory order is its elements' order
        # (which draws the random bits of bf16 v: docs/math.md, "Random bits"); contiguous
        # copies when the param is not dense, or has packed 8-bit state (uint8), whose blocks
        # hold its elements in row-major order
        shaped = [xs for xs in rows if xs[i].dtype != torch.uint8]
        own = len(shaped) == len(rows) and _dense_layout(p)  # p's own layout, else contiguous
        for j, xs in enumerate(shaped):
            x = xs[i]
            xs[i] = laid_out_as(x, p) if own else x.contiguous()
            if xs[i] is not x and j != 1:  # grads are only read
                b.writeback.append((x, xs[i]))
    return b


def _prepare(kind: str, plan, flips: list[bool], has_scale: bool, has_found_inf: bool) -> None:
    """Every backend prepares (compiles) what this step launches, before any tensor is touched.
    A bucket whose group asked for ``"auto"`` goes to the next backend of ``backends.resolve``
    when its backend fails to compile (one warning per backend, device and dtypes); an
    explicitly requested backend raises."""
    clip = any(h.max_grad_norm is not None for h, _ in plan)
    for (h, entries), flip in zip(plan, flips):
        has_gm = has_scale or h.max_grad_norm is not None or flip
        for entry in entries:
            be, b = entry
            while True:
                try:
                    be.prepare(b, kind, h, has_gm, has_found_inf, clip)
                    break
                except _backends.BackendCompileError as e:
                    if b.requested_backend != "auto":
                        raise
                    be.end(b)
                    be = entry[0] = _backends.fall_back(be, b, e)
                    be.bind(b, check=True)


# --------------------------------------------------------------------------------- step
@torch.no_grad()
def trust_ratio_step(
    kind: str,
    groups: Sequence[TensorGroup],
    *,
    cache: StepCache | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    reducer: SqSumReducer | None = None,
    skip_nonfinite: bool = False,
    skipped_steps: torch.Tensor | None = None,
) -> None:
    """Run one LAMB (``kind="lamb"``) or LARS (``kind="lars"``) step over ``groups``.

    ``cache``: what the caller keeps between steps (:class:`StepCache`, one per optimizer; None:
    nothing is kept). ``grad_scale``/``found_inf`` follow GradScaler's optimizer protocol (the
    grads are unscaled as they are read; a nonzero ``found_inf`` makes the step a no-op).
    ``skip_nonfinite``: a step whose grads hold inf or nan (their total ``Σg²`` is not finite)
    changes nothing, decided on the device; ``skipped_steps`` (a tensor) is then incremented.
    ``reducer`` completes per-rank sums in sharded training (:mod:`fusedopt.distributed`).
    """
    if kind not in ("lamb", "lars"):
        raise ValueError(f"kind must be 'lamb' or 'lars', got {kind!r}")
    _check_step_tensors(grad_scale, found_inf, skipped_steps)
    bound: list = []  # every [backend, bucket] of the step: each is ended, also on an error
    try:
        plan, gis, flips = [], [], []
        for gi, g in enumerate(groups):
            if g.params:
                entries = _buckets(kind, gi, g, cache, bound)
                _check_hyper(kind, gi, g.hyper, entries)
                plan.append((g.hyper, entries))
                gis.append(gi)
                flips.append(g.maximize)
        if not plan:
            return
        _prepare(kind, plan, flips, grad_scale is not None,
                 found_inf is not None or skip_nonfinite)
        if cache is not None and not torch.compiler.is_compiling():
            for gi, (_, entries) in zip(gis, plan):
                if len(entries) != 1 or entries[0][1].writeback:
                    cache.single.pop(gi, None)
                elif entries[0][1].scratch.get("checked"):
                    be, b = entries[0]
                    cache.single[gi] = (b.slot, be, b.requested_backend, _seen(b))
        # the global Σg² (clipping, the non-finite guard), pass 1, the reduction, pass 2
        total = None
        if skip_nonfinite or any(h.max_grad_norm is not None for h, _ in plan):
            dev0 = plan[0][1][0][1].device
            parts = [be.grad_sq_norms(b).to(dev0, torch.float64).sum()
                     for _, entries in plan for be, b in entries]
            total = torch.stack(parts).sum()
            if reducer is not None:
                reducer.reduce_grad_sq(total)
        if skip_nonfinite:
            bad = torch.isinf(total) | torch.isnan(total)
            if skipped_steps is not None:
                skipped_steps.add_(bad.to(skipped_steps.device, skipped_steps.dtype))
            bad = bad.to(torch.float32)
            found_inf = bad if found_inf is None else torch.maximum(
                found_inf.reshape(()).to(bad.device, torch.float32), bad)
        mults = _grad_multipliers(plan, flips, total, grad_scale)
        hypers = [encode(h) for h, _ in plan]
        steps = [(h, hyper, be, b, gm, None if found_inf is None else
                  found_inf.reshape(()).to(b.device, torch.float32))
                 for (h, entries), hyper, row in zip(plan, hypers, mults)
                 for (be, b), gm in zip(entries, row)]
        sums = [be.pass1(kind, b, h, hyper, gm, fi) for h, hyper, be, b, gm, fi in steps]
        if reducer is not None:
            reducer.reduce_trust_sums(sums, [b for _, _, _, b, _, _ in steps])
        for (h, hyper, be, b, gm, fi), s in zip(steps, sums):
            be.pass2(kind, b, h, hyper, s, gm, fi)
            for orig, stand_in in b.writeback:
                orig.copy_(stand_in)
    finally:
        for be, b in bound:
            be.end(b)


def _grad_multipliers(plan, flips, total, grad_scale):
    """Per-bucket ``grad_mult = ±1 / (scale · c)`` as 0-dim device tensors (None when it is 1;
    negative for a group that maximizes: the kernels read the grads times it, so the sign costs
    no pass of its own and gives the bits of a step on the negated grads)."""
    mults = []
    for (h, entries), flip in zip(plan, flips):
        row = []
        for _, b in entries:
            dev = b.device
            m = None
            if grad_scale is not None:
                m = grad_scale.reshape(()).to(dev, torch.float64).reciprocal()
            if h.max_grad_norm is not None:
                g_norm = lowp.sqrt_rn(total.to(dev))
                if m is not None:
                    g_norm = g_norm * m  # G of the unscaled gradients
                c = torch.clamp(g_norm / h.max_grad_norm, min=1.0)
                m = c.reciprocal() if m is None else m / c
            if flip:
                m = torch.full((), -1.0, dtype=torch.float64, device=dev) if m is None else -m
            row.append(None if m is None else m.to(b.compute_dtype))
        mults.append(row)
    return mults


# ----------------------------------------------------------------------- public functions
class StepOptions(TypedDict, total=False):
    """Keywords that :func:`lamb` and :func:`lars` pass on to :func:`trust_ratio_step`."""

    grad_scale: torch.Tensor | None  # GradScaler's scale: grads are unscaled as they are read
    found_inf: torch.Tensor | None  # nonzero: the step changes nothing
    skip_nonfinite: bool  # a step whose grads hold inf or NaN changes nothing (default False)
    skipped_steps: torch.Tensor | None  # counts the steps skip_nonfinite skipped


_D, _L = LAMB_DEFAULTS, LARS_DEFAULTS


def lamb(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    masters: Sequence[torch.Tensor | None] | None = None,
    lr: float | torch.Tensor = _D["lr"],
    betas: tuple[float, float] = _D["betas"],
    eps: float = _D["eps"],
    weight_decay: float = _D["weight_decay"],
    bias_correction: bool = _D["bias_correction"],
    grad_averaging: bool = _D["grad_averaging"],
    max_grad_norm: float | None = _D["max_grad_norm"],
    trust_ratio_bounds: tuple[float, float] | None = _D["trust_ratio_bounds"],
    decoupled_weight_decay: bool = _D["decoupled_weight_decay"],
    adapt: bool = _D["adapt"],
    maximize: bool = False,
    backend: str = "auto",
    **step: Unpack[StepOptions],
) -> None:
    """One LAMB step over lists of tensors, in place (the math of :class:`fusedopt.FusedLAMB`,
    whose defaults these are).

    ``steps`` are float32 0-dim tensors on each param's device (incremented by the step);
    ``exp_avgs``/``exp_avg_sqs`` are in the compute dtype (float64 for float64 params, else
    float32); ``masters`` optionally gives fp32 master weights of bf16/fp16 params (None entries
    for params without). Options are those of the class; ``step`` takes the keywords of
    :class:`StepOptions` (GradScaler's protocol and the non-finite guard). Everything is checked
    before anything is written, as by the class (lengths, tensors that share memory, shapes,
    dtypes). Example::

        steps = [torch.zeros(()) for _ in params]
        m = [torch.zeros_like(p) for p in params]; v = [torch.zeros_like(p) for p in params]
        fusedopt.functional.lamb(params, [p.grad for p in params], m, v, steps, lr=1e-3)
    """
    opts = {k: v for k, v in locals().items() if k in _D}  # the signature's options
    _one_group("lamb", opts, params, grads, steps, masters, backend, maximize,
               dict(exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs), step)


def lars(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor = _L["lr"],
    masters: Sequence[torch.Tensor | None] | None = None,
    momentum: float = _L["momentum"],
    weight_decay: float = _L["weight_decay"],
    trust_coefficient: float = _L["trust_coefficient"],
    eps: float = _L["eps"],
    nesterov: bool = _L["nesterov"],
    dampening: float = _L["dampening"],
    trust_clip: bool = _L["trust_clip"],
    denominator: str = _L["denominator"],
    lr_in_momentum: bool = _L["lr_in_momentum"],
    max_grad_norm: float | None = _L["max_grad_norm"],
    adapt: bool = _L["adapt"],
    maximize: bool = False,
    backend: str = "auto",
    **step: Unpack[StepOptions],
) -> None:
    """One LARS step over lists of tensors, in place (the math of :class:`fusedopt.FusedLARS`);
    see :func:`lamb` for ``steps``, ``masters`` and ``step`` (:class:`StepOptions`)."""
    opts = {k: v for k, v in locals().items() if k in _L}
    _one_group("lars", opts, params, grads, steps, masters, backend, maximize,
               dict(momentum_buffers=momentum_buffers), step)


def _one_group(kind: str, opts: dict, params, grads, steps, masters, backend, maximize,
               state: dict, step_args: dict) -> None:
    """:func:`lamb` / :func:`lars`: the options checked, one TensorGroup, one step."""
    unknown = sorted(set(step_args) - set(StepOptions.__annotations__))
    if unknown:
        raise TypeError(f"fusedopt.functional.{kind}() got unexpected keyword arguments {unknown}")
    check_options(kind, {**opts, "backend": backend, "maximize": maximize})
    g = TensorGroup(list(params), list(grads), list(steps),
                    masters=None if masters is None else list(masters),
                    hyper=(lamb_hyper if kind == "lamb" else lars_hyper)(opts), backend=backend,
                    maximize=maximize, **{key: list(xs) for key, xs in state.items()})
    try:
        trust_ratio_step(kind, [g], **step_args)
    except (ValueError, TypeError, RuntimeError) as e:
        prefix = f"{_name(kind)}: param group 0"  # the engine's words for the one group
        if type(e) in (ValueError, TypeError, RuntimeError) and str(e).startswith(prefix):
            raise type(e)(f"fusedopt.functional.{kind}(){str(e)[len(prefix):]}") from None
        raise
