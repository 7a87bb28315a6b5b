"""What only the tests need: pytest params of the backends, the NaN-rule cases and the hypothesis
strategies. The cases, tolerances and run-and-compare machinery that the tests share with
``python -m fusedopt check`` are in fusedopt.testing; the names some test files import from here
are re-exported below."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from fusedopt.testing import LR, OPTIMIZERS, REFERENCES, REL_TOL, max_rel_err

# Re-exported under the names tests/test_cpp.py and tests/test_triton.py import from here.
from fusedopt.testing import (  # noqa: F401, E402
    SHAPES_SMALL,
    SHAPES_ZOO,
    assert_within_rounding,
    make_tensors,
    option_cases,
    run_backend,
)

LAMB_CASES = option_cases("lamb")  # {name: options} of fusedopt.testing.OPTION_CASES
LARS_CASES = option_cases("lars")


def tols(dtype):
    """The ``rel`` tolerance of the math's dtype (fusedopt.testing.REL_TOL)."""
    return REL_TOL[dtype]


def backend_mark(name):
    """A skipif mark for tests of backend ``name``, with the reason it cannot run on CPU tensors
    here (none when it can)."""
    import pytest

    from fusedopt import backends

    be = backends.get_backend(name)
    if be is None:
        why = f"backend {name!r} is not available: {backends.load_error(name)}"
    else:
        why = be.unavailable_reason(torch.device("cpu"), torch.float32, torch.float32)
    return pytest.mark.skipif(why is not None, reason=str(why))


def in_memory(t):
    """A contiguous tensor of ``t``'s elements in the order of ``t``'s memory (its dims by
    decreasing stride): what docs/math.md's "Random bits" counts as the elements' places."""
    return t.permute(*sorted(range(t.dim()), key=lambda d: -t.stride(d))).contiguous()


def backend_params(names=("eager", "cpp", "triton")):
    """pytest params for backends, each skipped with the reason it cannot run on CPU tensors
    here."""
    import pytest

    return [pytest.param(n, id=n, marks=backend_mark(n)) for n in names]


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
        opt = OPTIMIZERS[kind](params, lr=LR[kind], backend=backend, **hyper)
        ref = REFERENCES[kind]([{**hyper, "lr": LR[kind]}])
        ref_w = [w[1].double()]
        opt.step()
        ref.step([ref_w], [[g[1].double()]])
        out[case] = ([p.detach().cpu() for p in params], ref_w[0])
    return out


def assert_nan_rule(runs):
    """``runs``: ``{case: (params after one step, float64 reference of the second param)}``."""
    for case, (params, ref_second) in runs.items():
        assert torch.isnan(params[0]).all(), f"{case}: a NaN trust ratio must reach every element"
        assert max_rel_err([params[1]], [ref_second]) <= REL_TOL[torch.float32], case


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


def triton_module() -> tuple[bool, str]:
    """The set-up of a module of Triton tests: skips it without triton, or under an interpreter
    that cannot run the kernels; returns (interpreted, the device the kernels run on).
    tests/conftest.py chose the interpreter (TRITON_INTERPRET=1) before triton was imported."""
    import os

    import pytest

    pytest.importorskip("triton")
    from fusedopt.backends import triton_backend

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted and triton_backend.interpreter_reason() is not None:
        pytest.skip(triton_backend.interpreter_reason(), allow_module_level=True)
    return interpreted, "cpu" if interpreted else "cuda"


_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that NaN equals NaN (torch.equal has NaN unequal to itself, so a
    tensor holding NaN, such as the never-written padding of DeepSpeed's ZeRO-3 partitions,
    would never equal its own copy)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if a.is_complex():
        a, b = torch.view_as_real(a).reshape(-1), torch.view_as_real(b).reshape(-1)
    if not a.is_floating_point():
        return torch.equal(a, b)
    ia, ib = a.view(_INT_OF[a.element_size()]), b.view(_INT_OF[b.element_size()])
    return bool(((ia == ib) | (torch.isnan(a) & torch.isnan(b))).all())
