"""Side-by-side CPU timings of the cpp backend, split into its parts, interleaved round by round.

    python bench/cpu_kernels.py                  # BERT-base shapes and 4000 x 2,500
    python bench/cpu_kernels.py --rounds 30 --sets small

``python -m fusedopt.tools.bench`` times whole ``step()`` calls of every optimizer; this script
times the cpp backend's ``step()`` beside its parts: the two kernel passes alone (the backend calls on a
prebuilt bucket) and the Python gathering of ``step()`` (each group's lists, gathered as at every
step, and their binding to the kept native layout), so that the per-tensor
overhead can be read off; with torch's fused AdamW, timm's ``Lamb`` (when timm is installed) and
the bandwidth yardstick in the same rounds (``fusedopt.tools.bench.interleave``).
"""
from __future__ import annotations

import argparse
import gc

import torch

import fusedopt
from fusedopt.backends import get_backend
from fusedopt._hyper import encode
from fusedopt.functional import StepCache, _buckets
from fusedopt.tools.bench import (BYTES_PER_ELEMENT, YARDSTICK, Result, bert_base_shapes,
                                  interleave, joint_rounds, make_params, print_table, ratios,
                                  timm_optimizers)

SETS = {"bert": ("bert-base", bert_base_shapes()), "small": ("4000 x 2,500", [(2500,)] * 4000)}


def _gathering(opt, kind):
    """step()'s gathering alone: each group's lists (Note [step cache]: gathered at every step)
    and their binding to the kept layout, which ends as the step does."""
    def run():
        for gi, group in enumerate(opt.param_groups):
            bound = []
            _buckets(kind, gi, opt._group(group), opt._cache, bound)
            for be, b in bound:
                be.end(b)
    return run


def _passes(opt, kind):
    """The backend's two passes on the optimizer's kept buckets, without step()'s gathering."""
    opt.step()  # creates the state
    plan, cache = [], StepCache()  # layouts of their own, bound once (steps bind the optimizer's)
    for gi, group in enumerate(opt.param_groups):
        g = opt._group(group)
        plan.append((g.hyper, encode(g.hyper), _buckets(kind, gi, g, cache, [])))

    def run():
        for h, hyper, entries in plan:
            for be, b in entries:
                be.pass2(kind, b, h, hyper, be.pass1(kind, b, h, hyper, None, None), None, None)
    return run


def bench_set(label, shapes, rounds, eager):
    numel = sum(torch.Size(s).numel() for s in shapes)
    params = make_params(shapes, torch.device("cpu"))
    a, c = torch.randn(numel), torch.randn(numel)
    lamb = fusedopt.FusedLAMB(params, backend="cpp")
    lars = fusedopt.FusedLARS(params, lr=0.1, weight_decay=1e-4, backend="cpp")
    rows = {  # label: (bytes per element or 0, fn)
        YARDSTICK: (12, lambda: a.add_(c, alpha=1e-3)),
        "fusedopt LAMB [cpp]": (BYTES_PER_ELEMENT["lamb"], lamb.step),
        "cpp LAMB passes only": (BYTES_PER_ELEMENT["lamb"], _passes(lamb, "lamb")),
        "LAMB step's gathering": (0, _gathering(lamb, "lamb")),
        "fusedopt LARS [cpp]": (BYTES_PER_ELEMENT["lars"], lars.step),
        "cpp LARS passes only": (BYTES_PER_ELEMENT["lars"], _passes(lars, "lars")),
        "torch AdamW(fused=True)": (BYTES_PER_ELEMENT["adamw"], torch.optim.AdamW(params, fused=True).step),
    }
    times = interleave({k: fn for k, (_, fn) in rows.items()}, torch.device("cpu"), rounds)
    slow = {}  # allocate parameter-sized temporaries: a second phase (see fusedopt.tools.bench)
    timm = timm_optimizers()
    if timm is not None:
        slow["timm Lamb (foreach)"] = (BYTES_PER_ELEMENT["lamb"],
                                       timm[0](params, always_adapt=True, max_grad_norm=None).step)
    if eager:
        slow["fusedopt LAMB [eager]"] = (BYTES_PER_ELEMENT["lamb"],
                                         fusedopt.FusedLAMB(params, backend="eager").step)
    times.update(interleave({k: fn for k, (_, fn) in slow.items()}, torch.device("cpu"), rounds))
    rows.update(slow)
    results = [Result(k, rows[k][0], t) for k, t in times.items()]
    print_table(label, len(shapes), numel, results)
    # for the joint rounds of both sets: the rows with a bytes model, but not the slow phase's
    joint = {k: fn for k, (nbytes, fn) in rows.items() if nbytes and k not in slow}
    return {r.name: r.median for r in results}, numel, joint


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-eager", action="store_true", help="leave out the eager backend (slow)")
    ap.add_argument("--sets", default="bert,small")
    args = ap.parse_args()
    assert get_backend("cpp") is not None, "fusedopt._C is not built"
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    medians, numels, joint = {}, {}, {}
    for name in args.sets.split(","):
        label, shapes = SETS[name]
        medians[label], numels[label], joint[label] = bench_set(label, shapes, args.rounds,
                                                                not args.no_eager)
        gc.collect()
    lines = ratios(medians)
    if len(joint) == 2:
        lines += joint_rounds(joint, numels, torch.device("cpu"), args.rounds)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
