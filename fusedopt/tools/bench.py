"""Step-time benchmark: fusedopt backends side by side with torch's fused optimizers.

    python -m fusedopt.tools.bench            # BERT-base shaped params and 4000 small tensors
    python -m fusedopt.tools.bench --quick    # a small, fast run
    python -m fusedopt bench --quick          # the same, through the fusedopt command

The candidates of a parameter set run interleaved: each round times one ``step()`` of every
optimizer, in turn, and the in-place bandwidth yardstick (``a.add_(c, alpha=s)``: 12 B/element
over a buffer the size of the parameter set), so that a shared machine whose speed drifts during
the run slows all of them alike. The optimizers that allocate parameter-sized temporaries in every
step (our eager backend, timm's foreach optimizers) run in a second interleaved phase: freeing
gigabytes slowed whichever step came next by up to a third on our CPU machine. For every
optimizer it reports the median and the spread (interquartile range) of ms/step over the rounds,
the achieved GB/s by docs/math.md's bytes model (LAMB 40 B/element, LARS 28, AdamW 28, momentum SGD
20, +4 with global clipping), and that as a fraction of the yardstick's GB/s. The last lines give
the ratios the performance targets are stated in, against AdamW, timm and the eager backend.

The time per element of the many-small-tensors set over the BERT-base set compares two sets, so it
comes from a last phase in which the compiled fusedopt steps of both sets and both yardsticks run
in the same rounds: timed minutes apart, as the per-set tables are, that ratio moved with the
machine's speed (between 1.6 and 2.5 for the same build on our CPU machine). The yardstick's own
per-element ratio, printed beside it, is what the memory system alone gives.

The many-small-tensors set also runs the compiled fusedopt steps on a copy of its params and grads
moved into flat buffers by ``fusedopt.flatten_parameters`` (rows marked "flattened params"; Note
[flat params] in ``fusedopt/flat.py``), in its table and in the last phase: the other rows use
one allocation per param and per grad, as ``nn.Module`` and autograd make them.
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

from .common import DemoError, Number, check_option, parse_device, parse_once

BYTES_PER_ELEMENT = {"lamb": 40, "lars": 28, "adamw": 28, "sgd": 20}
FLATTENED = " (flattened params)"  # suffix of the rows on flattened params (module docstring)


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


YARDSTICK = "in-place a.add_(c, alpha=s)"


def interleave(fns: dict[str, Callable[[], None]], device: torch.device, rounds: int,
               warmup: int = 2) -> dict[str, list[float]]:
    """ms of each call of each fn: ``warmup`` untimed calls each, then ``rounds`` rounds in
    which every fn runs once, in turn."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return times


def print_table(set_name: str, n_tensors: int, numel: int, results: list[Result]) -> None:
    """The table of one parameter set; ``results`` hold the yardstick (name YARDSTICK) and rows
    whose bytes_per_element may be 0 (no GB/s: a part of a step, say)."""
    by_name = {r.name: r for r in results}
    bw = 12 * numel / (by_name[YARDSTICK].median * 1e-3) / 1e9
    print(f"\n{set_name}: {n_tensors} tensors, {numel / 1e6:.1f}M elements; "
          f"in-place bandwidth {bw:.1f} GB/s ({len(results[0].times_ms)} interleaved rounds)")
    print(f"{'optimizer':40s} {'ms/step':>9s} {'IQR':>7s} {'GB/s':>7s} {'of bw':>6s}")
    for r in results:
        if r.name == YARDSTICK:
            continue
        if r.bytes_per_element:
            gbs = r.bytes_per_element * numel / (r.median * 1e-3) / 1e9
            print(f"{r.name:40s} {r.median:9.2f} {r.iqr:7.2f} {gbs:7.1f} {gbs / bw:6.0%}")
        else:
            print(f"{r.name:40s} {r.median:9.2f} {r.iqr:7.2f}")


def ratios(medians: dict[str, dict[str, float]]) -> list[str]:
    """The ratios of the performance targets against other optimizers, from the median ms of each
    row of each set (rows of one set were timed in the same rounds)."""
    lines = []
    for set_name, m in medians.items():
        skip = ("[eager]", FLATTENED)  # the targets compare the compiled steps on params as made
        for row in [k for k in m if k.startswith("fusedopt ") and not k.endswith(skip)]:
            kind = row.split()[1]  # LAMB or LARS
            against = [("torch AdamW(fused=True)", False)] if kind == "LAMB" else []
            against += [(f"timm {kind.capitalize()} (foreach)", True),
                        (f"fusedopt {kind} [eager]", True)]
            for other, slower in against:
                if other in m:
                    r = m[other] / m[row] if slower else m[row] / m[other]
                    a, b = (other, row) if slower else (row, other)
                    lines.append(f"{set_name}: {a} / {b} = {r:.2f}")
    return lines


def per_element_ratios(medians: dict[str, dict[str, float]], numels: dict[str, int]) -> list[str]:
    """Time per element of the second set over the first, for each row of the second set whose
    row (the same optimizer on params not flattened) the first has; the medians should come from
    rounds that timed both sets (see ``joint_rounds``)."""
    (big, mb), (small, ms) = medians.items()
    return [f"{row}: time per element, {small} / {big} = "
            f"{(ms[row] / numels[small]) / (mb[base] / numels[big]):.2f}"
            for row in ms if (base := row.removesuffix(FLATTENED)) in mb]


def joint_rounds(fns: dict[str, dict[str, Callable[[], None]]], numels: dict[str, int],
                 device: torch.device, rounds: int) -> list[str]:
    """Runs the fns of two parameter sets (set name -> row -> fn) in the same interleaved rounds
    and returns the lines of ``per_element_ratios`` (headed by what was run)."""
    flat = {f"{s}: {row}": fn for s, rows in fns.items() for row, fn in rows.items()}
    times = interleave(flat, device, rounds)
    medians = {s: {row: statistics.median(times[f"{s}: {row}"]) for row in rows}
               for s, rows in fns.items()}
    return ([f"time per element, both sets in the same {rounds} rounds:"]
            + per_element_ratios(medians, numels))


def make_params(shapes, device: torch.device) -> list[torch.nn.Parameter]:
    """Params of ``shapes`` with grads (seeded values), each param and grad an allocation of its
    own, as a model and autograd make them."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device) * 1e-3
    return params


def candidates(device: torch.device, quick: bool):
    """(label, bytes model, factory(params) -> optimizer, phase): phase 1 for the optimizers
    that allocate parameter-sized temporaries in every step (see the module docstring), else 0."""
    out = []
    backends = [b for b in fusedopt.available_backends() if b != "triton" or device.type == "cuda"]
    if device.type == "cpu":
        backends = [b for b in backends if b in ("eager", "cpp")]
    for be in backends:
        phase = int(be == "eager")
        out.append((f"fusedopt LAMB [{be}]", "lamb",
                    lambda ps, be=be: fusedopt.FusedLAMB(ps, backend=be), phase))
        out.append((f"fusedopt LARS [{be}]", "lars",
                    lambda ps, be=be: fusedopt.FusedLARS(ps, lr=0.1, weight_decay=1e-4, backend=be),
                    phase))
    out.append(("torch AdamW(fused=True)", "adamw", lambda ps: torch.optim.AdamW(ps, fused=True), 0))
    out.append(("torch SGD(momentum=0.9, fused=True)", "sgd",
                lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), 0))
    timm = timm_optimizers()
    if timm is not None:  # the settings that compute what the fusedopt rows above compute
        lamb, lars = timm
        out.append(("timm Lamb (foreach)", "lamb",
                    lambda ps: lamb(ps, always_adapt=True, max_grad_norm=None), 1))
        out.append(("timm Lars (foreach)", "lars",
                    lambda ps: lars(ps, lr=0.1, momentum=0.9, weight_decay=1e-4), 1))
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
    medians, numels, joint = {}, {}, {}
    sets = param_sets(quick)
    for set_name, shapes in sets.items():
        numel = numels[set_name] = sum(torch.Size(s).numel() for s in shapes)
        params = make_params(shapes, dev)
        # the many-small-tensors set (the last) again, flattened (module docstring)
        flat = make_params(shapes, dev) if set_name == list(sets)[-1] else None
        if flat is not None:
            fusedopt.flatten_parameters(flat)
        a, c = torch.randn(numel, device=dev), torch.randn(numel, device=dev)
        rows = {YARDSTICK: (12, lambda a=a, c=c: a.add_(c, alpha=1e-3), 0)}  # this set's a, c
        for label, kind, factory, phase in candidates(dev, quick):
            if not only or only.lower() in label.lower():
                rows[label] = (BYTES_PER_ELEMENT[kind], factory(params).step, phase)
                if flat is not None and label.startswith("fusedopt ") and phase == 0:
                    rows[label + FLATTENED] = (BYTES_PER_ELEMENT[kind], factory(flat).step, 0)
        times = {}
        for phase in (0, 1):
            fns = {k: fn for k, (_, fn, ph) in rows.items() if ph == phase}
            if phase == 0 or fns:
                times.update(interleave(fns, dev, repeats))
        results = [Result(k, rows[k][0], t) for k, t in times.items()]
        print_table(set_name, len(shapes), numel, results)
        medians[set_name] = {r.name: r.median for r in results}
        # kept for the joint rounds: the yardstick and the compiled fusedopt steps (their
        # optimizers keep this set's params alive); the others are freed now
        joint[set_name] = {k: fn for k, (_, fn, ph) in rows.items()
                           if k == YARDSTICK or (k.startswith("fusedopt ") and ph == 0)}
        del rows, params, flat, a, c
        gc.collect()
    lines = ratios(medians)
    if len(joint) == 2 and len(next(iter(joint.values()))) > 1:
        lines += joint_rounds(joint, numels, dev, repeats)
    if lines:
        print("\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    """``python -m fusedopt bench``. Bad options are refused before anything runs (an
    ``error:`` line, exit status 2)."""
    ap = argparse.ArgumentParser(prog="python -m fusedopt bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small parameter sets, fewer repeats")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--repeats", type=int, default=None,
                    help="interleaved rounds (timed steps per optimizer), at least 2")
    ap.add_argument("--only", default=None, help="run only optimizers whose label contains this")
    args = parse_once(ap, argv)
    try:
        device = parse_device("--device", args.device)
        if args.repeats is not None:
            # two rounds at least: the spread (interquartile range) needs two times
            check_option("--repeats", args.repeats, Number(2, 10 ** 6, integer=True))
        if args.only:
            labels = [label for label, *_ in candidates(device, args.quick)]
            if not any(args.only.lower() in label.lower() for label in labels):
                raise DemoError(f"--only {args.only!r}: matches none of the optimizers on "
                                f"{device}: {labels}")
    except DemoError as e:
        ap.error(str(e))
    run(quick=args.quick, device=args.device, repeats=args.repeats, only=args.only)


if __name__ == "__main__":
    main()
