"""The identity checks of the optimizer's plan cache (Note [plan cache] in fusedopt/optim.py).

Each runs in C++ when the extension ``fusedopt._C`` is built (Note [identity scans] in
csrc/cpu/python_helpers.h: one loop, borrowed references, prefetched dicts) and in Python
otherwise; both answer the same (tests/test_cpp.py checks them side by side). The extension is
imported on first use, not with fusedopt.
"""
from __future__ import annotations

from operator import is_, itemgetter


def _items_are(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(is_, a, b))


def _dict_items_are(d: dict, keys: list, values: list) -> bool:
    return (len(d) == len(keys) == len(values) and all(map(is_, d.keys(), keys))
            and all(map(is_, d.values(), values)))


def _entries_are(dicts: list, keys: tuple, lists: tuple) -> bool:
    if not (all(isinstance(ts, list) and len(ts) == len(dicts) for ts in lists)
            and all(isinstance(d, dict) for d in dicts)):
        return False
    try:
        return all(all(map(is_, map(itemgetter(k), dicts), ts)) for k, ts in zip(keys, lists))
    except KeyError:
        return False


PYTHON = {"items_are": _items_are, "dict_items_are": _dict_items_are,
          "entries_are": _entries_are}
_impl: dict | None = None


def _load() -> dict:
    global _impl
    try:
        from . import _C
        _impl = {name: getattr(_C, name) for name in PYTHON}
    except (ImportError, AttributeError):
        _impl = dict(PYTHON)
    return _impl


def items_are(a: list, b: list) -> bool:
    """Whether the lists a and b hold the same objects in the same order."""
    return (_impl or _load())["items_are"](a, b)


def dict_items_are(d: dict, keys: list, values: list) -> bool:
    """Whether the items of d, in its order, are exactly ``zip(keys, values)`` (by identity)."""
    return (_impl or _load())["dict_items_are"](d, keys, values)


def entries_are(dicts: list, keys: tuple, lists: tuple) -> bool:
    """Whether ``dicts[i][keys[j]] is lists[j][i]`` for every i and j (lists: one list per key,
    each as long as dicts); a missing key answers False."""
    return (_impl or _load())["entries_are"](dicts, keys, lists)
