"""Parameter groups that exclude biases and normalization weights from decay and adaptation."""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Sequence, Union

import torch

Predicate = Callable[[str, torch.Tensor], bool]
Exclude = Union[Predicate, Sequence[str], str]


def one_dimensional(name: str, param: torch.Tensor) -> bool:
    """The self-supervised-learning convention: exclude every param with ``ndim <= 1``
    (biases and normalization scales/shifts in practically every architecture)."""
    return param.ndim <= 1


def name_patterns(*patterns: str) -> Predicate:
    """Exclude params whose name matches any pattern (``re.search``; a plain word is a substring
    test, as Paddle's ``exclude_from_weight_decay``), e.g. ``name_patterns("bias", "norm", "bn")``."""
    compiled = [re.compile(p) for p in patterns]
    return lambda name, param: any(c.search(name) for c in compiled)


def _as_predicate(exclude: Exclude, what: str = "exclude") -> Predicate:
    if callable(exclude):
        return exclude
    if isinstance(exclude, str):
        return name_patterns(exclude)
    if isinstance(exclude, Sequence) and all(isinstance(p, str) for p in exclude):
        return name_patterns(*exclude)
    raise TypeError(
        f"Invalid {what}: {exclude!r}; expected a callable (name, param) -> bool, a name pattern "
        "or a sequence of name patterns"
    )


def param_groups(
    model_or_named_params: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
    *,
    weight_decay: float,
    exclude: Exclude = one_dimensional,
    exclude_from_weight_decay: bool = True,
    exclude_from_adaptation: bool = True,
    full_state: Exclude | None = None,
    **group_options: Any,
) -> list[dict[str, Any]]:
    """Split parameters into a regular group and an excluded group.

    Excluded params (chosen by ``exclude``: a predicate ``(name, param) -> bool``, name patterns,
    or the default :func:`one_dimensional`) get ``weight_decay=0`` and ``adapt=False``; set
    ``exclude_from_weight_decay`` or ``exclude_from_adaptation`` to False to apply only one of the
    two. Params that ``full_state`` selects (the same forms as ``exclude``; e.g. ``"embed"``)
    keep full-precision moments whatever ``state_precision`` the other groups take: they go into
    groups of their own with ``state_precision="full"``. Params with ``requires_grad=False`` are
    left out. ``group_options`` (e.g. ``lr``, ``state_precision``) go into every group. Empty
    groups are omitted. In a model wrapped in FSDP1 (``FullyShardedDataParallel(...,
    use_orig_params=True)``), whose params are 1-D pieces of their tensors, the predicates see a
    meta tensor of each param's own shape in its place.
    """
    shapes = {}
    if isinstance(model_or_named_params, torch.nn.Module):
        named = model_or_named_params.named_parameters()
        shapes = _fsdp1_shapes(model_or_named_params)
    else:
        named = model_or_named_params
    pred = _as_predicate(exclude)
    full = (lambda name, p: False) if full_state is None else _as_predicate(full_state,
                                                                             "full_state")
    split: dict[tuple[bool, bool], list[torch.Tensor]] = {}
    for name, p in named:
        if p.requires_grad:
            q = torch.empty(shapes[id(p)], device="meta") if id(p) in shapes else p
            split.setdefault((bool(full(name, q)), bool(pred(name, q))), []).append(p)
    groups = []
    for kept_full, excluded in sorted(split):  # regular, excluded, then their full-state twins
        group = {"params": split[kept_full, excluded], "weight_decay": weight_decay,
                 **group_options}
        if excluded:
            group["weight_decay"] = 0.0 if exclude_from_weight_decay else weight_decay
            group["adapt"] = not exclude_from_adaptation
        if kept_full:
            group["state_precision"] = "full"
        groups.append(group)
    return groups


def _fsdp1_shapes(model: torch.nn.Module) -> dict[int, torch.Size]:
    """id(param) -> its own shape, for the params of ``model`` that FSDP1 holds as pieces."""
    from .distributed import fsdp1_handles

    return {id(p): shape for h in fsdp1_handles(model) if h._use_orig_params
            for p, shape in zip(h.flat_param._params, h.flat_param._shapes)}
