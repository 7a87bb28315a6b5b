"""Low-precision optimizer state: fusedopt LAMB and LARS with fp32, bf16 and 8-bit state beside
torch's fused AdamW (fp32 state) and, where they are installed, bitsandbytes' and torchao's 8-bit
optimizers, interleaved round by round on one parameter set.

    python bench/low_precision.py                 # BERT-base shapes on the CPU, 15 rounds
    python bench/low_precision.py --rounds 30 --no-peers
    python bench/low_precision.py --device cuda   # the triton and cuda backends on a GPU
    python bench/low_precision.py --device cuda --no-peers --tiles 16384,1,2048,8 65536,1,4096,8
    python bench/low_precision.py --device cuda --no-peers --graph   # each step also graphed
    python bench/low_precision.py --resident --no-peers   # a cache-resident set: compute alone
    python bench/low_precision.py --accuracy      # 8-bit state against full state, and the peers

On the CPU the fusedopt rows run the cpp backend and each sample is one step; on a GPU they run
every GPU backend that loads (triton, cuda) and each sample is ``--steps`` steps launched back to
back, then one synchronization (the time per step of a training loop whose host runs ahead). A
GPU run then says where each row's time goes: the host's time to enqueue a step (the calls return
before the device finishes) and the device's kernel time per step (torch.profiler), so a row
bound by the host or by latency rather than by memory traffic shows as such.

GB/s use the bytes model of docs/math.md ("Minimum memory traffic"), extended to the formats;
"of bw" is that against an in-place ``a.add_(c, alpha=s)`` timed in the same rounds. State memory
is measured from the optimizers' state after a step (bytes of every state tensor, the step
counts included, per parameter element). ``--accuracy`` prints instead how far 8-bit state moves
a 50-step run from full state, for fusedopt and the installed peers
(fusedopt/tools/lowp_accuracy.py).
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, installed or not
import fusedopt  # noqa: E402
from fusedopt.backends import get_backend  # noqa: E402
from fusedopt.kernels import tables  # noqa: E402
from fusedopt.tools.bench import (  # noqa: E402
    YARDSTICK, Result, bert_base_shapes, interleave, make_params, print_table,
)

# bytes per element and step (docs/math.md): fp32 params and grads; 8-bit adds its block words
# (8 bytes per block and moment: LAMB reads and writes both in pass 1 and reads d's in pass 2,
# LARS reads and writes its buffer's); the peers' 8-bit AdamW reads and writes two codes and two
# float32 scales per block of 256
WORDS = 8 / 256
MODEL = {("lamb", "full"): 40, ("lamb", "bf16"): 28, ("lamb", "8bit"): 21 + 5 * WORDS,
         ("lars", "full"): 28, ("lars", "bf16"): 24, ("lars", "8bit"): 22 + 2 * WORDS,
         "adamw": 28, "adam8bit": 20 + 4 * 4 / 256}


def state_bytes_per_param(opt: torch.optim.Optimizer, numel: int) -> float:
    """Bytes of every tensor in the optimizer's state (tensor subclasses by their inner
    tensors) per parameter element."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if not isinstance(v, torch.Tensor):
                continue
            inner = getattr(v, "__tensor_flatten__", None)
            parts = [getattr(v, n) for n in inner()[0]] if inner else [v]
            total += sum(t.numel() * t.element_size() for t in parts)
    return total / numel


def peers(params):
    """(label, bytes model, optimizer) of the installed 8-bit peers."""
    out = []
    try:
        bnb = importlib.import_module("bitsandbytes")
        out += [("bitsandbytes AdamW8bit", MODEL["adam8bit"], bnb.optim.AdamW8bit(params)),
                ("bitsandbytes LAMB8bit", MODEL[("lamb", "8bit")], bnb.optim.LAMB8bit(params)),
                ("bitsandbytes LAMB 32-bit", MODEL[("lamb", "full")], bnb.optim.LAMB(params))]
    except Exception as e:  # noqa: BLE001 - a peer that cannot load is left out, with its reason
        print(f"bitsandbytes left out: {type(e).__name__}: {e}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ao = importlib.import_module("torchao.optim")
        out.append(("torchao AdamW8bit", MODEL["adam8bit"], ao.AdamW8bit(params)))
    except Exception as e:  # noqa: BLE001
        print(f"torchao left out: {type(e).__name__}: {e}")
    return out


def captured(fn):
    """``fn`` (one optimizer step) captured in a CUDA graph after warm-up steps on a side stream
    (tables, compilation, state); returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def where_the_time_goes(rows: dict, walls: dict, n: int, samples: int = 5) -> None:
    """Per row on a GPU: wall ms/step (the interleaved median), the host's ms to enqueue a step,
    the device's kernel ms and kernels per step (one profiled sample of ``n`` steps)."""
    from torch.profiler import ProfilerActivity, profile

    print(f"\n{'optimizer':40s} {'wall ms':>8s} {'host ms':>8s} {'kernel ms':>9s} "
          f"{'kernels':>7s}  bound by")
    for name, (_, opt, fn) in rows.items():
        if opt is None:
            continue
        host = []
        for _ in range(samples):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            host.append((time.perf_counter() - t0) * 1e3 / n)
        torch.cuda.synchronize()
        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    fn()
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernel_ms = sum(e.device_time_total for e in kernels) / 1e3 / n
            count = len(kernels) / n
        except Exception as e:  # noqa: BLE001 - the timings above stand without the profile
            print(f"{name}: no profile ({type(e).__name__}: {e})")
            kernel_ms, count = float("nan"), float("nan")
        wall, host_ms = walls[name], statistics.median(host)
        bound = ("host" if host_ms > 0.9 * wall else "kernels" if kernel_ms > 0.9 * wall
                 else "neither alone")
        print(f"{name:40s} {wall:8.3f} {host_ms:8.3f} {kernel_ms:9.3f} {count:7.1f}  {bound}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-peers", action="store_true", help="leave out bitsandbytes and torchao")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=10,
                    help="steps per timed sample on a GPU (default %(default)s)")
    ap.add_argument("--tiles", nargs="*", default=[], metavar="CHUNK,ROWS,BLOCK,WARPS",
                    help="on a GPU, also LAMB rows of the triton backend with these tile sizes "
                         "and warps per program (fusedopt/kernels/tables.py), timed in the same "
                         "rounds")
    ap.add_argument("--resident", action="store_true",
                    help="two tensors of 2^19 elements, which stay in the caches (on a GPU in "
                         "its L2), instead of BERT-base's shapes: a row's time is then its "
                         "compute and latency, not its memory traffic; --steps steps per sample")
    ap.add_argument("--graph", action="store_true",
                    help="on a GPU, also each optimizer's step captured in a CUDA graph and "
                         "replayed (the device's time without the host's), in the same rounds")
    ap.add_argument("--accuracy", action="store_true",
                    help="print the accuracy table of 8-bit state against full state instead "
                         "(fusedopt/tools/lowp_accuracy.py; CPU)")
    ap.add_argument("--size", type=int, default=1024,
                    help="with --accuracy: the weight is SIZE x SIZE (default %(default)s)")
    args = ap.parse_args()
    if args.accuracy:
        return accuracy(args.size)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    backends = ([b for b in ("triton", "cuda") if get_backend(b) is not None] if on_gpu
                else ["cpp"])
    assert backends, "no fused backend loads on " + args.device
    n = args.steps if on_gpu or args.resident else 1
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device "
          f"{torch.cuda.get_device_name() if on_gpu else 'cpu'}, {n} step(s) per sample")
    shapes = [(1 << 19,)] * 2 if args.resident else bert_base_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    params = make_params(shapes, device)
    a, c = torch.randn(numel, device=device), torch.randn(numel, device=device)
    rows = {YARDSTICK: (12, None, lambda: a.add_(c, alpha=1e-3))}
    adamw = torch.optim.AdamW(params, fused=True)
    rows["torch AdamW(fused=True), fp32 state"] = (MODEL["adamw"], adamw, adamw.step)
    for kind, cls, kw in (("lamb", fusedopt.FusedLAMB, {}),
                          ("lars", fusedopt.FusedLARS, dict(lr=0.1, weight_decay=1e-4))):
        for prec in ("full", "bf16", "8bit"):
            for be in backends:
                opt = cls(params, backend=be, state_precision=prec, **kw)
                name = {"full": "fp32"}.get(prec, prec)
                rows[f"fusedopt {kind.upper()} [{be}], {name} state"] = (
                    MODEL[(kind, prec)], opt, opt.step)

    default_tiles = (tables.CHUNK_SIZE, tables.ROWS, tables.BLOCK_SIZE, tables.NUM_WARPS)

    def tiled(cfg, fn):
        def run():  # the tables of each optimizer are its own, so alternating rebuilds none
            tables.CHUNK_SIZE, tables.ROWS, tables.BLOCK_SIZE, tables.NUM_WARPS = cfg
            fn()
        return run

    if args.tiles:
        assert on_gpu and "triton" in backends, "--tiles needs a GPU and the triton backend"
        for spec in args.tiles:
            cfg = tuple(int(x) for x in spec.split(","))
            for prec in ("full", "bf16", "8bit"):
                opt = fusedopt.FusedLAMB(params, backend="triton", state_precision=prec)
                name = {"full": "fp32"}.get(prec, prec)
                rows[f"LAMB [triton {spec}], {name} state"] = (MODEL[("lamb", prec)], opt,
                                                               tiled(cfg, opt.step))
        for k in [k for k in rows if "[triton]" in k]:
            nbytes, opt, fn = rows[k]
            rows[k] = (nbytes, opt, tiled(default_tiles, fn))

    if args.graph:
        assert on_gpu, "--graph needs a GPU"
        for name in [k for k, (_, opt, _) in rows.items() if opt is not None]:
            nbytes, opt, fn = rows[name]
            if isinstance(opt, torch.optim.AdamW):  # torch's fused AdamW captures when asked
                opt = torch.optim.AdamW(params, fused=True, capturable=True)
                fn = opt.step
            rows[f"{name} (CUDA graph)"] = (nbytes, opt, captured(fn))

    def steps(fn):
        return fn if n == 1 else lambda: [fn() for _ in range(n)]

    fast = {k: steps(fn) for k, (_, _, fn) in rows.items()}
    times = interleave(fast, device, args.rounds)
    if not args.no_peers:  # minutes per step on the CPU: a phase of their own, fewer rounds
        slow = {label: (nbytes, opt, opt.step) for label, nbytes, opt in peers(params)}
        times.update(interleave({k: steps(fn) for k, (_, _, fn) in slow.items()}, device,
                                max(3, args.rounds // 5), warmup=1))
        rows.update(slow)
    times = {k: [t / n for t in ts] for k, ts in times.items()}
    results = [Result(k, rows[k][0], t) for k, t in times.items()]
    print_table("resident" if args.resident else "bert-base", len(shapes), numel, results)
    adam_ms = Result("", 0, times["torch AdamW(fused=True), fp32 state"]).median
    print(f"\n{'optimizer':40s} {'state B/param':>13s} {'ms / AdamW':>11s}")
    for r in results:
        opt = rows[r.name][1]
        if opt is not None:
            print(f"{r.name:40s} {state_bytes_per_param(opt, numel):13.2f} "
                  f"{r.median / adam_ms:11.3f}")
    if on_gpu:
        where_the_time_goes(rows, {r.name: r.median for r in results}, n)


def accuracy(size: int) -> None:
    from fusedopt.tools import lowp_accuracy

    print(f"torch {torch.__version__}; a {size} x {size} weight, 50 steps, worst of 2 seeds: "
          "relative distance of the 8-bit run's movement from the full-state run's")
    table = lowp_accuracy.table(shape=(size, size))
    print(f"\n{'optimizer':42s} {'noise-only':>11s} {'signal+noise':>13s}")
    for name, errs in table.items():
        print(f"{name:42s} {errs['noise']:11.2e} {errs['signal']:13.2e}")


if __name__ == "__main__":
    main()
