"""What stepping a DeepSpeed ZeRO partition piece by piece costs (docs/distributed.md,
"DeepSpeed ZeRO"): one process, the first half of the BERT-base params as one flat buffer (rank 0
of 2; the tensor at the cut contributes its first piece), interleaved round by round:

* pieces: the flat buffer registered as ZeRO's partition (``enable_deepspeed_zero`` through a
  stand-in for DeepSpeed's wrapper, a gloo group of one process): one row per piece, per-tensor
  trust ratios, the all-reduce of the sums table;
* one tensor: the same buffer stepped as one tensor (what ZeRO gives without the call: one
  trust ratio for the whole partition);
* apart: the same pieces as separate tensors (what a model without ZeRO steps).

    python bench/flat_partition.py            # 15 rounds
    python bench/flat_partition.py --rounds 30 --backend eager
"""
from __future__ import annotations

import argparse
import tempfile
import types

import torch
import torch.distributed as dist

import fusedopt
from fusedopt.distributed import enable_deepspeed_zero
from fusedopt.tools.bench import bert_base_shapes, interleave


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--backend", default="cpp")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            run(args)
        finally:
            dist.destroy_process_group()


def run(args) -> None:
    numels = [torch.Size(s).numel() for s in bert_base_shapes()]
    half = sum(numels) // 2
    pieces, at = [], 0  # (start in the buffer, numel, tensor index)
    for t, n in enumerate(numels):
        if at >= half:
            break
        pieces.append((at, min(n, half - at), t))
        at += n
    gen = torch.Generator().manual_seed(0)
    flat = torch.nn.Parameter(torch.randn(half, generator=gen))
    flat.grad = torch.randn(half, generator=gen)
    one = torch.nn.Parameter(flat.detach().clone())
    one.grad = flat.grad.clone()
    apart = [torch.nn.Parameter(flat.detach()[s:s + n].clone()) for s, n, _ in pieces]
    for p, (s, n, _) in zip(apart, pieces):
        p.grad = flat.grad[s:s + n].clone()
    opts = dict(lr=1e-3, weight_decay=0.01, backend=args.backend)
    opt_pieces = fusedopt.FusedLAMB([flat], **opts)
    mappings = [types.SimpleNamespace(_hp_mapping=None) for _ in numels]
    for s, n, t in pieces:
        address = types.SimpleNamespace(start=s, numel=n)
        mappings[t]._hp_mapping = types.SimpleNamespace(get_hp_fragment_address=lambda a=address: a)
    enable_deepspeed_zero(types.SimpleNamespace(optimizer=types.SimpleNamespace(
        optimizer=opt_pieces, bit16_groups=[mappings], real_dp_process_group=[dist.group.WORLD])))
    fns = {"pieces (enable_deepspeed_zero)": opt_pieces.step,
           "one tensor (no call)": fusedopt.FusedLAMB([one], **opts).step,
           "apart (separate tensors)": fusedopt.FusedLAMB(apart, **opts).step}
    times = interleave(fns, torch.device("cpu"), args.rounds)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"{len(pieces)} pieces, {half / 1e6:.1f}M elements, backend {args.backend}, "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds")
    base = med["apart (separate tensors)"]
    for k, v in med.items():
        print(f"{k:34s} {v:8.2f} ms/step  {v / base:5.2f}x of apart")


if __name__ == "__main__":
    main()
