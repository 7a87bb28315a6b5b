"""What ``torch.compile`` of ``opt.step`` costs against the uncompiled step, on one process.

    python bench/compiled_step.py [--tensors 24] [--numel 65536] [--rounds 40] [--backend cpp]

Builds ``--tensors`` params of ``--numel`` elements (half of them one-dimensional, in a second
group with ``adapt=False``, as ``fusedopt.param_groups`` makes them), a tensor ``lr`` and
``max_grad_norm=1.0``; times the first compiled call (tracing and inductor), then alternates one
uncompiled and one compiled step per round on two identical optimizers, so that a machine whose
speed drifts slows both alike, and prints the medians and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import fusedopt


def build(n: int, numel: int, backend: str, kind: str):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen) * 0.02) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen) * 1e-3
    groups = [{"params": params[: n // 2]},
              {"params": params[n // 2:], "weight_decay": 0.0, "adapt": False}]
    lr = torch.tensor(1e-3 if kind == "lamb" else 0.1)
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    return cls(groups, lr=lr, max_grad_norm=1.0, backend=backend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=24)
    ap.add_argument("--numel", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--backend", default="cpp")
    ap.add_argument("--kind", default="lamb", choices=["lamb", "lars"])
    args = ap.parse_args()
    plain = build(args.tensors, args.numel, args.backend, args.kind)
    compiled_opt = build(args.tensors, args.numel, args.backend, args.kind)
    step = torch.compile(compiled_opt.step)
    t = time.perf_counter()
    step()
    first = time.perf_counter() - t
    plain.step()
    for _ in range(3):
        plain.step()
        step()
    times = {"uncompiled": [], "compiled": []}
    for _ in range(args.rounds):
        for name, fn in (("uncompiled", plain.step), ("compiled", step)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    u, c = (statistics.median(times[k]) * 1e3 for k in ("uncompiled", "compiled"))
    print(f"{args.kind} {args.backend}, {args.tensors} x {args.numel}: first compiled call "
          f"{first:.1f} s; uncompiled {u:.3f} ms/step, compiled {c:.3f} ms/step, "
          f"compiled / uncompiled {c / u:.2f}")


if __name__ == "__main__":
    main()
