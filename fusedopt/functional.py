"""The functional layer: one trust-ratio step over buckets of tensors, shared by LAMB and LARS.

``FusedLAMB.step`` / ``FusedLARS.step`` only gather tensors into :class:`Bucket` objects and call
:func:`trust_ratio_step`; this module sequences the phases of SPEC.md, each delegated to a backend:

0. global gradient clipping (only if a group sets ``max_grad_norm``): per-tensor ``Σg²`` of every
   grad of every group, ``G = sqrt(Σ)``, ``c = max(1, G / max_grad_norm)``;
1. pass 1 per bucket (steps, LAMB moments, the two sums of squares of each trust ratio);
2. the optional cross-rank reduction of those sums (sharded training: one collective per phase);
3. pass 2 per bucket (trust ratios with the zero-norm rule, the update).

Nothing here reads a tensor value on the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from . import backends as _backends
from ._hyper import LambHyper, LarsHyper


def compute_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Math runs in float64 for float64 params and in float32 for every other storage dtype."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def bias_correction(beta: float, step: torch.Tensor) -> torch.Tensor:
    """``1 - beta**t``, evaluated in float64 (the C++ and Triton backends use the same formula)."""
    return 1.0 - torch.pow(beta, step.to(torch.float64))


@dataclass
class Bucket:
    """Tensors of one param group that share device, param dtype and grad dtype.

    ``params`` are the stored parameters (the local shard for DTensors); when ``masters`` is given
    the math reads and writes the fp32 masters and ``params`` receive the result rounded to
    nearest even. State lists are None when the optimizer does not use them.
    """

    params: list[torch.Tensor]
    # None when the backend took the grads itself (Backend.take_cached_grads, cached buckets only)
    grads: list[torch.Tensor] | None
    steps: list[torch.Tensor]
    exp_avgs: list[torch.Tensor] | None = None
    exp_avg_sqs: list[torch.Tensor] | None = None
    momentum_buffers: list[torch.Tensor] | None = None
    masters: list[torch.Tensor] | None = None
    # (original, contiguous stand-in) pairs written back after pass 2, for strided tensors
    writeback: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # backend-private data carried from pass 1 to pass 2 (e.g. eager's update direction)
    scratch: dict = field(default_factory=dict)
    # backend-private data kept across steps while every list but ``grads`` stays the same objects
    # (the optimizer's plan cache hands the same dict to each step's bucket); None: a one-off bucket
    persistent: dict | None = None
    # backend-private data that lives as long as the optimizer, one dict per param group and
    # (device, param dtype, grad dtype), whatever the lists hold; whatever a backend keeps there
    # it validates on use (the Triton backend's pointer tables). None: a one-off bucket
    workspace: dict | None = None
    # the group's ``backend`` option: "auto" lets a backend that fails to compile hand the bucket
    # to the next one (Backend.prepare)
    requested_backend: str = "auto"

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def param_dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.grads[0].dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.param_dtype)

    @property
    def weights(self) -> list[torch.Tensor]:
        """The tensors the math reads as ``w``: fp32 masters when present, else the params."""
        return self.masters if self.masters is not None else self.params


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


def _grad_multipliers(plan, hypers, grad_scale, reducer):
    """Per-bucket ``grad_mult = 1 / (scale · c)`` as 0-dim device tensors (None when it is 1)."""
    clip = any(h.max_grad_norm is not None for h in hypers)
    total = None
    if clip:
        parts = []
        dev0 = plan[0][1][0][1].device
        for _, entries in plan:
            for be, b in entries:
                parts.append(be.grad_sq_norms(b).to(dev0, torch.float64).sum())
        total = torch.stack(parts).sum()
        if reducer is not None:
            reducer.reduce_grad_sq(total)
    mults = []
    for h, (_, entries) in zip(hypers, plan):
        row = []
        for be, b in entries:
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


def trust_ratio_step(
    kind: str,
    plan: list[tuple[LambHyper | LarsHyper, list[tuple[_backends.Backend, Bucket]]]],
    *,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    reducer: SqSumReducer | None = None,
) -> None:
    """Run one LAMB (``kind="lamb"``) or LARS (``kind="lars"``) step over the plan.

    ``plan`` holds, per param group, its host-side scalars and its (backend, bucket) pairs.
    ``grad_scale``/``found_inf`` follow GradScaler's optimizer protocol.
    """
    plan = [(h, entries) for h, entries in plan if entries]
    if not plan:
        return
    plan = _prepared(kind, plan, grad_scale is not None, found_inf is not None)
    hypers = [h for h, _ in plan]
    mults = _grad_multipliers(plan, hypers, grad_scale, reducer)

    def inf_on(dev):
        return None if found_inf is None else found_inf.to(dev, torch.float32)

    all_buckets, all_sums = [], []
    for (h, entries), row in zip(plan, mults):
        for (be, b), gm in zip(entries, row):
            fi = inf_on(b.device)
            if kind == "lamb":
                sums = be.lamb_pass1(b, h, gm, fi)
            else:
                sums = be.lars_pass1(b, h, gm, fi)
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
