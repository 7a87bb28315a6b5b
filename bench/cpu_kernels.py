"""Side-by-side CPU timings of the cpp backend, interleaved round by round (fair on a busy machine).

    python bench/cpu_kernels.py                  # BERT-base shapes and 4000 x 2,500
    python bench/cpu_kernels.py --rounds 30 --sets small

Per round every candidate runs once, in turn, so slow phases of a shared machine hit all of them;
the table gives the median (and the fastest) ms/step. Besides whole ``step()`` calls (and timm's
``Lamb`` when timm is installed) it times
``a.add_(c, alpha=s)`` over a buffer of the same size (12 B/element: the bandwidth yardstick), the
two kernel passes alone (the backend calls on a prebuilt bucket) and the Python gathering of
``step()`` (``_build_plan``), so the per-tensor Python overhead can be read off.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import fusedopt
from fusedopt.backends import get_backend
from fusedopt.bench import BYTES_PER_ELEMENT, bert_base_shapes, timm_optimizers

SETS = {"bert": ("bert-base", bert_base_shapes()), "small": ("4000 x 2,500", [(2500,)] * 4000)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _passes(opt, kind):
    """The backend's two passes on the optimizer's (prebuilt) buckets, without step()'s gathering."""
    plan = opt._build_plan()

    def run():
        for h, entries in plan:
            for be, b in entries:
                if kind == "lamb":
                    be.lamb_pass2(b, h, be.lamb_pass1(b, h, None, None), None)
                else:
                    be.lars_pass2(b, h, be.lars_pass1(b, h, None, None), None, None)
    return run


def bench_set(label, shapes, rounds, eager_rounds):
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    a, c = torch.randn(numel), torch.randn(numel)
    lamb = fusedopt.FusedLAMB(params, backend="cpp")
    lars = fusedopt.FusedLARS(params, lr=0.1, weight_decay=1e-4, backend="cpp")
    adamw = torch.optim.AdamW(params, fused=True)
    cands = {  # label: (bytes per element or None, fn)
        "a.add_(c, alpha=s)": (12, lambda: a.add_(c, alpha=1e-3)),
        "cpp LAMB step": (BYTES_PER_ELEMENT["lamb"], lamb.step),
        "cpp LAMB passes only": (BYTES_PER_ELEMENT["lamb"], _passes(lamb, "lamb")),
        "LAMB step's _build_plan": (None, lamb._build_plan),
        "cpp LARS step": (BYTES_PER_ELEMENT["lars"], lars.step),
        "cpp LARS passes only": (BYTES_PER_ELEMENT["lars"], _passes(lars, "lars")),
        "torch AdamW(fused=True)": (BYTES_PER_ELEMENT["adamw"], adamw.step),
    }
    timm = timm_optimizers()
    if timm is not None:
        timm_lamb = timm[0](params, always_adapt=True, max_grad_norm=None)
        cands["timm Lamb (foreach) step"] = (BYTES_PER_ELEMENT["lamb"], timm_lamb.step)
    times = {k: [] for k in cands}
    for fn in [v[1] for v in cands.values()]:
        fn()  # warm-up (creates the state)
    for _ in range(rounds):
        for k, (_, fn) in cands.items():
            times[k].append(_timed(fn))
    if eager_rounds:
        eager = fusedopt.FusedLAMB(params, backend="eager")
        eager.step()
        cands["eager LAMB step"] = (BYTES_PER_ELEMENT["lamb"], eager.step)
        times["eager LAMB step"] = [_timed(eager.step) for _ in range(eager_rounds)]
    bw = 12 * numel / (statistics.median(times["a.add_(c, alpha=s)"]) * 1e-3) / 1e9
    print(f"\n{label}: {len(shapes)} tensors, {numel / 1e6:.1f}M fp32 elements, threads "
          f"{torch.get_num_threads()}, {rounds} interleaved rounds; in-place bandwidth {bw:.1f} GB/s")
    print(f"{'':28s} {'median ms':>10s} {'min ms':>8s} {'ns/elem':>8s} {'GB/s':>6s} {'of bw':>6s}")
    for k, (bpe, _) in cands.items():
        med = statistics.median(times[k])
        gbs = f"{bpe * numel / (med * 1e-3) / 1e9:6.1f}" if bpe else ""
        frac = f"{bpe * numel / (med * 1e-3) / 1e9 / bw:6.0%}" if bpe else ""
        print(f"{k:28s} {med:10.2f} {min(times[k]):8.2f} {med * 1e6 / numel:8.2f} {gbs:>6s} {frac:>6s}")
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--eager-rounds", type=int, default=3, help="eager LAMB steps timed (0: skip)")
    ap.add_argument("--sets", default="bert,small")
    args = ap.parse_args()
    assert get_backend("cpp") is not None, "fusedopt._C is not built"
    print(f"torch {torch.__version__}")
    res = {}
    for name in args.sets.split(","):
        label, shapes = SETS[name]
        res[name] = bench_set(label, shapes, args.rounds, args.eager_rounds)
        gc.collect()
    if {"bert", "small"} <= res.keys():
        b, s = res["bert"], res["small"]
        nb = sum(torch.Size(x).numel() for x in SETS["bert"][1])
        ns = sum(torch.Size(x).numel() for x in SETS["small"][1])
        for k in ("cpp LAMB step", "cpp LARS step"):
            print(f"{k}: time per element, 4000 x 2,500 / bert-base = {(s[k] / ns) / (b[k] / nb):.2f}")
    for name, r in res.items():
        ratio = r["cpp LAMB step"] / r["torch AdamW(fused=True)"]
        print(f"{name}: cpp LAMB / AdamW(fused) = {ratio:.2f}"
              + (f"; eager LAMB / cpp LAMB = {r['eager LAMB step'] / r['cpp LAMB step']:.1f}"
                 if "eager LAMB step" in r else "")
              + (f"; timm Lamb / cpp LAMB = {r['timm Lamb (foreach) step'] / r['cpp LAMB step']:.1f}"
                 if "timm Lamb (foreach) step" in r else ""))


if __name__ == "__main__":
    main()
