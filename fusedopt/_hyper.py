"""Hyper-parameters: defaults (written once), validation, and the host-side scalars of a step.

Every backend receives the frozen :class:`LambHyper` / :class:`LarsHyper` built here, so the values
derived on the host (``beta3``, ``1 - beta2``, λ inside u, ``1 - dampening``, the bound switches)
are computed in exactly one place.
Per-tensor values that depend on the step count (the bias corrections ``1 - beta^t``) are computed
by the backends from the step tensors, with the formula of :func:`bias_correction`.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from . import lowp
from ._bucket import compute_dtype, local

BACKEND_NAMES = ("auto", "eager", "cpp", "triton", "cuda")
DENOMINATORS = ("sum", "combined")

LAMB_DEFAULTS: dict[str, Any] = dict(
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-6,
    weight_decay=0.01,
    bias_correction=True,
    grad_averaging=True,
    max_grad_norm=None,
    trust_ratio_bounds=None,
    decoupled_weight_decay=False,
    adapt=True,
)

LARS_DEFAULTS: dict[str, Any] = dict(
    lr=1e-3,  # torch SGD's default, so that FusedLARS(params) constructs as SGD(params) does
    momentum=0.9,
    weight_decay=0.0,
    trust_coefficient=0.001,
    eps=1e-8,
    nesterov=False,
    dampening=0.0,
    trust_clip=False,
    denominator="sum",
    lr_in_momentum=True,
    max_grad_norm=None,
    adapt=True,
)


def is_real(x: Any) -> bool:
    """A real number that is not a bool (True is an int in Python)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _show(x: Any) -> str:
    """``repr(x)`` for an error message, short for an int of many digits; a tensor is named as
    the type that is refused (torch's Adam takes tensor betas, for instance)."""
    if isinstance(x, torch.Tensor):
        return f"a tensor ({x!r}; of the options only lr may be one)"
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) >= 10 ** 30:
        return f"an int of {len(str(abs(x))) if abs(x) < 10 ** 4000 else 'over 4000'} digits"
    return repr(x)


def _finite(x: Any) -> bool:
    """Whether the real number ``x`` is finite as a float64 (False for NaN, inf and an int too
    large for a float). Written with comparisons only (Note [traced options])."""
    if isinstance(x, int):
        try:
            x = float(x)
        except OverflowError:
            return False
    return -math.inf < x < math.inf


def _num(x: Any) -> Any:
    """An option's value as a float. Note [traced options]: under torch.compile, dynamo turns a
    float option that changed between calls into a symbol (a graph input) instead of a constant
    of the graph; float() would specialize the symbol again (a recompile per value), and
    math.isinf would break the graph, so a traced step keeps the value as it is and every check
    of it is a comparison (a guard, true for every valid value)."""
    return x if torch.compiler.is_compiling() else float(x)


def _check_lr(lr: Any) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.is_complex() or not lr.is_floating_point():
            raise ValueError(f"Invalid lr: a tensor lr must be a real floating-point tensor of one "
                             f"element, got {lr!r}")
        if lr.device.type == "meta":
            raise ValueError("Invalid lr: a tensor lr on the meta device holds no value")
        if not torch.compiler.is_compiling():  # a traced step reads no value on the host
            check_lr_value(lr)
        return
    if not is_real(lr) or not (lr >= 0.0) or not _finite(lr):
        raise ValueError(f"Invalid lr: {_show(lr)}; expected a finite number >= 0")


def check_lr_value(lr: torch.Tensor) -> None:
    """The value of a tensor lr: finite and >= 0. Reads it on the host (a device sync for an
    accelerator tensor), so the optimizers check it only when the tensor is new to them."""
    value = float(lr.detach().reshape(()).item())
    if not (value >= 0.0) or not _finite(value):
        raise ValueError(f"Invalid lr: a tensor lr holds {value!r}; expected a finite number >= 0")


def _check_nonneg(name: str, x: Any) -> None:
    if not is_real(x) or not (x >= 0.0) or not _finite(x):
        raise ValueError(f"Invalid {name}: {_show(x)}; expected a finite number >= 0")


def _check_bool(name: str, x: Any) -> None:
    if not isinstance(x, bool):
        raise ValueError(f"Invalid {name}: {_show(x)}; expected True or False")


def _check_max_grad_norm(x: Any) -> None:
    if x is None:
        return
    if not is_real(x) or not (x > 0.0) or not _finite(x):
        raise ValueError(f"Invalid max_grad_norm: {_show(x)}; expected None (no clipping) or a finite "
                         "number > 0")


def check_backend_name(backend: Any) -> None:
    if backend not in BACKEND_NAMES:
        raise ValueError(f"Invalid backend: {backend!r}; expected one of {BACKEND_NAMES}")


def check_maximize(maximize: Any) -> None:
    if not isinstance(maximize, bool):
        raise ValueError(f"Invalid maximize: {maximize!r}; expected True or False")


def validate_lamb_group(g: dict[str, Any]) -> None:
    """Raise ValueError naming the first invalid LAMB hyper-parameter of a param group."""
    _check_lr(g["lr"])
    betas = g["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r}; expected a pair (beta1, beta2)")
    for i, b in enumerate(betas, start=1):
        if not is_real(b) or not (0.0 <= b < 1.0):
            raise ValueError(f"Invalid beta{i}: {_show(b)}; expected 0 <= beta{i} < 1")
    eps = g["eps"]
    if not is_real(eps) or not (eps > 0.0) or not _finite(eps):
        # u = m / (sqrt(v) + eps) is 0/0 for an element whose gradient has been 0 at every step
        raise ValueError(f"Invalid eps: {_show(eps)}; expected a finite number > 0 (LAMB divides by "
                         "sqrt(v) + eps, which is 0 where all gradients so far were 0)")
    _check_nonneg("weight_decay", g["weight_decay"])
    for name in ("bias_correction", "grad_averaging", "decoupled_weight_decay", "adapt"):
        _check_bool(name, g[name])
    _check_max_grad_norm(g["max_grad_norm"])
    bounds = g["trust_ratio_bounds"]
    if bounds is not None:
        if not isinstance(bounds, (tuple, list)) or len(bounds) != 2 or not all(map(is_real, bounds)):
            raise ValueError(
                f"Invalid trust_ratio_bounds: {bounds!r}; expected None or a pair (lo, hi)"
            )
        lo, hi = bounds
        if not (0.0 <= lo <= hi) or not _finite(lo) or not (hi == math.inf or _finite(hi)):
            raise ValueError(
                f"Invalid trust_ratio_bounds: {bounds!r}; expected 0 <= lo <= hi, lo finite "
                "(hi may be inf: no upper bound)"
            )


def validate_lars_group(g: dict[str, Any]) -> None:
    """Raise ValueError naming the first invalid LARS hyper-parameter of a param group."""
    _check_lr(g["lr"])
    _check_nonneg("momentum", g["momentum"])
    _check_nonneg("weight_decay", g["weight_decay"])
    _check_nonneg("eps", g["eps"])
    tc = g["trust_coefficient"]
    if not is_real(tc) or not (tc > 0.0) or not _finite(tc):
        raise ValueError(f"Invalid trust_coefficient: {_show(tc)}; expected a finite number > 0")
    damp = g["dampening"]
    if not is_real(damp) or not (0.0 <= damp <= 1.0):
        raise ValueError(f"Invalid dampening: {_show(damp)}; expected 0 <= dampening <= 1")
    for name in ("nesterov", "trust_clip", "lr_in_momentum", "adapt"):
        _check_bool(name, g[name])
    if g["nesterov"] and (g["momentum"] <= 0 or damp != 0):
        raise ValueError(
            f"Invalid nesterov=True with momentum={g['momentum']!r}, dampening={_show(damp)}; "
            "Nesterov momentum requires momentum > 0 and dampening = 0"
        )
    if g["denominator"] not in DENOMINATORS:
        raise ValueError(
            f"Invalid denominator: {g['denominator']!r}; expected one of {DENOMINATORS}"
        )
    _check_max_grad_norm(g["max_grad_norm"])


def check_options(kind: str, group: dict[str, Any]) -> None:
    """The options of a step of ``kind`` ("lamb", "lars") that the functional form takes too: the
    math, ``backend`` and ``maximize`` (ValueError naming the first invalid one)."""
    (validate_lamb_group if kind == "lamb" else validate_lars_group)(group)
    check_backend_name(group["backend"])
    check_maximize(group["maximize"])


def check_group(kind: str, group: dict[str, Any]) -> None:
    """Every option of a param group of a ``kind`` optimizer (ValueError naming the first invalid
    one)."""
    check_options(kind, group)
    if not isinstance(group["capturable"], bool):
        raise ValueError(f"Invalid capturable: {group['capturable']!r}; expected True or False")
    mw = group["master_weights"]
    if mw is not None and not isinstance(mw, bool):
        raise ValueError(f"Invalid master_weights: {mw!r}; expected None, True or False")
    sp = group["state_precision"]
    if not isinstance(sp, str) or sp not in lowp.FORMATS:
        raise ValueError(f"Invalid state_precision: {sp!r}; expected one of "
                         f"{', '.join(map(repr, lowp.FORMATS))}")
    for flag in ("foreach", "fused"):
        if group[flag] is not None and not isinstance(group[flag], bool):
            raise ValueError(f"Invalid {flag}: {group[flag]!r}; expected None, True or False")
    if group["fused"] and group["backend"] == "eager":
        raise ValueError("Invalid fused: True with backend='eager' (the unfused backend); "
                         "use backend='auto', 'cpp', 'triton' or 'cuda'")
    if group["differentiable"] is not False:
        raise ValueError(f"Invalid differentiable: {group['differentiable']!r}; fusedopt steps "
                         "run without autograd (fused kernels, in place), so only False is "
                         "accepted; differentiate through torch.optim's optimizers instead")
    mn = group["state_min_numel"]
    if not isinstance(mn, int) or isinstance(mn, bool) or mn < 0:
        raise ValueError(f"Invalid state_min_numel: {mn!r}; expected an int >= 0")


def check_param_dtypes(h: "LambHyper | LarsHyper", state_precision: str, params) -> None:
    """Raise ValueError where a group's options (``h``, ``state_precision``) cannot step its
    ``params``: a hyper-parameter their compute dtype cannot hold (check_representable), or
    low-precision state asked of float64 params."""
    for dtype in {compute_dtype(local(p).dtype) for p in params
                  if isinstance(p, torch.Tensor) and p.is_floating_point()}:
        check_representable(h, dtype)
        if dtype == torch.float64 and state_precision != "full":
            raise ValueError(f"state_precision={state_precision!r} stores float32 moments in low "
                             "precision; float64 params keep full state (put them in a group "
                             "with state_precision='full')")


def check_representable(h: "LambHyper | LarsHyper", dtype: torch.dtype) -> None:
    """Raise ValueError for a hyper-parameter that the compute dtype ``dtype`` cannot hold: a
    float32 step would compute with inf (then NaN params) where the number is finite in Python."""
    info = torch.finfo(dtype)
    values = [("lr", h.lr), ("weight_decay", h.weight_decay), ("eps", h.eps),
              ("max_grad_norm", h.max_grad_norm)]
    if isinstance(h, LambHyper):
        values += [("trust_ratio_bounds", h.ratio_lo)]
        if h.ratio_hi != math.inf:  # inf: no upper bound
            values += [("trust_ratio_bounds", h.ratio_hi)]
    else:
        values += [("trust_coefficient", h.trust_coefficient), ("momentum", h.momentum)]
    for name, x in values:
        if not isinstance(x, torch.Tensor) and x is not None and x > info.max:
            raise ValueError(f"Invalid {name}: {_show(x)} overflows {dtype} (max {info.max:.4g}), the "
                             "dtype this step computes in")
    if isinstance(h, LambHyper) and h.eps < info.tiny:
        raise ValueError(f"Invalid eps: {h.eps!r} is below the smallest normal {dtype} "
                         f"({info.tiny:.4g}), the dtype this step computes in")


@dataclass(frozen=True)
class LambHyper:
    """Host-side scalars of one LAMB param group (docs/math.md symbols)."""

    lr: float | torch.Tensor
    beta1: float
    beta2: float
    beta3: float  # (1 - beta1) if grad_averaging else 1
    eps: float
    weight_decay: float  # lambda; 0 for excluded params
    bias_correction: bool
    adapt: bool
    decoupled: bool
    bounded: bool  # trust_ratio_bounds given
    ratio_lo: float
    ratio_hi: float
    max_grad_norm: float | None
    one_minus_beta2: float
    lambda_in_u: float  # λ inside u; 0 with decoupled weight decay
    decoupled_lambda: float  # λ of the factor 1 - lr·λ on w; 0 unless decoupled

    def decay_factor(self, dtype: torch.dtype) -> float | torch.Tensor:
        """``1 - lr·λ`` for decoupled weight decay (1 otherwise), in ``dtype`` when ``lr`` is a
        tensor (the C++ and CUDA kernels form it in double beside the kernel: math.h
        lamb_decay, as lr may live on the device)."""
        lr = self.lr.to(dtype) if isinstance(self.lr, torch.Tensor) else self.lr
        return 1.0 - lr * self.decoupled_lambda


@dataclass(frozen=True)
class LarsHyper:
    """Host-side scalars of one LARS param group (docs/math.md symbols)."""

    lr: float | torch.Tensor
    momentum: float  # mu
    dampening: float
    weight_decay: float  # lambda
    trust_coefficient: float  # kappa
    eps: float
    nesterov: bool
    trust_clip: bool
    combined: bool  # denominator == "combined"
    lr_in_momentum: bool
    adapt: bool
    max_grad_norm: float | None
    one_minus_dampening: float


def _lr(lr: float | torch.Tensor) -> float | torch.Tensor:
    # a tensor lr of one element, whatever its shape, is used as a 0-dim tensor by every backend
    if isinstance(lr, torch.Tensor):
        return lr if lr.dim() == 0 else lr.reshape(())
    return _num(lr)


def lamb_hyper(g: dict[str, Any]) -> LambHyper:
    beta1, beta2 = (_num(b) for b in g["betas"])
    bounds = g["trust_ratio_bounds"]
    return LambHyper(
        lr=_lr(g["lr"]),
        beta1=beta1,
        beta2=beta2,
        beta3=(1.0 - beta1) if g["grad_averaging"] else 1.0,
        eps=_num(g["eps"]),
        weight_decay=_num(g["weight_decay"]),
        bias_correction=bool(g["bias_correction"]),
        adapt=bool(g["adapt"]),
        decoupled=bool(g["decoupled_weight_decay"]),
        bounded=bounds is not None,
        ratio_lo=_num(bounds[0]) if bounds is not None else 0.0,
        ratio_hi=_num(bounds[1]) if bounds is not None else math.inf,
        max_grad_norm=None if g["max_grad_norm"] is None else _num(g["max_grad_norm"]),
        one_minus_beta2=1.0 - beta2,
        lambda_in_u=0.0 if g["decoupled_weight_decay"] else _num(g["weight_decay"]),
        decoupled_lambda=_num(g["weight_decay"]) if g["decoupled_weight_decay"] else 0.0,
    )


def lars_hyper(g: dict[str, Any]) -> LarsHyper:
    return LarsHyper(
        lr=_lr(g["lr"]),
        momentum=_num(g["momentum"]),
        dampening=_num(g["dampening"]),
        weight_decay=_num(g["weight_decay"]),
        trust_coefficient=_num(g["trust_coefficient"]),
        eps=_num(g["eps"]),
        nesterov=bool(g["nesterov"]),
        trust_clip=bool(g["trust_clip"]),
        combined=g["denominator"] == "combined",
        lr_in_momentum=bool(g["lr_in_momentum"]),
        adapt=bool(g["adapt"]),
        max_grad_norm=None if g["max_grad_norm"] is None else _num(g["max_grad_norm"]),
        one_minus_dampening=1.0 - _num(g["dampening"]),
    )


# The fields in declaration order (a tuple of names: dataclasses.fields does not trace under
# torch.compile).
LAMB_FIELDS = tuple(f.name for f in dataclasses.fields(LambHyper))
LARS_FIELDS = tuple(f.name for f in dataclasses.fields(LarsHyper))


def encode(h: LambHyper | LarsHyper) -> torch.Tensor:
    """``h`` as the one tensor every fused kernel reads its scalars from (Note [hyper fields] in
    csrc/cpu/ops.h): a float64 CPU tensor of its fields in declaration order, booleans 0/1, no
    ``max_grad_norm`` NaN, a tensor ``lr`` 0 (it travels beside, as a tensor). Under
    torch.compile the tensor is computed in the graph from the options (Note [traced options]),
    so a float option that changes between steps is a graph input, not a constant: no recompile,
    and the value the kernels read is the value of this step."""
    names = LAMB_FIELDS if isinstance(h, LambHyper) else LARS_FIELDS
    values = [math.nan if v is None else 0.0 if isinstance(v, torch.Tensor) else v
              for v in (getattr(h, name) for name in names)]
    if torch.compiler.is_compiling():
        zero = torch.zeros((), dtype=torch.float64)
        return torch.stack([zero + v for v in values])
    return torch.tensor(values, dtype=torch.float64)
