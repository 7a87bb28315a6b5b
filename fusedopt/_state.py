"""The optimizer's ``state`` mapping, which counts its own edits.

Note [list cache] (fusedopt/optim.py) keeps each param group's tensor lists between steps and
must drop them when a state dict or a state tensor is replaced or removed. :class:`OptimizerState`
and the per-param :class:`ParamState` dicts it creates are plain dicts that bump one shared
counter on every edit (``opt.state[p] = {...}``, ``opt.state[p]["exp_avg"] = t``, ``del``,
``pop``, ``update`` ...), so the optimizer compares one integer per step instead of looking at
every tensor. In-place changes of a state tensor's values are not edits of the mapping and need
no invalidation. The optimizer's ``state_dict()`` and pickling hand out plain dicts, so
checkpoints carry no fusedopt class.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any


class _Counter:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


def _bumping(name: str):
    base = getattr(dict, name)

    def method(self, *args, **kwargs):
        self._edits.value += 1
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


_EDITS = ("__setitem__", "__delitem__", "pop", "popitem", "clear", "update", "setdefault",
          "__ior__")


class ParamState(dict):
    """One param's state dict (see the module docstring)."""

    __slots__ = ("_edits",)

    def __init__(self, edits: _Counter, *args: Any, **kwargs: Any) -> None:
        self._edits = edits
        dict.__init__(self, *args, **kwargs)


class OptimizerState(defaultdict):
    """``optimizer.state``: a ``defaultdict`` of :class:`ParamState` (see the module docstring)."""

    def __init__(self, items: Any = ()) -> None:
        super().__init__(None)
        self._edits = _Counter()
        for k, v in dict(items).items():
            defaultdict.__setitem__(self, k, self._wrap(v))

    @property
    def edits(self) -> int:
        """How many edits the mapping and its state dicts have seen."""
        return self._edits.value

    def _wrap(self, v: Any) -> Any:
        if isinstance(v, dict) and not (isinstance(v, ParamState) and v._edits is self._edits):
            return ParamState(self._edits, v)
        return v

    def __missing__(self, key):
        v = ParamState(self._edits)
        defaultdict.__setitem__(self, key, v)
        self._edits.value += 1
        return v

    def __setitem__(self, key, value) -> None:
        self._edits.value += 1
        defaultdict.__setitem__(self, key, self._wrap(value))

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = {} if default is None else default
        return defaultdict.__getitem__(self, key)

    def update(self, *args, **kwargs) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def plain(self) -> defaultdict:
        """The same items as torch's ``defaultdict(dict)`` of plain dicts (same tensors)."""
        out: defaultdict = defaultdict(dict)
        out.update({k: dict(v) if isinstance(v, dict) else v for k, v in self.items()})
        return out


for _name in _EDITS:
    setattr(ParamState, _name, _bumping(_name))
for _name in ("__delitem__", "pop", "popitem", "clear", "__ior__"):
    setattr(OptimizerState, _name, _bumping(_name))
