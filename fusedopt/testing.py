"""What the tests and ``python -m fusedopt check`` share: the tables of cases and the machinery that
runs a case against the float64 reference (:mod:`fusedopt.reference`).

For testing fusedopt (its test suite, the self-check of a machine, a new backend): public so that
``python -m fusedopt check`` can use it on an installed package, but not part of the optimizer API,
and free to change between versions. In the role of torch's ``OptimizerInfo``
(``torch/testing/_internal/common_optimizers.py``): the tables are data, which the tests
parametrize over and the self-check iterates over, and the module imports no test framework.

The tables

* :data:`OPTION_CASES`: :class:`OptionCase` rows (kind, name, options): every option of
  ``FusedLAMB`` and ``FusedLARS`` of docs/math.md varied, one per row, and a mix per kind.
* :data:`DTYPE_CASES`: :class:`DtypeCase` rows (name, param dtype, grad dtype, ``master_weights``):
  fp32, fp64, bf16 and fp16 with and without fp32 master weights, and grads of another dtype.
* :data:`SHAPES_SMALL`, :data:`SHAPES_ZOO`, :data:`SHAPES_FULL`, :data:`SHAPES_QUICK`: the shapes
  that break kernels (0-size, 1 element, odd sizes, several dims, several chunks).
* :data:`CASE_SETS`: :class:`CaseSet` rows: which (option case, dtype case) pairs run over which
  shapes for how many steps (``"full"``: the self-check and tests/test_parity.py; ``"quick"``:
  ``check --quick``; ``"interpreted"``: Triton under its interpreter).
* :data:`REL_TOL`, :data:`ROUNDING_ATOL`, :data:`UNIT_ROUNDOFF`: the tolerances of the rules
  (:data:`RULES`) that :func:`judge` applies.
* :data:`BAD_INPUTS`: :class:`BadInput` rows (name, how to build the bad input, exception type,
  message regex, kinds, whether the backend matters): what the optimizers must refuse, with
  nothing changed (tests/test_hardening.py).

The machinery

* :func:`make_inputs`, :func:`run_optimizer`, :func:`run_reference` (and :func:`run_backend`, the
  three in one call): one optimizer and the reference stepped from the same rounded values.
* :func:`run_case`: one (option case, backend, device, dtype case) of a case set against the
  reference, judged by the rules of :func:`judge`; returns a :class:`CaseResult`. A
  :class:`RunCache` keeps inputs, references and eager runs between cases.
* :func:`max_rel_err`, :func:`excess_over_eager`, :func:`assert_within_rounding`: the comparisons.
* :func:`two_group_optimizer`, :func:`snapshot`, :func:`changed`: what the bad-input rows build on
  and how a refused call is seen to have changed nothing (params, grads, every state entry, bit
  for bit).
* :func:`case_inputs`, :func:`case_reference`,
  :func:`misaligned_like`, :func:`state_tensors`, :func:`bit_mismatches`: what the self-check's
  protocol rows (misaligned and large tensors, GradScaler, a tensor lr) build on.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from . import backends as _backends
from .optim import FusedLAMB, FusedLARS
from .reference import ReferenceLAMB, ReferenceLARS

__all__ = [
    "KINDS", "OPTIMIZERS", "REFERENCES", "LR", "STATE_KEY",
    "SHAPES_SMALL", "SHAPES_ZOO", "SHAPES_FULL", "SHAPES_QUICK",
    "OptionCase", "OPTION_CASES", "option_cases", "option_case",
    "DtypeCase", "DTYPE_CASES", "dtype_case",
    "CaseSet", "CASE_SETS", "ALL",
    "REL_TOL", "ROUNDING_ATOL", "UNIT_ROUNDOFF", "RULES", "rel_tolerance",
    "make_tensors", "Inputs", "make_inputs", "EXCLUDED_OPTIONS", "run_optimizer", "run_reference",
    "run_backend", "max_rel_err", "excess_over_eager", "assert_within_rounding",
    "CaseResult", "RunCache", "judge", "run_case", "one_line",
    "Trial", "BadInput", "BAD_INPUTS", "BAD_OPTIONS", "two_group_optimizer", "snapshot",
    "changed", "unchanged",
    "case_inputs", "case_reference", "misaligned_like", "state_tensors",
    "bit_mismatches",
]

# ----------------------------------------------------------------------------------- kinds

KINDS = ("lamb", "lars")
OPTIMIZERS = {"lamb": FusedLAMB, "lars": FusedLARS}
REFERENCES = {"lamb": ReferenceLAMB, "lars": ReferenceLARS}
#: the learning rate every case runs with
LR = {"lamb": 1e-2, "lars": 0.5}
#: the first state tensor of each kind (named in the messages of refused state)
STATE_KEY = {"lamb": "exp_avg", "lars": "momentum_buffer"}

# ---------------------------------------------------------------------------------- shapes

#: 0-size, 1 element, odd sizes, several dims (a zero weight at index 1, a zero gradient at 3 and
#: an excluded group at 5 in the case sets)
SHAPES_SMALL = ((3, 5), (7,), (0,), (1,), (4097,), (2, 3, 4))
#: plus an odd size and a tensor of three of the C++ backend's 32,768-element chunks (kChunk in
#: csrc/cpu/multi_tensor.h)
SHAPES_ZOO = SHAPES_SMALL + ((18011,), (70001,), (256, 300))
#: the zoo with a tensor of 140,001 elements instead, which spans several chunks of every fused
#: backend (cpp 32,768; cuda 65,536 with a partial third; triton 16,384 on a GPU)
SHAPES_FULL = SHAPES_SMALL + ((18011,), (140001,), (256, 300))
SHAPES_QUICK = SHAPES_SMALL + ((70001,),)

# ---------------------------------------------------------------------------- option cases


@dataclass(frozen=True)
class OptionCase:
    """Options of one kind, given alike to the optimizer and the reference."""

    kind: str  # "lamb" or "lars"
    name: str
    items: tuple  # sorted (option, value) pairs

    @property
    def options(self) -> dict:
        return dict(self.items)

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.name}"


def _case(kind: str, name: str, **options) -> OptionCase:
    return OptionCase(kind, name, tuple(sorted(options.items())))


#: One row per option of docs/math.md (LAMB: betas, eps, weight_decay, bias_correction,
#: grad_averaging, max_grad_norm, trust_ratio_bounds, decoupled_weight_decay, adapt; LARS:
#: momentum, weight_decay, trust_coefficient, eps, nesterov, dampening, trust_clip, denominator,
#: lr_in_momentum, max_grad_norm, adapt; lr is LR, not the default), the forms of torch's SGD,
#: and a mix of flags per kind.
OPTION_CASES = (
    _case("lamb", "default"),
    _case("lamb", "no_wd", weight_decay=0.0),
    _case("lamb", "betas", betas=(0.8, 0.99)),
    _case("lamb", "no_bias_correction", bias_correction=False),
    _case("lamb", "no_grad_averaging", grad_averaging=False),
    _case("lamb", "clip", max_grad_norm=0.5),
    _case("lamb", "bounds", trust_ratio_bounds=(0.8, 1.2)),
    _case("lamb", "decoupled", decoupled_weight_decay=True, weight_decay=0.1),
    _case("lamb", "no_adapt", adapt=False),
    _case("lamb", "eps_tiny", eps=1e-30),  # the smallest eps class (eps=0 is refused: 0/0 at g=0)
    _case("lamb", "mixed", bias_correction=False, grad_averaging=False,
          decoupled_weight_decay=True, weight_decay=0.1, trust_ratio_bounds=(0.5, 2.0),
          max_grad_norm=0.5),
    _case("lars", "default", weight_decay=1e-4),
    _case("lars", "no_wd"),
    _case("lars", "momentum", momentum=0.5, weight_decay=1e-4),
    _case("lars", "trust_coefficient", trust_coefficient=0.02, weight_decay=1e-4),
    _case("lars", "eps", eps=0.1, weight_decay=1e-4),
    _case("lars", "combined", denominator="combined", weight_decay=1e-2),
    _case("lars", "nesterov", nesterov=True, weight_decay=1e-4),
    _case("lars", "trust_clip", trust_clip=True, trust_coefficient=1.0, weight_decay=1e-4),
    _case("lars", "torch_sgd_form", lr_in_momentum=False, weight_decay=1e-4),
    _case("lars", "torch_sgd_dampening", lr_in_momentum=False, dampening=0.3, weight_decay=1e-4),
    _case("lars", "torch_sgd_nesterov", lr_in_momentum=False, nesterov=True, weight_decay=1e-4),
    _case("lars", "clip", max_grad_norm=0.5, weight_decay=1e-4),
    _case("lars", "no_momentum", momentum=0.0, weight_decay=1e-4),
    _case("lars", "no_adapt", adapt=False, weight_decay=1e-4),
    _case("lars", "mixed", lr_in_momentum=False, nesterov=True, trust_clip=True,
          trust_coefficient=1.0, denominator="combined", weight_decay=1e-2, max_grad_norm=0.5),
)


def option_cases(kind: str) -> dict[str, dict]:
    """``{name: options}`` of the option cases of ``kind``, in table order."""
    return {c.name: c.options for c in OPTION_CASES if c.kind == kind}


def option_case(kind: str, name: str) -> OptionCase:
    return next(c for c in OPTION_CASES if c.kind == kind and c.name == name)


# ----------------------------------------------------------------------------- dtype cases


@dataclass(frozen=True)
class DtypeCase:
    name: str
    param: torch.dtype
    grad: torch.dtype
    master_weights: bool | None = None  # the optimizers' option (None: their default)

    @property
    def low(self) -> bool:
        """bf16/fp16 params: judged against eager's rounding (see :func:`judge`)."""
        return self.param in (torch.bfloat16, torch.float16)

    @property
    def compute(self) -> torch.dtype:
        return torch.float64 if self.param == torch.float64 else torch.float32


#: Every param dtype, with and without fp32 master weights, and grads of another dtype than the
#: params' where every backend of the dtype takes them (the cuda backend takes bf16/fp16 grads
#: for fp32 params and fp32 grads for bf16/fp16 params; ``unavailable_reason`` says so otherwise)
DTYPE_CASES = (
    DtypeCase("fp32", torch.float32, torch.float32),
    DtypeCase("fp64", torch.float64, torch.float64),
    DtypeCase("bf16", torch.bfloat16, torch.bfloat16, master_weights=False),
    DtypeCase("bf16+master", torch.bfloat16, torch.bfloat16, master_weights=True),
    DtypeCase("fp16", torch.float16, torch.float16, master_weights=False),
    DtypeCase("fp16+master", torch.float16, torch.float16, master_weights=True),
    DtypeCase("fp32,grad=bf16", torch.float32, torch.bfloat16),
    DtypeCase("bf16+master,grad=fp32", torch.bfloat16, torch.float32, master_weights=True),
)


def dtype_case(name: str) -> DtypeCase:
    return next(d for d in DTYPE_CASES if d.name == name)


# ------------------------------------------------------------------------------- case sets

ALL = None  # in a CaseSet block: every option case


@dataclass(frozen=True)
class CaseSet:
    """What runs for one (device, backend): shapes, steps, where the zero weight, the zero
    gradient and the second group (``weight_decay=0, adapt=False``) lie, and blocks of
    (option-case names or ALL, dtype-case names) whose products are the pairs that run."""

    name: str
    shapes: tuple
    steps: int
    blocks: tuple  # of (tuple of option-case names, or ALL, tuple of dtype-case names)
    zero_weight: int = 1
    zero_grad: int = 3
    excluded: tuple = (5,)
    note: str | None = None

    @property
    def pairs(self) -> tuple[tuple[OptionCase, DtypeCase], ...]:
        """(option case, dtype case) pairs in table order: by option case, then by block."""
        out = []
        for case in OPTION_CASES:
            for names, dtypes in self.blocks:
                if names is ALL or case.name in names:
                    out += [(case, dtype_case(d)) for d in dtypes]
        return tuple(out)


_LOW = ("bf16", "bf16+master", "fp16", "fp16+master", "fp32,grad=bf16", "bf16+master,grad=fp32")
CASE_SETS = {
    "full": CaseSet("full", SHAPES_FULL, 5,
                    ((ALL, ("fp32", "fp64")), (("default", "mixed"), _LOW))),
    "quick": CaseSet("quick", SHAPES_QUICK, 3,
                     ((("default", "mixed"), ("fp32",)),
                      (("default",), ("fp64", "bf16", "fp16+master")))),
    "interpreted": CaseSet(
        "interpreted", SHAPES_SMALL, 2,
        ((("default", "mixed"), ("fp32",)), (("default",), ("fp64", "bf16", "fp16+master"))),
        note="triton on cpu runs in Triton's interpreter (TRITON_INTERPRET=1), about 1 ms per "
             "operation of every program, so it checks a reduced set: tensors of at most 4,097 "
             "elements, 2 steps, the default and mixed flags"),
}

# ------------------------------------------------------------------------------ tolerances

#: largest per-tensor ``max|x - ref| / max|ref|`` (:func:`max_rel_err`) by the dtype the math
#: runs in (the ``rel`` rule)
REL_TOL = {torch.float32: 1e-5, torch.float64: 1e-11}
#: absolute slack of the ``2x eager`` rule (flash-attention's), by param dtype
ROUNDING_ATOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
#: unit roundoff (half the spacing of the numbers in [1, 2)) of the low-precision param dtypes
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _pow2(x: float) -> str:
    return f"2**{math.log2(x):.0f}"


#: The rules a case is judged by (:func:`judge`; ``python -m fusedopt check --help`` prints them).
RULES = """\
A row passes when its error is within the tolerance of its rule (the ``rule`` column):

``rel``
    fp32 and fp64 params (and fp32 params with bf16 grads): per tensor,
    ``max|x - ref| / max|ref|``, the largest over the tensors, at most {rel32} (fp32 math) or
    {rel64} (fp64 math).
``2x eager``
    bf16/fp16 params of a backend other than eager: every element within twice the eager
    backend's error (eager run on the same device) plus a slack,
    ``|x - ref| <= 2 |eager - ref| + max(atol, ulp)``, with atol {atol_bf16} (bf16) or
    {atol_fp16} (fp16) and ulp the spacing of the param dtype's numbers at that element. The ulp
    is there because a backend whose fp32 result differs from eager's by a few fp32 ulps
    (another summation order, a fused multiply-add) stores the neighbouring bf16/fp16 value
    wherever eager's result lay that close to a rounding boundary (in the full set's fp16 LAMB
    cases the C++ and eager backends store different values, one ulp apart, for about 0.02% of
    the elements), and above 1.0 one fp16 ulp is more than atol alone allows.
    The error and tolerance shown are ``|x - ref| - 2 |eager - ref|`` and the slack at the
    element where their ratio is largest (error 0: every element within twice eager's error).
``master``
    with fp32 master weights: the masters within the fp32 tolerance of ``rel`` (the math runs in
    fp32 on them), and every param bit-equal to its master rounded to the param dtype.
``steps*u``
    bf16/fp16 params of the eager backend without masters (it is the yardstick of ``2x eager``, so
    it is held to a bound of its own): ``rel`` at most one rounding of the stored value per step,
    ``steps * u`` with the unit roundoff u = {u_bf16} (bf16) or {u_fp16} (fp16).

A row held to several rules (``master`` and ``2x eager``) passes when it meets all of them; the
table shows the one whose error is largest against its tolerance.
""".format(rel32=f"{REL_TOL[torch.float32]:.0e}".replace("e-0", "e-"),
           rel64=f"{REL_TOL[torch.float64]:.0e}".replace("e-0", "e-"),
           atol_bf16=_pow2(ROUNDING_ATOL[torch.bfloat16]),
           atol_fp16=_pow2(ROUNDING_ATOL[torch.float16]),
           u_bf16=_pow2(UNIT_ROUNDOFF[torch.bfloat16]), u_fp16=_pow2(UNIT_ROUNDOFF[torch.float16]))


def rel_tolerance(param_dtype: torch.dtype) -> float:
    """The ``rel`` tolerance for params of ``param_dtype`` (fp64 math for fp64, else fp32)."""
    return REL_TOL[torch.float64 if param_dtype == torch.float64 else torch.float32]


# ----------------------------------------------------------------------- running the math

def make_tensors(shapes, dtype, seed, *, zero_weight=None, device="cpu") -> list[torch.Tensor]:
    """Standard-normal tensors from ``torch.Generator().manual_seed(seed)``, drawn in float64 in
    the order of ``shapes``, then rounded to ``dtype``; tensor ``zero_weight`` is zeros."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(shapes):
        t = torch.randn(s, generator=g, dtype=torch.float64)
        if zero_weight is not None and i == zero_weight:
            t.zero_()
        out.append(t.to(device=device, dtype=dtype))
    return out


@dataclass(frozen=True)
class Inputs:
    """Initial values (the param dtype) and the gradients of every step (the grad dtype), on the
    CPU: what the optimizer and the reference are both fed."""

    init: tuple
    grads: tuple  # per step, a tuple of tensors

    @property
    def steps(self) -> int:
        return len(self.grads)


def make_inputs(shapes, steps: int, param_dtype=torch.float32, grad_dtype=None, *, seed: int = 0,
                zero_weight: int | None = None, zero_grad: int | None = None) -> Inputs:
    """The initial values of :func:`make_tensors` (``seed``) and, per step, gradients drawn in
    float64 from a generator seeded ``seed + 1`` and rounded to ``grad_dtype`` (default: the
    params'); gradient ``zero_grad`` is zeros at every step."""
    grad_dtype = grad_dtype or param_dtype
    init = make_tensors(shapes, torch.float64, seed, zero_weight=zero_weight)
    gen = torch.Generator().manual_seed(seed + 1)
    grads = []
    for _ in range(steps):
        gs = []
        for i, s in enumerate(shapes):
            g = torch.randn(s, generator=gen, dtype=torch.float64)
            if zero_grad is not None and i == zero_grad:
                g.zero_()
            gs.append(g.to(grad_dtype))
        grads.append(tuple(gs))
    return Inputs(tuple(t.to(param_dtype) for t in init), tuple(grads))


def _group_indices(n: int, excluded) -> list[list[int]]:
    main = [i for i in range(n) if i not in excluded]
    return [main] + ([list(excluded)] if excluded else [])


#: the options of the second group (the ``excluded`` params)
EXCLUDED_OPTIONS = {"weight_decay": 0.0, "adapt": False}


def run_optimizer(kind: str, backend: str, options: dict, inputs: Inputs, *, device="cpu",
                  master_weights=None, excluded=(), lr=None, misalign=(), before=None,
                  after=None):
    """Steps a ``FusedLAMB`` / ``FusedLARS`` over ``inputs``; returns ``(params, optimizer)``.

    ``excluded``: indices of params placed in a second group with ``weight_decay=0,
    adapt=False``. Each step's gradients are copies on ``device``. ``misalign`` names what lies
    4 bytes past a 16-byte boundary (:func:`misaligned_like`): ``"params"``, ``"grads"``,
    ``"state"`` (the moments, made as zeros before the first step). ``before(k, opt, params)`` /
    ``after(k, opt, params)`` are called around step ``k``, its grads set."""
    unknown = set(misalign) - {"params", "grads", "state"}
    if unknown:
        raise ValueError(f"misalign: unknown lists {sorted(unknown)}")
    lr = LR[kind] if lr is None else lr

    def placed(t, what):
        t = t.to(device, copy=True)
        return misaligned_like(t) if what in misalign else t

    params = [torch.nn.Parameter(placed(t, "params")) for t in inputs.init]
    grad_dtype = inputs.grads[0][0].dtype if inputs.grads and inputs.grads[0] else None
    if grad_dtype is not None and params and grad_dtype != params[0].dtype:
        for p in params:
            if hasattr(p, "grad_dtype"):  # torch >= 2.10 checks grad dtypes unless told otherwise
                p.grad_dtype = grad_dtype
    groups = []
    for gi, idx in enumerate(_group_indices(len(params), excluded)):
        groups.append({"params": [params[i] for i in idx], **(EXCLUDED_OPTIONS if gi else {})})
    cls = OPTIMIZERS[kind]
    opt = cls(groups, lr=lr, backend=backend, master_weights=master_weights, **options)
    if "state" in misalign:
        for p in params:
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                            **{k: placed(torch.zeros_like(p.detach()), "state")
                               for k in cls._state_keys}}
    for k, gs in enumerate(inputs.grads):
        for p, g in zip(params, gs):
            p.grad = placed(g, "grads")
        if before is not None:
            before(k, opt, params)
        opt.step()
        if after is not None:
            after(k, opt, params)
    return params, opt


def run_reference(kind: str, options: dict, inputs: Inputs, *, excluded=(), lr=None, lrs=None,
                  device="cpu") -> list[torch.Tensor]:
    """The float64 reference stepped over ``inputs`` (from the stored, rounded values); returns
    its weights, on ``device``. ``lr``: the learning rate of every step (default :data:`LR`);
    ``lrs``: one per step instead."""
    steps = inputs.steps
    lrs = [LR[kind] if lr is None else lr] * steps if lrs is None else list(lrs)
    if len(lrs) != steps:
        raise ValueError(f"lrs holds {len(lrs)} learning rates for {steps} steps")
    groups = _group_indices(len(inputs.init), excluded)
    ref = REFERENCES[kind]([{**options, "lr": lrs[0], **(EXCLUDED_OPTIONS if gi else {})}
                            for gi in range(len(groups))])
    weights = [t.to(device, torch.float64, copy=True) for t in inputs.init]
    for step_lr, gs in zip(lrs, inputs.grads):
        for h in ref.groups:
            h["lr"] = step_lr
        gs = [g.to(device) for g in gs]
        ref.step([[weights[i] for i in idx] for idx in groups],
                 [[gs[i] for i in idx] for idx in groups])
    return weights


def run_backend(kind, backend, shapes, hyper, *, dtype=torch.float32, grad_dtype=None, steps=5,
                seed=0, zero_weight=None, zero_grad=None, excluded=(), master_weights=None,
                device="cpu", lr=None):
    """Runs ``steps`` steps of ``backend`` and of the reference from :func:`make_inputs`; returns
    ``(params, float64 reference weights, optimizer)``."""
    inputs = make_inputs(shapes, steps, dtype, grad_dtype, seed=seed, zero_weight=zero_weight,
                         zero_grad=zero_grad)
    params, opt = run_optimizer(kind, backend, hyper, inputs, device=device,
                                master_weights=master_weights, excluded=excluded, lr=lr)
    return params, run_reference(kind, hyper, inputs, excluded=excluded, lr=lr), opt


# ----------------------------------------------------------------------------- comparisons

def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", torch.float64)


def max_rel_err(xs, refs) -> float:
    """Largest per-tensor ``max|x - ref| / max|ref|`` (0-size tensors skipped; a NaN gives
    inf)."""
    worst = 0.0
    for x, r in zip(xs, refs):
        if x.numel() == 0:
            continue
        r = _f64(r)
        err = (_f64(x) - r).abs().max().item() / (r.abs().max().item() or 1.0)
        if not math.isfinite(err):
            return math.inf
        worst = max(worst, err)
    return worst


def excess_over_eager(xs, eager, refs, atol: float, ulp_dtype: torch.dtype | None = None):
    """flash-attention's within-rounding rule, elementwise: ``|x - ref| <= 2 |eager - ref| +
    slack``, with ``slack = atol`` or, given ``ulp_dtype``, ``max(atol, ulp)``, the spacing of
    ``ulp_dtype``'s numbers at the larger of ``|x|`` and ``|ref|`` (a backend whose fp32 result
    differs from eager's by a few fp32 ulps stores the neighbouring bf16/fp16 value wherever
    eager's result lay that close to a rounding boundary, and above 1.0 one fp16 ulp is more
    than its atol alone allows).

    Returns ``(excess, slack, count)``: ``excess = |x - ref| - 2 |eager - ref|`` and the slack
    at the element where ``excess / slack`` is largest (excess 0 when no element exceeds), and
    the number of elements beyond their slack. A NaN excess counts as infinite."""
    eps = torch.finfo(ulp_dtype).eps if ulp_dtype is not None else None
    worst, worst_ratio, count = (0.0, atol), 0.0, 0
    for x, e, r in zip(xs, eager, refs):
        if x.numel() == 0:
            continue
        x, e, r = _f64(x), _f64(e), _f64(r)
        excess = (x - r).abs() - 2 * (e - r).abs()
        nan = excess.isnan()
        if nan.any():
            worst, worst_ratio = (math.inf, atol), math.inf
            count += int(nan.sum())
            excess = excess.nan_to_num(nan=0.0)
        if eps is None:
            slack = torch.full_like(r, atol)
        else:
            _, exponent = torch.frexp(torch.maximum(x.abs(), r.abs()))
            slack = torch.ldexp(torch.full_like(r, eps), exponent - 1).clamp_min(atol)
        ratio = excess / slack
        count += int((excess > slack).sum())
        i = int(ratio.argmax())
        if ratio.view(-1)[i].item() > worst_ratio:
            worst_ratio = ratio.view(-1)[i].item()
            worst = (excess.view(-1)[i].item(), slack.view(-1)[i].item())
    return worst[0], worst[1], count


def assert_within_rounding(fast, eager, ref_w, atol, ulp_dtype=None):
    """Raises AssertionError unless every element meets :func:`excess_over_eager`'s rule."""
    excess, slack, count = excess_over_eager(fast, eager, ref_w, atol, ulp_dtype)
    if count:
        raise AssertionError(f"{count} elements beyond 2x eager's error + {atol}: the worst "
                             f"{excess:.3g} over 2x eager's error (slack {slack:.3g})")


# ------------------------------------------------------------------------- judging a case

@dataclass
class CaseResult:
    """One (option case, backend, device, dtype case): ``status`` is ``"pass"``, ``"FAIL"``,
    ``"ERROR"`` (the run raised; ``detail`` says what) or ``"skip"`` (the backend does not take
    these dtypes there; ``detail`` says why); ``error`` and ``tolerance`` are those of ``rule``,
    the rule whose error is largest against its tolerance."""

    device: str
    backend: str
    kind: str
    dtype: str
    case: str
    status: str = "ERROR"
    error: float | None = None
    tolerance: float | None = None
    rule: str = ""
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", "ERROR")

    def __str__(self) -> str:
        num = (lambda x: "-" if x is None else f"{x:.3g}")
        return (f"{self.kind} {self.case} {self.dtype} on {self.backend}/{self.device}: "
                f"{self.status} ({self.rule or 'no rule'}: error {num(self.error)}, tolerance "
                f"{num(self.tolerance)}){': ' + self.detail if self.detail else ''}")


def one_line(e: BaseException) -> str:
    """``"Type: message"``, its first line, at most 200 characters."""
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def judge(result: CaseResult, dtype: DtypeCase, steps: int, got, ref, masters=None,
          eager=None) -> CaseResult:
    """Fills ``result`` by :data:`RULES` (a row held to several passes when it meets all of
    them). ``got``: the params; ``masters``: ``(master values, params equal their rounded
    masters)`` or None; ``eager``: the eager backend's params (a ``2x eager`` row) or None."""
    if not dtype.low:
        checks = [("rel", max_rel_err(got, ref), rel_tolerance(dtype.param))]
    else:
        checks = []
        if masters is not None:
            checks.append(("master", max_rel_err(masters[0], ref), REL_TOL[torch.float32]))
        if eager is None:
            if masters is None:
                checks.append(("steps*u", max_rel_err(got, ref),
                               steps * UNIT_ROUNDOFF[dtype.param]))
        else:
            excess, slack, _ = excess_over_eager(got, eager, ref, ROUNDING_ATOL[dtype.param],
                                                 dtype.param)
            checks.append(("2x eager", excess, slack))
    result.rule, result.error, result.tolerance = max(checks, key=lambda c: c[1] / c[2])
    result.status = "pass" if all(e <= t for _, e, t in checks) else "FAIL"
    if masters is not None and not masters[1]:
        result.status = "FAIL"
        result.detail = "a param differs from its master weight rounded to the param dtype"
    return result


class RunCache:
    """Inputs, references and eager runs of :func:`run_case`, kept for the cases after (the
    reference of a case serves every backend and device; the eager run every other backend of
    the device). ``maxsize``: entries kept per kind of thing, least recently used dropped
    (None: all)."""

    def __init__(self, maxsize: int | None = None):
        self.maxsize = maxsize
        self._stores: dict[str, OrderedDict] = {}

    def get(self, what: str, key, make: Callable[[], Any]):
        store = self._stores.setdefault(what, OrderedDict())
        if key in store:
            store.move_to_end(key)
        else:
            store[key] = make()
            if self.maxsize is not None and len(store) > self.maxsize:
                store.popitem(last=False)
        value = store[key]
        if isinstance(value, BaseException):  # an eager run that raised, raised for each asking
            raise value
        return value


def _inputs(cache: RunCache, cs: CaseSet, dtype: DtypeCase) -> Inputs:
    return cache.get("inputs", (cs.shapes, cs.steps, cs.zero_weight, cs.zero_grad, dtype.param,
                                dtype.grad),
                     lambda: make_inputs(cs.shapes, cs.steps, dtype.param, dtype.grad,
                                         zero_weight=cs.zero_weight, zero_grad=cs.zero_grad))


def _run(cs: CaseSet, case: OptionCase, backend: str, device, dtype: DtypeCase, inputs: Inputs):
    params, opt = run_optimizer(case.kind, backend, case.options, inputs, device=device,
                                master_weights=dtype.master_weights, excluded=cs.excluded)
    got = [_f64(p) for p in params]
    masters = None
    if dtype.master_weights:
        ms = [opt.state[p]["master_param"].detach() for p in params]
        rounded_ok = all(torch.equal(m.to(p.dtype), p.detach()) for m, p in zip(ms, params))
        masters = ([_f64(m) for m in ms], rounded_ok)
    return got, masters


def _eager_run(cache: RunCache, cs: CaseSet, case: OptionCase, device, dtype: DtypeCase,
               inputs: Inputs):
    def make():
        try:
            return _run(cs, case, "eager", device, dtype, inputs)[0]
        except Exception as e:  # noqa: BLE001 - kept, raised again for each case asking
            return e
    return cache.get("eager", (str(device), cs, case, dtype), make)


def _takes_grad_of_another_dtype() -> bool:
    """Whether this torch lets a param hold a grad of another dtype (``Tensor.grad_dtype``)."""
    return hasattr(torch.nn.Parameter(torch.zeros(1)), "grad_dtype")


def run_case(case: OptionCase, backend: str, device, dtype: DtypeCase,
             case_set: CaseSet | str = "full", cache: RunCache | None = None) -> CaseResult:
    """Runs ``case`` on ``backend`` for ``device`` and ``dtype`` over the shapes and steps of
    ``case_set`` (a :class:`CaseSet` or a name of :data:`CASE_SETS`), runs the reference (and,
    for a ``2x eager`` row, the eager backend) from the same values, and judges the result
    (:func:`judge`). Never raises for what the backend does: a backend that raises gives an
    ``ERROR`` result, one that cannot run these dtypes there a ``skip``."""
    cs = CASE_SETS[case_set] if isinstance(case_set, str) else case_set
    cache = cache if cache is not None else RunCache()
    device = torch.device(device)
    result = CaseResult(str(device), backend, case.kind, dtype.name, case.name)
    be = _backends.get_backend(backend)
    why = (be.unavailable_reason(device, dtype.param, dtype.grad) if be is not None
           else f"backend {backend!r} is not available: {_backends.load_error(backend)}")
    if why is None and dtype.grad != dtype.param and not _takes_grad_of_another_dtype():
        why = (f"torch {torch.__version__} refuses a {dtype.grad} grad for a {dtype.param} "
               "param (torch >= 2.10 takes it: Tensor.grad_dtype)")
    if why is not None:
        result.status, result.detail = "skip", str(why)
        return result
    inputs = _inputs(cache, cs, dtype)
    ref = case_reference(cache, cs, case, dtype)
    try:
        got, masters = _run(cs, case, backend, device, dtype, inputs)
    except Exception as e:  # noqa: BLE001 - a backend that raises is a failed case
        result.detail = one_line(e)
        return result
    eager = None
    if dtype.low and backend != "eager":
        try:
            eager = _eager_run(cache, cs, case, device, dtype, inputs)
        except Exception as e:  # noqa: BLE001
            result.detail = f"the eager run this case is compared with raised {one_line(e)}"
            return result
    return judge(result, dtype, cs.steps, got, ref, masters, eager)


# ------------------------------------------------------------------------------ bad input

@dataclass
class Trial:
    """A bad input made ready: ``call()`` must raise; ``watched`` (optimizers and tensors) must
    be bit-identical before and after (:func:`snapshot`)."""

    call: Callable[[], Any]
    watched: list


@dataclass(frozen=True)
class BadInput:
    """A bad input that the optimizers refuse with an error that names it, changing nothing.

    ``make(kind, backend)`` builds it (usually: the optimizer of :func:`two_group_optimizer`,
    edited in its later group) and returns a :class:`Trial`; ``exc`` and ``match`` (a regex for
    ``re.search``; ``{state}`` stands for the kind's :data:`STATE_KEY`) are what ``call()``
    raises. ``backend_matters``: the fault is in tensors the step may have kept from an earlier
    step, which a backend's native handle can vouch for in place of the Python checks (Note
    [kept buckets] in fusedopt/functional.py: the cpp backend's kept layout), so it is tried on
    every backend; the other rows are refused by backend-independent Python before any backend
    is asked (options, construction, fresh optimizers)."""

    name: str
    make: Callable[[str, str], Trial]
    exc: type
    match: str
    kinds: tuple = KINDS
    backend_matters: bool = False

    def message(self, kind: str) -> str:
        return self.match.replace("{state}", STATE_KEY[kind])


def two_group_optimizer(kind: str, backend: str, *, dtype=torch.float32, lr=0.1, steps: int = 2,
                        **options):
    """An optimizer of two groups of two params (shapes (5, 3) and (5,)), stepped ``steps``
    times; returns ``(optimizer, [group 0 params, group 1 params])``. A bad-input row edits the
    LATER group, so that a step that checked group 1 only after writing group 0 would show."""
    gen = torch.Generator().manual_seed(0)
    groups = [[torch.nn.Parameter(torch.randn(5, 3, generator=gen, dtype=dtype)),
               torch.nn.Parameter(torch.randn(5, generator=gen, dtype=dtype))] for _ in range(2)]
    opt = OPTIMIZERS[kind]([{"params": g} for g in groups], lr=lr, backend=backend, **options)
    for _ in range(steps):
        for p in (p for g in groups for p in g):
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
        opt.step()
    return opt, groups


def _bits(t) -> tuple:
    """A tensor as (dtype, shape, device type, its bytes); a non-tensor as its repr."""
    if not isinstance(t, torch.Tensor):
        return ("value", repr(t))
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    if t.device.type == "meta":
        return (t.dtype, tuple(t.shape), "meta", None)
    data = t.cpu().contiguous().reshape(-1)
    return (t.dtype, tuple(t.shape), t.device.type,
            data.view(torch.uint8).clone() if data.numel() else data.clone())


def snapshot(watched: Iterable) -> list[tuple[str, Any]]:
    """``(label, value)`` pairs of everything a refused call must leave as it was: of an
    optimizer, its groups' param counts, every param, grad and state entry (present or not), and
    ``skipped_steps``; of a tensor, its bits."""
    out: list[tuple[str, Any]] = []
    for wi, obj in enumerate(watched):
        if isinstance(obj, torch.Tensor):
            out.append((f"watched[{wi}]", _bits(obj)))
            continue
        out.append((f"watched[{wi}] group count", len(obj.param_groups)))
        for gi, g in enumerate(obj.param_groups):
            out.append((f"group {gi} param count", len(g["params"])))
            for pi, p in enumerate(g["params"]):
                where = f"group {gi} param {pi}"
                out.append((where, _bits(p)))
                out.append((f"{where} grad", _bits(p.grad)))
                st = obj.state.get(p)  # not obj.state[p]: a defaultdict would make one
                out.append((f"{where} has state", st is not None))
                for key in sorted(st or {}):
                    out.append((f"{where} state {key!r}", _bits(st[key])))
        if hasattr(obj, "skipped_steps"):
            out.append((f"watched[{wi}] skipped_steps", _bits(obj.skipped_steps)))
    return out


def _same(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and torch.equal(a, b))
    return a == b


def changed(before, after) -> list[str]:
    """The labels of :func:`snapshot` whose values differ (or that one of the two lacks)."""
    if [k for k, _ in before] != [k for k, _ in after]:
        return [f"the snapshot's entries differ: {[k for k, _ in before]} before, "
                f"{[k for k, _ in after]} after"]
    return [k for (k, a), (_, b) in zip(before, after) if not _same(a, b)]


def unchanged(before, after) -> bool:
    return not changed(before, after)


def _edited(edit: Callable, **setup) -> Callable[[str, str], Trial]:
    """A row's ``make``: ``edit(opt, groups, kind)`` applied to :func:`two_group_optimizer`'s
    optimizer (built with ``setup``), then ``opt.step()``."""
    def make(kind, backend):
        opt, groups = two_group_optimizer(kind, backend, **setup)
        edit(opt, groups, kind)
        return Trial(opt.step, [opt])
    return make


def _set_state(key, value: Callable[[torch.Tensor], Any]) -> Callable:
    """An edit that replaces state ``key`` (``None``: the kind's STATE_KEY) of group 1's param 0
    by ``value(old)``."""
    def edit(opt, groups, kind):
        st = opt.state[groups[1][0]]
        k = key or STATE_KEY[kind]
        st[k] = value(st[k])
    return edit


def _param_data_of_another_shape(opt, groups, kind):
    p = groups[1][0]
    p.data = torch.randn(4, 4)
    p.grad = None
    p.grad = torch.randn(4, 4)


def _set_grad_data(gi, pi, make):
    def edit(opt, groups, kind):
        groups[gi][pi].grad.data = make()
    return edit


def _set_option(key, value):
    def edit(opt, groups, kind):
        opt.param_groups[1][key] = value
    return edit


def _list_edited_in_place(key, good: list, bad):
    """An edit that gives group 1 the list option ``key`` = ``good`` (as a config file gives
    one), steps, then sets its first item to ``bad`` in place."""
    def edit(opt, groups, kind):
        opt.param_groups[1][key] = list(good)
        opt.step()
        opt.param_groups[1][key][0] = bad
    return edit


def _load_option(key, value):
    def edit(opt, groups, kind):
        sd = opt.state_dict()
        sd["param_groups"][1][key] = value
        opt.load_state_dict(sd)
    return edit


def _delete_option(key):
    def edit(opt, groups, kind):
        del opt.param_groups[1][key]
    return edit


def _stale_master(opt, groups, kind):
    """master_weights False for a step, then back to None: the stale fp32 master must not
    overwrite what the step in between wrote (the step asks for a master it no longer has)."""
    for g in opt.param_groups:
        g["master_weights"] = False
    for p in (p for g in groups for p in g):
        p.grad = torch.ones_like(p)
    opt.step()
    for g in opt.param_groups:
        g["master_weights"] = None


def _model_half(opt, groups, kind):
    for p in (p for g in groups for p in g):
        p.data = p.data.half()
        p.grad = None
        p.grad = torch.ones_like(p)


def _param_twice(opt, groups, kind):
    opt.param_groups[1]["params"].append(groups[1][0])


def _sparse_grad(opt, groups, kind):
    p = groups[1][1]
    p.grad = torch.zeros_like(p).to_sparse()


def _complex_param_group(opt, groups, kind):
    extra = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    extra.grad = torch.zeros_like(extra)
    opt.add_param_group({"params": [extra]})


def _param_on_another_device(opt, groups, kind):
    extra = torch.nn.Parameter(torch.randn(3, device="meta"))
    extra.grad = torch.zeros_like(extra)
    opt.param_groups[1]["params"].append(extra)


def _foreign_state(source: str) -> Callable[[str, str], Trial]:
    """A fresh optimizer loads the state of torch's SGD (with momentum) or of the other kind,
    then steps."""
    def make(kind, backend):
        _, groups = two_group_optimizer(kind, backend, steps=0)
        for p in (p for g in groups for p in g):
            p.grad = torch.ones_like(p)
        if source == "sgd":
            other = torch.optim.SGD([{"params": g} for g in groups], lr=0.1, momentum=0.9)
        else:
            other = OPTIMIZERS["lars" if kind == "lamb" else "lamb"](
                [{"params": g} for g in groups], lr=0.1, backend=backend)
        other.step()
        fresh = OPTIMIZERS[kind]([{"params": g} for g in groups], lr=0.1, backend=backend)
        fresh.load_state_dict(other.state_dict())
        return Trial(fresh.step, [fresh])
    return make


def _lamb_state_without_a_count(kind, backend):
    """LAMB moments saved with no step count, neither their own nor their group's (Note [foreign
    step counts] in fusedopt/optim.py): refused by ``load_state_dict``."""
    opt, _ = two_group_optimizer(kind, backend)
    sd = opt.state_dict()
    sd["state"] = {i: {k: v for k, v in st.items() if k != "step"} for i, st in sd["state"].items()}
    fresh, _ = two_group_optimizer(kind, backend)
    return Trial(lambda: fresh.load_state_dict(sd), [fresh])


def _expanded_param(kind, backend):
    """Group 1 holds an expanded (stride-0) tensor: its elements overlap in memory."""
    base = torch.nn.Parameter(torch.randn(3))
    bad = torch.randn(1).expand(4).requires_grad_()
    opt = OPTIMIZERS[kind]([{"params": [base]}, {"params": [bad]}], lr=0.1, backend=backend)
    base.grad, bad.grad = torch.randn(3), torch.randn(4)
    return Trial(opt.step, [opt])


def _overlapping_views(kind, backend):
    """Two params that are views of one tensor sharing elements 5 to 9 (a step would write the
    shared elements twice)."""
    base = torch.zeros(20, requires_grad=True)
    a, b = base.detach()[:10], base.detach()[5:15]
    for p in (a, b):
        p.grad = torch.ones(10)
    opt = OPTIMIZERS[kind]([a, b], lr=0.1, backend=backend)
    return Trial(opt.step, [opt, base])


def _unusable_backend(kind, backend):
    """``backend="cuda"`` named for CPU params: refused at the first step, which changes nothing
    and makes no state (``backend`` is the row's own, whatever backend runs the row)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
              torch.nn.Parameter(torch.randn(5, generator=gen))]
    opt = OPTIMIZERS[kind](params, lr=LR[kind], backend="cuda")
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return Trial(opt.step, [opt])


def _constructed(**options) -> Callable[[str, str], Trial]:
    """The constructor given ``options`` (over ``lr=LR[kind]``) for one fp32 param."""
    def make(kind, backend):
        p = torch.nn.Parameter(torch.randn(3))
        return Trial(lambda: OPTIMIZERS[kind]([p], **{"lr": LR[kind], "backend": backend,
                                                      **options}), [p])
    return make


def _added_group(**options) -> Callable[[str, str], Trial]:
    """``add_param_group`` given a group with ``options``."""
    def make(kind, backend):
        opt = OPTIMIZERS[kind]([torch.nn.Parameter(torch.randn(3))], lr=LR[kind],
                               backend=backend)
        return Trial(lambda: opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.randn(2))], **options}), [opt])
    return make


#: Options set to bad values after construction, ``(kind, option, value, message)``: the value
#: is refused at the next step, naming the group and the option (``message`` follows
#: ``"param group 1: Invalid "``), whether set in ``param_groups`` or by ``load_state_dict``.
BAD_OPTIONS = (
    ("lamb", "lr", "0.1", r"lr: '0\.1'"),
    ("lamb", "lr", -1, r"lr: -1"),
    ("lamb", "lr", 1e308, r"lr: 1e\+308 overflows torch.float32"),
    ("lamb", "betas", (2, 0), r"beta1: 2"),
    ("lamb", "betas", (0.9,), r"betas: \(0\.9,\); expected a pair"),
    ("lamb", "betas", (torch.tensor(0.5), 0.999),
     r"beta1: a tensor \(tensor\(0\.5000\); of the options only lr may be one\)"),
    ("lamb", "trust_ratio_bounds", (2, 1), r"trust_ratio_bounds.*lo <= hi"),
    ("lamb", "trust_ratio_bounds", (1,), r"trust_ratio_bounds: \(1,\); expected None or a pair"),
    ("lamb", "trust_ratio_bounds", (math.inf, math.inf),
     r"trust_ratio_bounds: \(inf, inf\); expected 0 <= lo <= hi, lo finite"),
    ("lamb", "adapt", "no", r"adapt: 'no'"),
    ("lamb", "eps", 0.0, r"eps: 0\.0"),
    ("lamb", "eps", 1e-60, r"eps: 1e-60"),
    ("lamb", "weight_decay", 1e300, r"weight_decay: 1e\+300 overflows torch.float32"),
    ("lamb", "backend", "bogus", r"backend: 'bogus'"),
    ("lamb", "master_weights", "yes", r"master_weights: 'yes'"),
    ("lamb", "max_grad_norm", -1.0, r"max_grad_norm: -1\.0"),
    ("lars", "lr", "0.1", r"lr: '0\.1'"),
    ("lars", "lr", -1, r"lr: -1"),
    ("lars", "lr", 1e308, r"lr: 1e\+308 overflows torch.float32"),
    ("lars", "denominator", "bogus", r"denominator: 'bogus'"),
    ("lars", "trust_coefficient", -1, r"trust_coefficient: -1"),
    ("lars", "trust_coefficient", 1e308, r"trust_coefficient: 1e\+308 overflows torch.float32"),
    ("lars", "adapt", "no", r"adapt: 'no'"),
    ("lars", "weight_decay", 1e300, r"weight_decay: 1e\+300 overflows torch.float32"),
    ("lars", "momentum", -0.5, r"momentum: -0\.5"),
    ("lars", "dampening", 2.0, r"dampening: 2\.0"),
    ("lars", "backend", "bogus", r"backend: 'bogus'"),
    ("lars", "nesterov", 1, r"nesterov: 1"),
)


def _option_rows() -> list[BadInput]:
    rows = []
    for kind, key, value, msg in BAD_OPTIONS:
        rows.append(BadInput(f"set:{key}={value!r}", _edited(_set_option(key, value)),
                             ValueError, "param group 1: Invalid " + msg, (kind,)))
        if key != "backend":  # load_state_dict keeps the constructed backend (not state)
            rows.append(BadInput(f"loaded:{key}={value!r}", _edited(_load_option(key, value)),
                                 ValueError, "param group 1: Invalid " + msg, (kind,)))
    return rows


_STEP_FORMAT = r"param group 1, param 0.*'step' must be a 0-dim float32 tensor"

#: What the optimizers refuse, one row per fault (tests/test_hardening.py runs each row per kind
#: on the eager backend, and the rows whose backend matters on every backend of the machine).
BAD_INPUTS = (
    # -- tensors kept from earlier steps, edited: refused before any write
    BadInput("param_data_of_another_shape", _edited(_param_data_of_another_shape),
             RuntimeError, r"param group 1, param 0.*state '{state}'.*shape", backend_matters=True),
    BadInput("state_of_another_shape", _edited(_set_state(None, lambda old: torch.zeros(3))),
             RuntimeError, r"param group 1, param 0.*state '{state}'.*shape \(3,\)",
             backend_matters=True),
    BadInput("state_of_another_dtype", _edited(_set_state(None, lambda old: old.double())),
             RuntimeError, r"param group 1, param 0.*state '{state}' must be a torch.float32\b",
             backend_matters=True),
    BadInput("state_none", _edited(_set_state(None, lambda old: None)), TypeError,
             r"param group 1, param 0 of those with grads: state '{state}' is NoneType, not a "
             r"tensor", backend_matters=True),
    BadInput("step_int64", _edited(_set_state("step", lambda old: torch.tensor(2))),
             RuntimeError, _STEP_FORMAT, backend_matters=True),
    BadInput("step_of_shape_1", _edited(_set_state("step", lambda old: torch.tensor([2.0]))),
             RuntimeError, _STEP_FORMAT, backend_matters=True),
    BadInput("step_float64", _edited(_set_state("step", lambda old: torch.tensor(2.0).double())),
             RuntimeError, _STEP_FORMAT, backend_matters=True),
    BadInput("grad_of_shape_1_for_5", _edited(_set_grad_data(1, 1, lambda: torch.randn(1))),
             RuntimeError, r"param group 1 has a grad of shape \(1,\) for a param of shape "
             r"\(5,\)", backend_matters=True),
    BadInput("grad_resized", _edited(lambda opt, groups, kind: groups[1][0].grad.resize_(2)),
             RuntimeError, r"param group 1 has a grad of shape \(2,\) for a param of shape "
             r"\(5, 3\)", backend_matters=True),
    BadInput("grad_complex", _edited(_set_grad_data(
        1, 0, lambda: torch.randn(5, 3, dtype=torch.complex64))), RuntimeError,
        r"does not support complex grads \(param group 1", backend_matters=True),
    BadInput("grad_sparse", _edited(_sparse_grad), RuntimeError,
             r"does not support sparse params or gradients \(param group 1\)",
             backend_matters=True),
    BadInput("same_param_twice", _edited(_param_twice), ValueError,
             r"param group 1 holds the same param twice", backend_matters=True),
    BadInput("param_on_another_device", _edited(_param_on_another_device), RuntimeError,
             r"params of one group must be on one device; param group 1 has params on "
             r"\['cpu', 'meta'\]", backend_matters=True),
    BadInput("complex_param_group", _edited(_complex_param_group), RuntimeError,
             r"does not support complex params \(param group 2", backend_matters=True),
    BadInput("params_made_half_without_masters", _edited(_model_half), RuntimeError,
             r"param 0 of param group 0 has no state tensor 'master_param'",
             backend_matters=True),
    BadInput("stale_master_turned_back_on", _edited(_stale_master, dtype=torch.bfloat16),
             RuntimeError, r"param 0 of param group 0 has no state tensor 'master_param'",
             backend_matters=True),
    BadInput("master_none", _edited(_set_state("master_param", lambda old: None),
                                    dtype=torch.bfloat16), TypeError,
             r"param group 1, param 0 of those with grads: state 'master_param' is NoneType, not "
             r"a tensor", backend_matters=True),
    # -- options: refused at the step that finds them, naming the group
    *_option_rows(),
    BadInput("betas_list_edited_in_place", _edited(_list_edited_in_place("betas", [0.9, 0.999],
                                                                        2.0)),
             ValueError, r"param group 1: Invalid beta1: 2\.0", ("lamb",)),
    BadInput("trust_ratio_bounds_list_edited_in_place", _edited(_list_edited_in_place(
        "trust_ratio_bounds", [0.1, 10.0], -1.0)),
        ValueError, r"param group 1: Invalid trust_ratio_bounds", ("lamb",)),
    BadInput("lr_on_the_meta_device", _edited(_set_option("lr", torch.tensor(0.1,
                                                                              device="meta"))),
             ValueError, r"param group 1: Invalid lr: a tensor lr on the meta device holds no "
             r"value"),
    *(BadInput(f"tensor_lr_{name}", _edited(_set_option("lr", torch.tensor(v))), ValueError,
               r"param group 1: Invalid lr: a tensor lr holds " + name)
      for name, v in (("nan", math.nan), ("inf", math.inf), ("-1", -1.0))),
    BadInput("option_deleted", _edited(_delete_option("weight_decay")), ValueError,
             r"param group 1 has no option 'weight_decay'"),
    # -- fresh optimizers: refused at the first step, before any state is made
    BadInput("expanded_stride0_param", _expanded_param, RuntimeError,
             r"param group 1, param 0 of those with grads \(shape \(4,\), torch.float32\): its "
             r"elements overlap in memory \(stride 0"),
    BadInput("overlapping_param_views", _overlapping_views, ValueError,
             r"param group 0: params\[0\] and params\[1\] overlap in memory \(views of one "
             r"tensor\)"),
    BadInput("explicit_backend_that_cannot_run", _unusable_backend, RuntimeError,
             r"backend='cuda'"),
    BadInput("foreign_state_of_sgd", _foreign_state("sgd"), RuntimeError,
             r"param 0 of param group 0 has no state tensor 'step' \(a state dict of another "
             r"optimizer", kinds=("lamb",)),  # LARS resumes torch SGD's momentum
    BadInput("lamb_state_without_a_count", _lamb_state_without_a_count, ValueError,
             r"param 0 of the state dict has moments but no step count, neither its own nor its "
             r"param group's", kinds=("lamb",)),
    BadInput("foreign_state_of_the_other_kind", _foreign_state("other"), RuntimeError,
             r"param 0 of param group 0 has no state tensor '{state}' \(a state dict of "
             r"another optimizer"),
    # -- construction and add_param_group: refused where the value is given
    *(BadInput(f"constructed:tensor_lr_{name}", _constructed(lr=torch.tensor(v)), ValueError,
               r"Invalid lr: a tensor lr holds " + name)
      for name, v in (("nan", math.nan), ("inf", math.inf), ("-1", -1.0))),
    BadInput("constructed:max_grad_norm=inf", _constructed(max_grad_norm=math.inf), ValueError,
             r"Invalid max_grad_norm: inf; expected None \(no clipping\) or a finite number > 0"),
    BadInput("constructed:lr=10**400", _constructed(lr=10 ** 400), ValueError,
             r"Invalid lr: an int of 401 digits"),
    BadInput("added_group:lr=10**400", _added_group(lr=10 ** 400), ValueError,
             r"Invalid lr: an int of 401 digits"),
    BadInput("constructed:lr=-1.0", _constructed(lr=-1.0), ValueError, r"Invalid lr: -1\.0"),
    BadInput("constructed:weight_decay=-0.1", _constructed(weight_decay=-0.1), ValueError,
             r"Invalid weight_decay: -0\.1"),
    BadInput("constructed:backend='fast'", _constructed(backend="fast"), ValueError,
             r"Invalid backend: 'fast'"),
    BadInput("constructed:master_weights='yes'", _constructed(master_weights="yes"), ValueError,
             r"Invalid master_weights"),
    BadInput("constructed:max_grad_norm=0.0", _constructed(max_grad_norm=0.0), ValueError,
             r"Invalid max_grad_norm: 0\.0"),
    BadInput("constructed:max_grad_norm=-1.0", _constructed(max_grad_norm=-1.0), ValueError,
             r"Invalid max_grad_norm: -1\.0"),
    BadInput("constructed:max_grad_norm=0", _constructed(max_grad_norm=0), ValueError,
             r"Invalid max_grad_norm: 0"),
    BadInput("constructed:eps=-1e-08", _constructed(eps=-1e-8), ValueError,
             r"Invalid eps: -1e-08"),
    BadInput("constructed:betas=(1.0, 0.999)", _constructed(betas=(1.0, 0.999)), ValueError,
             r"Invalid beta1: 1\.0; expected 0 <= beta1 < 1", ("lamb",)),
    BadInput("constructed:betas=(0.9, -0.1)", _constructed(betas=(0.9, -0.1)), ValueError,
             r"Invalid beta2: -0\.1", ("lamb",)),
    BadInput("constructed:trust_ratio_bounds=(2.0, 1.0)",
             _constructed(trust_ratio_bounds=(2.0, 1.0)), ValueError,
             r"Invalid trust_ratio_bounds.*lo <= hi", ("lamb",)),
    BadInput("constructed:trust_ratio_bounds=(-1.0, 1.0)",
             _constructed(trust_ratio_bounds=(-1.0, 1.0)), ValueError,
             r"Invalid trust_ratio_bounds.*0 <= lo", ("lamb",)),
    BadInput("constructed:momentum=1e39", _constructed(momentum=1e39), ValueError,
             r"Invalid momentum: 1e\+39 overflows torch.float32", ("lars",)),
    BadInput("constructed:momentum=-0.9", _constructed(momentum=-0.9), ValueError,
             r"Invalid momentum: -0\.9", ("lars",)),
    BadInput("constructed:trust_coefficient=0.0", _constructed(trust_coefficient=0.0),
             ValueError, r"Invalid trust_coefficient: 0\.0", ("lars",)),
    BadInput("constructed:nesterov_without_momentum", _constructed(nesterov=True, momentum=0.0),
             ValueError, r"nesterov.*momentum > 0", ("lars",)),
    BadInput("constructed:nesterov_with_dampening", _constructed(nesterov=True, dampening=0.1),
             ValueError, r"nesterov.*dampening = 0", ("lars",)),
    BadInput("constructed:denominator='max'", _constructed(denominator="max"), ValueError,
             r"Invalid denominator: 'max'", ("lars",)),
)


# ------------------------------------------------------------------------ protocol helpers
# What the protocol rows of ``python -m fusedopt check`` (fusedopt/tools/check.py) build on:
# inputs and references shared with run_case, misaligned placement, bitwise comparison.

def case_inputs(cache: RunCache, cs: CaseSet, dtype: DtypeCase) -> Inputs:
    """The inputs :func:`run_case` steps for ``cs`` and ``dtype`` (the same cache entry)."""
    return _inputs(cache, cs, dtype)


def case_reference(cache: RunCache, cs: CaseSet, case: OptionCase, dtype: DtypeCase) -> list:
    """The float64 reference weights :func:`run_case` judges ``case`` by (one cache entry per
    case set, case and dtypes)."""
    inputs = _inputs(cache, cs, dtype)
    return cache.get("reference", (cs, case, dtype.param, dtype.grad),
                     lambda: run_reference(case.kind, case.options, inputs, excluded=cs.excluded))


def misaligned_like(t: torch.Tensor, offset: int = 1) -> torch.Tensor:
    """A contiguous tensor equal to ``t`` (shape, dtype, device, values) that starts ``offset``
    elements into an allocation of its own, as a slice of a larger buffer does: a view whose data
    pointer is not a multiple of 16 bytes. torch's allocators return blocks aligned to at least
    64 bytes, so any ``offset`` whose bytes are not a multiple of 16 misaligns it (ValueError for
    one that is; RuntimeError if an allocation was not 16-byte aligned after all)."""
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 1:
        raise ValueError(f"offset must be an int >= 1, got {offset!r}")
    if offset * t.element_size() % 16 == 0:
        raise ValueError(f"an offset of {offset} {t.dtype} elements is a multiple of 16 bytes: "
                         "the view would be aligned")
    base = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    out = base[offset:].view(t.shape)
    out.copy_(t.detach())
    if t.numel() and out.data_ptr() % 16 == 0:
        raise RuntimeError(f"a {t.dtype} view {offset} elements into an allocation is 16-byte "
                           f"aligned on {t.device}: the allocation was not")
    return out


def state_tensors(opt, params) -> list[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` of every state tensor of ``params`` in ``opt``, in param order and by
    key (what a bitwise comparison of two runs compares besides the params)."""
    out = []
    for i, p in enumerate(params):
        st = opt.state.get(p) or {}
        out += [(f"param {i} state {k!r}", st[k]) for k in sorted(st)
                if isinstance(st[k], torch.Tensor)]
    return out


_SAME_SIZE_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bit_mismatches(xs, ys) -> int:
    """How many elements of the tensors ``xs`` differ in their bits from those of ``ys`` (pairwise;
    a pair of another shape or dtype counts every element of the larger, a missing partner every
    element): 0 is bit for bit, NaNs and signed zeros included."""
    xs, ys = list(xs), list(ys)
    count = sum(t.numel() for t in xs[len(ys):]) + sum(t.numel() for t in ys[len(xs):])
    for x, y in zip(xs, ys):
        if x.shape != y.shape or x.dtype != y.dtype:
            count += max(x.numel(), y.numel())
            continue
        if x.numel() == 0:
            continue
        as_int = _SAME_SIZE_INT[x.element_size()]
        a = x.detach().cpu().contiguous().reshape(-1).view(as_int)
        b = y.detach().cpu().contiguous().reshape(-1).view(as_int)
        count += int((a != b).sum())
    return count
