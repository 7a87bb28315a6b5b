"""The sharded settings whose step needs an adapter of fusedopt.distributed, recognized at the
step from what the engines themselves leave (docs/distributed.md, "Settings a step recognizes").

A step without its adapter would be silently wrong: one trust ratio per flat partition or per
rank's piece, or each rank clipping by its own part of the norm. The step raises instead, before
anything changes, naming the call to make; the group options that flat partitions cannot take
are refused here too (check_partition_options). A leaf module: it imports nothing of fusedopt.
"""
from __future__ import annotations

import sys
import weakref
from itertools import repeat
from typing import Any

#: torch.distributed.fsdp (FSDP1) sets this attribute, True, on every param it flattens into a
#: FlatParameter (use_orig_params=True: the params the optimizer steps) and on the FlatParameter
#: itself (use_orig_params=False)
FSDP1_MARK = "_fsdp_flattened"
#: DeepSpeed ZeRO-3 names each flat float32 partition it hands the optimizer by this attribute
ZERO3_MARK = "ds_id"

# DeepSpeed's optimizers that hand theirs one flat float32 buffer per param group (a piece of
# each rank's share of the group's tensors, cut across tensor boundaries), by module and class;
# they leave no mark on that buffer (ZeRO-3 does, ZERO3_MARK), so they are recognized as the
# caller of the step: the frame of their method whose ``self`` holds this optimizer as
# ``.optimizer``
_DEEPSPEED_FLAT = {
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"): "ZeRO-1/2",
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"): "ZeRO-3",
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"): "its BF16_Optimizer (ZeRO-1, bf16)",
    ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"): "its FP16_Optimizer",
}
# How far up the stack the callers are looked for: DeepSpeed's method calls torch's step wrapper
# (the step hooks), then step(), torch.no_grad's wrapper and the optimizer's methods down to the
# one that looks (six frames); torch's ZeroRedundancyOptimizer constructs its local optimizer
# two frames above the constructor that looks
_DEPTH = 12


def _self_of(frame):
    code = frame.f_code
    if not code.co_argcount or code.co_varnames[0] != "self":
        return None
    return frame.f_locals.get("self")


def _callers(depth: int):
    """The ``self`` of each method frame among the ``depth`` callers of the caller."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return
        obj = _self_of(frame)
        if obj is not None:
            yield obj
        frame = frame.f_back


def zero_parent() -> weakref.ref | None:
    """Called by the optimizer's constructor: a weak reference to the ZeroRedundancyOptimizer
    constructing it as its local optimizer (torch's ``_init_local_optimizer``), else None."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is None:
        return None
    for obj in _callers(_DEPTH):
        if isinstance(obj, zero.ZeroRedundancyOptimizer):
            return weakref.ref(obj)
    return None


def deepspeed_caller(optimizer) -> str | None:
    """What DeepSpeed optimizer of :data:`_DEEPSPEED_FLAT` is stepping ``optimizer`` (its name in
    words), None if none is."""
    if "deepspeed" not in sys.modules:
        return None
    for obj in _callers(_DEPTH):
        kind = _DEEPSPEED_FLAT.get((type(obj).__module__, type(obj).__name__))
        if kind is not None and getattr(obj, "optimizer", None) is optimizer:
            return kind
    return None


def check_step(optimizer) -> None:
    """Raises (RuntimeError naming the call to make) when ``optimizer`` (a FusedLAMB/FusedLARS,
    stepped eagerly) is the local optimizer of a ZeroRedundancyOptimizer and clips
    (``max_grad_norm``) or skips non-finite steps (``skip_nonfinite``, decided on the same
    gradient total) without :func:`fusedopt.distributed.enable_zero_global_clipping`, or is
    stepped by a DeepSpeed optimizer of flat partitions without
    :func:`fusedopt.distributed.enable_deepspeed_zero`."""
    name = type(optimizer).__name__
    parent = optimizer._zero_parent
    if parent is not None and optimizer._sharding.reducer is None and parent() is not None:
        what = ("clips (max_grad_norm)" if any(g.get("max_grad_norm") is not None
                                               for g in optimizer.param_groups)
                else "skips non-finite steps (skip_nonfinite)" if optimizer.skip_nonfinite
                else None)
        if what is not None:
            raise RuntimeError(
                f"{name} is the local optimizer of a ZeroRedundancyOptimizer and {what}: each "
                "rank would decide by the norm of its own params' gradients; call "
                "fusedopt.distributed.enable_zero_global_clipping(zero_optimizer) once, on every "
                "rank, before the first step (nothing was changed)")
    if not optimizer._sharding.partitions:
        kind = deepspeed_caller(optimizer)
        if kind is not None:
            raise RuntimeError(
                f"{name} is stepped by DeepSpeed's {kind}, which hands it flat partitions of "
                "many tensors: stepped as they are, each would get one trust ratio; call "
                "fusedopt.distributed.enable_deepspeed_zero(engine) once, on every rank, after "
                "deepspeed.initialize (nothing was changed)")


def check_params(optimizer, gi: int, ps: list) -> None:
    """Raises (RuntimeError naming the call to make) when params ``ps`` of param group ``gi``
    carry the mark of FSDP1 without :func:`fusedopt.distributed.enable_fsdp1`, or of a ZeRO-3
    partition without :func:`fusedopt.distributed.enable_deepspeed_zero`."""
    name = type(optimizer).__name__
    if not optimizer._sharding.wholes and any(map(getattr, ps, repeat(FSDP1_MARK), repeat(False))):
        raise RuntimeError(
            f"{name}: param group {gi} holds params that FullyShardedDataParallel (FSDP1) "
            "flattened: each rank's piece of a tensor would get its own trust ratio; call "
            "fusedopt.distributed.enable_fsdp1(model, optimizer) once, on every rank, after "
            "wrapping the model and building the optimizer (use_orig_params=True; nothing was "
            "changed)")
    if not optimizer._sharding.partitions and any(map(hasattr, ps, repeat(ZERO3_MARK))):
        raise RuntimeError(
            f"{name}: param group {gi} holds a flat partition of DeepSpeed ZeRO-3 (many tensors: "
            "stepped as it is, it would get one trust ratio); call "
            "fusedopt.distributed.enable_deepspeed_zero(engine) once, on every rank, after "
            "deepspeed.initialize (nothing was changed)")


def check_partition_options(group: dict[str, Any]) -> None:
    """Options that a group of flat partitions (Note [flat partitions] in fusedopt/_sharding.py)
    cannot take."""
    if group["max_grad_norm"] is not None:
        raise ValueError("max_grad_norm cannot clip flat partitions by the global norm "
                         "(DeepSpeed steps each param group on its own); set DeepSpeed's "
                         "\"gradient_clipping\" instead and max_grad_norm=None")
    if group["state_precision"] == "8bit":
        raise ValueError("state_precision='8bit' is not supported for flat partitions (its blocks "
                         "would cross the pieces); use 'bf16' or 'full'")
