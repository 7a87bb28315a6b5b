"""What the optimizer does around torch.compile's tracing of its step: the guards a traced step
needs, a tensor lr per group (Note [shared tensor lr]), and what runs eagerly outside the graph.
"""
from __future__ import annotations

from typing import Any

import torch

# Note [shared tensor lr]: several param groups given one tensor lr object (the default lr of
# the constructor, or one tensor put in several groups) each get a view of it instead: the
# same storage, so a change made in place (as torch's schedulers make it) reaches every
# group, but an object per group. torch.compile keeps one graph input per tensor object and
# guards only the first place it found it: with a shared object, a tensor later assigned to
# one group alone would not be seen by the compiled step (torch's compiled Adam has this
# fault), nor would the guard that makes a new tensor lr be checked.


def guard_on(tensors) -> None:
    """Note [traced flat state]: under dynamo, make the traced step's guards cover ``tensors``
    (reading an attribute realizes each one's lazy variable, and with it the guard on its
    identity) although the graph does not use them (dynamo then drops them as inputs)."""
    for x in tensors:
        if x is not None:
            _ = x.dtype


def unshare_lrs(groups) -> None:
    """Note [shared tensor lr]: a tensor lr object found in several groups is replaced, in each
    group after the first, by a view of it."""
    seen = set()
    for g in groups:
        lr = g.get("lr")
        if isinstance(lr, torch.Tensor):
            if id(lr) in seen:
                g["lr"] = lr.view(lr.shape)
            seen.add(id(g["lr"]))


# Run eagerly when a traced step calls them (a graph break there). torch's lazy form of
# torch._dynamo.disable: importing dynamo at import time would import triton (Note [lazy import]
# in fusedopt/backends/triton_backend.py).
@torch._disable_dynamo
def step_outside_dynamo(step: Any, opt: Any, closure):
    """``step``: the optimizer class's own step(), not torch's wrapper of it (whose step hooks
    have run once already)."""
    return step(opt, closure)


@torch._disable_dynamo
def unshare_lrs_outside_graph(opt: Any) -> None:
    unshare_lrs(opt.param_groups)


@torch._disable_dynamo
def drop_stale(opt: Any) -> None:
    """Note [refused steps] (fusedopt/optim.py) under torch.compile: the stale masters that a
    traced step found, dropped after its graph ran."""
    for p in opt._stale:
        opt.state[p].pop("master_param", None)
    opt._stale.clear()
