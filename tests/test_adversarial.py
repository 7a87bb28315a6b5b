"""Adversarial property suite for the hardening issue: eager and cpp backends, random configs plus
edits of groups, state, grads and params made behind the optimizer's back.

For every checked ``step()`` exactly one of two outcomes must hold:

(a) it raises ValueError/RuntimeError/TypeError whose message names the problem, and params,
    grads, every state tensor (``step`` included), the set of params with state and every
    param-group option are bit-identical to before the call (NaN positions compare equal); or
(b) it succeeds, the result agrees with the float64 reference (docs/math.md, fusedopt/reference.py)
    run from the pre-step snapshot, the two backends agree with each other, the grads are
    untouched, and no NaN appears when every input was finite. With low-precision state (bf16 or
    8-bit moments, the ``*_low_precision`` tests) the two backends agree with each other and the
    reference is left to tests/test_low_precision.py (one rounding apart, a moment can take the
    next code, which the reference's tolerances here are not made for).

Edits marked ``must_raise`` are invalid by the documented validation rules, so (b) is not open to
them. Steps of an unedited (valid) config must succeed. The shrink phase is off to keep the file
fast; every example is derandomized.
"""
from __future__ import annotations

import copy
import math
import random
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fusedopt
from fusedopt import lowp
from fusedopt.reference import LAMB_SPEC, LARS_SPEC, ReferenceLAMB, ReferenceLARS
from helpers import LAMB_HYPER_ST, LARS_HYPER_ST, backend_params, bits_equal

BACKENDS = ("eager", "cpp")
ERRORS = (ValueError, RuntimeError, TypeError)
LOW = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
STATE_KEYS = {"lamb": ("exp_avg", "exp_avg_sq"), "lars": ("momentum_buffer",)}
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                phases=(Phase.explicit, Phase.generate),
                suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------- comparisons
def _values_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bits_equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_values_equal, a, b))
    return type(a) is type(b) and a == b


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _tol(dtype) -> float:
    """Relative (to the tensor's largest |value|) tolerance of one step in ``dtype``."""
    return {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2 ** -7,
            torch.float16: 2 ** -10}.get(dtype, 1e-5)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, floor: float = 0.0) -> str | None:
    """None if ``got`` agrees with ``want`` (any dtype; compared after rounding ``want`` to
    ``got``'s dtype): non-finite positions must match exactly (NaN == NaN, same inf), finite ones
    within ``tol`` relative to the largest finite |want| (at least ``floor``: the magnitude of the
    step's inputs, so that cancellation in a tiny tensor is not a failure)."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    g = got.detach().double()
    w = want.detach().to(got.dtype).double() if got.dtype.is_floating_point else want.double()
    if g.numel() == 0:
        return None
    fin = torch.isfinite(g) & torch.isfinite(w)
    nonfin_ok = torch.where(fin, True, (g == w) | (torch.isnan(g) & torch.isnan(w)))
    if not bool(nonfin_ok.all()):
        i = int((~nonfin_ok).nonzero()[0][0]) if g.dim() else 0
        return f"non-finite mismatch at flat {i}: got {g.reshape(-1)[i]} want {w.reshape(-1)[i]}"
    if not bool(fin.any()):
        return None
    scale = max(float(w[fin].abs().max()), floor) or 1.0
    err = float((g[fin] - w[fin]).abs().max()) / scale
    return None if err <= tol else f"max rel err {err:.3g} > {tol:.3g}"


# ----------------------------------------------------------------------------- configs
@dataclass
class ParamSpec:
    shape: tuple
    layout: str  # contig | t | slice
    grad_layout: str  # contig | t | slice | expand
    has_grad: bool


@dataclass
class GroupSpec:
    params: list
    dtype: torch.dtype
    grad_dtype: torch.dtype
    hyper: dict


@dataclass
class Config:
    kind: str
    groups: list
    lr: tuple  # (form, value): form in float, t0, t1, t11
    master_weights: bool | None
    warm: int
    seed: int
    precisions: tuple = ()  # each group's state_precision (state_min_numel=0); () for full


SHAPES = [(), (0,), (1,), (3,), (7,), (2, 3), (5, 4), (0, 3), (3, 1, 2)]



@st.composite
def param_st(draw, first):
    shape = draw(st.sampled_from(SHAPES))
    return ParamSpec(shape, draw(st.sampled_from(["contig", "contig", "t", "slice"])),
                     draw(st.sampled_from(["contig", "contig", "t", "slice", "expand"])),
                     True if first else draw(st.sampled_from([True, True, True, False])))


@st.composite
def config_st(draw, kind, min_groups=1, low=False):
    groups = []
    for _ in range(draw(st.integers(min_groups, 3))):
        n = draw(st.integers(1, 3))
        ps = [draw(param_st(i == 0)) for i in range(n)]
        dtype = draw(st.sampled_from(DTYPES))
        gdt = dtype if draw(st.booleans()) else draw(st.sampled_from(DTYPES))
        hyper = dict(draw(LAMB_HYPER_ST if kind == "lamb" else LARS_HYPER_ST))
        if kind == "lars" and draw(st.booleans()):
            hyper["nesterov"] = True
        if kind == "lars" and hyper.get("nesterov"):
            hyper.update(momentum=hyper.get("momentum", 0.9) or 0.9, dampening=0.0)
        groups.append(GroupSpec(ps, dtype, gdt, hyper))
    lr_vals = [1e-3, 1e-2, 0.1] if kind == "lamb" else [0.1, 0.5, 1.0]
    lr = (draw(st.sampled_from(["float", "float", "t0", "t1", "t11", "t0_64"])),
          draw(st.sampled_from(lr_vals)))
    # float64 params keep full state (add_param_group refuses the others for them)
    precisions = tuple("full" if gs.dtype == torch.float64 else draw(st.sampled_from(["bf16", "8bit"]))
                       for gs in groups) if low else ()
    return Config(kind, groups, lr, draw(st.sampled_from([None, True, False])),
                  draw(st.integers(0, 2)), draw(st.integers(0, 2 ** 16)), precisions)


def _lr_value(form, v):
    return {"float": lambda: v, "t0": lambda: torch.tensor(v), "t1": lambda: torch.tensor([v]),
            "t11": lambda: torch.tensor([[v]]),
            "t0_64": lambda: torch.tensor(v, dtype=torch.float64)}[form]()


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x``'s values in the given memory layout."""
    if layout == "t" and x.dim() >= 2:
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "slice" and x.dim() >= 1:
        base = torch.zeros(*x.shape[:-1], x.shape[-1] * 2, dtype=x.dtype)
        out = base[..., ::2]
        out.copy_(x)
        return out
    if layout == "expand" and x.dim() >= 1 and x.shape[0] > 1:
        return x[:1].expand(x.shape)  # stride 0 along dim 0
    return x


class Run:
    """One optimizer built from a Config on one backend."""

    def __init__(self, cfg: Config, backend: str):
        self.cfg, self.backend = cfg, backend
        gen = torch.Generator().manual_seed(cfg.seed)
        self.groups: list[list[torch.nn.Parameter]] = []
        opt_groups = []
        for gs in cfg.groups:
            ps = []
            for spec in gs.params:
                x = torch.randn(spec.shape, generator=gen, dtype=torch.float64).to(gs.dtype)
                p = torch.nn.Parameter(_layout(x, spec.layout))
                if gs.grad_dtype != gs.dtype and hasattr(p, "grad_dtype"):
                    p.grad_dtype = gs.grad_dtype
                ps.append(p)
            self.groups.append(ps)
            opt_groups.append({"params": list(ps), **gs.hyper})
        for g, precision in zip(opt_groups, cfg.precisions):
            g.update(state_precision=precision, state_min_numel=0)
        cls = fusedopt.FusedLAMB if cfg.kind == "lamb" else fusedopt.FusedLARS
        with warnings.catch_warnings():  # 8-bit: non-contiguous params keep bf16 state, warned
            warnings.simplefilter("ignore", UserWarning)
            self.opt = cls(opt_groups, lr=_lr_value(*cfg.lr), backend=backend,
                           master_weights=cfg.master_weights)
        self.rnd = random.Random(cfg.seed)
        self.steps_done = 0

    def all_params(self):
        seen, out = set(), []
        for g in self.opt.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def set_grads(self):
        gen = torch.Generator().manual_seed(self.cfg.seed * 7 + 1000 * self.steps_done + 1)
        for gs, ps in zip(self.cfg.groups, self.groups):
            for spec, p in zip(gs.params, ps):
                g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(gs.grad_dtype)
                p.grad = _layout(g, spec.grad_layout) if spec.has_grad else None

    def target(self, with_state=False):
        """The first param with a grad (and state) of the LAST group."""
        for p in self.opt.param_groups[-1]["params"]:
            if p.grad is not None and (not with_state or self.opt.state.get(p)):
                return p
        raise AssertionError("no target param")


def _snapshot(run: Run) -> dict:
    opt = run.opt
    ps = run.all_params()
    return dict(
        params=[_copy(p) for p in ps],
        grads=[None if p.grad is None else _copy(p.grad) for p in ps],
        state={i: {k: _copy(v) for k, v in opt.state[p].items()}
               for i, p in enumerate(ps) if opt.state.get(p)},
        groups=[{k: _copy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
        members=[[id(p) for p in g["params"]] for g in opt.param_groups],
    )


def _diff(a: dict, b: dict) -> list[str]:
    out = []
    for what in ("params", "grads"):
        for i, (x, y) in enumerate(zip(a[what], b[what])):
            if not _values_equal(x, y):
                out.append(f"{what}[{i}] changed")
    if len(a["params"]) != len(b["params"]):
        out.append("number of params changed")
    if a["state"].keys() != b["state"].keys():
        out.append(f"params with state changed: {sorted(a['state'])} -> {sorted(b['state'])}")
    for i in a["state"].keys() & b["state"].keys():
        sa, sb = a["state"][i], b["state"][i]
        if sa.keys() != sb.keys():
            out.append(f"state[{i}] keys changed: {sorted(sa)} -> {sorted(sb)}")
        for k in sa.keys() & sb.keys():
            if not _values_equal(sa[k], sb[k]):
                out.append(f"state[{i}][{k!r}] changed")
    if a["members"] != b["members"]:
        out.append("group params changed")
    for gi, (ga, gb) in enumerate(zip(a["groups"], b["groups"])):
        for k in ga.keys() | gb.keys():
            if k not in ga or k not in gb or not _values_equal(ga[k], gb[k]):
                out.append(f"param_groups[{gi}][{k!r}] changed")
    return out


# ----------------------------------------------------------------------------- reference
def _finite_number(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.is_floating_point() and bool(torch.isfinite(x).all())
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return True
    if isinstance(x, (int, float)):
        return math.isfinite(x)
    if isinstance(x, (tuple, list)):
        return all(map(_finite_number, x))
    return True


def _inputs_finite(run: Run, snap: dict) -> bool:
    tensors = [t for t in snap["params"] + snap["grads"] if t is not None]
    tensors += [v for s in snap["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    if not all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point()):
        return False
    return all(_finite_number(v) for g in snap["groups"] for v in g.values())


def _reference(run: Run, snap: dict):
    """The float64 reference step from the pre-step snapshot: returns
    {param index: (weights, state dict)} for the params it steps (raises on inputs it cannot
    interpret, i.e. inputs that should have been refused)."""
    kind = run.cfg.kind
    spec = LAMB_SPEC if kind == "lamb" else LARS_SPEC
    ps = run.all_params()
    index = {id(p): i for i, p in enumerate(ps)}
    hypers, weights, grads, where = [], [], [], {}
    for gi, g in enumerate(run.opt.param_groups):
        h = {k: g[k] for k in spec}
        lr = g["lr"]
        h["lr"] = float(lr.reshape(())) if isinstance(lr, torch.Tensor) else float(lr)
        hypers.append(h)
        ws, gs = [], []
        for p in g["params"]:
            i = index[id(p)]
            st_ = snap["state"].get(i, {})
            mw = g["master_weights"]
            use_master = p.dtype in LOW and (mw is None or mw) and "master_param" in st_
            ws.append((st_["master_param"] if use_master else snap["params"][i]).double().clone())
            gr = snap["grads"][i]
            gs.append(None if gr is None else gr.double())
            where[i] = (gi, len(ws) - 1, use_master)
        weights.append(ws)
        grads.append(gs)
    ref = (ReferenceLAMB if kind == "lamb" else ReferenceLARS)(hypers)
    for i, (gi, pi, _) in where.items():
        st_ = snap["state"].get(i)
        if st_:
            s = {"step": int(round(float(torch.as_tensor(st_["step"]).reshape(()))))}
            for k in STATE_KEYS[kind]:
                if k in st_:
                    s[k] = st_[k].double().clone()
            ref.state[(gi, pi)] = s
    ref.step(weights, grads)
    out = {}
    for i, (gi, pi, use_master) in where.items():
        if grads[gi][pi] is not None:
            out[i] = (weights[gi][pi], ref.state[(gi, pi)], use_master, ref.groups[gi])
    return out


def _unexplained(run: Run, p, got: torch.Tensor, w0: torch.Tensor, h: dict, rs: dict, tol: float,
                 floor: float) -> bool:
    """Whether ``got`` (param ``p``'s weight after the step, which missed the reference) also
    misses LAMB's update of ``w0`` (the weight before the step) computed in float64 from the
    moments the backend stored; always for LARS. Where LAMB's moments cancel to rounding noise
    (β1·m + β3·g exactly 0 in real numbers, as bf16 values can make it), the sign of u, and with
    it the direction of the whole step ``lr·‖w‖·u/‖u‖``, is that noise's: the backend and the
    float64 reference then differ by up to ``2·lr·‖w‖`` while both follow the contract. The
    moments themselves are compared with the reference; this compares the update they give."""
    if run.cfg.kind != "lamb":
        return True
    st_ = run.opt.state[p]
    w = w0.double().clone()
    ReferenceLAMB.apply(h, {"step": rs["step"], "exp_avg": st_["exp_avg"].double(),
                            "exp_avg_sq": st_["exp_avg_sq"].double()}, w)
    return _close(got, w, tol, floor) is not None


def _check_success(run: Run, before: dict, after: dict) -> list[str]:
    errs = _check_untouched(run, before, after)
    if run.cfg.precisions:  # the backends are compared with each other (_compare_backends)
        return errs
    try:
        ref = _reference(run, before)
    except Exception as e:  # noqa: BLE001 - the inputs were not interpretable: should have raised
        return [f"step succeeded on inputs the reference cannot interpret ({type(e).__name__}: {e})"]
    ps = run.all_params()
    # fp64 tensors get fp32-level agreement when the clipping total sums lower-precision grads
    mixed_clip = any(g.get("max_grad_norm") is not None for g in run.opt.param_groups) and any(
        x is not None and x.dtype != torch.float64 for x in before["grads"])

    def tol(dtype):
        return 1e-6 if dtype == torch.float64 and mixed_clip else _tol(dtype)

    def amax(*ts):
        return max([float(t.detach().double().abs().max()) for t in ts
                    if isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point()
                    and bool(torch.isfinite(t).all())] + [0.0])

    for i, p in enumerate(ps):
        st_ = run.opt.state.get(p) or {}
        st0 = before["state"].get(i, {})
        w_floor = amax(before["params"][i], st0.get("master_param"))
        s_floor = amax(before["grads"][i], *[st0.get(k) for k in STATE_KEYS[run.cfg.kind]])
        if i not in ref:
            if not _values_equal(before["params"][i], after["params"][i]):
                errs.append(f"param {i} without grad changed")
            continue
        w, rs, use_master, h = ref[i]
        w0 = st0["master_param"] if use_master else before["params"][i]
        if use_master:
            m = st_.get("master_param")
            if not isinstance(m, torch.Tensor):
                errs.append(f"param {i}: master_param missing after the step")
            else:
                e = _close(m, w, tol(torch.float32), w_floor)
                if e and _unexplained(run, p, m, w0, h, rs, tol(torch.float32), w_floor):
                    errs.append(f"param {i} master vs reference: {e}")
        p_tol = tol(p.dtype) if not use_master else max(_tol(p.dtype), 1e-5)
        e = _close(p, w, p_tol, w_floor)
        if e and _unexplained(run, p, p, w0, h, rs, p_tol, w_floor):
            errs.append(f"param {i} ({p.dtype}) vs reference: {e}")
        for k in STATE_KEYS[run.cfg.kind]:
            t = st_.get(k)
            if not isinstance(t, torch.Tensor):
                errs.append(f"param {i}: state {k!r} missing after the step")
                continue
            e = _close(t, rs[k], tol(t.dtype if t.dtype.is_floating_point else torch.float32), s_floor)
            if e:
                errs.append(f"param {i} state {k!r} vs reference: {e}")
        s = st_.get("step")
        try:
            sv = float(torch.as_tensor(s).reshape(()))
        except Exception:  # noqa: BLE001
            sv = None
        if sv != rs["step"]:
            errs.append(f"param {i}: step {s!r} != reference {rs['step']}")
    return errs


def _check_untouched(run: Run, before: dict, after: dict) -> list[str]:
    """What every successful step keeps: grads as they were, and no NaN from finite inputs."""
    errs = []
    for i, (x, y) in enumerate(zip(before["grads"], after["grads"])):
        if not _values_equal(x, y):
            errs.append(f"grad {i} modified by the step")
    if _inputs_finite(run, before):
        for i, p in enumerate(run.all_params()):
            ts = [p] + [v for v in (run.opt.state.get(p) or {}).values() if isinstance(v, torch.Tensor)]
            if any(t.is_floating_point() and bool(torch.isnan(t).any()) for t in ts):
                errs.append(f"NaN in param {i} or its state from finite inputs")
    return errs


# ----------------------------------------------------------------------------- edits
@dataclass
class Edit:
    kinds: tuple
    must_raise: bool
    keywords: tuple
    edits: list  # functions run -> None, each followed by a checked step
    needs_state: bool = False
    min_groups: int = 2


def _g(run):
    return run.opt.param_groups[-1]


def _set(key, value):
    def f(run):
        _g(run)[key] = value() if callable(value) else value
    return f


def _set_all(key, value):
    def f(run):
        for g in run.opt.param_groups:
            g[key] = value
    return f


def _state_key(run, p):
    keys = sorted(run.opt.state[p])
    return keys[run.rnd.randrange(len(keys))]


def _st_edit(how):
    def f(run):
        p = run.target(with_state=True)
        st_ = run.opt.state[p]
        k = _state_key(run, p)
        t = st_[k]
        if how == "shape":
            st_[k] = torch.zeros(tuple(t.shape) + (2,), dtype=t.dtype)
        elif how == "int":
            st_[k] = t.to(torch.int32)
        elif how == "otherfloat":
            st_[k] = t.to(torch.float32 if t.dtype == torch.float64 else torch.float64)
        elif how == "none":
            st_[k] = None
        elif how == "del":
            del st_[k]
        elif how == "strided":
            st_[k] = _layout(t.clone(), "slice" if t.dim() else "contig")
        run.edited_key = k
    return f


def _step_edit(how):
    def f(run):
        p = run.target(with_state=True)
        s = run.opt.state[p]["step"]
        run.opt.state[p]["step"] = {"int64": lambda: s.to(torch.int64),
                                    "shape1": lambda: s.reshape(1).clone(),
                                    "pyint": lambda: int(s.item())}[how]()
    return f


def _grad_edit(how):
    def f(run):
        p = run.target()
        if how == "shape":
            p.grad.data = torch.randn(p.numel() + 1, dtype=p.grad.dtype)
        elif how == "resize":
            p.grad = p.grad.clone(memory_format=torch.contiguous_format)
            p.grad.resize_(p.numel() + 1)
        elif how == "complex":
            p.grad.data = torch.randn(p.shape, dtype=torch.complex64)
        elif how == "int":
            p.grad.data = torch.ones(p.shape, dtype=torch.int32)
        elif how == "inf":
            g = p.grad.clone(memory_format=torch.contiguous_format)
            if g.numel():
                g.view(-1)[0] = float("inf")
            p.grad = g
        elif how == "zero":
            p.grad = torch.zeros_like(p.grad)
    return f


def _eps0_zero_grad(run):
    _g(run)["eps"] = 0.0
    _grad_edit("zero")(run)


def _param_twice(run):
    g = _g(run)
    g["params"].append(g["params"][0])


def _param_expanded(run):
    g = _g(run)
    old = g["params"][0]
    x = torch.randn(3, dtype=old.dtype, generator=torch.Generator().manual_seed(5))
    p = torch.nn.Parameter(x.expand(4, 3))
    p.grad = torch.randn(4, 3, dtype=old.dtype, generator=torch.Generator().manual_seed(6))
    g["params"][0] = p


def _clone_params(run):
    return [[torch.nn.Parameter(p.detach().clone()) for p in g["params"]]
            for g in run.opt.param_groups]


def _load_from(make):
    def f(run):
        groups = _clone_params(run)
        other = make([{"params": ps} for ps in groups])
        for ps, orig in zip(groups, run.opt.param_groups):
            for p, q in zip(ps, orig["params"]):
                if q.grad is not None:
                    p.grad = q.grad.detach().to(p.dtype).contiguous()
        other.step()
        run.opt.load_state_dict(other.state_dict())
    return f


EDITS: dict[str, Edit] = {
    # group options edited after construction, in the LAST group
    "lr_str": Edit(("lamb", "lars"), True, ("lr",), [_set("lr", "0.1")]),
    "lr_neg": Edit(("lamb", "lars"), True, ("lr",), [_set("lr", -1)]),
    "lr_nan": Edit(("lamb", "lars"), True, ("lr",), [_set("lr", float("nan"))]),
    "lr_inf": Edit(("lamb", "lars"), True, ("lr",), [_set("lr", float("inf"))]),
    "lr_huge": Edit(("lamb", "lars"), False, ("lr",), [_set("lr", 1e308)]),
    "lr_tensor_nan": Edit(("lamb", "lars"), False, ("lr",), [_set("lr", lambda: torch.tensor(float("nan")))]),
    "lr_tensor_inf": Edit(("lamb", "lars"), False, ("lr",), [_set("lr", lambda: torch.tensor(float("inf")))]),
    "lr_tensor_neg": Edit(("lamb", "lars"), False, ("lr",), [_set("lr", lambda: torch.tensor(-1.0))]),
    "lr_tensor_1": Edit(("lamb", "lars"), False, ("lr",), [_set("lr", lambda: torch.tensor([0.02]))]),
    "lr_tensor_11": Edit(("lamb", "lars"), False, ("lr",), [_set("lr", lambda: torch.tensor([[0.02]]))]),
    "lr_tensor_2": Edit(("lamb", "lars"), True, ("lr",), [_set("lr", lambda: torch.tensor([0.1, 0.2]))]),
    "lr_tensor_int": Edit(("lamb", "lars"), False, ("lr",), [_set("lr", lambda: torch.tensor(1))]),
    "betas_2_0": Edit(("lamb",), True, ("beta",), [_set("betas", (2.0, 0.0))]),
    "betas_short": Edit(("lamb",), True, ("beta",), [_set("betas", (0.9,))]),
    "bounds_2_1": Edit(("lamb",), True, ("trust_ratio_bounds",), [_set("trust_ratio_bounds", (2.0, 1.0))]),
    "bounds_short": Edit(("lamb",), True, ("trust_ratio_bounds",), [_set("trust_ratio_bounds", (1.0,))]),
    "bounds_inf_inf": Edit(("lamb",), False, ("trust_ratio_bounds",),
                           [_set("trust_ratio_bounds", (math.inf, math.inf))]),
    "adapt_str": Edit(("lamb", "lars"), True, ("adapt",), [_set("adapt", "no")]),
    "weight_decay_1e300": Edit(("lamb", "lars"), False, ("weight_decay",), [_set("weight_decay", 1e300)]),
    "eps0_zero_grad": Edit(("lamb", "lars"), False, ("eps",), [_eps0_zero_grad]),
    "max_grad_norm_0": Edit(("lamb", "lars"), True, ("max_grad_norm",), [_set("max_grad_norm", 0.0)]),
    "trust_coefficient_neg": Edit(("lars",), True, ("trust_coefficient",), [_set("trust_coefficient", -1.0)]),
    "trust_coefficient_1e308": Edit(("lars",), False, ("trust_coefficient",), [_set("trust_coefficient", 1e308)]),
    "denominator_bogus": Edit(("lars",), True, ("denominator",), [_set("denominator", "bogus")]),
    "dampening_2": Edit(("lars",), True, ("dampening",), [_set("dampening", 2.0)]),
    "nesterov_no_momentum": Edit(("lars",), True, ("nesterov",),
                                 [lambda run: _g(run).update(nesterov=True, momentum=0.0, dampening=0.0)]),
    "backend_bogus": Edit(("lamb", "lars"), True, ("backend",), [_set("backend", "bogus")]),
    "group_key_deleted": Edit(("lamb", "lars"), True, ("weight_decay",),
                              [lambda run: _g(run).pop("weight_decay")]),
    "master_weights_str": Edit(("lamb", "lars"), True, ("master_weights",), [_set("master_weights", "yes")]),
    "master_weights_off": Edit(("lamb", "lars"), False, ("master",), [_set_all("master_weights", False)],
                               needs_state=True),
    "master_weights_off_then_none": Edit(("lamb", "lars"), False, ("master",),
                                         [_set_all("master_weights", False), _set_all("master_weights", None)],
                                         needs_state=True),
    # state edits (a param of the LAST group)
    "state_wrong_shape": Edit(("lamb", "lars"), True, ("shape", "state"), [_st_edit("shape")], needs_state=True),
    "state_int_dtype": Edit(("lamb", "lars"), True, ("dtype", "state"), [_st_edit("int")], needs_state=True),
    "state_other_float": Edit(("lamb", "lars"), False, ("dtype", "state"), [_st_edit("otherfloat")], needs_state=True),
    "state_none": Edit(("lamb", "lars"), True, ("state",), [_st_edit("none")], needs_state=True),
    "state_deleted": Edit(("lamb", "lars"), True, ("state",), [_st_edit("del")], needs_state=True),
    "state_strided": Edit(("lamb", "lars"), False, ("state",), [_st_edit("strided")], needs_state=True),
    "step_int64": Edit(("lamb", "lars"), False, ("step",), [_step_edit("int64")], needs_state=True),
    "step_shape1": Edit(("lamb", "lars"), False, ("step",), [_step_edit("shape1")], needs_state=True),
    "step_python_int": Edit(("lamb", "lars"), False, ("step",), [_step_edit("pyint")], needs_state=True),
    "load_adam": Edit(("lamb",), False, ("state", "step", "exp_avg", "master", "key", "missing", "load"),
                      [_load_from(lambda gs: torch.optim.Adam(gs, lr=1e-3))], needs_state=True),
    "load_sgd": Edit(("lars",), False, ("state", "step", "momentum", "master", "key", "missing", "load"),
                     [_load_from(lambda gs: torch.optim.SGD(gs, lr=0.1, momentum=0.9))], needs_state=True),
    "load_lars_into_lamb": Edit(("lamb",), False, ("state", "step", "exp_avg", "master", "key", "missing", "load"),
                                [_load_from(lambda gs: fusedopt.FusedLARS(gs, lr=0.1, backend="eager"))],
                                needs_state=True),
    "load_lamb_into_lars": Edit(("lars",), False, ("state", "step", "momentum", "master", "key", "missing", "load"),
                                [_load_from(lambda gs: fusedopt.FusedLAMB(gs, lr=0.1, backend="eager"))],
                                needs_state=True),
    # grads and params
    "grad_wrong_shape": Edit(("lamb", "lars"), True, ("shape",), [_grad_edit("shape")]),
    "grad_resized": Edit(("lamb", "lars"), True, ("shape",), [_grad_edit("resize")]),
    "grad_complex": Edit(("lamb", "lars"), True, ("complex",), [_grad_edit("complex")]),
    "grad_int": Edit(("lamb", "lars"), True, ("floating", "dtype", "int"), [_grad_edit("int")]),
    "grad_inf": Edit(("lamb", "lars"), False, ("inf",), [_grad_edit("inf")]),
    "param_twice": Edit(("lamb", "lars"), True, ("twice", "same param", "duplicate"), [_param_twice]),
    "param_expanded": Edit(("lamb", "lars"), True, ("stride", "overlap", "expand", "memory", "contiguous"),
                           [_param_expanded]),
}


# ----------------------------------------------------------------------------- driver
@dataclass
class Outcome:
    kind: str  # ok | raised
    detail: str = ""
    errs: list = field(default_factory=list)


def _checked_step(run: Run, edit: Callable | None, keywords: tuple, must_raise: bool) -> Outcome:
    before_edit = _snapshot(run)
    if edit is not None:
        try:
            edit(run)
        except ERRORS as e:  # the edit itself (load_state_dict) may refuse: then nothing changed
            errs = _diff(before_edit, _snapshot(run))
            if not any(k.lower() in str(e).lower() for k in keywords):
                errs.append(f"edit raised {type(e).__name__} not naming {keywords}: {e}")
            return Outcome("raised", f"edit: {type(e).__name__}: {e}", errs)
    before = _snapshot(run)
    try:
        run.opt.step()
    except ERRORS as e:
        errs = [f"after {type(e).__name__} ({str(e)[:120]}): {d}" for d in _diff(before, _snapshot(run))]
        if edit is None:
            errs.append(f"step of a valid config raised {type(e).__name__}: {e}")
        elif not any(k.lower() in str(e).lower() for k in keywords):
            errs.append(f"{type(e).__name__} does not name the problem {keywords}: {e}")
        return Outcome("raised", f"{type(e).__name__}: {e}", errs)
    except Exception as e:  # noqa: BLE001
        errs = [f"unclear exception {type(e).__name__}: {e}"]
        errs += [f"after {type(e).__name__}: {d}" for d in _diff(before, _snapshot(run))]
        return Outcome("raised", f"{type(e).__name__}: {e}", errs)
    run.steps_done += 1
    after = _snapshot(run)
    if must_raise and edit is not None:
        return Outcome("ok", errs=["step succeeded on an invalid edit"])
    return Outcome("ok", errs=_check_success(run, before, after))


def _drive(cfg: Config, name: str | None, backend: str):
    e = EDITS[name] if name else None
    run = Run(cfg, backend)
    outcomes = []
    warm = max(cfg.warm, 1) if e is not None and e.needs_state else cfg.warm
    plan = [None] * warm + (e.edits if e else [])
    for i, edit in enumerate(plan):
        run.set_grads()
        out = _checked_step(run, edit, e.keywords if e else (), bool(e and e.must_raise))
        outcomes.append(out)
        if out.kind == "raised":
            break
    return run, outcomes


def _compare_backends(a: Run, b: Run) -> list[str]:
    errs = []
    sa, sb = _snapshot(a), _snapshot(b)
    # the steps before an edit count too: a loaded state dict may have taken max_grad_norm away
    clipped = [g.get("max_grad_norm") for g in a.opt.param_groups] + [
        gs.hyper.get("max_grad_norm") for gs in a.cfg.groups]
    mixed_clip = any(c is not None for c in clipped) and any(
        gs.grad_dtype != torch.float64 for gs in a.cfg.groups)

    def tol(dtype):
        return 1e-6 if dtype == torch.float64 and mixed_clip else _tol(dtype)

    for i, (x, y) in enumerate(zip(sa["params"], sb["params"])):
        e = _close(y, x, tol(x.dtype))
        if e:
            errs.append(f"param {i}: cpp vs eager: {e}")
    for i in sa["state"].keys() & sb["state"].keys():
        for k in sa["state"][i].keys() & sb["state"][i].keys():
            x, y = sa["state"][i][k], sb["state"][i][k]
            if (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype == torch.uint8 and x.numel() == y.numel()):
                # packed 8-bit moments, compared as their values: the backends sum the clipping
                # total and the trust ratios' norms in their own orders, so a moment one ulp
                # apart may round to the next code (1/127 of its block's largest for LAMB's
                # direction, 1/8 of a decade's part for LARS's buffer)
                shape = sa["params"][i].shape
                x, y = (lowp.read(t, shape, k).double() for t in (x, y))
                e = _close(y, x, 2 ** -3)
                if e:
                    errs.append(f"state[{i}][{k!r}] (8-bit): cpp vs eager: {e}")
            elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.is_floating_point():
                e = _close(y, x, tol(x.dtype))
                if e:
                    errs.append(f"state[{i}][{k!r}]: cpp vs eager: {e}")
    return errs


def _check(cfg: Config, name: str | None):
    runs, report = {}, []
    for be in BACKENDS:
        run, outs = _drive(cfg, name, be)
        runs[be] = outs
        for j, o in enumerate(outs):
            report += [f"[{be} step {j}] {m}" for m in o.errs]
        runs[be] = (run, outs)
    (ra, oa), (rb, ob) = runs["eager"], runs["cpp"]
    ka, kb = [o.kind for o in oa], [o.kind for o in ob]
    if ka != kb:
        report.append(f"backends disagree: eager {ka} ({oa[-1].detail[:100]}) vs cpp {kb} ({ob[-1].detail[:100]})")
    elif ka and ka[-1] == "ok":
        report += _compare_backends(ra, rb)
    assert not report, f"edit={name}\n" + "\n".join(report[:12])


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@settings(max_examples=30, **SETTINGS)
@given(data=st.data())
def test_valid_configs(kind, data):
    """Random valid configs (shapes incl. 0-size/0-dim/odd, transposed/sliced params, transposed,
    sliced and stride-0 grads, all four dtypes, grads of another dtype, lr float or tensor,
    master weights on/off/auto, several groups): every step succeeds and matches."""
    cfg = data.draw(config_st(kind))
    _check(cfg, None)


EDIT_CASES = [pytest.param(kind, name, id=f"{kind}-{name}")
              for name, e in EDITS.items() for kind in e.kinds]


@pytest.mark.parametrize("kind,name", EDIT_CASES)
@settings(max_examples=4, **SETTINGS)
@given(data=st.data())
def test_edit(kind, name, data):
    cfg = data.draw(config_st(kind, min_groups=EDITS[name].min_groups))
    _check(cfg, name)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
@settings(max_examples=15, **SETTINGS)
@given(data=st.data())
def test_valid_configs_low_precision(kind, data):
    """The random valid configs with bf16 or 8-bit state in every group that is not float64."""
    _check(data.draw(config_st(kind, low=True)), None)


@pytest.mark.parametrize("kind,name", EDIT_CASES)
@settings(max_examples=2, **SETTINGS)
@given(data=st.data())
def test_edit_low_precision(kind, name, data):
    """The edits, on configs with low-precision state."""
    _check(data.draw(config_st(kind, min_groups=EDITS[name].min_groups, low=True)), name)


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_four_threads_one_optimizer(kind, backend):
    """4 threads call step() of one optimizer: each call succeeds or raises a RuntimeError naming
    the other thread (no crash, no half step); afterwards every step count equals the number of
    successes and the params equal a sequential run of that many steps."""
    def build():
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (20000, 7, 0, 3000, 1)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
        return ps, cls([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.01, backend=backend)

    ps, opt = build()
    barrier = threading.Barrier(4)
    ok, other, bad = [0], [0], []
    lock = threading.Lock()

    def worker():
        barrier.wait()
        for _ in range(25):
            try:
                opt.step()
                with lock:
                    ok[0] += 1
            except RuntimeError as e:
                if "thread" not in str(e):
                    bad.append(repr(e))
                with lock:
                    other[0] += 1
            except BaseException as e:  # noqa: BLE001
                bad.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:3]
    assert ok[0] + other[0] == 100 and ok[0] >= 1
    for p in ps:
        assert float(opt.state[p]["step"]) == ok[0]
    ps2, opt2 = build()
    for _ in range(ok[0]):
        opt2.step()
    for p, q in zip(ps, ps2):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
