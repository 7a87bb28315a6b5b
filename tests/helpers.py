"""Shared test harness: run a backend for several steps and compare with the float64 reference."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

import fusedopt
from fusedopt.reference import ReferenceLAMB, ReferenceLARS

# Shapes that break kernels: 0-size, 1 element, odd sizes, several dims.
SHAPES_SMALL = [(3, 5), (7,), (0,), (1,), (4097,), (2, 3, 4)]
# ...plus an odd size and tensors spanning several of the C++ backend's 32768-element chunks
# (kChunk in csrc/cpu/multi_tensor.h): 70001 elements span three.
SHAPES_ZOO = SHAPES_SMALL + [(18011,), (70001,), (256, 300)]

# One entry per flag of docs/math.md (and a few combinations); ids are readable in pytest output.
LAMB_CASES = {
    "default": {},
    "no_wd": dict(weight_decay=0.0),
    "no_bias_correction": dict(bias_correction=False),
    "no_grad_averaging": dict(grad_averaging=False),
    "clip": dict(max_grad_norm=0.5),
    "bounds": dict(trust_ratio_bounds=(0.8, 1.2)),
    "decoupled": dict(decoupled_weight_decay=True, weight_decay=0.1),
    "no_adapt": dict(adapt=False),
    "eps_tiny": dict(eps=1e-30),  # the smallest eps class (eps=0 is refused: 0/0 at g=0)
}
LARS_CASES = {
    "default": dict(weight_decay=1e-4),
    "no_wd": {},
    "combined": dict(denominator="combined", weight_decay=1e-2),
    "nesterov": dict(nesterov=True, weight_decay=1e-4),
    "trust_clip": dict(trust_clip=True, trust_coefficient=1.0, weight_decay=1e-4),
    "torch_sgd_form": dict(lr_in_momentum=False, weight_decay=1e-4),
    "torch_sgd_dampening": dict(lr_in_momentum=False, dampening=0.3, weight_decay=1e-4),
    "torch_sgd_nesterov": dict(lr_in_momentum=False, nesterov=True, weight_decay=1e-4),
    "clip": dict(max_grad_norm=0.5, weight_decay=1e-4),
    "no_momentum": dict(momentum=0.0, weight_decay=1e-4),
    "no_adapt": dict(adapt=False, weight_decay=1e-4),
}
LR = {"lamb": 1e-2, "lars": 0.5}


def make_tensors(shapes, dtype, seed, *, zero_weight=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(shapes):
        t = torch.randn(s, generator=g, dtype=torch.float64)
        if zero_weight is not None and i == zero_weight:
            t.zero_()
        out.append(t.to(device=device, dtype=dtype))
    return out


def run_backend(kind, backend, shapes, hyper, *, dtype=torch.float32, grad_dtype=None, steps=5,
                seed=0, zero_weight=None, zero_grad=None, excluded=(), master_weights=None,
                device="cpu", lr=None):
    """Run ``steps`` steps of ``backend``; returns (params, float64 reference weights, optimizer).

    ``excluded``: indices of params placed in a second group with weight_decay=0, adapt=False.
    ``zero_grad``: index of a param whose gradient is always 0.
    """
    grad_dtype = grad_dtype or dtype
    lr = LR[kind] if lr is None else lr
    init = make_tensors(shapes, torch.float64, seed, zero_weight=zero_weight)
    params = [torch.nn.Parameter(t.to(device=device, dtype=dtype)) for t in init]
    if grad_dtype != dtype and hasattr(params[0], "grad_dtype"):
        for p in params:  # torch >= 2.10 checks grad dtypes unless told otherwise
            p.grad_dtype = grad_dtype
    # the reference starts from the stored (rounded) values
    ref_w = [p.detach().to("cpu", torch.float64).clone() for p in params]
    main = [i for i in range(len(shapes)) if i not in excluded]
    groups_idx = [main] + ([list(excluded)] if excluded else [])
    opt_groups, ref_groups = [], []
    for gi, idx in enumerate(groups_idx):
        extra = {} if gi == 0 else dict(weight_decay=0.0, adapt=False)
        opt_groups.append({"params": [params[i] for i in idx], **extra})
        ref_groups.append({**hyper, "lr": lr, **extra})
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls(opt_groups, lr=lr, backend=backend, master_weights=master_weights, **hyper)
    ref = (ReferenceLAMB if kind == "lamb" else ReferenceLARS)(ref_groups)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        grads = []
        for i, s in enumerate(shapes):
            gr = torch.randn(s, generator=gen, dtype=torch.float64)
            if zero_grad is not None and i == zero_grad:
                gr.zero_()
            gr = gr.to(grad_dtype)  # the reference sees the same rounded gradient
            grads.append(gr)
            params[i].grad = gr.to(device)
        opt.step()
        ref.step([[ref_w[i] for i in idx] for idx in groups_idx],
                 [[grads[i] for i in idx] for idx in groups_idx])
    return params, ref_w, opt


def max_rel_err(params, ref_w) -> float:
    """Largest per-tensor ``max|p - ref| / max|ref|`` (0-size tensors skipped)."""
    worst = 0.0
    for p, r in zip(params, ref_w):
        if p.numel() == 0:
            continue
        p64 = p.detach().to("cpu", torch.float64)
        scale = r.abs().max().item() or 1.0
        worst = max(worst, (p64 - r).abs().max().item() / scale)
    return worst


def abs_errs(params, ref_w) -> list[torch.Tensor]:
    return [(p.detach().to("cpu", torch.float64) - r).abs() for p, r in zip(params, ref_w)]


def assert_within_rounding(fast, eager, ref_w, atol):
    """flash-attention's rule: |fast - ref64| <= 2 |eager_lowprec - ref64| + atol, elementwise."""
    for ef, ee in zip(abs_errs(fast, ref_w), abs_errs(eager, ref_w)):
        bad = ef > 2 * ee + atol
        assert not bad.any(), f"{int(bad.sum())} elements beyond 2x eager's error + {atol}: max {ef.max()}"


def tols(dtype):
    return {torch.float32: 1e-5, torch.float64: 1e-11}[dtype]


__all__ = ["SHAPES_SMALL", "SHAPES_ZOO", "LAMB_CASES", "LARS_CASES", "run_backend", "max_rel_err",
           "assert_within_rounding", "tols", "make_tensors"]


def backend_params(names=("eager", "cpp", "triton")):
    """pytest params for backends, each skipped with the reason it cannot run on CPU tensors here."""
    import pytest

    from fusedopt import backends

    out = []
    for n in names:
        be = backends.get_backend(n)
        if be is None:
            why = f"backend {n!r} is not available: {backends.load_error(n)}"
        else:
            why = be.unavailable_reason(torch.device("cpu"), torch.float32, torch.float32)
        out.append(pytest.param(n, id=n, marks=pytest.mark.skipif(why is not None, reason=str(why))))
    return out


NAN_RULE_CASES = ("lamb_bounds", "lars_clip", "lamb_inf_weight", "lars_inf_weight")


def nan_rule_inputs(case):
    """``(kind, weights, grads, hyper)`` of a case of :func:`nan_rule_runs` (float32)."""
    gen = torch.Generator().manual_seed(3)
    w = [torch.randn(40, generator=gen), torch.randn(7, generator=gen)]
    g = [torch.randn(40, generator=gen), torch.randn(7, generator=gen)]
    if case == "lamb_bounds":
        w[0][5] = 1e30
        return "lamb", w, g, dict(trust_ratio_bounds=(0.5, 2.0), weight_decay=0.1)
    if case.endswith("inf_weight"):  # λ = 0: λ·w is 0·inf, NaN (u, and g + λw, hold it)
        w[0][5] = float("inf")
        return case[:4], w, g, dict(weight_decay=0.0)
    g[0][5] = float("nan")
    return "lars", w, g, dict(trust_clip=True, trust_coefficient=1.0, weight_decay=1e-3)


def nan_rule_runs(backend, device="cpu"):
    """Note [NaN propagation] (csrc/fusedopt/math.h): a NaN norm gives a NaN trust ratio, and the
    bounds keep it NaN. Two steps of one backend whose first param makes a norm NaN; returns
    ``{case: (params after the step, float64 reference of the second param)}``.

    * ``lamb_bounds``: a float32 weight of 1e30 overflows both ``‖w‖²`` and ``‖u‖²`` (λ > 0), so
      ``φ = inf/inf`` is NaN, which ``trust_ratio_bounds`` keeps (a NaN-dropping clamp gives the
      lower bound and leaves every other element finite);
    * ``lars_clip``: a NaN gradient element makes ``‖g‖`` NaN, so the ratio is NaN, which
      ``trust_clip`` keeps (a zero-norm test ``‖g‖ > 0`` would give 1 and a single NaN element);
    * ``lamb_inf_weight``, ``lars_inf_weight``: an inf weight with ``weight_decay=0``: the math's
      ``λ·w`` is ``0·inf``, NaN, also for λ = 0 (LAMB's u, LARS's denominator), so the ratio is
      NaN (a backend that leaves the term out when λ is 0 gives ±inf and NaN elements).
    """
    out = {}
    for case in NAN_RULE_CASES:
        kind, w, g, hyper = nan_rule_inputs(case)
        params = [torch.nn.Parameter(x.clone().to(device)) for x in w]
        for p, x in zip(params, g):
            p.grad = x.to(device)
        cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
        opt = cls(params, lr=LR[kind], backend=backend, **hyper)
        ref = (ReferenceLAMB if kind == "lamb" else ReferenceLARS)([{**hyper, "lr": LR[kind]}])
        ref_w = [w[1].double()]
        opt.step()
        ref.step([ref_w], [[g[1].double()]])
        out[case] = ([p.detach().cpu() for p in params], ref_w[0])
    return out


def assert_nan_rule(runs):
    """``runs``: ``{case: (params after one step, float64 reference of the second param)}``."""
    for case, (params, ref_second) in runs.items():
        assert torch.isnan(params[0]).all(), f"{case}: a NaN trust ratio must reach every element"
        assert max_rel_err([params[1]], [ref_second]) <= tols(torch.float32), case


# Hyper-parameters of docs/math.md for property tests: every flag, values from small to default.
LAMB_HYPER_ST = st.fixed_dictionaries({}, optional={
    "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.9999)),
    "eps": st.sampled_from([1e-30, 1e-8, 1e-6, 1e-3]),
    "weight_decay": st.sampled_from([0.0, 1e-3, 0.1]),
    "bias_correction": st.booleans(),
    "grad_averaging": st.booleans(),
    "max_grad_norm": st.sampled_from([None, 0.1, 10.0]),
    "trust_ratio_bounds": st.sampled_from([None, (0.0, 10.0), (0.9, 1.1)]),
    "decoupled_weight_decay": st.booleans(),
    "adapt": st.booleans(),
})
LARS_HYPER_ST = st.fixed_dictionaries({}, optional={
    "momentum": st.sampled_from([0.0, 0.5, 0.9]),
    "weight_decay": st.sampled_from([0.0, 1e-4, 1e-2]),
    "trust_coefficient": st.sampled_from([1e-3, 0.02, 1.0]),
    "eps": st.sampled_from([0.0, 1e-8]),
    "trust_clip": st.booleans(),
    "denominator": st.sampled_from(["sum", "combined"]),
    "lr_in_momentum": st.booleans(),
    "dampening": st.sampled_from([0.0, 0.5]),
    "max_grad_norm": st.sampled_from([None, 0.1, 10.0]),
    "adapt": st.booleans(),
})
