"""The LR search of the tuning phase, apart from any training (:func:`search_lr`).

It takes a callable that scores one multiplier of the scaling rule's LR (steps to the target, or
why not), so it can be checked on a synthetic objective whose best LR is known
(tests/test_sweep.py) as well as driven by the MLP's runs (:func:`.training.tune`).
"""
from __future__ import annotations

import math
from typing import Any, Callable

# what a multiplier's evaluation may say: reached (a finite "steps"), or why not
REACHED, DIVERGED, NOT_REACHED, SLOWER = "reached", "diverged", "not reached", "slower"


def _key(cell: dict[str, Any]) -> tuple[float, float, float]:
    # fewest steps; ties to the multiplier closest to 1, then the smaller one
    return (cell["steps"], abs(math.log(cell["multiplier"])), cell["multiplier"])


def search_lr(evaluate: Callable[[float, float], dict[str, Any]], grid, *, widen: bool = True,
              max_doublings: int = 6) -> dict[str, Any]:
    """The multiplier of the rule's LR with the fewest steps to the target.

    ``evaluate(m, best)`` scores multiplier ``m``: a dict with ``steps`` (finite when it reached
    the target, ``math.inf`` otherwise) and ``status`` (``"reached"``, ``"diverged"``,
    ``"not reached"``, or ``"slower"``: stopped because it could no longer beat ``best``, the
    fewest steps so far, ``math.inf`` before any multiplier reached); any other keys are kept.

    ``grid`` is tried first, closest to 1 first. With ``widen``, the search then goes on in
    factor-2 steps beyond the grid's ends while the best multiplier is at an end of what was
    tried (one more step past it: the choice is interior once a neighbour on each side is
    worse), or, while none has reached the target, towards smaller LRs if any tried diverged,
    else (all too slow) towards larger ones. It never tries
    a multiplier beyond ``2**±max_doublings`` (the cap).

    Returns ``cells`` (every evaluation, by multiplier), ``multiplier`` (the choice; 1.0 when
    none reached), ``found``, ``edge`` (the choice is the smallest or largest multiplier tried:
    its best LR may lie beyond), ``capped`` (the search stopped at the cap, with the choice, or
    the direction it was going, at the edge) and ``side`` (``"low"``/``"high"``: the edge the
    choice is at, else ``None``).
    """
    lo_cap, hi_cap = 2.0 ** -max_doublings, 2.0 ** max_doublings
    cells: dict[float, dict[str, Any]] = {}
    best = math.inf

    def run(m: float) -> None:
        nonlocal best
        c = dict(evaluate(m, best))
        c["multiplier"] = m
        if not (c.get("status") == REACHED and math.isfinite(c.get("steps", math.inf))):
            c["steps"] = math.inf
        cells[m] = c
        best = min(best, c["steps"])

    for m in sorted(set(grid), key=lambda m: (abs(math.log(m)), m)):
        run(float(m))
    capped = False
    while widen:
        tried = sorted(cells)
        winner = min(cells.values(), key=_key)
        if math.isfinite(winner["steps"]):
            m = winner["multiplier"]
            if len(tried) > 1 and tried[0] < m < tried[-1]:
                break  # interior
            nxt = m / 2 if m == tried[0] else m * 2
        elif any(c["status"] == DIVERGED for c in cells.values()):
            # an LR that diverged is too high: look below (at large batch the smallest tried
            # may also miss the target, stuck rather than diverged, and a smaller one still work)
            nxt = tried[0] / 2
        else:  # every one too slow: look above
            nxt = tried[-1] * 2
        if not (lo_cap * (1 - 1e-9) <= nxt <= hi_cap * (1 + 1e-9)):
            capped = True
            break
        run(nxt)
    tried = sorted(cells)
    winner = min(cells.values(), key=_key)
    found = math.isfinite(winner["steps"])
    side = None
    if found and len(tried) > 1:
        if winner["multiplier"] == tried[0]:
            side = "low"
        elif winner["multiplier"] == tried[-1]:
            side = "high"
    return dict(cells=[cells[m] for m in tried], multiplier=winner["multiplier"] if found else 1.0,
                found=found, edge=side is not None, side=side, capped=capped)
