"""Triton backend benchmark: step time, GB/s against docs/math.md's bytes model, launches per step.

On a CUDA machine (TRITON_INTERPRET unset)::

    python bench/bench_triton_gpu.py                 # every workload, LAMB and LARS
    python bench/bench_triton_gpu.py --json out.json

times ``optimizer.step()`` of the triton backend and, for comparison, eager, the compiled CUDA
extension when built, and torch's fused AdamW (``torch.optim.AdamW(fused=True)``), all on the
same workload in the same interleaved rounds: each round times every candidate in turn with
``triton.testing.do_bench`` (L2 flushed between runs, so host overhead counts), and a row's
median and 20th/80th percentiles are over the steps of all its rounds (a clock or thermal drift
then moves every row alike). The achieved bandwidth is ``bytes_per_element × elements /
median`` with docs/math.md's model (float32, no clipping: LAMB 40 B, LARS 28 B) and AdamW's
(28 B: reads p, g, m, v and writes p, m, v), next to the bandwidth this GPU reaches on a plain
device-to-device copy.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 is set before triton is
imported), which says nothing about speed: the script then reports launches per step and the
parity of the interpreted kernels with eager only.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fusedopt  # noqa: E402
from fusedopt.backends import get_backend  # noqa: E402

# docs/math.md, float32, no clipping; AdamW reads p, g, m, v and writes p, m, v
BYTES_PER_ELEMENT = {"lamb": 40, "lars": 28, "adamw": 28}
LR = {"lamb": 1e-3, "lars": 0.1, "adamw": 1e-3}
ADAMW = "torch fused"  # the backend column of torch.optim.AdamW(fused=True)
ROUNDS = 5  # interleaved rounds per workload
ROUND_MS = dict(warmup=10, rep=40)  # do_bench's warm-up and timed milliseconds per round
# name -> shapes: few large tensors, many small ones, and a ResNet-50-like mix
WORKLOADS = {
    "8 x 4096x4096": [(4096, 4096)] * 8,
    "10000 x 1024": [(1024,)] * 10000,
    "resnet50-like": ([(64, 64, 3, 3)] * 6 + [(128, 128, 3, 3)] * 8 + [(256, 256, 3, 3)] * 12
                      + [(512, 512, 3, 3)] * 6 + [(256,)] * 60 + [(2048, 1000)]),
}


def make_optimizer(kind: str, shapes, backend: str, device: str, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device, dtype) * 1e-2
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    return cls(params, lr=LR[kind], backend=backend), params


def make_adamw(shapes, device: str, dtype=torch.float32):
    """torch's fused AdamW over params and grads drawn as :func:`make_optimizer` draws them."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device, dtype) * 1e-2
    return torch.optim.AdamW(params, lr=LR["adamw"], fused=True), params


def interleaved(fns: dict, rounds: int, bench: Callable[[Callable[[], None]], Iterable[float]]
                ) -> dict:
    """The step times (ms) of each fn over ``rounds`` rounds, each of which times every fn in
    turn with ``bench(fn)`` (ms per step)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k] += [float(t) for t in bench(fn)]
    return times


def quantile(xs, q: float) -> float:
    """The ``q`` quantile of ``xs``, linear between order statistics (numpy's default)."""
    xs = sorted(xs)
    if not xs or not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} of {len(xs)} values")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def launches_per_step(kind: str, shapes, device: str, **hyper) -> int:
    from fusedopt.kernels import tables
    opt, _ = make_optimizer(kind, shapes, "triton", device)
    for g in opt.param_groups:
        g.update(hyper)
    opt.step()
    before = tables.launch_count()
    opt.step()
    return tables.launch_count() - before


def environment() -> dict:
    import triton
    env = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
               machine=platform.machine(), interpreted=not ON_GPU)
    if ON_GPU:
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return env


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy of 1 GiB (read + write), the practical ceiling."""
    from triton.testing import do_bench
    x = torch.empty(2**28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), quantiles=[0.5])
    return 2 * x.numel() * 4 / ms / 1e6


def usable_backends(device: str) -> list[str]:
    return [b for b in ("triton", "cuda", "eager")
            if get_backend(b) is not None
            and get_backend(b).unavailable_reason(torch.device(device), torch.float32,
                                                  torch.float32) is None]


def do_bench_ms(fn) -> list[float]:
    """ms of each step that ``triton.testing.do_bench`` timed (L2 flushed before each)."""
    from triton.testing import do_bench
    return do_bench(fn, return_mode="all", **ROUND_MS)


def bench_gpu(kinds, workloads, *, device: str = "cuda", backends=None, rounds: int = ROUNDS,
              bench=do_bench_ms, table=None) -> list[dict]:
    """Per workload (names of ``table``, default WORKLOADS), every (kind, backend) and torch's
    fused AdamW timed in the same interleaved rounds (:func:`interleaved` with ``bench``)."""
    table = WORKLOADS if table is None else table
    backends = usable_backends(device) if backends is None else list(backends)
    rows = []
    for name in workloads:
        shapes = table[name]
        numel = sum(torch.Size(s).numel() for s in shapes)
        launches = ({kind: launches_per_step(kind, shapes, device) for kind in kinds}
                    if "triton" in backends else {})
        steps, keep = {}, []  # keep: the optimizers and params, alive until the rows are made
        for kind in kinds:
            for backend in backends:
                opt, params = make_optimizer(kind, shapes, backend, device)
                opt.step()  # state, tables, compilation: untimed
                steps[(kind, backend)] = opt.step
                keep.append((opt, params))
        try:
            opt, params = make_adamw(shapes, device)
            opt.step()
        except (RuntimeError, ValueError) as e:  # a torch without fused AdamW on this device
            print(f"{name}: torch AdamW(fused=True) not timed: {e}", flush=True)
        else:
            steps[("adamw", ADAMW)] = opt.step
            keep.append((opt, params))
        times = interleaved(steps, rounds, bench)
        for (kind, backend), ts in times.items():
            lo, med, hi = (quantile(ts, q) for q in (0.2, 0.5, 0.8))
            rows.append(dict(kind=kind, workload=name, tensors=len(shapes), elements=numel,
                             backend=backend, ms_median=med, ms_p20=lo, ms_p80=hi,
                             gbps=BYTES_PER_ELEMENT[kind] * numel / med / 1e6,
                             launches_per_step=launches.get(kind) if backend == "triton"
                             else None, rounds=rounds, samples=len(ts)))
        del steps, keep
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def interpreter_report(kinds) -> list[dict]:
    """Launches per step and parity with eager, on small CPU tensors under the interpreter."""
    from fusedopt.kernels import tables
    # the interpreter pays per program and per operation: many rows of wide tiles (as the tests)
    tables.CHUNK_SIZE, tables.ROWS, tables.BLOCK_SIZE = 2048, 64, 512
    rows = []
    for kind in kinds:
        for n in (3, 300):
            shapes = [(7,)] * n
            rows.append(dict(kind=kind, tensors=n,
                             launches_per_step=launches_per_step(kind, shapes, "cpu"),
                             with_clipping=launches_per_step(kind, shapes, "cpu", max_grad_norm=1.0)))
        out = {}
        for backend in ("triton", "eager"):
            opt, params = make_optimizer(kind, [(3, 5), (4097,), (0,), (1,)], backend, "cpu")
            opt.step()
            out[backend] = params
        err = max(((a - b).abs().max() / b.abs().max()).item()
                  for a, b in zip(out["triton"], out["eager"]) if a.numel())
        rows.append(dict(kind=kind, parity_max_rel_diff_vs_eager=err))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["lamb", "lars"], choices=["lamb", "lars"])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--json", help="also write the results and the environment to this file")
    args = ap.parse_args()

    env = environment()
    print("environment:", json.dumps(env))
    if ON_GPU:
        env["copy_gbps"] = copy_bandwidth()
        print(f"device-to-device copy: {env['copy_gbps']:.0f} GB/s")
        rows = bench_gpu(args.kinds, args.workloads)
        print(f"{'kind':5} {'workload':16} {'backend':11} {'median ms':>10} {'p20-p80 ms':>16} "
              f"{'GB/s':>7} {'% copy':>7} {'launches':>8}")
        for r in rows:
            print(f"{r['kind']:5} {r['workload']:16} {r['backend']:11} {r['ms_median']:10.3f} "
                  f"{r['ms_p20']:7.3f}-{r['ms_p80']:<8.3f} {r['gbps']:7.0f} "
                  f"{100 * r['gbps'] / env['copy_gbps']:6.0f}% {r['launches_per_step'] or '':>8}")
        print(f"each workload's rows timed in the same {ROUNDS} interleaved rounds; GB/s by bytes "
              f"per element: LAMB {BYTES_PER_ELEMENT['lamb']}, LARS {BYTES_PER_ELEMENT['lars']}, "
              f"AdamW {BYTES_PER_ELEMENT['adamw']} ({ADAMW}: torch.optim.AdamW(fused=True), reads "
              "p, g, m, v and writes p, m, v)")
    else:
        print("no GPU: Triton interpreter, launches per step and parity only (no timings)")
        rows = interpreter_report(args.kinds)
        for r in rows:
            print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(environment=env, results=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
