"""fusedopt.schedules: scaling rules and warm-up schedulers against their formulas."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedopt.schedules import (
    LEGWLR,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupPolyDecayLR,
    scale_lr,
)


def make_opt(lr=0.1, n_groups=1):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr * (i + 1)}
              for i in range(n_groups)]
    return torch.optim.SGD(groups, lr=lr)


def lrs_over(sched, opt, n):
    """LR of group 0 used by optimizer steps 0..n-1 (the LR in the group before each step)."""
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


# ------------------------------------------------------------------ scale_lr
@settings(deadline=None)  # no per-example deadline: CI machines can be busy
@given(base=st.floats(0, 10), b=st.integers(1, 10_000), b0=st.integers(1, 10_000))
def test_scale_lr_rules(base, b, b0):
    assert scale_lr(base, b, b0, "linear") == pytest.approx(base * b / b0)
    assert scale_lr(base, b, b0, rule="sqrt") == pytest.approx(base * math.sqrt(b / b0))
    assert scale_lr(base, b, b0) == scale_lr(base, b, b0, "linear")  # default rule


def test_scale_lr_examples():
    # Goyal et al.: 0.1 per 256 images -> 3.2 at 8192
    assert scale_lr(0.1, 8192, 256) == pytest.approx(3.2)
    assert scale_lr(0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 256, 256, "sqrt") == pytest.approx(0.1)


@pytest.mark.parametrize("args, word, bad", [
    ((-0.1, 512, 32), "base_lr", -0.1),
    ((float("nan"), 512, 32), "base_lr", float("nan")),
    ((float("inf"), 512, 32), "base_lr", float("inf")),
    ((0.1, 0, 32), "batch_size", 0),
    ((0.1, 512.0, 32), "batch_size", 512.0),
    ((0.1, True, 32), "batch_size", True),
    ((0.1, 512, -32), "base_batch_size", -32),
])
def test_scale_lr_rejects(args, word, bad):
    with pytest.raises(ValueError, match=f"Invalid {word}: ") as ei:
        scale_lr(*args)
    assert repr(bad) in str(ei.value)  # names the bad value
    assert "expected" in str(ei.value)  # and the allowed range


def test_scale_lr_rejects_rule():
    with pytest.raises(ValueError, match=r"rule.*'cubic'.*linear.*sqrt"):
        scale_lr(0.1, 512, 32, rule="cubic")


# ------------------------------------------------------------------ formulas
def poly_ref(t, W, T, p, s=0.0, e=0.0, peak=1.0):
    if t < W:
        return peak * (s + (1 - s) * t / W)
    if t >= T:
        return peak * e
    return peak * (e + (1 - e) * (1 - (t - W) / (T - W)) ** p)


def cos_ref(t, W, T, s=0.0, e=0.0):
    if t < W:
        return s + (1 - s) * t / W
    if t >= T:
        return e
    return e + (1 - e) * 0.5 * (1 + math.cos(math.pi * (t - W) / (T - W)))


def test_poly_decay_chosen_steps():
    base = 0.4
    opt = make_opt(base)
    sched = WarmupPolyDecayLR(opt, warmup_steps=5, total_steps=25, power=2.0)
    lrs = lrs_over(sched, opt, 30)
    # warm-up: 0, 0.2, 0.4, 0.6, 0.8 of base; peak at step 5
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(base * 1 / 5)
    assert lrs[4] == pytest.approx(base * 4 / 5)
    assert lrs[5] == pytest.approx(base)
    # half-way through the decay (t - W = 10 of 20): (1/2)^2 = 1/4
    assert lrs[15] == pytest.approx(base / 4)
    assert lrs[20] == pytest.approx(base * (5 / 20) ** 2)
    assert lrs[25] == pytest.approx(0.0, abs=1e-15)
    assert lrs[29] == pytest.approx(0.0, abs=1e-15)


def test_cosine_chosen_steps():
    base = 1.0
    opt = make_opt(base)
    sched = WarmupCosineLR(opt, warmup_steps=4, total_steps=12, end_factor=0.1)
    lrs = lrs_over(sched, opt, 14)
    assert lrs[2] == pytest.approx(0.5)
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[8] == pytest.approx(0.1 + 0.9 * 0.5)  # cos(pi/2) = 0
    assert lrs[12] == pytest.approx(0.1)
    assert lrs[13] == pytest.approx(0.1)


def test_warmup_start_factor_goyal():
    # Goyal et al.: k = 16, start at eta = base/16 and reach 16 * eta at step W
    opt = make_opt(1.6)
    sched = WarmupDecayLR(opt, 10, 100, decay="none", warmup_start_factor=1 / 16)
    lrs = lrs_over(sched, opt, 12)
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[5] == pytest.approx(0.1 + (1.6 - 0.1) * 0.5)
    assert lrs[10] == pytest.approx(1.6) and lrs[11] == pytest.approx(1.6)


@settings(max_examples=40, deadline=None)
@given(
    W=st.integers(0, 20), extra=st.integers(1, 40), p=st.floats(0.5, 4.0),
    s=st.floats(0, 1), e=st.floats(0, 1), decay=st.sampled_from(["poly", "cosine"]),
)
def test_schedule_matches_formula_every_step(W, extra, p, s, e, decay):
    T = W + extra
    base = [0.3, 0.6]
    opt = make_opt(0.3, n_groups=2)
    sched = WarmupDecayLR(opt, W, T, decay=decay, power=p, warmup_start_factor=s, end_factor=e)
    for t in range(T + 3):
        ref = poly_ref(t, W, T, p, s, e) if decay == "poly" else cos_ref(t, W, T, s, e)
        for g, b in zip(opt.param_groups, base):
            assert g["lr"] == pytest.approx(b * ref, rel=1e-9, abs=1e-12)
        assert sched.get_last_lr()[0] == pytest.approx(base[0] * ref, rel=1e-9, abs=1e-12)
        opt.step()
        sched.step()


@settings(max_examples=30, deadline=None)
@given(W=st.integers(0, 30), extra=st.integers(1, 60), p=st.floats(0.5, 4.0))
def test_schedule_shape_properties(W, extra, p):
    T = W + extra
    opt = make_opt(1.0)
    sched = WarmupPolyDecayLR(opt, W, T, p)
    f = [sched.factor(t) for t in range(T + 2)]
    assert max(f) == pytest.approx(1.0)  # the peak is the base LR
    assert all(a <= b + 1e-12 for a, b in zip(f[:W], f[1:W + 1]))  # non-decreasing warm-up
    assert all(a >= b - 1e-12 for a, b in zip(f[W:], f[W + 1:]))  # non-increasing decay
    assert all(0.0 <= x <= 1.0 + 1e-12 for x in f)


# ------------------------------------------------------------------ LEGW
def test_legw_warmup_and_sqrt_peak():
    # base batch 32 (LR 0.1, 0.5 warm-up epochs) -> batch 512: k = 16
    base_lr, k, spe = 0.1, 16, 4
    opt = make_opt(base_lr)
    sched = LEGWLR(opt, base_warmup_epochs=0.5, batch_multiple=k, steps_per_epoch=spe,
                   total_epochs=20)
    W = k * 0.5 * spe  # 32 steps
    T = 20 * spe
    assert sched.warmup_steps == W and sched.total_steps == T
    lrs = lrs_over(sched, opt, T + 1)
    peak = base_lr * math.sqrt(k)  # 0.4
    assert lrs[0] == 0.0
    assert lrs[16] == pytest.approx(peak / 2)
    assert lrs[32] == pytest.approx(peak)
    assert max(lrs) == pytest.approx(peak)
    assert lrs[32 + 24] == pytest.approx(peak * 0.5 ** 2)  # poly power 2, halfway through decay
    assert lrs[T] == pytest.approx(0.0, abs=1e-15)


@settings(deadline=None)  # no per-example deadline: CI machines can be busy
@given(k=st.floats(0.25, 64), e_w=st.floats(0, 2), spe=st.integers(1, 50))
def test_legw_formula(k, e_w, spe):
    total_epochs = 2 * k * e_w + 1
    opt = make_opt(0.2)
    sched = LEGWLR(opt, e_w, k, spe, total_epochs, decay="cosine")
    W, T = round(k * e_w * spe), round(total_epochs * spe)
    assert (sched.warmup_steps, sched.total_steps) == (W, T)
    for t in (0, W // 2, W, (W + T) // 2, T):
        assert sched.factor(t) == pytest.approx(math.sqrt(k) * cos_ref(t, W, T), abs=1e-12)


@pytest.mark.parametrize("kwargs, word", [
    (dict(base_warmup_epochs=-1), "base_warmup_epochs"),
    (dict(batch_multiple=0), "batch_multiple"),
    (dict(batch_multiple=float("inf")), "batch_multiple"),
    (dict(steps_per_epoch=0), "steps_per_epoch"),
    (dict(total_epochs=0), "total_epochs"),
    (dict(base_warmup_epochs=2, batch_multiple=16), "warm-up"),  # 32 epochs > 20
    (dict(decay="step"), "decay"),
])
def test_legw_rejects(kwargs, word):
    args = dict(base_warmup_epochs=0.5, batch_multiple=16, steps_per_epoch=4, total_epochs=20)
    args.update(kwargs)
    with pytest.raises(ValueError, match=word):
        LEGWLR(make_opt(), **args)


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("args, kwargs, pattern", [
    ((-1, 10), {}, r"warmup_steps: -1.*\[0, 9\]"),
    ((10, 10), {}, r"warmup_steps: 10.*\[0, 9\]"),
    ((2.5, 10), {}, r"warmup_steps: 2.5"),
    ((0, 0), {}, r"total_steps: 0.*>= 1"),
    ((0, None), {}, r"total_steps: None"),
    ((0, 10), dict(decay="linear"), r"decay: 'linear'.*poly.*cosine.*none"),
    ((0, 10), dict(power=0.0), r"power: 0.0.*\(0.0, inf\)"),
    ((0, 10), dict(power=float("nan")), r"power: nan"),
    ((0, 10), dict(warmup_start_factor=1.5), r"warmup_start_factor: 1.5.*\[0.0, 1.0\]"),
    ((0, 10), dict(end_factor=-0.1), r"end_factor: -0.1.*\[0.0, 1.0\]"),
    ((0, 10), dict(peak_factor=0), r"peak_factor: 0"),
])
def test_warmup_decay_rejects(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        WarmupDecayLR(make_opt(), *args, **kwargs)


def test_constant_after_warmup_without_total():
    opt = make_opt(0.5)
    sched = WarmupDecayLR(opt, 4, None, decay="none")
    lrs = lrs_over(sched, opt, 10)
    assert lrs[:5] == pytest.approx([0, 0.125, 0.25, 0.375, 0.5])
    assert lrs[5:] == pytest.approx([0.5] * 5)


# ------------------------------------------------------------------ PyTorch integration
def test_state_dict_resume_matches_uninterrupted():
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.8, momentum=0.9)
        return model, opt, WarmupPolyDecayLR(opt, 6, 30, power=2.0, end_factor=0.01)

    model, opt, sched = build()
    lrs_full = lrs_over(sched, opt, 30)

    model, opt, sched = build()
    lrs_a = lrs_over(sched, opt, 13)
    ckpt = copy.deepcopy({"opt": opt.state_dict(), "sched": sched.state_dict()})
    # fresh objects, constructed then restored (PyTorch's documented order)
    model2, opt2, sched2 = build()
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    lrs_b = lrs_over(sched2, opt2, 17)
    assert lrs_a + lrs_b == pytest.approx(lrs_full, rel=1e-12, abs=1e-15)


def test_chained_with_multiplicative_scheduler():
    gamma = 0.9
    opt = make_opt(1.0)
    warm = WarmupPolyDecayLR(opt, 3, 20, power=2.0)
    expo = torch.optim.lr_scheduler.ExponentialLR(opt, gamma)
    chain = torch.optim.lr_scheduler.ChainedScheduler([warm, expo])
    lrs = lrs_over(chain, opt, 20)
    for t, lr in enumerate(lrs):
        assert lr == pytest.approx(poly_ref(t, 3, 20, 2.0) * gamma ** t, rel=1e-9, abs=1e-15)


def test_sequential_lr_switches_to_closed_form():
    # 5 constant steps at 0.1 x base, then our schedule restarted at its own step 0
    opt = make_opt(1.0)
    const = torch.optim.lr_scheduler.ConstantLR(opt, factor=0.1, total_iters=5)
    cosine = WarmupCosineLR(opt, 2, 10)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [const, cosine], milestones=[5])
    lrs = lrs_over(seq, opt, 16)
    assert lrs[:5] == pytest.approx([0.1] * 5)
    assert lrs[5:16] == pytest.approx([cos_ref(t, 2, 10) for t in range(11)], abs=1e-12)


def test_step_with_epoch_uses_closed_form():
    opt = make_opt(2.0)
    sched = WarmupPolyDecayLR(opt, 4, 12)
    with pytest.warns(UserWarning):
        sched.step(8)
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * poly_ref(8, 4, 12, 2.0))


def test_tensor_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=torch.tensor(0.5))
    sched = WarmupPolyDecayLR(opt, 2, 6)
    seen = []
    for _ in range(6):
        seen.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert seen == pytest.approx([0.5 * poly_ref(t, 2, 6, 2.0) for t in range(6)])


@pytest.mark.parametrize("s", [5e-324, 1e-300, 1e-13])
def test_tiny_start_factor_does_not_poison_the_recursion(s):
    # lr(0) = base·s underflows or nearly so; the next steps must still follow the formula
    opt = make_opt(0.3)
    sched = WarmupPolyDecayLR(opt, 1, 4, power=1.0, warmup_start_factor=s)
    lrs = lrs_over(sched, opt, 5)
    assert all(math.isfinite(v) for v in lrs)
    assert lrs[1:] == pytest.approx([0.3 * poly_ref(t, 1, 4, 1.0, s) for t in range(1, 5)])
