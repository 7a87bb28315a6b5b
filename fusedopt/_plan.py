"""What an optimizer keeps of each param group from one step to the next: its plan.

Note [group plans]: a group's plan holds the option values last checked, the tensor lr whose
value was last read, and the lists the last step gathered; a step takes from it what still fits
instead of doing the work again. ``add_param_group``, ``load_state_dict``, ``__setstate__`` and
the sharding adapters drop every plan (with the step cache of the backends, Note [step cache] in
fusedopt/_bucket.py).

* **Options** are checked when the group is added and again at the step after any of them was
  replaced (by a scheduler, by hand, by ``load_state_dict``) or, for a list, edited in place: the
  values last checked are compared by identity (a list's items by value, as betas read from a
  config file can be edited in place), one pass over a dozen keys. A tensor ``lr`` changed in
  place (as torch's schedulers do) is the same object and its value is not read again: a step
  reads no tensor value on the host (on an accelerator that would be a device sync per step).
  Under torch.compile (Note [traced options] in fusedopt/_hyper.py) every trace checks every
  option; the checks are comparisons, which become the graph's guards, so a compiled step that a
  new value fails is traced again and refuses it before anything runs. The value of a tensor lr
  is read by ``_init_group``, which dynamo runs eagerly at trace time, when the tensor is new to
  its group; the trace then compares the group's lr with the tensor read last (``is``: a guard
  on identity), so that a new tensor is traced, and read, again.
* **Lists**: the group's lists as the last step gathered them are handed out again, with this
  step's grads, when nothing they depend on changed: the state mapping saw no edit
  (``OptimizerState.edits``: a state dict or state tensor replaced or removed, state created,
  ``load_state_dict``), ``group["params"]`` holds the same params, of the same dtypes (which
  decide the master weights), the same ones have grads, and the group's ``backend`` and
  ``master_weights`` are the same. Gathering the lists costs each step a state lookup per param
  (a Python-level hash) and the reads of thousands of state dicts, which a measurement put at a
  fifth of a step of 4000 small tensors (docs/performance.md, "Gathering at every step"); a
  tensor whose data changed in place (``p.data = ...``) is caught by the backend's bind (Note
  [kept layout] in csrc/cpu/ops.h). Sharded groups are gathered at every step.
"""
from __future__ import annotations

import dataclasses
from itertools import repeat
from operator import attrgetter, is_
from typing import Any, Callable

import torch

from ._bucket import dtype_codes
from ._bucket import grads as grads_of

_DTYPE = attrgetter("dtype")


def _same_dtypes(ps: list, dtypes: set) -> bool:
    """Whether the tensors of ``ps`` have exactly the dtypes ``dtypes``: one C loop over the list
    (Note [native scans] in csrc/cpu/register.cpp)."""
    codes = dtype_codes(ps, tuple(dtypes))
    return 0 not in codes and len(set(codes)) == len(dtypes)


class GroupPlan:
    """One param group's plan (Note [group plans]); a new one fits nothing."""

    def __init__(self) -> None:
        self.options: tuple | None = None  # the option values last checked
        self.lists: list[tuple[int, tuple]] = []  # (place, items) of the list values among them
        self.lr: torch.Tensor | None = None  # the tensor lr whose value was last read
        self.kept: tuple | None = None  # (key, params list, its params, the lists, their dtypes)

    def options_fit(self, values: tuple) -> bool:
        return (self.options is not None and all(map(is_, values, self.options))
                and all(tuple(values[i]) == items for i, items in self.lists))

    def checked(self, values: tuple, lr: Any) -> None:
        """``values`` (with the group's ``lr``) were checked."""
        self.options = values
        self.lists = [(i, tuple(v)) for i, v in enumerate(values) if type(v) is list]
        if isinstance(lr, torch.Tensor):
            self.lr = lr

    def group(self, state, group: dict[str, Any], gather: Callable[[dict[str, Any]], Any],
              hyper: Callable[[dict[str, Any]], Any]):
        """The group's lists (a TensorGroup) with this step's grads and ``hyper(group)``: the kept
        ones where they fit (``state``: the optimizer's OptimizerState), else
        ``gather(group)``'s, kept unless sharded."""
        all_ps = group["params"]
        grads = grads_of(all_ps)
        # not `None in grads`: that calls Tensor.__eq__(None) on every grad, a torch dispatch each
        with_grad = (tuple(g is not None for g in grads)
                     if any(map(is_, grads, repeat(None))) else None)
        key = (state.edits, with_grad, group["backend"], group["master_weights"])
        hit = self.kept
        if (hit is not None and hit[0] == key and hit[1] is all_ps and len(hit[2]) == len(all_ps)
                and all(map(is_, all_ps, hit[2])) and _same_dtypes(all_ps, hit[4])):
            return dataclasses.replace(
                hit[3], hyper=hyper(group), maximize=group["maximize"],
                grads=grads if with_grad is None else [x for x in grads if x is not None])
        g = gather(group)
        if not g.sources:  # the edits counted after gathering, which may have created state
            self.kept = ((state.edits, *key[1:]), all_ps, tuple(all_ps), g,
                         set(map(_DTYPE, all_ps)))
        return g
