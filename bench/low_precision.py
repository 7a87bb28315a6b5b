"""Low-precision optimizer state on the CPU: fusedopt LAMB and LARS with fp32, bf16 and 8-bit
state beside torch's fused AdamW (fp32 state) and, where they are installed, bitsandbytes' and
torchao's 8-bit optimizers, interleaved round by round on one parameter set.

    python bench/low_precision.py                 # BERT-base shapes, 15 rounds
    python bench/low_precision.py --rounds 30 --no-peers

GB/s use the bytes model of docs/math.md ("Minimum memory traffic"), extended to the formats;
"of bw" is that against an in-place ``a.add_(c, alpha=s)`` timed in the same rounds. State memory
is measured from the optimizers' state after a step (bytes of every state tensor, the step
counts included, per parameter element).
"""
from __future__ import annotations

import argparse
import importlib
import warnings

import torch

import fusedopt
from fusedopt.backends import get_backend
from fusedopt.tools.bench import (YARDSTICK, Result, bert_base_shapes, interleave, make_params,
                                  print_table)

# bytes per element and step (docs/math.md): fp32 params and grads; 8-bit adds its block scales
SCALES = 8 / 256
MODEL = {("lamb", "full"): 40, ("lamb", "bf16"): 28, ("lamb", "8bit"): 22 + 3 * SCALES,
         ("lars", "full"): 28, ("lars", "bf16"): 24, ("lars", "8bit"): 22 + 1.5 * SCALES,
         "adamw": 28, "adam8bit": 22 + 3 * SCALES}


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


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-peers", action="store_true", help="leave out bitsandbytes and torchao")
    args = ap.parse_args()
    assert get_backend("cpp") is not None, "fusedopt._C is not built"
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    shapes = bert_base_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    params = make_params(shapes, torch.device("cpu"))
    a, c = torch.randn(numel), torch.randn(numel)
    rows = {YARDSTICK: (12, None, lambda: a.add_(c, alpha=1e-3))}
    adamw = torch.optim.AdamW(params, fused=True)
    rows["torch AdamW(fused=True), fp32 state"] = (MODEL["adamw"], adamw, adamw.step)
    for kind, cls, kw in (("lamb", fusedopt.FusedLAMB, {}),
                          ("lars", fusedopt.FusedLARS, dict(lr=0.1, weight_decay=1e-4))):
        for prec in ("full", "bf16", "8bit"):
            opt = cls(params, backend="cpp", state_precision=prec, **kw)
            name = {"full": "fp32"}.get(prec, prec)
            rows[f"fusedopt {kind.upper()} [cpp], {name} state"] = (MODEL[(kind, prec)], opt,
                                                                    opt.step)
    fast = {k: fn for k, (_, _, fn) in rows.items()}
    times = interleave(fast, torch.device("cpu"), args.rounds)
    if not args.no_peers:  # minutes per step: a phase of their own, fewer rounds
        slow = {label: (nbytes, opt, opt.step) for label, nbytes, opt in peers(params)}
        times.update(interleave({k: fn for k, (_, _, fn) in slow.items()}, torch.device("cpu"),
                                max(3, args.rounds // 5), warmup=1))
        rows.update(slow)
    results = [Result(k, rows[k][0], t) for k, t in times.items()]
    print_table("bert-base", len(shapes), numel, results)
    adam_ms = Result("", 0, times["torch AdamW(fused=True), fp32 state"]).median
    print(f"\n{'optimizer':40s} {'state B/param':>13s} {'ms / AdamW':>11s}")
    for r in results:
        opt = rows[r.name][1]
        if opt is not None:
            print(f"{r.name:40s} {state_bytes_per_param(opt, numel):13.2f} "
                  f"{r.median / adam_ms:11.3f}")


if __name__ == "__main__":
    main()
