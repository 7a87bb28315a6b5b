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
zero-norm rule) and a zero gradient. The flag cases cover each switch of the math; the
low-precision storage cases (bf16 and fp16 params, with and without fp32 master weights, and fp32
params with bf16 grads) run the default flags and a mix of flags.

A row passes when its error is within the tolerance of its rule (the ``rule`` column):

``rel``
    fp32 and fp64 params (and fp32 params with bf16 grads): per tensor,
    ``max|x - ref| / max|ref|``, the largest over the tensors, at most 1e-5 (fp32 math) or 1e-11
    (fp64 math).
``2x eager``
    bf16/fp16 params of a backend other than eager: every element within twice the eager
    backend's error (eager run on the same device) plus a slack,
    ``|x - ref| <= 2 |eager - ref| + max(atol, ulp)``, with atol 2**-8 (bf16) or 2**-11 (fp16)
    and ulp the spacing of the param dtype's numbers at that element. The ulp is there because
    a backend whose fp32 result differs from eager's by a few fp32 ulps (another summation
    order, a fused multiply-add) stores the neighbouring bf16/fp16 value wherever eager's result
    lay that close to a rounding boundary: in the full set's fp16 cases the C++ and eager
    backends store different values for about 0.1% of the elements, one ulp apart, and above
    1.0 one fp16 ulp is more than atol alone allows.
    The error and tolerance shown are ``|x - ref| - 2 |eager - ref|`` and the slack at the
    element where their ratio is largest (error 0: every element within twice eager's error).
``master``
    with fp32 master weights: the masters within the fp32 tolerance of ``rel`` (the math runs in
    fp32 on them), and every param bit-equal to its master rounded to the param dtype.
``steps*u``
    bf16/fp16 params of the eager backend without masters (it is the yardstick of ``2x eager``, so
    it is held to a bound of its own): ``rel`` at most one rounding of the stored value per step,
    ``steps * u`` with the unit roundoff u = 2**-8 (bf16) or 2**-11 (fp16).

A row held to several rules (``master`` and ``2x eager``) passes when it meets all of them; the
table shows the one whose error is largest against its tolerance.
``rel``, ``master`` and ``2x eager`` use the tolerances the test suite holds the C++ backend to
(``2x eager`` adds the ulp); ``steps*u`` is the check's own.

Triton on CPU tensors runs only under its interpreter (``TRITON_INTERPRET=1`` set before triton is
first imported), which executes every operation of every program in Python, about a millisecond
each: there it runs a reduced set (small tensors, fewer cases and steps).

A short speed table per device follows (``--no-speed`` skips it): ms per ``step()`` and GB/s by
the bytes model of :mod:`fusedopt.tools.bench` for the fusedopt backends checked there, beside
torch's ``AdamW`` (fused where the device supports it, else foreach) and apex's ``FusedLAMB`` when
apex imports, with the in-place bandwidth of ``a.add_(c, alpha=s)`` measured in the same rounds.

The exit status is 0 when every row passed and 1 otherwise (a failed row, a backend that raised,
or a ``--backend`` that could run on none of the devices).
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
from fusedopt.reference import ReferenceLAMB, ReferenceLARS

# ------------------------------------------------------------------------------ tolerances

# Largest per-tensor ``max|x - ref| / max|ref|`` by the dtype the math runs in.
REL_TOL = {torch.float32: 1e-5, torch.float64: 1e-11}
# Absolute slack of the ``2x eager`` rule, by param dtype.
ROUNDING_ATOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# Unit roundoff (half the spacing of the numbers in [1, 2)) of the low-precision param dtypes.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def rel_tolerance(param_dtype: torch.dtype) -> float:
    """The ``rel`` tolerance for params of ``param_dtype`` (fp64 math for fp64, else fp32)."""
    return REL_TOL[torch.float64 if param_dtype == torch.float64 else torch.float32]


# --------------------------------------------------------------------------------- the cases

LR = {"lamb": 1e-2, "lars": 0.5}
# Shapes of every case: 0-size, 1 element, odd sizes, several dims, and 140,001 elements, which
# spans several chunks of every fused backend (cpp 32,768; cuda 65,536 with a partial third;
# triton 16,384 on a GPU).
SHAPES = ((3, 5), (7,), (0,), (1,), (4097,), (2, 3, 4), (18011,), (140001,), (256, 300))
QUICK_SHAPES = ((3, 5), (7,), (0,), (1,), (4097,), (2, 3, 4), (70001,))
INTERPRETER_SHAPES = ((3, 5), (7,), (0,), (1,), (4097,), (2, 3, 4))
ZERO_WEIGHT, ZERO_GRAD, EXCLUDED = 1, 3, 5  # indices into the shapes (EXCLUDED: second group)


@dataclass(frozen=True)
class Case:
    kind: str  # "lamb" or "lars"
    name: str
    hyper: tuple  # (option, value) pairs passed to the optimizer and the reference

    @property
    def options(self) -> dict:
        return dict(self.hyper)


def _case(kind: str, name: str, **hyper) -> Case:
    return Case(kind, name, tuple(sorted(hyper.items())))


LAMB_CASES = (
    _case("lamb", "default"),
    _case("lamb", "bias_correction=False", bias_correction=False),
    _case("lamb", "grad_averaging=False", grad_averaging=False),
    _case("lamb", "decoupled_weight_decay", decoupled_weight_decay=True, weight_decay=0.1),
    _case("lamb", "trust_ratio_bounds", trust_ratio_bounds=(0.8, 1.2)),
    _case("lamb", "adapt=False", adapt=False),
    _case("lamb", "max_grad_norm", max_grad_norm=0.5),
    _case("lamb", "mixed", bias_correction=False, grad_averaging=False,
          decoupled_weight_decay=True, weight_decay=0.1, trust_ratio_bounds=(0.5, 2.0),
          max_grad_norm=0.5),
)
LARS_CASES = (
    _case("lars", "default", weight_decay=1e-4),
    _case("lars", "nesterov", nesterov=True, weight_decay=1e-4),
    _case("lars", "trust_clip", trust_clip=True, trust_coefficient=1.0, weight_decay=1e-4),
    _case("lars", "denominator=combined", denominator="combined", weight_decay=1e-2),
    _case("lars", "lr_in_momentum=False", lr_in_momentum=False, dampening=0.3, weight_decay=1e-4),
    _case("lars", "adapt=False", adapt=False, weight_decay=1e-4),
    _case("lars", "max_grad_norm", max_grad_norm=0.5, weight_decay=1e-4),
    _case("lars", "mixed", lr_in_momentum=False, nesterov=True, trust_clip=True,
          trust_coefficient=1.0, denominator="combined", weight_decay=1e-2, max_grad_norm=0.5),
)


@dataclass(frozen=True)
class Precision:
    label: str
    param: torch.dtype
    grad: torch.dtype
    master: bool | None = None  # the optimizer's master_weights option

    @property
    def low(self) -> bool:
        return self.param in (torch.bfloat16, torch.float16)


FP32 = Precision("fp32", torch.float32, torch.float32)
FP64 = Precision("fp64", torch.float64, torch.float64)
BF16 = Precision("bf16", torch.bfloat16, torch.bfloat16, master=False)
BF16_MASTER = Precision("bf16+master", torch.bfloat16, torch.bfloat16, master=True)
FP16 = Precision("fp16", torch.float16, torch.float16, master=False)
FP16_MASTER = Precision("fp16+master", torch.float16, torch.float16, master=True)
FP32_BF16_GRADS = Precision("fp32,grad=bf16", torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class CaseSet:
    """What runs for one (device, backend): shapes, steps, and (case, precision) pairs."""

    shapes: tuple
    steps: int
    pairs: tuple  # of (Case, Precision)
    note: str | None = None


def _pairs(flag_cases: Iterable[Case], flag_precisions, low_cases: Iterable[Case], low_precisions):
    out = [(c, p) for c in flag_cases for p in flag_precisions]
    out += [(c, p) for c in low_cases for p in low_precisions]
    order = {c: i for i, c in enumerate(LAMB_CASES + LARS_CASES)}
    return tuple(sorted(out, key=lambda cp: (cp[0].kind != "lamb", order[cp[0]])))


def _by_name(cases, *names):
    return [c for c in cases if c.name in names]


FULL = CaseSet(SHAPES, 5, _pairs(
    LAMB_CASES + LARS_CASES, (FP32, FP64),
    _by_name(LAMB_CASES + LARS_CASES, "default", "mixed"),
    (BF16, BF16_MASTER, FP16, FP16_MASTER, FP32_BF16_GRADS)))
QUICK = CaseSet(QUICK_SHAPES, 3, _pairs(
    _by_name(LAMB_CASES + LARS_CASES, "default", "mixed"), (FP32,),
    _by_name(LAMB_CASES + LARS_CASES, "default"), (FP64, BF16, FP16_MASTER)))
INTERPRETED = CaseSet(INTERPRETER_SHAPES, 2, _pairs(
    _by_name(LAMB_CASES + LARS_CASES, "default", "mixed"), (FP32,),
    _by_name(LAMB_CASES + LARS_CASES, "default"), (FP64, BF16, FP16_MASTER)),
    note="triton on cpu runs in Triton's interpreter (TRITON_INTERPRET=1), about 1 ms per "
         "operation of every program, so it checks a reduced set: tensors of at most 4,097 "
         "elements, 2 steps, the default and mixed flags")


def case_set(device: torch.device, backend: str, quick: bool) -> CaseSet:
    if backend == "triton" and device.type == "cpu":
        return INTERPRETED
    return QUICK if quick else FULL


# ------------------------------------------------------------------------------ running a case

@dataclass
class Row:
    device: str
    backend: str
    kind: str
    precision: str
    case: str
    result: str  # "pass", "FAIL", "ERROR" or "skip"
    error: float | None = None
    tolerance: float | None = None
    rule: str = ""
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.result in ("FAIL", "ERROR")


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    # (device, backend, why) of the backends that did not run on a device
    not_checked: list[tuple[str, str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # failures that are not rows

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.failed]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems


class _Inputs:
    """The initial values and gradients of every step, generated once per (shapes, steps,
    precision) on the CPU, rounded to the param and grad dtypes, and the reference's result
    from the same rounded values, computed once per case."""

    def __init__(self):
        self._data: dict = {}
        self._ref: dict = {}
        self.eager: dict = {}  # the eager runs of the ``2x eager`` rule (``_eager_baseline``)

    def data(self, shapes, steps, precision: Precision):
        key = (shapes, steps, precision.param, precision.grad)
        if key not in self._data:
            gen = torch.Generator().manual_seed(0)
            init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
            init[ZERO_WEIGHT].zero_()
            grads = []
            for _ in range(steps):
                gs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
                gs[ZERO_GRAD].zero_()
                grads.append([g.to(precision.grad) for g in gs])
            self._data[key] = ([t.to(precision.param) for t in init], grads)
        return self._data[key]

    def reference(self, shapes, steps, precision: Precision, case: Case) -> list[torch.Tensor]:
        key = (shapes, steps, precision.param, precision.grad, case)
        if key not in self._ref:
            init, grads = self.data(shapes, steps, precision)
            groups = _group_indices(len(shapes))
            hyper = [{**case.options, "lr": LR[case.kind]},
                     {**case.options, "lr": LR[case.kind], "weight_decay": 0.0, "adapt": False}]
            ref = (ReferenceLAMB if case.kind == "lamb" else ReferenceLARS)(hyper)
            weights = [t.to(torch.float64, copy=True) for t in init]
            for gs in grads:
                ref.step([[weights[i] for i in idx] for idx in groups],
                         [[gs[i] for i in idx] for idx in groups])
            self._ref[key] = weights
        return self._ref[key]


def _group_indices(n: int) -> list[list[int]]:
    return [[i for i in range(n) if i != EXCLUDED], [EXCLUDED]]


def run_optimizer(device: torch.device, backend: str, case: Case, precision: Precision,
                  shapes, steps: int, inputs: _Inputs):
    """Steps a fusedopt optimizer ``steps`` times; returns its params and their masters (or
    None), as float64 CPU tensors."""
    init, grads = inputs.data(shapes, steps, precision)
    params = [torch.nn.Parameter(t.to(device, copy=True)) for t in init]
    if precision.grad != precision.param:
        for p in params:
            if hasattr(p, "grad_dtype"):  # torch >= 2.10 checks grad dtypes unless told otherwise
                p.grad_dtype = precision.grad
    groups = _group_indices(len(shapes))
    opt_groups = [{"params": [params[i] for i in groups[0]]},
                  {"params": [params[i] for i in groups[1]], "weight_decay": 0.0, "adapt": False}]
    cls = fusedopt.FusedLAMB if case.kind == "lamb" else fusedopt.FusedLARS
    opt = cls(opt_groups, lr=LR[case.kind], backend=backend, master_weights=precision.master,
              **case.options)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.to(device, copy=True)
        opt.step()
    out = [p.detach().to("cpu", torch.float64) for p in params]
    masters = None
    if precision.master:
        masters = [opt.state[p]["master_param"].detach() for p in params]
        rounded_ok = all(torch.equal(m.to(p.dtype), p.detach()) for m, p in zip(masters, params))
        masters = ([m.to("cpu", torch.float64) for m in masters], rounded_ok)
    return out, masters


def max_rel_error(xs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    """Largest per-tensor ``max|x - ref| / max|ref|`` (0-size tensors skipped; NaN gives inf)."""
    worst = 0.0
    for x, r in zip(xs, refs):
        if x.numel() == 0:
            continue
        err = (x - r).abs().max().item() / (r.abs().max().item() or 1.0)
        if not math.isfinite(err):
            return math.inf
        worst = max(worst, err)
    return worst


def excess_over_eager(xs, eager, refs, dtype: torch.dtype) -> tuple[float, float]:
    """The ``2x eager`` rule: ``(excess, slack)`` at the element where ``excess / slack`` is
    largest, with ``excess = |x - ref| - 2 |eager - ref|`` (0 when no element exceeds) and
    ``slack = max(atol, ulp)``; NaN gives an infinite excess."""
    atol, eps = ROUNDING_ATOL[dtype], torch.finfo(dtype).eps
    worst, worst_ratio = (0.0, atol), 0.0
    for x, e, r in zip(xs, eager, refs):
        if x.numel() == 0:
            continue
        excess = (x - r).abs() - 2 * (e - r).abs()
        if excess.isnan().any():
            return math.inf, atol
        # the spacing of the param dtype's numbers at the larger of |x| and |ref|
        _, exponent = torch.frexp(torch.maximum(x.abs(), r.abs()))
        slack = torch.ldexp(torch.full_like(r, eps), exponent - 1).clamp_min(atol)
        ratio = excess / slack
        i = int(ratio.argmax())
        if ratio.view(-1)[i].item() > worst_ratio:
            worst_ratio = ratio.view(-1)[i].item()
            worst = (excess.view(-1)[i].item(), slack.view(-1)[i].item())
    return worst


def _judge(row: Row, checks: list[tuple[str, float, float]]) -> Row:
    """Fills the row from (rule, error, tolerance) checks: it passes when all do; the rule shown
    is the one with the largest error relative to its tolerance."""
    rule, err, tol = max(checks, key=lambda c: c[1] / c[2])
    row.rule, row.error, row.tolerance = rule, err, tol
    row.result = "pass" if all(e <= t for _, e, t in checks) else "FAIL"
    return row


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def check_row(device: torch.device, backend: str, case: Case, precision: Precision,
              cases: CaseSet, inputs: _Inputs, eager_result: Callable[[], list]) -> Row:
    row = Row(str(device), backend, case.kind.upper(), precision.label, case.name, "ERROR")
    be = _backends.get_backend(backend)
    why = be.unavailable_reason(device, precision.param, precision.grad) if be else None
    if why is not None:
        row.result, row.detail = "skip", why
        return row
    ref = inputs.reference(cases.shapes, cases.steps, precision, case)
    try:
        got, masters = run_optimizer(device, backend, case, precision, cases.shapes, cases.steps,
                                     inputs)
    except Exception as e:  # noqa: BLE001 - a backend that raises is a failed row
        row.detail = _one_line(e)
        return row
    if not precision.low:
        return _judge(row, [("rel", max_rel_error(got, ref), rel_tolerance(precision.param))])
    checks, rounded_ok = [], True
    if masters is not None:
        master_values, rounded_ok = masters
        checks.append(("master", max_rel_error(master_values, ref), REL_TOL[torch.float32]))
    if backend == "eager":
        if masters is None:
            checks.append(("steps*u", max_rel_error(got, ref),
                           cases.steps * UNIT_ROUNDOFF[precision.param]))
    else:
        try:
            eager = eager_result()
        except Exception as e:  # noqa: BLE001
            row.detail = f"the eager run this row is compared with raised {_one_line(e)}"
            return row
        checks.append(("2x eager", *excess_over_eager(got, eager, ref, precision.param)))
    _judge(row, checks)
    if not rounded_ok:
        row.result = "FAIL"
        row.detail = "a param differs from its master weight rounded to the param dtype"
    return row


# ------------------------------------------------------------------------------- the report

COLUMNS = (("device", 7), ("backend", 7), ("opt", 4), ("dtype", 14), ("case", 22),
           ("result", 6), ("error", 9), ("tolerance", 9), ("rule", 8))


def _format(values) -> str:
    cells = []
    for (_, width), v in zip(COLUMNS, values):
        cells.append(f"{v:>{width}s}" if width == 9 else f"{v:<{width}s}")
    return "  ".join(cells).rstrip()


def format_row(r: Row) -> str:
    num = (lambda x: "" if x is None else ("inf" if math.isinf(x) and x > 0 else f"{x:.2e}"))
    line = _format((r.device, r.backend, r.kind, r.precision, r.case, r.result, num(r.error),
                    num(r.tolerance), r.rule))
    if r.result in ("ERROR", "skip") or (r.failed and r.detail):
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
        speed_shapes=None, speed_rounds: int | None = None) -> Report:
    """Runs the check and prints its tables to ``out`` (default: stdout); returns the report.

    ``devices``: default every device of the machine. ``backends``: names to check (default all
    registered ones that can run). ``backend_objects`` (for testing the check itself): backend
    objects that ``backend=name`` resolves to during the run instead of the registered ones, e.g.
    one that corrupts a result, which the check must then report as failed.
    ``speed_shapes`` / ``speed_rounds``: the speed tables' param shapes and rounds (defaults per
    device type, see ``speed_table``).
    """
    out = out or sys.stdout

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    devs = parse_devices(map(str, devices)) if devices is not None else machine_devices()
    requested = list(dict.fromkeys(backends)) if backends is not None else None
    names = requested or list(_backends._REGISTRY)
    report = Report()
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
        say()
        say(_header())
        inputs = _Inputs()
        for dev, name in plan:
            cases = case_set(dev, name, quick)
            for case, precision in cases.pairs:
                eager = _eager_baseline(dev, case, precision, cases, inputs)
                with _quiet_interpreter(dev, name):
                    row = check_row(dev, name, case, precision, cases, inputs, eager)
                report.rows.append(row)
                say(format_row(row))
        say()
        summary = {}
        for r in report.rows:
            s = summary.setdefault((r.device, r.backend),
                                   {"pass": 0, "FAIL": 0, "ERROR": 0, "skip": 0})
            s[r.result] += 1
        for (dev, name), s in summary.items():
            say(f"{dev} {name}: {s['pass']} passed, {s['FAIL']} failed, {s['ERROR']} errors"
                + (f", {s['skip']} skipped (dtypes it does not support)" if s["skip"] else ""))
        for p in report.problems:
            say(f"problem: {p}")
        say(f"correctness: {'PASS' if report.ok else 'FAIL'} ({len(report.rows)} rows, "
            f"{time.perf_counter() - t0:.1f} s)")
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


def _eager_baseline(device, case, precision, cases, inputs):
    """A thunk giving the eager backend's params for this case on ``device`` (the yardstick of
    the ``2x eager`` rule), run at most once per run of the check."""
    cache = inputs.eager
    key = (str(device), cases.shapes, cases.steps, case, precision)

    def get():
        if key not in cache:
            try:
                cache[key] = run_optimizer(device, "eager", case, precision, cases.shapes,
                                           cases.steps, inputs)[0]
            except Exception as e:  # noqa: BLE001 - remembered, re-raised for each row asking
                cache[key] = e
        if isinstance(cache[key], Exception):
            raise cache[key]
        return cache[key]

    return get


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
    if apex_lamb is not None:  # the settings under which it computes fusedopt's default LAMB
        rows["apex FusedLAMB"] = (bench.BYTES_PER_ELEMENT["lamb"],
                                  apex_lamb(params, eps=1e-6, weight_decay=0.01, max_grad_norm=0,
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
    ap = argparse.ArgumentParser(prog="python -m fusedopt check", description=__doc__,
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
    args = ap.parse_args(argv)
    try:
        devices = parse_devices(args.device) if args.device else None
    except ValueError as e:
        ap.error(str(e))
    report = run(devices, args.backend, quick=args.quick, speed=not args.no_speed,
                 backend_objects=backend_objects)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
