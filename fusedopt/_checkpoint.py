"""Loading optimizer state: checks, format conversion and the saved 8-bit form.

``FusedLAMB.load_state_dict`` reads everything it needs from the state dict in its last
pre-hook (:func:`prepare`, which raises before torch's loader changes anything) and installs the
prepared state in its first post-hook (:func:`install`). A state dict's moments in another format
than the group's ``state_precision`` gives them are converted there (docs/math.md,
"Low-precision state"), and so is 8-bit state of the earlier format. A loader that puts a saved
state straight into ``optimizer.state`` (ZeroRedundancyOptimizer's) leaves the saved form there,
which the step takes in through :func:`adopt` with the same checks.
"""
from __future__ import annotations

import math
import warnings
from itertools import chain
from dataclasses import dataclass, field
from typing import Any

import torch

from . import lowp
from ._bucket import compute_dtype
from ._bucket import local as _local
from ._sharding import Sharding
from ._state import OptimizerState, state_format
from .flat import _dense_layout, laid_out_as

_SUFFIXES = (lowp.BLOCKS_SUFFIX, lowp.V1_SUFFIX)


def laid_out_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` (loaded state of the plain param ``p``) in ``p``'s memory layout, once: a row of
    other strides would step through copies at every step (functional._bucket)."""
    if hasattr(p, "to_local") or t.shape != p.shape or not _dense_layout(p):
        return t
    return laid_out_as(t, p)


def step_count(value: Any, where: str) -> float:
    """A saved step count as a float: a number or a one-element tensor, finite, whole and not
    negative (LAMB's bias correction reads it; a count of -1 or NaN would make the next update
    non-finite)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        count = float(value.detach().reshape(()).double())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        count = float(value)
    else:
        raise TypeError(f"{where}: 'step' must be a number or a one-element tensor, got "
                        + (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                           else type(value).__name__))
    if not math.isfinite(count) or count < 0 or count != math.floor(count):
        raise ValueError(f"{where}: 'step' is {count}; a step count is a whole number >= 0")
    return count


@dataclass
class Prepared:
    """What :func:`prepare` read: per saved param id, the state tensors to install."""

    state: dict[Any, dict[str, torch.Tensor]] = field(default_factory=dict)
    converted: set[tuple[str, str]] = field(default_factory=set)


def _saved_moment(opt, saved: dict, key: str, p: torch.Tensor, where: str):
    """(format, tensor or values) of the saved moment ``key`` of ``p``: ("8bit", packed),
    ("v1", float32 values of the earlier 8-bit format), (format, tensor) of a full or bf16
    moment; raises naming the key."""
    value = saved[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: state {key!r} is {type(value).__name__}, not a tensor")
    try:
        eight = lowp.saved_moment(saved, key, p)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None
    if eight is not None:
        return eight
    if not (value.is_floating_point()):
        raise TypeError(f"{where}: state {key!r} is {value.dtype}; a moment is a float tensor, or "
                        "8-bit codes (uint8) with their block words")
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"{where}: state {key!r} has shape {tuple(value.shape)}, the param "
                         f"{tuple(p.shape)}")
    return lowp.format_of(value), value


def _lamb_eps(opt, group: dict[str, Any], count: float, lp: torch.Tensor) -> torch.Tensor:
    return lowp.lamb_eps(float(group["eps"]), float(group["betas"][1]),
                         bool(group["bias_correction"]), count).to(lp.device)


def prepare_param(opt, group: dict[str, Any], saved_group: dict[str, Any], p: torch.Tensor,
                  saved: dict[str, Any], count: float | None, where: str,
                  converted: set) -> dict[str, torch.Tensor]:
    """The state tensors of ``p`` from its saved state ``saved`` (``count``: its step count, when
    the state has one or the group gave one), checked and in the format ``group`` gives ``p``.
    Hyper-parameters of the conversion come from ``saved_group`` (the group as loaded)."""
    lp = _local(p)
    cd = compute_dtype(lp.dtype)
    out: dict[str, torch.Tensor] = {}
    if count is not None:
        out["step"] = torch.tensor(count, dtype=torch.float32, device=lp.device)
    moments = {k: _saved_moment(opt, saved, k, p, where) for k in opt._state_keys
               if saved.get(k) is not None}
    if moments:
        fmt = state_format(group, p, opt._sharding.wholes.get(id(p)))
        if all(f == fmt for f, _ in moments.values()) and len(moments) == len(opt._state_keys):
            for key, (f, value) in moments.items():
                if f == "8bit":
                    out[key] = value
                else:
                    value = value.to(device=p.device, dtype=cd if f == "full" else value.dtype)
                    out[key] = laid_out_like(value, p) if not hasattr(p, "to_local") else value
        else:
            out.update(_converted(opt, saved_group, p, moments, fmt, count, where, converted))
    master = saved.get("master_param")
    if isinstance(master, torch.Tensor):
        if tuple(master.shape) != tuple(p.shape):
            raise ValueError(f"{where}: state 'master_param' has shape {tuple(master.shape)}, the "
                             f"param {tuple(p.shape)}")
        out["master_param"] = laid_out_like(master.to(device=p.device, dtype=cd), p)
    return out


def _converted(opt, saved_group, p, moments, fmt, count, where, converted):
    """The moments in format ``fmt``, converted from the ones saved (recorded in ``converted``)."""
    lp = _local(p)
    cd = compute_dtype(lp.dtype)
    if len(moments) != len(opt._state_keys):
        missing = [k for k in opt._state_keys if k not in moments]
        raise ValueError(f"{where}: state has {sorted(moments)} but not {missing}; the moments "
                         "are converted to another format together")
    values, packed = {}, {}
    for key, (f, value) in moments.items():
        converted.add(("8bit (earlier format)" if f == "v1" else f, fmt))
        if f == "v1":
            values[key] = value * value if key == "exp_avg_sq" else value
        elif f == "8bit":
            packed[key] = value
        else:
            values[key] = _local(value).to(device=lp.device, dtype=torch.float32)
    if packed:
        try:
            values.update(lowp.moments(packed, lp.shape))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    eps = None
    if fmt == "8bit" and opt._kind == "lamb":
        if count is None:
            raise ValueError(f"{where}: LAMB's 8-bit state is converted with its step count, "
                             "which the state has not")
        eps = _lamb_eps(opt, saved_group, count, lp)
    out = lowp.stored({k: v.reshape(lp.shape) for k, v in values.items()}, fmt, lp, eps=eps,
                      full_dtype=cd)
    if fmt == "8bit" or not hasattr(p, "to_local"):
        return {k: v if fmt == "8bit" else laid_out_like(v, p) for k, v in out.items()}
    return {k: lowp.placed(v, p) for k, v in out.items()}


def adopt(opt, gi: int, group: dict[str, Any], p: torch.Tensor, st: dict[str, Any]) -> None:
    """Takes in saved 8-bit state that a loader put straight into ``optimizer.state[p]`` (the
    codes under the moment's key and the block words under the key + ``_blocks``, or the
    earlier format): checked and packed (converted for the earlier format), in place of the
    saved tensors."""
    where = f"{type(opt).__name__}: param group {gi}, state of a param of shape {tuple(p.shape)}"
    count = step_count(st["step"], where) if st.get("step") is not None else None
    converted: set = set()
    new = prepare_param(opt, group, group, p, st, count, where, converted)
    for key in list(st):
        if any(key == k + s for k in opt._state_keys for s in _SUFFIXES):
            del st[key]
    st.update({k: v for k, v in new.items() if k != "step"})
    if converted:
        _warn(opt, converted)


def needs_adopting(opt, st: dict[str, Any]) -> bool:
    """Whether the state dict of one param holds saved 8-bit state (:func:`adopt`)."""
    return any(k + s in st for k in opt._state_keys for s in _SUFFIXES)


def _warn(opt, converted: set) -> None:
    warnings.warn(f"{type(opt).__name__}.load_state_dict converted optimizer state from one "
                  "format to another (" + ", ".join(f"{a} to {b}" for a, b in sorted(converted))
                  + "), to the groups' state_precision (docs/math.md, \"Low-precision state\")",
                  stacklevel=4)


def install(opt, prepared: Prepared, saved_ids: list, params: list) -> None:
    """The prepared state of each loaded param in ``optimizer.state``, replacing what torch's
    loader put there (its copies of the saved tensors, cast by its own rules)."""
    for pid, (_, p) in zip(saved_ids, params):
        new = prepared.state.get(pid)
        if new is None:
            continue
        st = opt.state[p]
        for key in list(st):
            if any(key == k + s for k in opt._state_keys for s in _SUFFIXES):
                del st[key]
        st.update(new)
    if prepared.converted:
        _warn(opt, prepared.converted)


def read(opt, state_dict: dict[str, Any], own_options: tuple[str, ...]) -> tuple:
    """What ``load_state_dict``'s last pre-hook reads from ``state_dict``: everything it will
    install, checked and converted, refusing a state dict before torch's loader changes
    anything; the options ``own_options`` of the groups, which the loaded groups do not
    replace."""
    saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
    params = [(g, p) for g in opt.param_groups for p in g["params"]]
    counts = _foreign_counts(opt, state_dict)
    prepared = Prepared()
    if len(saved_ids) == len(params):  # else torch's loader refuses the state dict
        saved_groups = {pid: g for g in state_dict["param_groups"] for pid in g["params"]}
        for pid, (group, p) in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if not isinstance(saved, dict):
                continue
            where = f"{type(opt).__name__}: param {pid} of the state dict"
            count = counts.get(pid)
            if saved.get("step") is not None:
                count = step_count(saved["step"], where)
            loaded_group = {**group, **{k: v for k, v in saved_groups[pid].items()
                                        if k != "params" and k not in own_options}}
            prepared.state[pid] = prepare_param(
                opt, group, loaded_group, p, saved, count, where, prepared.converted)
    own = [{k: g[k] for k in own_options} for g in opt.param_groups]
    return state_dict, saved_ids, params, prepared, counts, own


# Note [foreign step counts]: a saved state whose moments have no step count of their own
# takes its group's "step" (apex's FusedLAMB and timm's Lamb count there, once per step()).
# Without one, a LARS momentum buffer counts 1: a buffer means a step was taken, and LARS
# reads the count only to tell the first step (docs/math.md); LAMB's bias correction needs the
# count, so such LAMB state is refused. The group's "step" goes once its counts are taken: a
# count that no step advances would be wrong in every later checkpoint.
def _foreign_counts(opt, state_dict: dict[str, Any]) -> dict[Any, float]:
    """Saved param id -> the count of its state, for states that have moments but no count
    (Note [foreign step counts]); raises ValueError for one that cannot be counted."""
    counts = {}
    for g in state_dict["param_groups"]:
        for pid in g["params"]:
            saved = state_dict["state"].get(pid)
            if (not isinstance(saved, dict) or saved.get("step") is not None
                    or all(saved.get(k) is None for k in opt._state_keys)):
                continue
            count = g.get("step", 1 if opt._kind == "lars" else None)
            if count is None:
                raise ValueError(f"{type(opt).__name__}: param {pid} of the state dict has "
                                 "moments but no step count, neither its own nor its param "
                                 "group's; LAMB's bias correction needs it")
            counts[pid] = step_count(
                count, f"{type(opt).__name__}: param group of param {pid} of the state dict")
    return counts


def finish(opt, load: tuple) -> None:
    """What ``load_state_dict``'s first post-hook does with ``load`` (what :func:`read` read):
    the loaded groups keep their own options, and the state is installed as the optimizer keeps
    it."""
    state_dict, saved_ids, params, prepared, counts, own = load
    for g, mine, saved_group in zip(opt.param_groups, own, state_dict["param_groups"]):
        g.update(mine)
        if not counts.keys().isdisjoint(saved_group["params"]):
            g.pop("step", None)  # Note [foreign step counts]
    install(opt, prepared, saved_ids, params)


def saved_form(opt, out: dict[str, Any]) -> dict[str, Any]:
    """The first of ``state_dict``'s post-hooks, so that the user's see the state dict it
    returns: 8-bit moments as codes and block words, views of the optimizer's state (Note
    [saved 8-bit state] in lowp.py)."""
    # entries that are not a param's dict (opt.state["global_step"] = 1) saved as torch does
    out["state"] = {k: dict(v) if isinstance(v, dict) else v for k, v in out["state"].items()}
    params = chain.from_iterable(g["params"] for g in opt.param_groups)
    for i, p in enumerate(params):
        st = out["state"].get(i)
        for key in opt._state_keys if isinstance(st, dict) else ():
            t = st.get(key)
            if isinstance(t, torch.Tensor) and t.dtype == torch.uint8:
                st[key], st[key + lowp.BLOCKS_SUFFIX] = lowp.saved_form(t, p)
    return out


def pickled(opt, out: dict[str, Any]) -> dict[str, Any]:
    """``__getstate__``: torch's pickled form ``out`` of ``opt`` less what belongs to this
    process (the step's caches, its lock, the loader's hand-over)."""
    if isinstance(out["state"], OptimizerState):
        out["state"] = out["state"].plain()
    out["skip_nonfinite"] = opt.skip_nonfinite
    for key in ("_cache", "_plans", "_pending", "_stale", "_lock", "_load", "_zero_parent"):
        out.pop(key, None)
    # a pickled optimizer keeps a reducer set by hand (set_grad_norm_reducer), not the tensors'
    # places of this process (keys, pieces, partitions), which name tensor ids
    out["_sharding"] = Sharding(reducer=opt._sharding.reducer)
    return out


def unpickled(opt) -> None:
    """``__setstate__`` after torch's (unpickling, and torch's ``load_state_dict``, which calls
    it): what a pickle of an earlier version lacks, and the groups' options."""
    opt.state = OptimizerState(opt.state)
    d = opt.__dict__
    # the constructor's options: torch's __setstate__ adds keys of its own to defaults
    # (differentiable), which the groups must not gain (state_dict() would then differ from the
    # one loaded)
    d.setdefault("_option_keys", tuple(opt.defaults))
    d.setdefault("skip_nonfinite", False)
    d.setdefault("_sharding", Sharding(reducer=d.pop("_reducer", None)))  # kept by load_state_dict
    d.setdefault("_zero_parent", None)
    if "skipped_steps" not in d:
        opt.skipped_steps = torch.zeros((), dtype=torch.int64)
    for group in opt.param_groups:
        for k in opt._option_keys:
            group.setdefault(k, opt.defaults[k])
