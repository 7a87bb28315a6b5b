"""Step-time benchmark: fusedopt backends side by side with torch's fused optimizers.

    python -m fusedopt.bench            # BERT-base shaped params and 4000 small tensors
    python -m fusedopt.bench --quick    # a small, fast run

For every optimizer it reports the median and the spread (interquartile range) of ms/step, the
achieved GB/s by SPEC.md's bytes model (LAMB 40 B/element, LARS 28, AdamW 28, momentum SGD 20,
+4 with global clipping), and that as a fraction of the in-place memory bandwidth measured in the
same run (``a.add_(c, alpha=s)``: 12 B/element over a buffer the size of the parameter set).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import os
import platform
import statistics
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable

import torch

import fusedopt

BYTES_PER_ELEMENT = {"lamb": 40, "lars": 28, "adamw": 28, "sgd": 20}


def bert_base_shapes(layers: int = 12, vocab: int = 30522, hidden: int = 768, ffn: int = 3072):
    """The parameter shapes of BERT-base (~110M elements in ~200 tensors)."""
    shapes = [(vocab, hidden), (512, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (hidden,)] * 4
        shapes += [(hidden,), (hidden,)]
        shapes += [(ffn, hidden), (ffn,), (hidden, ffn), (hidden,)]
        shapes += [(hidden,), (hidden,)]
    shapes += [(hidden, hidden), (hidden,)]
    return shapes


def param_sets(quick: bool):
    if quick:
        return {
            "bert-like (2 layers)": bert_base_shapes(layers=2, vocab=4000),
            "500 x 2,500": [(2500,)] * 500,
        }
    return {"bert-base": bert_base_shapes(), "4000 x 2,500": [(2500,)] * 4000}


@dataclass
class Result:
    name: str
    bytes_per_element: int
    times_ms: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def iqr(self) -> float:
        q = statistics.quantiles(self.times_ms, n=4)
        return q[2] - q[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], None], device: torch.device, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def inplace_bandwidth(numel: int, device: torch.device, repeats: int) -> float:
    """GB/s of ``a.add_(c, alpha=s)`` (reads a and c, writes a: 12 B/element)."""
    a = torch.randn(numel, device=device)
    c = torch.randn(numel, device=device)
    times = time_fn(lambda: a.add_(c, alpha=1e-3), device, repeats, warmup=2)
    return 12 * numel / (statistics.median(times) * 1e-3) / 1e9


def candidates(device: torch.device, quick: bool):
    """(label, bytes model, factory(params) -> optimizer)."""
    out = []
    backends = [b for b in fusedopt.available_backends() if b != "triton" or device.type == "cuda"]
    if device.type == "cpu":
        backends = [b for b in backends if b in ("eager", "cpp")]
    for be in backends:
        out.append((f"fusedopt LAMB [{be}]", "lamb", lambda ps, be=be: fusedopt.FusedLAMB(ps, backend=be)))
        out.append((f"fusedopt LARS [{be}]", "lars",
                    lambda ps, be=be: fusedopt.FusedLARS(ps, lr=0.1, weight_decay=1e-4, backend=be)))
    out.append(("torch AdamW(fused=True)", "adamw", lambda ps: torch.optim.AdamW(ps, fused=True)))
    out.append(("torch SGD(momentum=0.9, fused=True)", "sgd",
                lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)))
    timm = timm_optimizers()
    if timm is not None:  # the settings that compute what the fusedopt rows above compute
        lamb, lars = timm
        out.append(("timm Lamb (foreach)", "lamb",
                    lambda ps: lamb(ps, always_adapt=True, max_grad_norm=None)))
        out.append(("timm Lars (foreach)", "lars",
                    lambda ps: lars(ps, lr=0.1, momentum=0.9, weight_decay=1e-4)))
    return out


def timm_optimizers():
    """timm's ``(Lamb, Lars)`` classes, or None when timm is not installed.

    ``import timm`` imports its model zoo, which needs torchvision; torchvision does not import
    beside every torch build (not beside the CPU wheel our machines use). The two optimizer
    modules need only torch, so when the normal import fails they are loaded from timm's own files
    with ``timm`` and ``timm.optim`` registered as bare packages (their ``__init__`` not run).
    """
    before = set(sys.modules)

    def forget_new_timm_modules():
        for name in [m for m in sys.modules if m.split(".")[0] == "timm" and m not in before]:
            del sys.modules[name]

    try:
        from timm.optim import Lamb, Lars
        return Lamb, Lars
    except ImportError:
        forget_new_timm_modules()  # what the failed import left half-initialised
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        root = list(spec.submodule_search_locations)[0]
        for name, path in (("timm", root), ("timm.optim", os.path.join(root, "optim"))):
            pkg = types.ModuleType(name)
            pkg.__path__ = [path]
            sys.modules[name] = pkg
        lamb = importlib.import_module("timm.optim.lamb").Lamb
        lars = importlib.import_module("timm.optim.lars").Lars
    except ImportError:
        return None
    finally:  # the bare packages are not left behind for others to import
        forget_new_timm_modules()
    return lamb, lars


def _cpp_isa() -> str:
    """The instruction-set clone of the C++ CPU kernels (Note [ISA clones]), or why none runs."""
    try:
        from fusedopt import _C
    except ImportError:
        return "not built"
    return _C.cpu_isa()


def run(quick: bool = False, device: str = "cpu", repeats: int | None = None, only: str | None = None):
    dev = torch.device(device)
    repeats = repeats or (7 if quick else 15)
    print(f"torch {torch.__version__}, fusedopt {fusedopt.__version__}, device {dev}, "
          f"threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}, "
          f"cpus {os.cpu_count()}, backends {fusedopt.available_backends()}, "
          f"cpp kernels {_cpp_isa()}")
    for set_name, shapes in param_sets(quick).items():
        numel = sum(torch.Size(s).numel() for s in shapes)
        bw = inplace_bandwidth(numel, dev, repeats)
        print(f"\n{set_name}: {len(shapes)} tensors, {numel / 1e6:.1f}M elements; "
              f"in-place bandwidth {bw:.1f} GB/s")
        print(f"{'optimizer':40s} {'ms/step':>9s} {'IQR':>7s} {'GB/s':>7s} {'of bw':>6s}")
        gen = torch.Generator(device="cpu").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dev)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dev) * 1e-3
        for label, kind, factory in candidates(dev, quick):
            if only and only.lower() not in label.lower():
                continue
            opt = factory(params)
            times = time_fn(opt.step, dev, repeats, warmup=2)
            res = Result(label, BYTES_PER_ELEMENT[kind], times)
            gbs = res.bytes_per_element * numel / (res.median * 1e-3) / 1e9
            print(f"{label:40s} {res.median:9.2f} {res.iqr:7.2f} {gbs:7.1f} {gbs / bw:6.0%}", flush=True)
            del opt
            gc.collect()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fusedopt.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small parameter sets, fewer repeats")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per optimizer")
    ap.add_argument("--only", default=None, help="run only optimizers whose label contains this")
    args = ap.parse_args(argv)
    run(quick=args.quick, device=args.device, repeats=args.repeats, only=args.only)


if __name__ == "__main__":
    main()
