"""The functional layer: LAMB and LARS steps over lists of tensors, in the manner of
``torch.optim.adam.adam``.

:func:`lamb` and :func:`lars` step one group of tensors with one set of hyper-parameters and are
usable without the optimizer classes. :func:`trust_ratio_step` steps several
:class:`TensorGroup` objects together: global gradient clipping spans them all, and a cross-rank
reducer runs one collective per phase. ``FusedLAMB.step`` / ``FusedLARS.step`` gather each param
group's lists and make one call to it.

A step runs the phases of docs/math.md, each delegated to a backend per :class:`Bucket` (tensors
of one group that share device, param dtype and grad dtype):

0. every check of every group, the backends resolved and their kernels prepared: a step that
   raises has changed nothing;
1. the grads' total ``Σg²`` when a group sets ``max_grad_norm`` or ``skip_nonfinite`` is on,
   ``c = max(1, sqrt(Σ) / max_grad_norm)``;
2. pass 1 per bucket (steps, LAMB moments, the two sums of squares of each trust ratio);
3. the optional cross-rank reduction of those sums (sharded training);
4. pass 2 per bucket (trust ratios with the zero-norm rule, the update).

Nothing here reads a tensor value on the host, and under ``torch.compile`` the whole step traces
into one graph: the fused backends are ``torch.ops.fusedopt`` operators with fake kernels.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol, Sequence, TypedDict, Unpack

import torch

from . import backends as _backends
from ._bucket import Bucket, TensorLists, bias_correction, compute_dtype
from ._hyper import (LambHyper, LarsHyper, check_backend_name, check_representable, lamb_hyper,
                     lars_hyper, validate_lamb_group, validate_lars_group)
from .flat import _dense_layout

__all__ = ["Bucket", "SqSumReducer", "StepOptions", "TensorGroup", "bias_correction",
           "compute_dtype", "lamb", "lars", "sq_norms", "trust_ratio_step"]


@dataclass
class TensorGroup(TensorLists):
    """One group of tensors (the lists of :class:`TensorLists`, where ``masters`` may hold None
    entries for params that are their own weight) stepped with one set of hyper-parameters."""

    hyper: LambHyper | LarsHyper = field(kw_only=True)
    # a backend name of fusedopt.backends.resolve, or a Backend object used as it is
    backend: str | _backends.Backend = "auto"
    # Note [list cache] in fusedopt/optim.py: a dict the caller keeps while it passes these very
    # list objects again; the step keeps its buckets there. None: build them every call
    cache: dict | None = None
    # a dict per group that lives as long as the caller (backend tables, Bucket.workspace)
    workspaces: dict | None = None


# the names of the lists of TensorLists (dataclasses.fields on the class does not trace under
# torch.compile; a tuple of names does)
_LIST_FIELDS = tuple(f.name for f in dataclasses.fields(TensorLists))


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


def check_tensors(kind: str, gi: int, params: list[torch.Tensor], grads: list[torch.Tensor]):
    """Raise on params and grads that no backend can step, naming the group; return the group's
    (devices, param dtypes, grad dtypes). Set-based: cheap for thousands of tensors."""
    name = _name(kind)
    if len(params) != len(grads):
        raise ValueError(f"{name}: param group {gi} has {len(params)} params but {len(grads)} grads")
    if any(lay is not torch.strided for lay in {t.layout for t in grads}):
        raise RuntimeError(f"{name} does not support sparse gradients (param group {gi})")
    p_dtypes, g_dtypes = {t.dtype for t in params}, {t.dtype for t in grads}
    for what, dtypes in (("params", p_dtypes), ("grads", g_dtypes)):
        if not all(d.is_floating_point for d in dtypes):
            kinds = "complex" if any(d.is_complex for d in dtypes) else "non-floating-point"
            raise RuntimeError(f"{name} does not support {kinds} {what} (param group {gi}: "
                               f"{sorted(map(str, dtypes))})")
    devices = {t.device for t in params}
    if len(devices) > 1:
        raise RuntimeError(
            f"params of one group must be on one device; param group {gi} has params on "
            f"{sorted(str(d) for d in devices)}")
    if {t.device for t in grads} != devices:
        raise RuntimeError(f"{name}: param group {gi} has grads on another device than its params")
    return devices, p_dtypes, g_dtypes


# ------------------------------------------------------------------------------ buckets
def cached_bucket(g: TensorGroup):
    """The (backend, bucket) kept in ``g.cache`` (Note [list cache]) with this step's grads, when
    its backend accepts them and its tensors did not change; None when no bucket is kept, False
    when the kept one refused (its params changed dtype or layout, or the grads do not fit)."""
    hit = g.cache.get("buckets") if g.cache is not None else None
    if hit is None or hit[0] is not g.params or hit[1] != g.backend:
        return None
    be, template, param_dtype, grad_dtype = hit[2]
    b = dataclasses.replace(template, grads=g.grads, scratch={}, writeback=[])
    if b.param_dtype == param_dtype and be.accepts_grads(b, grad_dtype):
        return be, b
    return False


def _buckets(kind: str, gi: int, g: TensorGroup) -> list[tuple[_backends.Backend, Bucket]]:
    """The group's (backend, bucket) pairs; raises before anything is modified."""
    cache = g.cache
    if cache is not None:
        ready = cache.pop("ready", None)
        if ready is not None and ready[0] is g.grads:
            return [ready[1]]
        hit = cached_bucket(g)
        if hit:
            return [hit]
    devices, p_dtypes, g_dtypes = check_tensors(kind, gi, g.params, g.grads)
    for p, gr in zip(g.params, g.grads):
        if p.shape != gr.shape:
            raise RuntimeError(f"{_name(kind)}: param group {gi} has a grad of shape "
                               f"{tuple(gr.shape)} for a param of shape {tuple(p.shape)}")
    if len(p_dtypes) == 1 and len(g_dtypes) == 1:
        keys = {(*devices, *p_dtypes, *g_dtypes): range(len(g.params))}
    else:
        keys = {}
        for i, (p, gr) in enumerate(zip(g.params, g.grads)):
            keys.setdefault((p.device, p.dtype, gr.dtype), []).append(i)
    out = []
    for key, idx in keys.items():
        be = g.backend if isinstance(g.backend, _backends.Backend) else _backends.resolve(
            g.backend, *key)
        out.append((be, _bucket(kind, gi, g, list(idx), key)))
    if cache is not None:
        cache.pop("buckets", None)
        if len(out) == 1 and not out[0][1].writeback:
            be, b = out[0]
            # a new bucket: no handle of an old one; the kept copy shares the dict, so that the
            # next steps reuse what the backend keeps there
            b.handles = {}
            cache["buckets"] = (g.params, g.backend, (be, dataclasses.replace(b, grads=[]),
                                                      b.param_dtype, b.grad_dtype))
    return out


def _bucket(kind: str, gi: int, g: TensorGroup, idx: list[int], key) -> Bucket:
    """A Bucket of the rows ``idx`` of ``g``, with contiguous stand-ins (written back after the
    step) for any row whose tensors do not share one dense layout."""
    def pick(xs):
        return None if xs is None else [xs[i] for i in idx]

    masters = pick(g.masters)  # None entries: params without masters
    if masters is not None and any(m is None for m in masters):
        if not all(m is None for m in masters):
            raise RuntimeError("fusedopt: params of one dtype must all have masters or none")
        masters = None
    lists = {name: pick(getattr(g, name)) for name in _LIST_FIELDS}
    b = Bucket(**{**lists, "masters": masters},
               requested_backend=getattr(g.backend, "name", g.backend))
    _check_bucket(kind, gi, b)
    if g.workspaces is not None:
        b.workspace = g.workspaces.setdefault(key, {})
    rows = [b.params, b.grads] + [xs for xs in (b.exp_avgs, b.exp_avg_sqs, b.momentum_buffers,
                                                 b.masters) if xs is not None]
    if all(x.is_contiguous() for xs in rows for x in xs):
        return b
    for i, p in enumerate(b.params):
        if all(_dense_layout(x[i]) and x[i].stride() == p.stride() for x in rows):
            continue
        for j, xs in enumerate(rows):
            stand_in = xs[i].contiguous()
            if j != 1:  # grads are only read
                b.writeback.append((xs[i], stand_in))
            xs[i] = stand_in
    return b


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
    if {(s.dtype, s.dim(), s.device) if isinstance(s, torch.Tensor) else None
            for s in b.steps} != {step_ok}:
        i, s = next((i, s) for i, s in enumerate(b.steps) if not isinstance(s, torch.Tensor)
                    or (s.dtype, s.dim(), s.device) != step_ok)
        got = (f"{s.dtype} of shape {list(s.shape)} on {s.device}"
               if isinstance(s, torch.Tensor) else repr(s))
        raise bad(i, f"state 'step' must be a 0-dim float32 tensor on {dev}, got {got} "
                     "(load_state_dict converts other step formats)")
    shapes = [p.shape for p in b.params]
    for key, xs in (("exp_avg", b.exp_avgs), ("exp_avg_sq", b.exp_avg_sqs),
                    ("momentum_buffer", b.momentum_buffers), ("master_param", b.masters)):
        if xs is None:
            continue
        if ({(x.dtype, x.device) if isinstance(x, torch.Tensor) else None for x in xs}
                == {(cd, dev)} and [x.shape for x in xs] == shapes):
            continue
        for i, x in enumerate(xs):
            if not isinstance(x, torch.Tensor):
                raise bad(i, f"state {key!r} is {type(x).__name__}, not a tensor")
            if (x.dtype, x.device, x.shape) != (cd, dev, shapes[i]):
                raise bad(i, f"state {key!r} must be a {cd} tensor of the param's shape on "
                             f"{dev}, got {x.dtype} of shape {tuple(x.shape)} on {x.device}")
    for i, p in enumerate(b.params):
        if not p.is_contiguous() and torch._debug_has_internal_overlap(p) == 1:
            raise bad(i, "its elements overlap in memory (stride 0, e.g. an expand()ed tensor): "
                         "an update cannot be written in place")


# --------------------------------------------------------------------------------- step
def _prepared(kind: str, plan, has_scale: bool, has_found_inf: bool):
    """The plan after every backend has prepared (compiled) what this step launches, before any
    tensor is touched. A bucket whose group asked for ``"auto"`` goes to the next backend of
    ``backends.resolve`` when its backend fails to compile (one warning per backend, device and
    dtypes); an explicitly requested backend raises."""
    clip = any(h.max_grad_norm is not None for h, _ in plan)
    out = []
    for h, entries in plan:
        has_gm = has_scale or h.max_grad_norm is not None
        row = []
        for be, b in entries:
            while True:
                try:
                    be.prepare(b, kind, h, has_gm, has_found_inf, clip)
                    break
                except _backends.BackendCompileError as e:
                    if b.requested_backend != "auto":
                        raise
                    be = _backends.fall_back(be, b, e)
            row.append((be, b))
        out.append((h, row))
    return out


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


def _grad_total(plan, reducer) -> torch.Tensor:
    """Σg² of every grad of the step, a float64 0-dim tensor on the first bucket's device."""
    dev0 = plan[0][1][0][1].device
    parts = [be.grad_sq_norms(b).to(dev0, torch.float64).sum()
             for _, entries in plan for be, b in entries]
    total = torch.stack(parts).sum()
    if reducer is not None:
        reducer.reduce_grad_sq(total)
    return total


def _grad_multipliers(plan, total, grad_scale):
    """Per-bucket ``grad_mult = 1 / (scale · c)`` as 0-dim device tensors (None when it is 1)."""
    mults = []
    for h, entries in plan:
        row = []
        for _, b in entries:
            dev = b.device
            m = None
            if grad_scale is not None:
                m = grad_scale.to(dev, torch.float64).reciprocal()
            if h.max_grad_norm is not None:
                g_norm = total.to(dev).sqrt()
                if m is not None:
                    g_norm = g_norm * m  # G of the unscaled gradients
                c = torch.clamp(g_norm / h.max_grad_norm, min=1.0)
                m = c.reciprocal() if m is None else m / c
            row.append(None if m is None else m.to(b.compute_dtype))
        mults.append(row)
    return mults


@torch.no_grad()
def trust_ratio_step(
    kind: str,
    groups: Sequence[TensorGroup],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    reducer: SqSumReducer | None = None,
    skip_nonfinite: bool = False,
    skipped_steps: torch.Tensor | None = None,
) -> None:
    """Run one LAMB (``kind="lamb"``) or LARS (``kind="lars"``) step over ``groups``.

    ``grad_scale``/``found_inf`` follow GradScaler's optimizer protocol (the grads are unscaled as
    they are read; a nonzero ``found_inf`` makes the step a no-op). ``skip_nonfinite``: a step
    whose grads hold inf or nan (their total ``Σg²`` is not finite) changes nothing, decided on
    the device; ``skipped_steps`` (a tensor) is then incremented. ``reducer`` completes per-rank
    sums in sharded training (:mod:`fusedopt.distributed`).
    """
    if kind not in ("lamb", "lars"):
        raise ValueError(f"kind must be 'lamb' or 'lars', got {kind!r}")
    built: list = []  # every (backend, bucket) of the step: each is finished, also on an error
    try:
        _run_step(kind, groups, built, grad_scale, found_inf, reducer, skip_nonfinite,
                  skipped_steps)
    finally:
        for be, b in built:
            be.finish(b)


def _run_step(kind, groups, built, grad_scale, found_inf, reducer, skip_nonfinite, skipped_steps):
    plan = []
    for gi, g in enumerate(groups):
        if g.params:
            entries = _buckets(kind, gi, g)
            built.extend(entries)
            _check_hyper(kind, gi, g.hyper, entries)
            plan.append((g.hyper, entries))
    if not plan:
        return
    plan = _prepared(kind, plan, grad_scale is not None, found_inf is not None or skip_nonfinite)
    total = None
    if skip_nonfinite or any(h.max_grad_norm is not None for h, _ in plan):
        total = _grad_total(plan, reducer)
    if skip_nonfinite:
        bad = torch.isinf(total) | torch.isnan(total)
        if skipped_steps is not None:
            skipped_steps.add_(bad.to(skipped_steps.device, skipped_steps.dtype))
        bad = bad.to(torch.float32)
        found_inf = bad if found_inf is None else torch.maximum(
            found_inf.to(bad.device, torch.float32), bad)
    mults = _grad_multipliers(plan, total, grad_scale)

    def inf_on(dev):
        return None if found_inf is None else found_inf.to(dev, torch.float32)

    all_buckets, all_sums = [], []
    for (h, entries), row in zip(plan, mults):
        for (be, b), gm in zip(entries, row):
            fi = inf_on(b.device)
            sums = be.lamb_pass1(b, h, gm, fi) if kind == "lamb" else be.lars_pass1(b, h, gm, fi)
            all_buckets.append(b)
            all_sums.append(sums)
    if reducer is not None:
        reducer.reduce_trust_sums(all_sums, all_buckets)
    k = 0
    for (h, entries), row in zip(plan, mults):
        for (be, b), gm in zip(entries, row):
            fi = inf_on(b.device)
            if kind == "lamb":
                be.lamb_pass2(b, h, all_sums[k], fi)
            else:
                be.lars_pass2(b, h, all_sums[k], gm, fi)
            k += 1
            for orig, stand_in in b.writeback:
                orig.copy_(stand_in)


# ----------------------------------------------------------------------- public functions
def _masters_list(masters, n):
    if masters is None:
        return None
    masters = list(masters)
    if len(masters) != n:
        raise ValueError(f"masters has {len(masters)} entries for {n} params")
    return masters


class StepOptions(TypedDict, total=False):
    """Keywords that :func:`lamb` and :func:`lars` pass on to :func:`trust_ratio_step`."""

    grad_scale: torch.Tensor | None  # GradScaler's scale: grads are unscaled as they are read
    found_inf: torch.Tensor | None  # nonzero: the step changes nothing
    skip_nonfinite: bool  # a step whose grads hold inf or NaN changes nothing (default False)
    skipped_steps: torch.Tensor | None  # counts the steps skip_nonfinite skipped


def lamb(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    masters: Sequence[torch.Tensor | None] | None = None,
    lr: float | torch.Tensor = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    max_grad_norm: float | None = None,
    trust_ratio_bounds: tuple[float, float] | None = None,
    decoupled_weight_decay: bool = False,
    adapt: bool = True,
    backend: str = "auto",
    **step: Unpack[StepOptions],
) -> None:
    """One LAMB step over lists of tensors, in place (the math of :class:`fusedopt.FusedLAMB`).

    ``steps`` are float32 0-dim tensors on each param's device (incremented by the step);
    ``exp_avgs``/``exp_avg_sqs`` are in the compute dtype (float64 for float64 params, else
    float32); ``masters`` optionally gives fp32 master weights of bf16/fp16 params (None entries
    for params without). Options are those of the class; ``step`` takes the keywords of
    :class:`StepOptions` (GradScaler's protocol and the non-finite guard). Example::

        steps = [torch.zeros(()) for _ in params]
        m = [torch.zeros_like(p) for p in params]; v = [torch.zeros_like(p) for p in params]
        fusedopt.functional.lamb(params, [p.grad for p in params], m, v, steps, lr=1e-3)
    """
    opts = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                bias_correction=bias_correction, grad_averaging=grad_averaging,
                max_grad_norm=max_grad_norm, trust_ratio_bounds=trust_ratio_bounds,
                decoupled_weight_decay=decoupled_weight_decay, adapt=adapt)
    _one_group("lamb", opts, params, grads, steps, masters, backend,
               dict(exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs), step)


def lars(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    masters: Sequence[torch.Tensor | None] | None = None,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 1e-8,
    nesterov: bool = False,
    dampening: float = 0.0,
    trust_clip: bool = False,
    denominator: str = "sum",
    lr_in_momentum: bool = True,
    max_grad_norm: float | None = None,
    adapt: bool = True,
    backend: str = "auto",
    **step: Unpack[StepOptions],
) -> None:
    """One LARS step over lists of tensors, in place (the math of :class:`fusedopt.FusedLARS`);
    see :func:`lamb` for ``steps``, ``masters`` and ``step`` (:class:`StepOptions`)."""
    opts = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                dampening=dampening, trust_clip=trust_clip, denominator=denominator,
                lr_in_momentum=lr_in_momentum, max_grad_norm=max_grad_norm, adapt=adapt)
    _one_group("lars", opts, params, grads, steps, masters, backend,
               dict(momentum_buffers=momentum_buffers), step)


def _one_group(kind: str, opts: dict, params, grads, steps, masters, backend, state: dict,
               step_args: dict) -> None:
    """:func:`lamb` / :func:`lars`: the options checked, one TensorGroup, one step."""
    unknown = sorted(set(step_args) - set(StepOptions.__annotations__))
    if unknown:
        raise TypeError(f"fusedopt.functional.{kind}() got unexpected keyword arguments {unknown}")
    (validate_lamb_group if kind == "lamb" else validate_lars_group)(opts)
    check_backend_name(backend)
    params = list(params)
    g = TensorGroup(params, list(grads), list(steps), masters=_masters_list(masters, len(params)),
                    hyper=(lamb_hyper if kind == "lamb" else lars_hyper)(opts), backend=backend,
                    **{key: list(xs) for key, xs in state.items()})
    _check_lengths(g)
    trust_ratio_step(kind, [g], **step_args)

def _check_lengths(g: TensorGroup) -> None:
    n = len(g.params)
    for name in ("grads", "steps", "exp_avgs", "exp_avg_sqs", "momentum_buffers"):
        xs = getattr(g, name)
        if xs is not None and len(xs) != n:
            raise ValueError(f"{name} has {len(xs)} entries for {n} params")
    for name in ("steps", "exp_avgs", "exp_avg_sqs", "momentum_buffers"):
        xs = getattr(g, name)
        if xs is None:
            continue
        for i, (x, p) in enumerate(zip(xs, g.params)):
            want = () if name == "steps" else p.shape
            if not isinstance(x, torch.Tensor) or x.shape != want or x.device != p.device:
                raise ValueError(f"{name}[{i}] must be a tensor of shape {tuple(want)} on "
                                 f"{p.device}, got {x if not isinstance(x, torch.Tensor) else (tuple(x.shape), x.device)}")
