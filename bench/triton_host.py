"""Host time of a Triton step with its kernel launches stubbed out (docs/performance.md).

    TRITON_INTERPRET=1 python bench/triton_host.py [--tensors 1000,10000] [--steps 20]

What a step costs the host besides the launches (gathering, checks, pointer tables, launch
arguments) decides whether a GPU step with thousands of tensors is bound by the host. The kernels
are replaced by a stand-in that records nothing and returns, so the interpreter never runs; the
tensors are CPU tensors (TRITON_INTERPRET=1 lets the backend take them). Prints the median host
time per step for each tensor count and the ratio of the largest count to the smallest, for LAMB
and LARS with global clipping (three launches per step) and a tensor lr.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt.kernels import tables  # noqa: E402


def host_time(kind: str, n: int, steps: int) -> float:
    """Median ms per step of ``n`` tensors of 64 elements, launches stubbed."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, generator=gen)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(64, generator=gen)
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls(params, lr=torch.tensor(0.01), max_grad_norm=1.0, backend="triton")
    opt.step()  # state, tables
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", default="1000,10000")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.tensors.split(",")]
    launches = []
    tables.launch = lambda kernel, table, **kw: launches.append(kernel)  # stubbed: host time only
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, launches stubbed")
    print("kind  " + "".join(f"{n:>10} tensors" for n in counts) + "   largest / smallest")
    for kind in ("lamb", "lars"):
        ms = [host_time(kind, n, args.steps) for n in counts]
        row = "".join(f"{m:>15.2f} ms" for m in ms)
        print(f"{kind:5} {row}   {ms[-1] / ms[0]:.1f}x")


if __name__ == "__main__":
    main()
