"""Step time of two source trees of fusedopt, in alternating processes (docs/performance.md).

    python bench/compare_builds.py OLD_TREE NEW_TREE [--rounds 5] [--steps 30] [--cases 4000]

A tree from before ``state_precision`` can run only the cases with full state.

Each tree must hold a built extension (``python setup.py build_ext --inplace`` in it). Every round
runs one process per tree, in turn, so that a machine whose speed drifts slows both alike; each
process times ``--steps`` steps of each case after warm-up and prints its median. The table gives
each case's median over the rounds and the ratio NEW / OLD with the range of the per-round ratios.
A compiled step's cost is measured by ``bench/compiled_step.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# name -> (optimizer, shapes, flattened, state_precision, backend)
CASES = {
    "bert-base LAMB": ("lamb", "bert", False, "full", "cpp"),
    "bert-base LARS": ("lars", "bert", False, "full", "cpp"),
    "4000 x 2,500 LAMB": ("lamb", "small", False, "full", "cpp"),
    "4000 x 2,500 LAMB, flattened": ("lamb", "small", True, "full", "cpp"),
    "4000 x 64 LAMB": ("lamb", "tiny", False, "full", "cpp"),
    # the host's cost per tensor: 1k and 10k one-element tensors
    "1000 x 1 LAMB": ("lamb", "1k", False, "full", "cpp"),
    "10000 x 1 LAMB": ("lamb", "10k", False, "full", "cpp"),
    "bert-base LAMB, 8-bit state": ("lamb", "bert", False, "8bit", "cpp"),
    "bert-base LARS, 8-bit state": ("lars", "bert", False, "8bit", "cpp"),
    "200 x 5,000 LAMB, eager, bf16 state": ("lamb", "mid", False, "bf16", "eager"),
    "200 x 5,000 LAMB, eager, 8-bit state": ("lamb", "mid", False, "8bit", "eager"),
    "16 x 256x256x3x3 channels_last LAMB, bf16 state": ("lamb", "conv", False, "bf16", "cpp"),
    "2000 x 16x16x3x3 channels_last LAMB": ("lamb", "small conv", False, "full", "cpp"),
    # two tensors of 2^19 elements, which stay in the caches: the step's arithmetic alone
    "resident LAMB": ("lamb", "resident", False, "full", "cpp"),
    "resident LAMB, bf16 state": ("lamb", "resident", False, "bf16", "cpp"),
    "resident LAMB, 8-bit state": ("lamb", "resident", False, "8bit", "cpp"),
    "resident LARS": ("lars", "resident", False, "full", "cpp"),
    "resident LARS, 8-bit state": ("lars", "resident", False, "8bit", "cpp"),
}

CHILD = r'''
import json, statistics, sys, time
import torch
import fusedopt
try:
    from fusedopt.tools.bench import bert_base_shapes
except ImportError:  # a tree from before the tools moved to fusedopt/tools
    from fusedopt.bench import bert_base_shapes
torch.manual_seed(0)
cases, steps = json.loads(sys.argv[1]), int(sys.argv[2])
out = {"file": fusedopt.__file__}


def timed(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


for name, (kind, shapes_name, flat, precision, backend) in cases.items():
    shapes = {"bert": bert_base_shapes, "small": lambda: [(2500,)] * 4000,
              "tiny": lambda: [(64,)] * 4000, "mid": lambda: [(5000,)] * 200,
              "1k": lambda: [(1,)] * 1000, "10k": lambda: [(1,)] * 10000,
              "conv": lambda: [(256, 256, 3, 3)] * 16,
              "small conv": lambda: [(16, 16, 3, 3)] * 2000,
              "resident": lambda: [(1 << 19,)] * 2}[shapes_name]()
    layout = torch.channels_last if "conv" in shapes_name else torch.contiguous_format
    params = [torch.nn.Parameter((torch.randn(s) * 0.02).to(memory_format=layout))
              for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    if flat:
        fusedopt.flatten_parameters(params)  # grads copied into slices of a grad buffer
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    extra = {} if precision == "full" else {"state_precision": precision}
    opt = cls(params, lr=1e-3 if kind == "lamb" else 0.1, weight_decay=0.01, max_grad_norm=1.0,
              backend=backend, **extra)
    for _ in range(3):
        opt.step()
    out[name] = timed(opt.step, steps)
print("RESULT " + json.dumps(out))
'''


def run(tree: str, cases: dict, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases), str(steps)], env=env,
                         capture_output=True, text=True, check=True, cwd=tree)
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    if not out.pop("file").startswith(os.path.abspath(tree)):
        raise SystemExit(f"{tree}: the child imported fusedopt from elsewhere")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cases", default="", help="only the cases whose name contains this text")
    args = ap.parse_args()
    cases = {name: case for name, case in CASES.items() if args.cases in name}
    if not cases:
        raise SystemExit(f"no case contains {args.cases!r}; the cases: {', '.join(CASES)}")
    old, new = [], []
    for r in range(args.rounds):
        old.append(run(args.old, cases, args.steps))
        new.append(run(args.new, cases, args.steps))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print("| case | old ms/step | new ms/step | new / old (range over rounds) |")
    print("|---|---|---|---|")
    for name in cases:
        o = statistics.median(x[name] for x in old)
        n = statistics.median(x[name] for x in new)
        ratios = [b[name] / a[name] for a, b in zip(old, new)]
        print(f"| {name} | {o:.2f} | {n:.2f} | {n / o:.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")

if __name__ == "__main__":
    main()
