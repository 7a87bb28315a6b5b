"""Compile the Triton backend's kernel specializations for real GPUs on a host without one.

Run as a program, in a process of its own: triton chooses between compiling and interpreting when
it is first imported, so this module removes ``TRITON_INTERPRET`` from its environment before
importing triton, and a process that already imported triton in interpreter mode cannot use it.
tests/test_triton_compile.py runs it with ``--json``::

    python tests/triton_compile.py --table          # the markdown table of docs/triton_kernels.md
    python tests/triton_compile.py --json OUT.json  # every result, for the test
    python tests/triton_compile.py --count          # the specializations, without compiling

Note [derived specializations]: the list is not written down here. The real step function
(``functional.trust_ratio_step``) drives the real ``TritonBackend`` over CPU tensors with
``kernels.tables.launch`` and ``kernels.tables.compile_only`` replaced by recorders, which call
the originals with a stand-in kernel that keeps the arguments instead of launching. The inputs
of a step (``step_axes``) are

* the bucket's dtypes: every (param dtype, grad dtype) pair among torch's floating-point dtypes
  that ``TritonBackend.unavailable_reason`` accepts on a CUDA device, with and without fp32
  masters where the optimizer keeps them (``fusedopt._state.LOW_PRECISION``);
* the bucket's layout: two tensors, both 16-byte aligned, both misaligned, or one of each;
* the state format of the two tensors (docs/math.md, "Low-precision state"): full, bf16, 8-bit,
  or one 8-bit and one bf16 (float64 params keep full state, the only one they take);
* with and without ``grad_scale`` and ``found_inf`` (GradScaler's protocol);
* every field of ``LambHyper`` / ``LarsHyper`` that selects code: each ``bool`` field both ways,
  ``max_grad_norm`` None or a number, ``lr`` a number or a 0-dim tensor of each dtype the
  backend accepts; the other fields keep their defaults.

Each recorded launch becomes what ``JITFunction.run`` would hand to ``triton.compile`` for a
GPU of the chosen architecture (Triton's own binder and argument packing, for a ``GPUTarget``
instead of the current device); identical ones are compiled once. A kernel the launcher never
reaches, a constexpr that never varies and a step that compiles in ``prepare`` something other
than what it launches are reported (``coverage``).

Note [selection]: the product of the step inputs is 138,240 steps, minutes of driving
(``--select all`` drives it). The default, the test's, finds the same specializations in a few
thousand steps. It drives a set of steps in which every pair of values of two inputs occurs
(``covering_steps``) and, from each of them, every step that differs in one input, until that
input is seen to change what the step compiles: such an input is *structural*. It then drives
the product of the structural inputs (the others at their first value) and checks that this
product launches every specialization that the other steps launched (``unexplained``). Every
specialization found is compiled, for every architecture: since the kernels take their variant
switches as runtime flags (Note [runtime flags] in fusedopt/kernels/tables.py), the structural
inputs are the dtypes, the layout and whether the step clips (which launches ``sq_norms``), and
the whole set is a few hundred builds.

Resources of each build come from the binary Triton produced (``cuobjdump
--dump-resource-usage``: registers, stack, static shared memory) and from the ``ptxas -v`` log
of the run that built it (registers, stack frame, spill stores and loads; ptxas runs again on
the PTX when the cubin came from a cache); the two must agree on registers. ``shared`` is the
dynamic shared memory Triton launches the kernel with (``metadata.shared``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = (80, 90)
KERNEL_MODULES = ("fusedopt.kernels.lamb", "fusedopt.kernels.lars", "fusedopt.kernels.common")


def _compiling_environment() -> None:
    """Make this process (and the processes it starts) compile instead of interpret."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("triton was imported in interpreter mode in this process; run "
                           "tests/triton_compile.py as a program of its own")
    os.environ.pop("TRITON_INTERPRET", None)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------- recording
class _Stand:
    """Stands for a kernel in ``tables.launch`` / ``tables.compile_only``: keeps the arguments of
    a launch (``kernel[grid](...)``) or of a warm-up (``kernel.warmup(...)``) instead."""

    def __init__(self, kernel, via: str, sink: list):
        self.kernel, self.fn, self.via, self.sink = kernel, kernel.fn, via, sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append((self.kernel, self.via, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.sink.append((self.kernel, self.via, args, kwargs))


def _float_dtypes():
    import torch
    seen = []
    for name in dir(torch):
        d = getattr(torch, name)
        if isinstance(d, torch.dtype) and d.is_floating_point and d not in seen:
            seen.append(d)
    return seen


def _hyper_axes(kind: str, lr_dtypes) -> tuple[object, dict]:
    """The defaults of ``kind``'s hyper-parameters and, per code-selecting field, the values it
    takes (Note [derived specializations])."""
    import torch

    from fusedopt import _hyper
    if kind == "lamb":
        cls, make, defaults = _hyper.LambHyper, _hyper.lamb_hyper, _hyper.LAMB_DEFAULTS
    else:
        cls, make, defaults = _hyper.LarsHyper, _hyper.lars_hyper, _hyper.LARS_DEFAULTS
    base = make({"lr": 0.1, **defaults})
    axes = {}
    for f in dataclasses.fields(cls):
        kind_of = str(f.type)
        if kind_of == "bool":
            axes[f.name] = [False, True]
        elif "Tensor" in kind_of:
            axes[f.name] = [getattr(base, f.name)] + [torch.tensor(0.1, dtype=d) for d in lr_dtypes]
        elif "None" in kind_of:
            axes[f.name] = [None, 1.0]
        elif kind_of != "float":
            raise TypeError(f"{cls.__name__}.{f.name}: a field of type {kind_of} that this "
                            "enumeration does not know how to vary")
    return base, axes


STATES = ("full", "bf16", "8bit", "mixed")  # the state formats of a bucket's two tensors


def _bucket_tensors(p_dtype, g_dtype, master: bool, layout: str, state: str = "full"):
    """Lists for a Bucket of two 5-element tensors: 16-byte aligned ("aligned"), starting one
    element into their storage ("misaligned"), or one of each ("mixed"); their state in the
    format ``state`` (docs/math.md, "Low-precision state"; "mixed": 8-bit and bf16), full state
    for float64 params, which hold no other."""
    import torch

    from fusedopt import lowp
    from fusedopt.functional import compute_dtype
    cd = compute_dtype(p_dtype)
    offsets = {"aligned": (0, 0), "misaligned": (1, 1), "mixed": (0, 1)}[layout]

    def make(dtype):
        return [torch.zeros(8, dtype=dtype)[o:o + 5] for o in offsets]

    params = make(p_dtype)

    def states():
        if state == "full" or cd != torch.float32:
            return make(cd)
        fmts = ("8bit", "bf16") if state == "mixed" else (state, state)
        return [lowp.zeros(p, f) for p, f in zip(params, fmts)]

    return dict(params=params, grads=make(g_dtype), exp_avgs=states(), exp_avg_sqs=states(),
                momentum_buffers=states(), masters=make(torch.float32) if master else None,
                steps=[torch.zeros((), dtype=torch.float32) for _ in offsets])


def step_axes() -> dict:
    """Per optimizer kind, the inputs of a step (Note [derived specializations]) as axes
    name -> values, and the hyper-parameter defaults."""
    import torch

    from fusedopt._state import LOW_PRECISION
    from fusedopt.backends.triton_backend import TritonBackend
    be = TritonBackend()
    cuda = torch.device("cuda")
    floats = _float_dtypes()
    pairs = [(p, g) for p in floats for g in floats if be.unavailable_reason(cuda, p, g) is None]
    supported = sorted({p for p, _ in pairs} | {g for _, g in pairs}, key=str)
    combos = [(p, g, m) for p, g in pairs
              for m in ((False, True) if p in LOW_PRECISION else (False,))]
    out = {}
    for kind in ("lamb", "lars"):
        base, hyper = _hyper_axes(kind, supported)
        axes = dict(dtypes=combos, layout=["mixed", "aligned", "misaligned"], state=list(STATES),
                    grad_scale=[None, 1024.0], found_inf=[None, 0.0])
        axes.update({"h." + k: v for k, v in hyper.items()})
        out[kind] = (base, axes)
    return dict(kinds=out, supported=supported)


def _product_size(axes: dict) -> int:
    n = 1
    for v in axes.values():
        n *= len(v)
    return n


def covering_steps(axes: dict, seed: int = 0) -> list[tuple[int, ...]]:
    """Note [selection] for step inputs: value indices, one tuple per step, such that every pair of
    values of two axes is in some step (greedy, from random candidates; deterministic)."""
    rng = random.Random(seed)
    sizes = [len(v) for v in axes.values()]
    dims = range(len(sizes))
    uncovered = {(a, i, b, j) for a, b in itertools.combinations(dims, 2)
                 for i in range(sizes[a]) for j in range(sizes[b])}

    def gain(t):
        return sum((a, t[a], b, t[b]) in uncovered for a, b in itertools.combinations(dims, 2))

    steps = []
    while uncovered:
        a, i, b, j = min(uncovered)
        candidates = []
        for _ in range(64):
            t = [rng.randrange(n) for n in sizes]
            t[a], t[b] = i, j
            candidates.append(tuple(t))
        best = max(candidates, key=gain)
        steps.append(best)
        uncovered -= {(x, best[x], y, best[y]) for x, y in itertools.combinations(dims, 2)}
    return steps


class _Driver:
    """Drives steps of the Triton backend with recording launches (Note [derived
    specializations]); each step's recorded calls are returned by :meth:`step`."""

    def __init__(self):
        from fusedopt.backends.triton_backend import TritonBackend
        from fusedopt.kernels import tables
        self.be = TritonBackend()
        self.domains = step_axes()
        self.sink: list = []
        self.buckets: dict = {}
        self.steps = 0
        self._tables = tables
        self._saved = (tables.launch, tables.compile_only)

    def __enter__(self):
        t, (launch, compile_only) = self._tables, self._saved
        t.launch = lambda kernel, table, **kw: launch(_Stand(kernel, "launch", self.sink), table, **kw)
        t.compile_only = lambda kernel, table, **kw: compile_only(
            _Stand(kernel, "prepare", self.sink), table, **kw)
        return self

    def __exit__(self, *exc):
        self._tables.launch, self._tables.compile_only = self._saved

    def step(self, kind: str, idx: tuple[int, ...]) -> list:
        """Run one step of ``kind`` with the axis values ``idx``; its recorded calls."""
        import torch

        from fusedopt import functional
        base, axes = self.domains["kinds"][kind]
        x = {n: values[i] for (n, values), i in zip(axes.items(), idx)}
        key = (kind, x["dtypes"], x["layout"], x["state"])
        if key not in self.buckets:
            lists = _bucket_tensors(*x["dtypes"], x["layout"], x["state"])
            for name in (("momentum_buffers",) if kind == "lamb" else ("exp_avgs", "exp_avg_sqs")):
                lists.pop(name)
            self.buckets[key] = (lists, functional.StepCache())
        lists, cache = self.buckets[key]
        h = dataclasses.replace(base, **{n[2:]: v for n, v in x.items() if n.startswith("h.")})
        g = functional.TensorGroup(**lists, hyper=h, backend=self.be)
        gs, fi = x["grad_scale"], x["found_inf"]
        first = len(self.sink)
        functional.trust_ratio_step(
            kind, [g], cache=cache, grad_scale=None if gs is None else torch.tensor(gs, dtype=torch.float32),
            found_inf=None if fi is None else torch.tensor(fi, dtype=torch.float32))
        self.steps += 1
        return self.sink[first:]

    def sq_norms(self) -> None:
        """The public sq_norms (fusedopt.sq_norms, the noise scale), for every dtype and layout."""
        first = len(self.sink)
        for d in self.domains["supported"]:
            for layout in ("mixed", "aligned", "misaligned"):
                self.be.sq_norms(_bucket_tensors(d, d, False, layout)["params"])
        self.sink[first:] = [(kernel, "sq_norms", args, kw) for kernel, _, args, kw in self.sink[first:]]


def record(select: str = "derived") -> dict:
    """Drive the Triton backend over the step inputs of Note [derived specializations] and record
    its launches and warm-ups: every step of their product (``select="all"``), or the steps of
    Note [selection] (``"derived"``). Returns the calls, the steps driven, the size of the
    product and, for "derived", the axes found to select code (``structural``)."""
    packer = _Packer(ARCHS[0])
    structural: dict[str, list[str]] = {}
    product, first, unexplained = 0, 0, set()
    with _Driver() as d:
        for kind, (base, axes) in d.domains["kinds"].items():
            names, sizes = list(axes), [len(v) for v in axes.values()]
            product += _product_size(axes)
            if select == "all":
                for idx in itertools.product(*map(range, sizes)):
                    d.step(kind, idx)
                continue
            found = set()
            for idx in covering_steps(axes):
                specs = _spec_keys(packer, d.step(kind, idx))
                for a, name in enumerate(names):
                    if name in found:
                        continue
                    for v in range(sizes[a]):
                        if v != idx[a] and _spec_keys(packer, d.step(
                                kind, idx[:a] + (v,) + idx[a + 1:])) != specs:
                            found.add(name)
                            break
            structural[kind] = [n for n in names if n in found]
            start = len(d.sink)
            for idx in itertools.product(*(range(n) if name in found else (0,)
                                           for name, n in zip(names, sizes))):
                d.step(kind, idx)
            reached = _spec_keys(packer, d.sink[start:])
            unexplained |= {k[0] for k in _spec_keys(packer, d.sink[first:start]) - reached}
            first = len(d.sink)
        d.sq_norms()
    return dict(calls=d.sink, steps=d.steps, step_product=product, structural=structural,
                unexplained=sorted(unexplained))


def _spec_keys(packer, calls) -> frozenset:
    """What the calls compile (for one architecture), without their via."""
    out = set()
    for kernel, _, args, kwargs in calls:
        _, signature, constexprs, attrs = packer.pack(kernel, args, kwargs)
        out.add((kernel.fn.__name__, repr(sorted(signature.items())),
                 repr(sorted(constexprs.items(), key=repr)), repr(sorted(attrs.items(), key=repr))))
    return frozenset(out)


# --------------------------------------------------------------------------- specializations
def _value(v) -> str:
    import triton.language as tl
    if isinstance(v, tl.dtype):
        return str(v)
    return repr(v)


def _call_key(v):
    import torch
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, v.data_ptr() % 16 == 0)
    return (type(v).__name__, _value(v))


class _Packer:
    """What ``JITFunction.run`` would compile for a call, on a GPU of one architecture."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.binders = {}

    def pack(self, kernel, args, kwargs):
        from triton import knobs
        from triton.runtime.jit import create_function_from_signature
        binder = self.binders.get(kernel)
        if binder is None:
            binder = self.binders[kernel] = create_function_from_signature(
                kernel.signature, kernel.params, self.backend)
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            self.backend, kwargs, bound, specialization, options)
        return options, signature, constexprs, attrs


def specializations(rec: dict, archs=ARCHS) -> list[dict]:
    """The distinct compilations of the recorded calls, per architecture. Each entry: kernel
    (module, name), arch, ``args`` (name → constexpr value or argument type), the compile inputs
    and ``via`` (launch / prepare)."""
    calls = {}  # the binder looks at a tensor's dtype and alignment, not at its values
    for kernel, via, args, kwargs in rec["calls"]:
        calls.setdefault((kernel, via, tuple(map(_call_key, args)),
                          tuple((k, _call_key(v)) for k, v in kwargs.items())),
                         (kernel, via, args, kwargs))
    out: dict[tuple, dict] = {}
    for arch in archs:
        packer = _Packer(arch)
        for kernel, via, args, kwargs in calls.values():
            options, signature, constexprs, attrs = packer.pack(kernel, args, kwargs)
            names = [p.name for p in kernel.params]
            shown = {}
            for i, name in enumerate(names):
                ty = signature[name]
                shown[name] = _value(constexprs[(i,)]) if ty == "constexpr" else ty
                if attrs.get((i,)):
                    shown[name] += " " + ",".join(f"{a}={b}" for a, b in attrs[(i,)])
            opts = options.__dict__
            key = (kernel.fn.__module__, kernel.fn.__name__, arch, tuple(shown.items()),
                   tuple((k, repr(v)) for k, v in sorted(opts.items())))
            entry = out.get(key)
            if entry is None:
                entry = out[key] = dict(
                    module=kernel.fn.__module__, name=kernel.fn.__name__, arch=arch, args=shown,
                    num_warps=opts["num_warps"], via=set(), key=repr(key),
                    compile=(signature, constexprs, attrs, opts))
            entry["via"].add(via)
    return list(out.values())


def kernels_in_modules() -> list[tuple[str, str]]:
    """Every ``*_kernel`` JIT function of fusedopt's kernel modules (the launchable ones)."""
    from triton.runtime.jit import JITFunction
    found = []
    for mod_name in KERNEL_MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in vars(mod).items():
            if (isinstance(obj, JITFunction) and name.endswith("_kernel")
                    and obj.fn.__module__ == mod_name):
                found.append((mod_name, name))
    return sorted(found)


def coverage(specs: list[dict]) -> list[str]:
    """What the recorded set misses: a ``*_kernel`` never launched; a bool constexpr seen only
    one way; a dtype constexpr with a single value; an optional tensor argument always None; a
    specialization that a step compiles in ``prepare`` but does not launch, or launches without
    compiling it in ``prepare``."""
    import triton.language as tl
    dtype_names = {str(v) for v in vars(tl).values() if isinstance(v, tl.dtype)}
    problems = []
    launched = {(s["module"], s["name"]) for s in specs}
    for k in kernels_in_modules():
        if k not in launched:
            problems.append(f"{k[1]} ({k[0]}) is never launched by the Triton backend")
    by_kernel = defaultdict(list)
    for s in specs:
        by_kernel[s["name"]].append(s)
    for name, group in sorted(by_kernel.items()):
        mod = importlib.import_module(group[0]["module"])
        kernel = getattr(mod, name)
        for p in kernel.params:
            values = {s["args"][p.name] for s in group}
            if p.is_constexpr:
                if values & {"True", "False"} and values != {"True", "False"}:
                    problems.append(f"{name}: constexpr {p.name} only takes {sorted(values)}")
                if values <= dtype_names and len(values) < 2:
                    problems.append(f"{name}: dtype constexpr {p.name} only takes {sorted(values)}")
            elif "None" in values and len(values) < 2:
                problems.append(f"{name}: optional argument {p.name} is always None")
        for s in group:
            in_steps = s["via"] & {"launch", "prepare"}
            if in_steps and in_steps != {"launch", "prepare"}:
                problems.append(f"{name} sm_{s['arch']}: {s['args']} is reached in a step only by "
                                f"{'/'.join(sorted(in_steps))}")
    return problems


# --------------------------------------------------------------------------- compiling
_USED = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_TARGET = re.compile(r"^\.target\s+(sm_\w+)", re.M)
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH_TO = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_GLOBAL = re.compile(r"\b((?:LDG|STG)\.[\w.]+)")


def loop_accesses(sass: str) -> list[dict]:
    """The global loads and stores of each loop of a kernel's SASS (``cuobjdump -sass``: the
    instructions from a backward branch's target to the branch), counted by form: ``LDG.E.128``
    moves 16 bytes a thread, ``LDG.E.U8`` one byte (Note [whole tiles] in
    fusedopt/kernels/common.py)."""
    instrs = [(int(a, 16), text) for a, text in _INSTR.findall(sass)]
    loops = []
    for addr, text in instrs:
        target = _BRANCH_TO.search(text)
        if target is None or int(target[1], 16) >= addr:
            continue
        counts: dict[str, int] = {}
        for a, t in instrs:
            if int(target[1], 16) <= a <= addr and (m := _GLOBAL.search(t)):
                counts[m[1]] = counts.get(m[1], 0) + 1
        loops.append(counts)
    return loops


def _compile_one(task: dict) -> dict:
    """Compile one specialization (in a worker process); its resources, or its error."""
    _compiling_environment()
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernel = getattr(importlib.import_module(task["module"]), task["name"])
    signature, constexprs, attrs, opts = task["compile"]
    out = dict(key=task["key"])
    knobs.nvidia.dump_ptxas_log = True  # Triton prints the log of its own `ptxas -v` run
    printed = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(printed):
            ck = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                target=GPUTarget("cuda", task["arch"], 32), options=opts)
    except Exception as e:  # reported with the specialization by the caller
        out.update(error=f"{type(e).__name__}: {e}"[-4000:], seconds=time.perf_counter() - t0)
        return out
    out["seconds"] = time.perf_counter() - t0
    out["shared"] = ck.metadata.shared
    try:
        out.update(_resources(ck, opts, printed.getvalue()))
    except Exception as e:
        out["error"] = f"resource report: {type(e).__name__}: {e}"[-4000:]
    return out


def _resources(ck, opts: dict, log: str) -> dict:
    """Registers, stack and spills of a compiled kernel: its cubin's resource usage, and the
    ``ptxas -v`` log of the run that built it (``log``; ptxas runs again on the kernel's PTX, with
    the flags Triton gives it, when the cubin came from a cache)."""
    from triton import knobs
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp, "k.cubin"), Path(tmp, "k.ptx")
        cubin.write_bytes(ck.asm["cubin"])
        res = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(cubin)],
                             capture_output=True, text=True, check=True).stdout
        m = _RES.search(res)
        out.update(regs=int(m[1]), stack=int(m[2]), static_shared=int(m[3]), local=int(m[4]))
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
        out["loops"] = loop_accesses(sass)
        arch = _TARGET.search(ck.asm["ptx"])[1]
        if _FRAME.search(log) is None:
            ptx.write_text(ck.asm["ptx"])
            fmad = [] if opts.get("enable_fp_fusion", True) else ["--fmad=false"]
            log = subprocess.run([knobs.nvidia.ptxas.path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                                  *fmad, f"--gpu-name={arch}", str(ptx), "-o", str(Path(tmp, "k.o"))],
                                 capture_output=True, text=True, check=True).stderr
        frame = _FRAME.search(log)
        out.update(ptxas_regs=int(_USED.search(log)[1]), stack_frame=int(frame[1]),
                   spill_stores=int(frame[2]), spill_loads=int(frame[3]), ptx_target=arch)
    return out


def compile_all(specs: list[dict], jobs: int = 2, cache_dir: str | None = None) -> list[dict]:
    """Compile ``specs`` in ``jobs`` processes; each spec gets its results merged in."""
    tmp = None
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="fusedopt-triton-cache-")
        cache_dir = tmp.name
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # read by the workers (and triton) at start
    tasks = [dict(module=s["module"], name=s["name"], arch=s["arch"], key=s["key"],
                  compile=s["compile"]) for s in specs]
    import multiprocessing
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_compile_one, tasks))
    finally:
        if tmp is not None:
            tmp.cleanup()
    by_key = {r["key"]: r for r in results}
    for s in specs:
        s.update({k: v for k, v in by_key[s["key"]].items() if k != "key"})
    return specs


# --------------------------------------------------------------------------- reporting
def _group(s: dict) -> str:
    a = s["args"]
    if "X_DTYPE" in a:
        return f"x {a['X_DTYPE']}"
    text = f"p {a['P_DTYPE']}"
    if "G_DTYPE" in a:
        text += f", g {a['G_DTYPE']}"
    if a.get("HAS_MASTER") == "True":
        text += ", fp32 master"
    return text


def _span(values) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def table(specs: list[dict]) -> str:
    """Markdown: per kernel and dtype combination, the variants compiled and their resources."""
    rows = defaultdict(lambda: defaultdict(list))
    for s in specs:
        rows[(s["name"], _group(s))][s["arch"]].append(s)
    archs = sorted({s["arch"] for s in specs})
    head = (["kernel", "dtypes", "variants"] + [f"regs sm_{a}" for a in archs]
            + ["shared B", "stack B", "spills B", "compile s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (name, group), by_arch in sorted(rows.items()):
        every = [s for a in archs for s in by_arch[a]]
        ok = [s for s in every if "error" not in s]
        cells = [name, group, str(len(by_arch[archs[0]]))]
        cells += [_span([s["regs"] for s in by_arch[a] if "error" not in s]) for a in archs]
        cells += [_span([s[k] for s in ok]) for k in ("shared", "stack_frame")]
        cells += [_span([s["spill_stores"] + s["spill_loads"] for s in ok]),
                  f"{sum(s['seconds'] for s in every) / len(every):.1f}"]
        if len(ok) < len(every):
            cells[-1] += f" ({len(every) - len(ok)} of {len(every)} FAILED)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def in_sample(s: dict) -> bool:
    """The sample the README's test command compiles (docs/triton_kernels.md, "Two tiers"):
    the specializations of 16-byte aligned tables whose params and grads (or whose one tensor
    dtype) agree. It keeps every kernel, architecture, state format, master and compute dtype
    (tests/test_triton_compile.py checks it); the full set adds the other layouts and the mixed
    dtypes."""
    a = {k: v.split(" ")[0] for k, v in s["args"].items()}
    return a.get("ALIGNED") == "True" and a.get("G_DTYPE", a.get("P_DTYPE")) == a.get(
        "P_DTYPE", a.get("G_DTYPE"))


def sample_missing(specs: list) -> list[str]:
    """The values of the code-selecting constexprs (dtypes, masters, state formats) that some
    specialization of a kernel and architecture has and none of its sample has."""
    def values(ss):
        out = defaultdict(set)
        for s in ss:
            for k, v in s["args"].items():
                if k.isupper() and k != "ALIGNED":
                    out[(s["name"], s["arch"], k)].add(v.split(" ")[0])
        return out
    every, sample = values(specs), values([s for s in specs if in_sample(s)])
    return sorted(f"{name} sm_{arch} {k}={v}" for (name, arch, k), vs in every.items()
                  for v in vs - sample.get((name, arch, k), set()))


def _jsonable(s: dict) -> dict:
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in s.items() if k != "compile"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--select", choices=("derived", "all"), default="derived",
                    help="Note [selection]: the steps that find every specialization (default), "
                         "or every step of the product (minutes)")
    ap.add_argument("--arch", default=",".join(map(str, ARCHS)), help="compute capabilities")
    ap.add_argument("--jobs", type=int, default=2, help="compiler processes")
    ap.add_argument("--cache-dir", help="Triton cache to use (default: a fresh temporary one)")
    ap.add_argument("--where", action="append", default=[], metavar="ARG=VALUE",
                    help="compile only the specializations with this argument value, or without "
                         "it (ARG!=VALUE); kernel=NAME for a kernel; repeatable")
    ap.add_argument("--sample", action="store_true",
                    help="compile only the sample (in_sample): the specializations of aligned "
                         "tables whose params and grads share a dtype")
    ap.add_argument("--count", action="store_true", help="count the specializations only")
    ap.add_argument("--table", action="store_true", help="print the markdown table")
    ap.add_argument("--json", metavar="PATH", help="write every result as JSON")
    args = ap.parse_args(argv)
    _compiling_environment()

    t0 = time.perf_counter()
    rec = record(args.select)
    specs = specializations(rec, tuple(int(a) for a in args.arch.split(",")))
    problems = coverage(specs) + [
        f"{name}: a step of the cover launches a specialization that the product of the "
        f"structural axes {rec['structural']} does not" for name in rec.get("unexplained", ())]
    t_record = time.perf_counter() - t0
    chosen = [s for s in specs if in_sample(s)] if args.sample else specs
    for cond in args.where:
        name, _, value = cond.partition("=")
        negate = name.endswith("!")
        name = name.rstrip("!")
        chosen = [s for s in chosen if negate != ((s["name"] if name == "kernel" else
                                                   s["args"].get(name, "").split(" ")[0]) == value)]
    counts = defaultdict(lambda: [0, 0])
    for s in specs:
        counts[(s["name"], s["arch"])][0] += 1
    for s in chosen:
        counts[(s["name"], s["arch"])][1] += 1
    summary = dict(step_product=rec["step_product"], steps=rec["steps"], calls=len(rec["calls"]),
                   record_seconds=round(t_record, 1),
                   structural=rec.get("structural"),
                   specializations=len(specs), selected=len(chosen), select=args.select,
                   sample=args.sample, sample_missing=sample_missing(specs),
                   per_kernel={f"{n} sm_{a}": c for (n, a), c in sorted(counts.items())},
                   coverage_problems=problems)
    print(json.dumps({k: v for k, v in summary.items() if k != "per_kernel"}), file=sys.stderr)
    if args.count:
        print(json.dumps(summary, indent=1))
        return 0
    t1 = time.perf_counter()
    compile_all(chosen, args.jobs, args.cache_dir)
    summary["compile_wall_seconds"] = round(time.perf_counter() - t1, 1)
    summary["compile_cpu_seconds"] = round(sum(s["seconds"] for s in chosen), 1)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(summary=summary,
                                                   results=[_jsonable(s) for s in chosen])))
    if args.table:
        print(table(chosen))
    failed = [s for s in chosen if "error" in s or s["spill_stores"] or s["spill_loads"]]
    print(json.dumps({k: summary[k] for k in ("selected", "compile_wall_seconds",
                                              "compile_cpu_seconds")}), file=sys.stderr)
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
