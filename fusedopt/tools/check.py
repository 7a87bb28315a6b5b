"""Self-check: every backend on every device of this machine against the float64 reference.

    python -m fusedopt check                  # all devices, all backends that can run, then speed
    python -m fusedopt check --quick          # a reduced case set
    python -m fusedopt check --backend cuda --device cuda:0 --no-speed

For every device (the CPU and each CUDA device), every backend that can run there, LAMB and LARS,
it steps a ``FusedLAMB`` / ``FusedLARS`` for a few steps on a set of params and compares the result
with :mod:`fusedopt.reference` (docs/math.md in float64, one tensor at a time) fed the
same initial values and gradients. Every case has two param groups (the second with
``weight_decay=0, adapt=False``), a 0-size tensor, a 1-element tensor, odd sizes, tensors of
several dimensions, a tensor spanning several chunks of every fused backend, a zero weight (the
zero-norm rule) and a zero gradient. The option cases vary each option of the math; the
low-precision storage cases (bf16 and fp16 params, with and without fp32 master weights, fp32
params with bf16 grads and bf16 params with fp32 grads) run the default options and a mix of them.
The cases, the rules below and their tolerances are :mod:`fusedopt.testing`'s, which the test suite
runs too (its "full" set, on the eager and C++ backends: tests/test_parity.py).

Triton on CPU tensors runs only under its interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported), which executes every operation of every program in Python, about a millisecond
each: there it runs a reduced set (small tensors, fewer cases and steps).

Protocol rows follow the option cases, for LAMB and LARS in fp32 on every backend and device
checked: misaligned tensors (the grads alone; params, grads and moments: views 4 bytes past a
16-byte boundary), one large tensor (on a GPU more chunks than the per-tensor reductions of triton
and cuda take in one round; on the CPU 129 chunks of cpp's, cpp on two or more threads against
one), GradScaler's protocol (``opt.grad_scale`` with scaled grads, with and without clipping;
``opt.found_inf = 1``: a step that changes nothing, as the first step and a later one) and a 0-dim
tensor lr changed in place (on the params' device, and on the CPU for GPU params). Each is judged
against the float64 reference and, where the math says the bits are the same, bit for bit against
the same steps on plain inputs (the rules below). They run in both modes, over the shapes and
steps of the backend's case set; only the CPU's large tensor is smaller with ``--quick`` (17
chunks of the cpp backend's 32,768 elements instead of 129). The COVERAGE line after the rows says
what they prove and what they leave to other checks.

A short speed table per device follows (``--no-speed`` skips it): ms per ``step()`` and GB/s by
the bytes model of :mod:`fusedopt.tools.bench` for the fusedopt backends checked there, beside
torch's ``AdamW`` (fused where the device supports it, else foreach) and apex's ``FusedLAMB`` when
apex imports, with the in-place bandwidth of ``a.add_(c, alpha=s)`` measured in the same rounds.

The exit status is 0 when every row passed and 1 otherwise (a failed row, a backend that raised,
or a ``--backend`` that could run on none of the devices).

The rules of the ``rule`` column are :data:`fusedopt.testing.RULES` (``--help`` prints them).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

import fusedopt
from fusedopt import backends as _backends
from fusedopt import testing
from fusedopt.testing import one_line as _one_line
from fusedopt.tools.common import DemoError, check_file_path, parse_once, torch_threads

# --------------------------------------------------------------------------------- the cases
# The cases, the rules and their tolerances are fusedopt.testing's (what the test suite runs):
# its case sets "full", "quick" and "interpreted", judged by testing.run_case.


def case_set(device: torch.device, backend: str, quick: bool) -> testing.CaseSet:
    if backend == "triton" and device.type == "cpu":
        return testing.CASE_SETS["interpreted"]
    return testing.CASE_SETS["quick" if quick else "full"]


@dataclass
class Report:
    rows: list[testing.CaseResult] = field(default_factory=list)
    # (device, backend, why) of the backends that did not run on a device
    not_checked: list[tuple[str, str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # failures that are not rows

    @property
    def failures(self) -> list[testing.CaseResult]:
        return [r for r in self.rows if r.failed]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems


# ------------------------------------------------------------------------------- the report

COLUMNS = (("device", 7), ("backend", 7), ("opt", 4), ("dtype", 21), ("case", 19),
           ("result", 6), ("error", 9), ("tolerance", 9), ("rule", 8))


def _format(values) -> str:
    cells = []
    for (_, width), v in zip(COLUMNS, values):
        cells.append(f"{v:>{width}s}" if width == 9 else f"{v:<{width}s}")
    return "  ".join(cells).rstrip()


def format_row(r: testing.CaseResult) -> str:
    num = (lambda x: "" if x is None else ("inf" if math.isinf(x) and x > 0 else f"{x:.2e}"))
    line = _format((r.device, r.backend, r.kind.upper(), r.dtype, r.case, r.status, num(r.error),
                    num(r.tolerance), r.rule))
    if r.status in ("ERROR", "skip") or (r.failed and r.detail):
        line += f"  {r.detail}"
    return line


def _header() -> str:
    return _format(name for name, _ in COLUMNS)


# ------------------------------------------------------------------------------- devices

def machine_devices() -> list[torch.device]:
    """The CPU and every CUDA device."""
    cuda = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")] + cuda


def parse_devices(names: Iterable[str]) -> list[torch.device]:
    """``cpu``, ``cuda`` (every CUDA device) or ``cuda:N``; raises ValueError for others."""
    out: list[torch.device] = []
    for name in names:
        if name == "cuda":
            if torch.cuda.device_count() == 0:
                raise ValueError(f"--device cuda: no CUDA device is available (torch "
                                 f"{torch.__version__}, torch.version.cuda={torch.version.cuda})")
            out += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
            continue
        if name != "cpu" and not re.fullmatch(r"cuda:\d+", name):
            raise ValueError(f"--device {name!r}: expected cpu, cuda or cuda:N")
        dev = torch.device(name)
        if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
        out.append(dev)
    return list(dict.fromkeys(out))


def _why_not(name: str, device: torch.device) -> str | None:
    be = _backends.get_backend(name)
    if be is None:
        return f"not available in this process: {_backends.load_error(name)}"
    return be.unavailable_reason(device, torch.float32, torch.float32)


@contextlib.contextmanager
def _substituted(objects: Mapping[str, _backends.Backend] | None):
    """While active, ``backend=name`` resolves to ``objects[name]`` (see ``run``)."""
    saved = {name: _backends.set_backend(name, be) for name, be in (objects or {}).items()}
    try:
        yield
    finally:
        for name, be in saved.items():
            _backends.set_backend(name, be)


@contextlib.contextmanager
def _quiet_interpreter(device: torch.device, backend: str):
    """Triton's interpreter evaluates masked-off lanes too (0/0 for a 0-size tensor's trust
    ratio), which numpy reports as RuntimeWarnings about values that are then discarded."""
    with warnings.catch_warnings():
        if backend == "triton" and device.type == "cpu":
            warnings.filterwarnings("ignore", r"(invalid value|divide by zero|overflow)",
                                    RuntimeWarning)
        yield


# ------------------------------------------------------------------------------------ run

def run(devices: Iterable[str | torch.device] | None = None, backends: Iterable[str] | None = None,
        *, quick: bool = False, speed: bool = True, out=None,
        backend_objects: Mapping[str, _backends.Backend] | None = None,
        speed_shapes=None, speed_rounds: int | None = None, option_rows: bool = True,
        protocol: Iterable[str] | None = None) -> Report:
    """Runs the check and prints its tables to ``out`` (default: stdout); returns the report.

    ``devices``: default every device of the machine. ``backends``: names to check (default all
    registered ones that can run). ``backend_objects`` (for testing the check itself): backend
    objects that ``backend=name`` resolves to during the run instead of the registered ones, e.g.
    one that corrupts a result, which the check must then report as failed.
    ``speed_shapes`` / ``speed_rounds``: the speed tables' param shapes and rounds (defaults per
    device type, see ``speed_table``). ``option_rows``: run the rows of the option cases and
    dtypes; ``protocol``: names of the protocol rows to run (:data:`PROTOCOL_ROWS`; default
    all, ``()`` none; ValueError for a name that is none).
    """
    out = out or sys.stdout

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    devs = parse_devices(map(str, devices)) if devices is not None else machine_devices()
    requested = list(dict.fromkeys(backends)) if backends is not None else None
    names = requested or list(_backends._REGISTRY)
    report = Report()
    chosen = {dev: protocol_rows(dev, protocol) for dev in devs}  # raises for unknown names
    t0 = time.perf_counter()
    with _substituted(backend_objects):
        plan: list[tuple[torch.device, str]] = []
        for dev in devs:
            for name in names:
                why = _why_not(name, dev)
                if why is None:
                    plan.append((dev, name))
                else:
                    report.not_checked.append((str(dev), name, why))
        for name in requested or []:
            if not any(n == name for _, n in plan):
                report.problems.append(f"--backend {name} could run on none of the devices "
                                       f"({', '.join(map(str, devs))})")
        say(f"fusedopt {fusedopt.__version__} self-check: torch {torch.__version__}, devices "
            f"{', '.join(map(str, devs))}")
        say("each case: two param groups (the second with weight_decay=0, adapt=False), a 0-size "
            "tensor, 1 element, odd sizes,")
        say("a multi-chunk tensor, a zero weight and a zero gradient, stepped several times and "
            "compared with")
        say("the float64 reference (fusedopt/reference.py); the rules: python -m fusedopt check "
            "--help")
        for line in _not_checked_lines(report.not_checked, plan):
            say(line)
        for dev, name in plan:
            note = case_set(dev, name, quick).note
            if note:
                say(f"note: {note}{_interpreter_chunks() if name == 'triton' else ''}")
        if any(name == "triton" and dev.type == "cuda" for dev, name in plan):
            say("note: triton compiles each kernel specialization (flags, dtypes) on its first use "
                "and keeps it in Triton's cache, so a first run takes longer")
        cache = testing.RunCache()  # inputs, references and runs, shared by the rows
        if option_rows:
            say()
            say(_header())
            for dev, name in plan:
                cases = case_set(dev, name, quick)
                for case, dtype in cases.pairs:
                    with _quiet_interpreter(dev, name):
                        row = testing.run_case(case, name, dev, dtype, cases, cache)
                    report.rows.append(row)
                    say(format_row(row))
        if any(chosen[dev] for dev, _ in plan):
            say()
            for line in _protocol_notes(plan, quick, chosen):
                say(line)
            say()
            say(_header())
            for dev, name in plan:
                for kind in testing.KINDS:
                    for prow in chosen[dev]:
                        row = run_protocol_row(prow, kind, name, dev, quick, cache)
                        report.rows.append(row)
                        say(format_row(row))
        say()
        summary = {}
        for r in report.rows:
            s = summary.setdefault((r.device, r.backend),
                                   {"pass": 0, "FAIL": 0, "ERROR": 0, "skip": 0})
            s[r.status] += 1
        for (dev, name), s in summary.items():
            say(f"{dev} {name}: {s['pass']} passed, {s['FAIL']} failed, {s['ERROR']} errors"
                + (f", {s['skip']} skipped (dtypes it or this torch does not take)" if s["skip"] else ""))
        for p in report.problems:
            say(f"problem: {p}")
        say(f"correctness: {'PASS' if report.ok else 'FAIL'} ({len(report.rows)} rows, "
            f"{time.perf_counter() - t0:.1f} s)")
        say(COVERAGE)
        if speed:
            for dev in devs:
                names_here = [n for d, n in plan if d == dev]
                timed = [n for n in names_here if not (n == "triton" and dev.type == "cpu")]
                say()
                if len(timed) < len(names_here):
                    say(f"speed on {dev}: triton is not timed (Triton's interpreter runs there)")
                if not timed:
                    continue
                try:
                    speed_table(dev, timed, shapes=speed_shapes, rounds=speed_rounds, out=out)
                except Exception as e:  # noqa: BLE001 - the speed table never fails the check
                    say(f"speed on {dev}: not measured: {_one_line(e)}")
    return report


def _not_checked_lines(not_checked, plan) -> list[str]:
    """Why backends that run on none of the devices did not: once for a backend that does not
    load, else per device. A backend that runs on some device is not listed for the devices of
    other types that it refuses (cpp on a GPU, cuda on the CPU)."""
    running = {name for _, name in plan}
    lines = []
    for name in dict.fromkeys(n for _, n, _ in not_checked):
        if name in running:
            continue
        if _backends.get_backend(name) is None:
            lines.append(f"not checked: {name}: not available in this process: "
                         f"{_backends.load_error(name)}")
        else:
            lines += [f"not checked: {name} on {dev}: {why}"
                      for dev, n, why in not_checked if n == name]
    return lines


def _interpreter_chunks() -> str:
    """The Triton kernels' chunk size under the interpreter, for the note on its reduced set."""
    try:
        from ..kernels import tables
    except Exception:  # noqa: BLE001 - the note goes without it
        return ""
    return f" (chunks of {tables.CHUNK_SIZE:,} elements there)"


# ---------------------------------------------------------------------------- protocol rows
# Rows beside the option cases, for LAMB and LARS in fp32, on every backend and device checked:
# what GradScaler, a tensor lr and where tensors lie in memory (misaligned views, one large
# tensor) ask of a step. Each is stepped over the shapes and steps of the backend's case set
# (the large row over shapes of its own) and judged against the float64 reference and/or bit
# for bit against the same steps on plain inputs (PROTOCOL_RULES).

#: GradScaler's scales are powers of 2, so ``(g * 2**12) * 2**-12`` is ``g`` exactly and a step
#: on scaled grads must give the bits of the step on the plain ones
GRAD_SCALE = 2.0 ** 12
FP32 = testing.dtype_case("fp32")

#: The backends whose results do not depend on the address of a tensor's data (so a misaligned
#: row is also held to the bits of the aligned steps), and why. Triton is not one of them: its
#: misaligned tensors run with tiles of another layout, which changes the order of a tensor's
#: sums (Note [per-tensor alignment] in fusedopt/kernels/tables.py); eager runs torch's kernels,
#: whose reductions promise no such thing.
ALIGNMENT_FREE = {
    "cpp": "its chunks and the lanes of its sums count from a tensor's first element "
           "(Note [chunk partition], csrc/cpu/multi_tensor.h)",
    "cuda": "a misaligned chunk takes the element path in the vector path's order "
            "(Note [vectorization], csrc/cuda/multi_tensor_apply.cuh)",
}
# The chunk sizes and reduction widths that the large row's tensor exceeds.
CPP_CHUNK = 32768  # kChunk, csrc/cpu/multi_tensor.h
CUDA_CHUNK = 65536  # kChunkSize, csrc/cuda/launch.h
CUDA_REDUCE_LANES = 256  # kReduceBlockSize, csrc/cuda/multi_tensor_apply.cuh
#: Triton's REDUCE_BLOCK while the large row runs under the interpreter (fusedopt/kernels/
#: tables.py; tests/test_triton.py lowers it alike): a tensor of a few chunks then takes the
#: finaliser's loop several times, as one of over 128 chunks of 16,384 elements does on a GPU
INTERPRETED_REDUCE_BLOCK = 2
#: cpp chunks of the large row's tensor on the CPU (by ``quick``): many per thread, and over 128
#: as on a GPU in the full set; fewer with --quick, where the float64 reference of 4M elements
#: would take longer than the rest of the check
CPU_LARGE_CHUNKS = {False: 129, True: 17}

PROTOCOL_RULES = """\
The protocol rows (fp32, LAMB and LARS) are held to one or more of:

``rel``
    as above, against the float64 reference stepped from the same values.
``bits``
    every param and every state tensor (moments, step counts) bit for bit equal to those of the
    same backend stepped over the same values in the plain way: aligned tensors (the misaligned
    rows, on the backends whose results do not depend on a tensor's address: {aligned}), 1
    thread (the large row of cpp, run on 2 or more), unscaled grads (the GradScaler rows: a scale
    of 2**12 undone is exact), no skipped steps (found_inf) or the lr as a Python float, set
    before each step (a tensor lr, changed in place). The error is the number of elements that
    differ.
``no-op``
    a step with ``found_inf`` = 1 changes nothing: params, grads, every state entry and step
    count bit for bit (a skipped first step leaves the state it creates at zero). The error
    counts what changed: the entries (tensors) of a skipped later step, and the param elements
    that a skipped first step changed and the state elements it left nonzero.
``grads``
    the step leaves the scaled grads as they were (GradScaler's grads are unscaled as they are
    read). The error is the number of grad elements that changed.
""".format(aligned=", ".join(ALIGNMENT_FREE))


# What the rows above prove and what they leave to other checks (printed after them). The large
# row's sizes per device and backend are in the notes before the protocol rows (large_shapes);
# triton's GPU tiles (16,384-element chunks, REDUCE_BLOCK 128) are those of fusedopt/kernels/
# tables.py, which imports triton.
COVERAGE = (
    "covered: every option case and dtype of each backend on each device, several steps against "
    "the float64 reference, tensors of up to a few chunks; in fp32 (the protocol rows): "
    "misaligned views (the grads alone; params, grads and moments), one tensor of more chunks "
    "than a GPU backend's per-tensor reduction takes in one round "
    f"({CUDA_REDUCE_LANES + 1} of cuda's {CUDA_CHUNK:,}, over 128 of triton's 16,384; under "
    f"Triton's interpreter {2 * INTERPRETED_REDUCE_BLOCK + 2} of 2,048 with REDUCE_BLOCK lowered "
    f"to {INTERPRETED_REDUCE_BLOCK}) and, on the CPU, {CPU_LARGE_CHUNKS[False]} of cpp's "
    f"{CPP_CHUNK:,} ({CPU_LARGE_CHUNKS[True]} with --quick), cpp on 2 or more threads bit for "
    "bit against 1; GradScaler's grad_scale (without and with clipping) and found_inf (a skipped "
    "first and a skipped later step); a 0-dim float64 tensor lr changed in place (on the "
    "params' device, and on the CPU for GPU params); not covered here: the protocol rows in "
    "other dtypes than fp32, torch.amp.GradScaler itself (the rows set the attributes it sets), "
    "a float32 tensor lr, low-precision state, CUDA-graph capture, host syncs, bit-for-bit "
    "reruns (the test suite covers them, and scripts/gpu_verify.py runs its GPU tests)")


@dataclass
class _Ctx:
    """One protocol row being run."""

    kind: str
    backend: str
    device: torch.device
    cs: testing.CaseSet  # the backend's case set on this device (its shapes, steps, groups)
    case: testing.OptionCase
    quick: bool
    cache: testing.RunCache


def _stepped(ctx: _Ctx, inputs: testing.Inputs, *, excluded=None, **how):
    """Steps ``ctx``'s optimizer over ``inputs`` as :func:`testing.run_optimizer` does, with the
    case set's groups unless ``excluded`` is given; ``how``: its ``lr``, ``misalign``,
    ``before`` and ``after``. Returns ``(params, optimizer)``."""
    return testing.run_optimizer(ctx.kind, ctx.backend, ctx.case.options, inputs,
                                 device=ctx.device,
                                 excluded=ctx.cs.excluded if excluded is None else excluded, **how)


def _outputs(params, opt) -> list[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` of what a bitwise comparison compares: the params and their state."""
    return ([(f"param {i}", p.detach().clone()) for i, p in enumerate(params)]
            + [(label, t.detach().clone()) for label, t in testing.state_tensors(opt, params)])


def _plain(ctx: _Ctx, inputs: testing.Inputs):
    """The outputs of the plain steps of ``ctx`` over the case set's inputs (shared by the rows
    of one backend, device, kind and option case)."""
    return ctx.cache.get("protocol:plain", (str(ctx.device), ctx.backend, ctx.cs, ctx.case),
                         lambda: _outputs(*_stepped(ctx, inputs)))


def _rel(params, ref, dtype=torch.float32):
    err, tol = testing.max_rel_err(params, ref), testing.rel_tolerance(dtype)
    return ("rel", err, tol, f"rel {err:.3g} {'<=' if err <= tol else '>'} {tol:.3g} against the "
                             "float64 reference")


def _elements(n: int) -> str:
    return f"{n} element{'' if n == 1 else 's'}"


def _bits(against: str, got, want):
    n = testing.bit_mismatches([t for _, t in got], [t for _, t in want])
    text = f"bits: {_elements(n)} differ{'s' if n == 1 else ''} from {against}"
    if [label for label, _ in got] != [label for label, _ in want]:
        text += " (not the same state tensors)"
    elif n:
        first = next(label for (label, x), (_, y) in zip(got, want)
                     if testing.bit_mismatches([x], [y]))
        worst = testing.max_rel_err([t for _, t in got], [t for _, t in want])
        text += f" (the first in {first}; the largest relative difference {worst:.3g})"
    return ("bits", float(n), 0.0, text)


def _misaligned(lists: tuple[str, ...]):
    def run(ctx: _Ctx) -> list:
        inputs = testing.case_inputs(ctx.cache, ctx.cs, FP32)
        ref = testing.case_reference(ctx.cache, ctx.cs, ctx.case, FP32)
        params, opt = _stepped(ctx, inputs, misalign=lists)
        checks = [_rel(params, ref)]
        if ctx.backend in ALIGNMENT_FREE:
            checks.append(_bits("the same steps on aligned tensors", _outputs(params, opt),
                                _plain(ctx, inputs)))
        return checks
    return run


def large_shapes(device: torch.device, backend: str, quick: bool) -> tuple[tuple, str]:
    """The large row's shapes on ``device`` for ``backend``, and what its large tensor spans."""
    device = torch.device(device)
    small = ((3, 5), (0,), (1,))
    if device.type == "cpu" and backend == "triton":  # the interpreter: REDUCE_BLOCK lowered
        from ..kernels import tables
        n = (2 * INTERPRETED_REDUCE_BLOCK + 1) * tables.CHUNK_SIZE + 5
        chunks = -(-n // tables.CHUNK_SIZE)
        return ((n,), *small), (
            f"{n:,} elements, {chunks} chunks of {tables.CHUNK_SIZE:,} with REDUCE_BLOCK lowered "
            f"to {INTERPRETED_REDUCE_BLOCK} (the interpreter is too slow for over 128 chunks of "
            f"16,384): the finaliser loops {-(-chunks // INTERPRETED_REDUCE_BLOCK)} times, as "
            "over 128 chunks do on a GPU")
    if device.type == "cpu":
        chunks = CPU_LARGE_CHUNKS[quick]
        n = (chunks - 1) * CPP_CHUNK + 5
        return ((n,), *small), (
            f"{n:,} elements, {chunks} chunks of cpp's {CPP_CHUNK:,}" +
            (", cpp on 2 or more threads and bit for bit against 1 thread" if backend == "cpp"
             else ""))
    n = CUDA_REDUCE_LANES * CUDA_CHUNK + 5
    what = f"{n:,} elements"
    if backend == "cuda":
        what += (f", {-(-n // CUDA_CHUNK)} chunks of {CUDA_CHUNK:,}: more than the "
                 f"{CUDA_REDUCE_LANES} lanes of the per-tensor reduction")
    elif backend == "triton":
        from ..kernels import tables
        chunks = -(-n // tables.CHUNK_SIZE)
        what += (f", {chunks:,} chunks of {tables.CHUNK_SIZE:,}: the finaliser loops "
                 f"{-(-chunks // tables.REDUCE_BLOCK)} times over REDUCE_BLOCK "
                 f"{tables.REDUCE_BLOCK}")
    return ((n,), *small), what


@contextlib.contextmanager
def _interpreted_reduce_block(ctx: _Ctx):
    """Under Triton's interpreter, REDUCE_BLOCK lowered for the large row (see
    INTERPRETED_REDUCE_BLOCK); elsewhere nothing."""
    if not (ctx.backend == "triton" and ctx.device.type == "cpu"):
        yield
        return
    from ..kernels import tables
    saved = tables.REDUCE_BLOCK
    tables.REDUCE_BLOCK = INTERPRETED_REDUCE_BLOCK
    try:
        yield
    finally:
        tables.REDUCE_BLOCK = saved


def _large(ctx: _Ctx) -> list:
    shapes, _ = large_shapes(ctx.device, ctx.backend, ctx.quick)
    steps = min(ctx.cs.steps, 3)
    inputs = ctx.cache.get("inputs", ("large", shapes, steps),
                           lambda: testing.make_inputs(shapes, steps))
    # the reference on the checked device where it is a GPU (float64, as on the CPU, and
    # seconds faster for a tensor of 16M elements)
    ref_dev = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
    ref = ctx.cache.get("reference", ("large", shapes, steps, ctx.case, str(ref_dev)),
                        lambda: testing.run_reference(ctx.kind, ctx.case.options, inputs,
                                                            device=ref_dev))
    with _interpreted_reduce_block(ctx):
        if ctx.backend == "cpp" and ctx.device.type == "cpu":
            with torch_threads(max(2, torch.get_num_threads())):
                params, opt = _stepped(ctx, inputs, excluded=())
            with torch_threads(1):
                one = _outputs(*_stepped(ctx, inputs, excluded=()))
            return [_rel(params, ref), _bits("the same steps on 1 thread",
                                             _outputs(params, opt), one)]
        params, _ = _stepped(ctx, inputs, excluded=())
    return [_rel(params, ref)]


def _scale_grads(ctx: _Ctx, opt, params) -> None:
    """What torch.amp.GradScaler hands a step: grads times its scale, ``opt.grad_scale`` (float32
    on the grads' device) and ``opt.found_inf`` (0: no inf or NaN found)."""
    for p in params:
        p.grad.mul_(GRAD_SCALE)
    opt.grad_scale = torch.tensor(GRAD_SCALE, device=ctx.device)
    opt.found_inf = torch.zeros((), device=ctx.device)


def _grad_scale(ctx: _Ctx) -> list:
    inputs = testing.case_inputs(ctx.cache, ctx.cs, FP32)
    ref = testing.case_reference(ctx.cache, ctx.cs, ctx.case, FP32)
    given, changed = {}, [0]

    def before(k, opt, params):
        _scale_grads(ctx, opt, params)
        given[k] = [p.grad.clone() for p in params]

    def after(k, opt, params):
        changed[0] += testing.bit_mismatches([p.grad for p in params], given.pop(k))

    params, opt = _stepped(ctx, inputs, before=before, after=after)
    return [_bits("the same steps on unscaled grads", _outputs(params, opt), _plain(ctx, inputs)),
            _rel(params, ref),
            ("grads", float(changed[0]), 0.0,
             f"grads: {_elements(changed[0])} of the scaled grads changed by the steps")]


def _bad_grads(ctx: _Ctx, params) -> list[torch.Tensor]:
    """Grads of an overflowed step: scaled, with an inf in the first nonempty grad and a NaN in
    the last (what makes GradScaler set found_inf)."""
    gen = torch.Generator().manual_seed(7)
    out = [(torch.randn(p.shape, generator=gen) * GRAD_SCALE).to(ctx.device) for p in params]
    nonempty = [g for g in out if g.numel()]
    nonempty[0].view(-1)[0] = math.inf
    nonempty[-1].view(-1)[-1] = math.nan
    return out


def _found_inf(ctx: _Ctx) -> list:
    """Steps with found_inf = 1 (overflowed grads, scaled) before the first step and before the
    second: each must change nothing, and the steps around them must give the plain bits."""
    inputs = testing.case_inputs(ctx.cache, ctx.cs, FP32)
    ref = testing.case_reference(ctx.cache, ctx.cs, ctx.case, FP32)
    texts, count = [], [0]

    def before(k, opt, params):
        if k in (0, 1):
            real = [p.grad for p in params]
            for p, g in zip(params, _bad_grads(ctx, params)):
                p.grad = g
            opt.grad_scale = torch.tensor(GRAD_SCALE, device=ctx.device)
            opt.found_inf = torch.ones((), device=ctx.device)
            if k == 0:  # no state yet: the step makes it, and must leave it at zero
                was = [p.detach().clone() for p in params]
                opt.step()
                moved = testing.bit_mismatches(params, was)
                nonzero = sum(int(t.count_nonzero()) for _, t in testing.state_tensors(opt, params))
                if moved or nonzero:
                    texts.append(f"a skipped first step changed {_elements(moved)} of the "
                                 f"params and left {_elements(nonzero)} of the state nonzero")
                count[0] += moved + nonzero
            else:
                before_step = testing.snapshot([opt])
                opt.step()
                diff = testing.changed(before_step, testing.snapshot([opt]))
                if diff:
                    texts.append(f"a skipped step changed {', '.join(diff[:3])}"
                                 + (f" and {len(diff) - 3} more" if len(diff) > 3 else ""))
                count[0] += len(diff)
            for p, g in zip(params, real):
                p.grad = g
        opt.grad_scale = None
        opt.found_inf = torch.zeros((), device=ctx.device)

    params, opt = _stepped(ctx, inputs, before=before)
    return [("no-op", float(count[0]), 0.0,
             "; ".join(texts) or "no-op: the skipped steps changed nothing"),
            _bits("the same steps without the skipped ones", _outputs(params, opt),
                  _plain(ctx, inputs)),
            _rel(params, ref)]


def _tensor_lr(on_cpu: bool):
    def run(ctx: _Ctx) -> list:
        """A 0-dim float64 tensor lr (on the params' device, or on the CPU), set in place before
        each step as a scheduler does, against the float lr set in the group before each step:
        a float64 tensor holds the Python float exactly, so the bits must be the same."""
        inputs = testing.case_inputs(ctx.cache, ctx.cs, FP32)
        lrs = [testing.LR[ctx.kind] * 0.8 ** k for k in range(inputs.steps)]

        def set_float(k, opt, params):
            for g in opt.param_groups:
                g["lr"] = lrs[k]

        floats = ctx.cache.get(
            "protocol:float lr", (str(ctx.device), ctx.backend, ctx.cs, ctx.case),
            lambda: _outputs(*_stepped(ctx, inputs, lr=lrs[0], before=set_float)))
        lr = torch.tensor(lrs[0], dtype=torch.float64,
                          device="cpu" if on_cpu else ctx.device)
        params, opt = _stepped(ctx, inputs, lr=lr, before=lambda k, o, p: lr.fill_(lrs[k]))
        ref = ctx.cache.get(
            "reference", ("lr schedule", ctx.cs, ctx.case),
            lambda: testing.run_reference(ctx.kind, ctx.case.options, inputs,
                                                excluded=ctx.cs.excluded, lrs=lrs))
        return [_bits("the same steps with the lr a float", _outputs(params, opt), floats),
                _rel(params, ref)]
    return run


@dataclass(frozen=True)
class ProtocolRow:
    name: str  # the case column
    option_case: str  # the option case of testing.OPTION_CASES it runs, per kind
    run: Callable[[_Ctx], list]  # the checks: (rule, error, tolerance, text)
    what: str
    accelerator_only: bool = False  # a row that the CPU device would run as another row


PROTOCOL_ROWS = (
    ProtocolRow("misaligned:grads", "mixed", _misaligned(("grads",)),
                "every grad a view 4 bytes past a 16-byte boundary, params and state aligned"),
    ProtocolRow("misaligned:all", "mixed", _misaligned(("params", "grads", "state")),
                "params, grads and moments views 4 bytes past a 16-byte boundary"),
    ProtocolRow("large", "default", _large, "one tensor of many chunks (below, per backend)"),
    ProtocolRow("grad_scale", "default", _grad_scale,
                f"grads times {GRAD_SCALE:g} with opt.grad_scale and opt.found_inf = 0, as "
                "torch.amp.GradScaler hands them, against unscaled grads"),
    ProtocolRow("grad_scale+clip", "clip", _grad_scale,
                "the same with clipping by the global norm (of the unscaled grads)"),
    ProtocolRow("found_inf", "clip", _found_inf,
                "steps with found_inf = 1 and overflowed grads, before the first step and the "
                "second: each changes nothing"),
    ProtocolRow("tensor_lr", "mixed", _tensor_lr(False),
                "a 0-dim float64 tensor lr on the params' device, changed in place before each "
                "step, against the float lr"),
    ProtocolRow("tensor_lr:cpu", "mixed", _tensor_lr(True),
                "the same with the tensor lr on the CPU", accelerator_only=True),
)


def protocol_rows(device: torch.device, names: Iterable[str] | None = None) -> list[ProtocolRow]:
    """The protocol rows that run on ``device`` (only those named in ``names``, if given;
    ValueError for a name that is none)."""
    if isinstance(names, str):
        raise TypeError(f"protocol rows: expected an iterable of row names, got the str "
                        f"{names!r}")
    if names is not None:
        names = list(names)
        unknown = [n for n in names if n not in {r.name for r in PROTOCOL_ROWS}]
        if unknown:
            raise ValueError(f"unknown protocol rows {unknown}; the rows: "
                             f"{', '.join(r.name for r in PROTOCOL_ROWS)}")
    return [r for r in PROTOCOL_ROWS if (names is None or r.name in names)
            and not (r.accelerator_only and torch.device(device).type == "cpu")]


def _checked(result: testing.CaseResult, checks: list) -> testing.CaseResult:
    """``result`` judged by ``checks`` (rule, error, tolerance, text): passed when every error is
    within its tolerance (a NaN never is); the columns show the check whose error is largest
    against its tolerance, ``detail`` every check, the failed ones first."""
    def ratio(c):
        e, t = c[1], c[2]
        if math.isnan(e):
            return math.inf
        return e / t if t > 0 else (math.inf if e > 0 else 0.0)

    failed = [c for c in checks if not c[1] <= c[2]]
    worst = max(checks, key=ratio)
    result.rule, result.error, result.tolerance = worst[0], worst[1], worst[2]
    result.status = "FAIL" if failed else "pass"
    result.detail = "; ".join(c[3] for c in failed + [c for c in checks if c not in failed])
    return result


def run_protocol_row(row: ProtocolRow, kind: str, backend: str, device, quick: bool = False,
                     cache: testing.RunCache | None = None) -> testing.CaseResult:
    """One protocol row for ``kind`` on ``backend`` and ``device``; never raises for what the
    backend does (a backend that raises gives an ``ERROR`` row)."""
    device = torch.device(device)
    result = testing.CaseResult(str(device), backend, kind, FP32.name, row.name)
    ctx = _Ctx(kind, backend, device, case_set(device, backend, quick),
               testing.option_case(kind, row.option_case), quick,
               cache if cache is not None else testing.RunCache())
    try:
        with _quiet_interpreter(device, backend):
            checks = row.run(ctx)
    except Exception as e:  # noqa: BLE001 - a backend that raises is a failed row
        result.detail = _one_line(e)
        return result
    return _checked(result, checks)


def _protocol_notes(plan, quick: bool, chosen: Mapping[torch.device, list]) -> list[str]:
    """What the protocol rows of ``chosen`` (per device) do, before their table."""
    rows = {r.name: r for dev, _ in plan for r in chosen[dev]}
    lines = ["protocol rows: fp32, LAMB and LARS, over the shapes and steps of each backend's "
             "case set; the rules: rel, bits, no-op, grads (--help)"]
    for row in rows.values():
        lines.append(f"  {row.name:16s} ({row.option_case} options) {row.what}")
    if "large" in rows:
        for dev, name in plan:
            _, what = large_shapes(dev, name, quick)
            lines.append(f"  large on {dev} {name}: {what}")
    aligned = [n for _, n in plan if n in ALIGNMENT_FREE]
    if aligned and any(n.startswith("misaligned") for n in rows):
        lines.append("  misaligned rows bit for bit against the aligned steps on "
                     + ", ".join(dict.fromkeys(aligned)))
    return lines


# ------------------------------------------------------------------------------ speed

def _apex_lamb():
    try:
        from apex.optimizers import FusedLAMB
    except Exception:  # noqa: BLE001 - apex missing or built against another torch
        return None
    return FusedLAMB


def _adamw(params, device):
    """torch's AdamW: fused where the device has the fused kernel, else foreach."""
    try:
        return "torch AdamW(fused=True)", torch.optim.AdamW(params, fused=True)
    except (RuntimeError, ValueError):
        return "torch AdamW(foreach=True)", torch.optim.AdamW(params, foreach=True)


def speed_table(device: torch.device, backend_names: list[str], *, shapes=None,
                rounds: int | None = None, out=None) -> None:
    """Times ``step()`` of LAMB and LARS on each backend beside torch's AdamW (and apex's
    FusedLAMB on CUDA when apex imports), interleaved with the in-place bandwidth yardstick, and
    prints the table of :func:`fusedopt.tools.bench.print_table` (GB/s by its bytes model).

    Default params: BERT-base (110M elements) on CUDA; on the CPU one BERT-shaped layer of width
    512 with a 2,000-word vocabulary (4.7M elements, 19 MB a list in fp32: larger than the
    caches once the state is counted), so that a row takes a few hundred ms there."""
    from contextlib import redirect_stdout

    from . import bench

    out = out or sys.stdout
    device = torch.device(device)
    if shapes is None:
        shapes = (bench.bert_base_shapes() if device.type == "cuda"
                  else bench.bert_base_shapes(layers=1, vocab=2000, hidden=512, ffn=2048))
    rounds = rounds or (20 if device.type == "cuda" else 5)
    numel = sum(torch.Size(s).numel() for s in shapes)
    params = bench.make_params(shapes, device)
    a, c = torch.randn(numel, device=device), torch.randn(numel, device=device)
    # label -> (bytes model key, step, phase); phase 1: optimizers that allocate param-sized
    # temporaries every step, timed apart from the others (see fusedopt.tools.bench)
    rows: dict[str, tuple] = {bench.YARDSTICK: (12, lambda: a.add_(c, alpha=1e-3), 0)}
    for name in backend_names:
        phase = int(name == "eager")
        rows[f"fusedopt LAMB [{name}]"] = (
            bench.BYTES_PER_ELEMENT["lamb"], fusedopt.FusedLAMB(params, backend=name).step, phase)
        rows[f"fusedopt LARS [{name}]"] = (
            bench.BYTES_PER_ELEMENT["lars"],
            fusedopt.FusedLARS(params, lr=0.1, weight_decay=1e-4, backend=name).step, phase)
    label, adamw = _adamw(params, device)
    rows[label] = (bench.BYTES_PER_ELEMENT["adamw"], adamw.step, 0)
    apex_lamb = _apex_lamb() if device.type == "cuda" else None
    if apex_lamb is not None:
        # the settings under which it computes fusedopt's default LAMB: apex clips by
        # global_norm / max_grad_norm whenever the norm exceeds it, so 0 would divide every grad
        # by inf; inf never clips. Its bytes: a grad-norm pass (4), stage 1 reading g, w, m, v and
        # writing m, v, u (28), the norms of w and u (8), stage 2 reading w, u, writing w (12).
        rows["apex FusedLAMB"] = (52, apex_lamb(params, eps=1e-6, weight_decay=0.01,
                                                max_grad_norm=float("inf"),
                                                use_nvlamb=True).step, 0)
    broken = []
    for k, (_, fn, _) in list(rows.items()):
        try:
            fn()  # one untimed step: a candidate that raises is reported, not timed
        except Exception as e:  # noqa: BLE001
            broken.append(f"{k}: not timed, its step raised {_one_line(e)}")
            del rows[k]
    times: dict[str, list[float]] = {}
    for phase in (0, 1):
        fns = {k: fn for k, (_, fn, ph) in rows.items() if ph == phase}
        if phase == 0 or fns:
            times.update(bench.interleave(fns, device, rounds, warmup=1))
    results = [bench.Result(k, rows[k][0], t) for k, t in times.items()]
    with redirect_stdout(out):
        bench.print_table(f"speed on {device}", len(shapes), numel, results)
        print("GB/s: bytes per element of fusedopt.tools.bench's model (LAMB 40, LARS 28, "
              "AdamW 28) x elements / median step; of bw: that over the in-place bandwidth "
              "(12 B/element)", flush=True)
        for line in broken:
            print(line, flush=True)
        if device.type == "cuda" and apex_lamb is None:
            print("apex FusedLAMB: not timed (apex does not import)", flush=True)


# ------------------------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None, *,
         backend_objects: Mapping[str, _backends.Backend] | None = None) -> int:
    """``python -m fusedopt check``; returns the exit status (0: every row passed).
    ``backend_objects``: as for :func:`run` (for testing the check itself)."""
    ap = argparse.ArgumentParser(prog="python -m fusedopt check",
                                 description=f"{__doc__}\n{testing.RULES}\n{PROTOCOL_RULES}",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a reduced set: fewer shapes, cases, dtypes and steps")
    ap.add_argument("--backend", action="append", choices=list(_backends._REGISTRY),
                    metavar="NAME", help="check only this backend (repeatable): "
                    + ", ".join(_backends._REGISTRY))
    ap.add_argument("--device", action="append", metavar="DEV",
                    help="check only this device (repeatable): cpu, cuda (every CUDA device) "
                         "or cuda:N; default: the CPU and every CUDA device")
    ap.add_argument("--no-speed", action="store_true", help="skip the speed tables")
    ap.add_argument("--json", metavar="PATH",
                    help="also write the rows, the backends not checked and the problems to PATH "
                         "(scripts/gpu_verify.py reads it)")
    args = parse_once(ap, argv)
    try:
        devices = parse_devices(args.device) if args.device else None
        if args.json:
            check_file_path("--json", args.json)
    except (ValueError, DemoError) as e:
        ap.error(str(e))
    report = run(devices, args.backend, quick=args.quick, speed=not args.no_speed,
                 backend_objects=backend_objects)
    if args.json:
        write_json(report, args.json, quick=args.quick)
    return 0 if report.ok else 1


def report_dict(report: Report, *, quick: bool = False) -> dict:
    """The report as JSON-ready data: every row (device, backend, optimizer, dtype, case, status,
    error, tolerance, rule, detail), the backends not checked with the reason, the problems."""
    return dict(
        mode="quick" if quick else "full", ok=report.ok, torch=torch.__version__,
        fusedopt=fusedopt.__version__,
        rows=[dict(device=r.device, backend=r.backend, kind=r.kind, dtype=r.dtype, case=r.case,
                   status=r.status, error=_json_float(r.error),
                   tolerance=_json_float(r.tolerance), rule=r.rule,
                   detail=r.detail) for r in report.rows],
        not_checked=[dict(device=d, backend=b, reason=why) for d, b, why in report.not_checked],
        problems=list(report.problems))


def _json_float(x):
    """A number as strict JSON holds it (inf and nan as strings)."""
    return x if x is None or math.isfinite(x) else str(x)


def write_json(report: Report, path: str, *, quick: bool = False) -> None:
    import json

    with open(path, "w") as f:
        json.dump(report_dict(report, quick=quick), f, indent=1, allow_nan=False, default=str)


if __name__ == "__main__":
    sys.exit(main())
