"""Params (and their grads) moved into one buffer per (device, dtype): ``flatten_parameters``.

Note [flat params]: a fused step streams every tensor of a bucket once per pass, and on a CPU the
tensors' places in memory matter when they are small. ``nn.Module`` and autograd allocate each
param and each grad on its own; glibc puts 10 KB allocations one after the other, but with a few
hundred bytes between them (allocator headers, alignment, freed temporaries), and a stream that
jumps at every tensor boundary loses the hardware prefetcher. Contiguous streams are what helps:
slices of one buffer with the heap's gaps left in were nearly as slow as separate allocations,
and prefetching each tensor's first bytes by software only added time (docs/performance.md,
"Many small tensors"). The optimizer's own state is already flat
(Note [flat state] in ``fusedopt/_state.py``); this module does the same for the params and grads.
It is opt-in because it changes where the user's tensors live: every ``p.data`` becomes a slice
of a shared buffer, and grads stay allocated between steps.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["FlatParameters", "flatten_parameters"]


def _aligned_offsets(numels: list[int], dtype: torch.dtype, align_bytes: int = 64):
    """Offsets (in elements) of consecutive tensors of ``numels`` elements in one buffer, each
    starting on an ``align_bytes`` boundary of the buffer, and the buffer's length."""
    unit = max(1, align_bytes // dtype.itemsize)
    offsets, end = [], 0
    for n in numels:
        start = -(-end // unit) * unit
        offsets.append(start)
        end = start + n
    return offsets, end


def _dense_layout(t: torch.Tensor) -> bool:
    """True if the elements of ``t`` fill its storage span exactly once (any dim order); a tensor
    without elements has nothing to fill."""
    if t.numel() == 0:
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def memory_order(t: torch.Tensor) -> list[int] | None:
    """The dims of ``t`` by decreasing stride when ``t`` is dense but not contiguous (a
    channels_last or transposed tensor): ``t.permute(order)`` is contiguous, its row-major order
    the order of ``t``'s elements in memory. None for a contiguous tensor and for one that is not
    dense, whose elements are taken in row-major order."""
    if t.is_contiguous() or not _dense_layout(t):
        return None
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """All elements of ``t`` as a 1-d tensor in the order of ``memory_order``: a view when ``t``
    is dense (any strides)."""
    order = memory_order(t)
    return t.reshape(-1) if order is None else t.permute(order).view(-1)


def laid_out_as(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` (of ``p``'s shape) laid out as the dense ``p``: ``t`` itself when its elements lie
    in memory in ``p``'s order without gaps, else a copy with ``p``'s strides. The kernels walk
    a param's tensors in the param's memory order."""
    # asked of is_contiguous, not read from the strides: under torch.compile dynamo gives a
    # param's grad of other strides symbolic ones, which it fails to compare (an internal error)
    order = memory_order(p)
    if t.is_contiguous() if order is None else t.permute(order).is_contiguous():
        return t
    return torch.empty_like(p, dtype=t.dtype).copy_(t)


def memory_to_row_major(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x``, one value per element of ``like`` listed in ``like``'s memory order (1-d), listed
    in row-major order."""
    order = memory_order(like)
    if order is None:
        return x
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return x.view([like.shape[d] for d in order]).permute(inverse).reshape(-1)


def _slot(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of ``buffer`` from element ``offset`` on with the shape and strides of ``like``
    (a dense layout: contiguous, channels_last, ...), so each param keeps its memory format."""
    return buffer.as_strided(like.shape, like.stride(), offset)


class FlatParameters:
    """Params whose data (and grads) are slices of one buffer per (device, dtype); made by
    :func:`flatten_parameters`.

    Attributes:
        params: the flattened params, each once, in the order given.
        buffers: ``(device, dtype) -> buffer`` of the params' data.
        grad_buffers: ``(device, dtype) -> buffer`` of their grads (empty when made with
            ``grads=False``).
    """

    def __init__(self, params: list[torch.Tensor], buffers: dict, grad_buffers: dict,
                 grad_views: list[torch.Tensor | None]):
        self.params = params
        self.buffers = buffers
        self.grad_buffers = grad_buffers
        self._grad_views = grad_views

    def zero_grad(self) -> None:
        """Zero the grad buffers (one fill per buffer) and make every flattened param's
        ``.grad`` its slice of them again, wherever it is no longer (set to None by
        ``optimizer.zero_grad()``, replaced by ``backward(create_graph=True)`` or by hand).

        Use it instead of ``optimizer.zero_grad()`` / ``model.zero_grad()``: those set the grads to
        None by default, and the next backward then allocates separate grads again (correct, only
        slower). As with ``zero_grad(set_to_none=False)``, a param that gets no gradient in the
        next backward has a zero grad, not None, and the optimizer steps it.
        """
        for buffer in self.grad_buffers.values():
            buffer.zero_()
        for p, view in zip(self.params, self._grad_views):
            if view is not None and p.grad is not view:
                p.grad = view

    def __repr__(self) -> str:
        keys = ", ".join(f"{d}/{str(t).removeprefix('torch.')}: {b.numel()}"
                         for (d, t), b in self.buffers.items())
        return (f"FlatParameters({len(self.params)} params; {keys}; "
                f"grads {'flat' if self.grad_buffers else 'not flattened'})")


def _unique_params(params) -> list[torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        params = params.parameters()
    elif isinstance(params, torch.Tensor):
        raise TypeError("params must be an nn.Module or an iterable of tensors, got a single "
                        "tensor; pass [tensor]")
    if not isinstance(params, Iterable):
        raise TypeError(f"params must be an nn.Module or an iterable of tensors, got "
                        f"{type(params).__name__}")
    out, seen = [], set()
    for i, p in enumerate(params):
        if isinstance(p, dict):
            raise TypeError("params must be tensors, got a dict (a param group?); pass "
                            "the model or its parameters()")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params must be tensors; item {i} is a {type(p).__name__}")
        if id(p) not in seen:  # a param given twice (tied weights) is flattened once
            seen.add(id(p))
            out.append(p)
    return out


def _check(params: list[torch.Tensor], grads: bool) -> None:
    """Raise, naming the param by its position, on anything flattening cannot keep as it is."""
    storages: dict[tuple, int] = {}
    for i, p in enumerate(params):
        what = f"param {i} ({tuple(p.shape)}, {p.dtype}, {p.device})"
        if hasattr(p, "to_local"):
            raise ValueError(f"{what} is a DTensor: sharded params are laid out by FSDP, not "
                             "flattened")
        if p.layout != torch.strided:
            raise ValueError(f"{what} has layout {p.layout}; only strided (dense) params can be "
                             "flattened")
        if p.grad_fn is not None:
            raise ValueError(f"{what} is not a leaf tensor (it has grad_fn "
                             f"{type(p.grad_fn).__name__}); flatten the leaf params")
        if p.device.type == "meta":
            raise ValueError(f"{what} is on the meta device: it has no data to move")
        if not _dense_layout(p):
            raise ValueError(f"{what} has strides {p.stride()}, which overlap or leave gaps; "
                             "only dense layouts (contiguous, channels_last, ...) are flattened")
        if p.numel():
            key = (p.device, p.untyped_storage().data_ptr())
            if key in storages:
                raise ValueError(
                    f"params {storages[key]} and {i} share a storage (views of one tensor, or "
                    "already flattened: use the FlatParameters of that call); flattening would "
                    "move them out of it. Tie weights by using one Parameter object in both places")
            storages[key] = i
        grad_dtype = getattr(p, "grad_dtype", p.dtype)  # newer torch: may differ from p.dtype
        if grads and p.requires_grad and grad_dtype not in (None, p.dtype):
            raise ValueError(f"{what} has grad_dtype {grad_dtype}; a flat grad buffer holds grads "
                             "of their param's dtype (flatten with grads=False)")
        g = p.grad
        if grads and g is not None:
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise ValueError(
                    f"{what} has a grad of shape {tuple(g.shape)}, {g.dtype}, {g.device}; a flat "
                    "grad buffer holds grads like their params. Flatten before the first backward "
                    "or after optimizer.zero_grad()")
            if g.layout != torch.strided:
                raise ValueError(f"{what} has a {g.layout} grad; only dense grads can be flattened")


def flatten_parameters(params, *, grads: bool = True) -> FlatParameters:
    """Move each param's data into one buffer per (device, dtype), and its grad into a second.

    ``params`` is an ``nn.Module`` (its ``parameters()``) or an iterable of params. Each param
    stays the same object (optimizers, param groups and modules keep working) with the same
    values, shape and strides; its ``.data`` becomes a slice of its (device, dtype) buffer, each
    slice starting on a 64-byte boundary. With ``grads=True`` every param that requires grad gets a
    ``.grad`` that is a slice of a grad buffer (its current grad copied in, zeros otherwise);
    backward then accumulates into those slices in place. Zero them with
    :meth:`FlatParameters.zero_grad`, not ``optimizer.zero_grad()``, which would set them to None
    (see there). Why: Note [flat params] in this module.

    Call it before building an optimizer, ``DistributedDataParallel`` or anything else that holds
    on to the params' storage. Not for FSDP (DTensor params are refused), and do not combine
    ``grads=True`` with DDP's ``gradient_as_bucket_view=True``, which makes grads views of its own
    buckets. Moving the model afterwards (``model.to(...)``, ``model.half()``) gives its params new
    allocations of their own again: flatten after moving. The old storages are freed when nothing
    else refers to them: at most one extra copy of the params exists while this runs.

    Raises ``ValueError``, changing nothing, for params that share a storage (views of one tensor,
    params flattened before: flattening would move them out of it; a param given twice is
    flattened once), DTensors, sparse or non-leaf tensors, layouts with gaps or overlaps, meta
    tensors, and grads (or a ``grad_dtype``) whose shape, dtype or device differ from their
    param's.
    """
    ps = _unique_params(params)
    _check(ps, grads)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(ps):
        groups.setdefault((p.device, p.dtype), []).append(i)
    # Everything is allocated and filled before any param changes, so an allocation that fails
    # (out of memory) leaves the params as they were.
    slots: list[torch.Tensor | None] = [None] * len(ps)
    grad_slots: list[torch.Tensor | None] = [None] * len(ps)
    buffers, grad_buffers = {}, {}
    with torch.no_grad():
        for (device, dtype), idx in groups.items():
            offsets, total = _aligned_offsets([ps[i].numel() for i in idx], dtype)
            buffers[(device, dtype)] = buffer = torch.zeros(total, dtype=dtype, device=device)
            grad_buffer = None
            if grads and any(ps[i].requires_grad for i in idx):
                grad_buffers[(device, dtype)] = grad_buffer = torch.zeros_like(buffer)
            for i, offset in zip(idx, offsets):
                p = ps[i]
                slots[i] = _slot(buffer, offset, p)
                slots[i].copy_(p)
                if grad_buffer is not None and p.requires_grad:
                    grad_slots[i] = _slot(grad_buffer, offset, p)
                    if p.grad is not None:
                        grad_slots[i].copy_(p.grad)
    for p, slot, grad_slot in zip(ps, slots, grad_slots):
        p.data = slot
        if grad_slot is not None:
            p.grad = grad_slot
    return FlatParameters(ps, buffers, grad_buffers, grad_slots)
