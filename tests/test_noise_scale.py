"""fusedopt.GradientNoiseScale and the gradient-accumulation helper."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedopt.noise_scale import GradientAccumulationNoiseScale, GradientNoiseScale

# --------------------------------------------------------------------------- synthetic problem
# Per-example gradients g_j = G + ξ_j with ξ_j ~ N(0, Σ), Σ = diag(var): the true noise scale is
# B_simple = tr(Σ) / |G|² in closed form. A linear "model" with per-example loss <w, z_j> has
# exactly z_j as its per-example gradient, so the same samples can be pushed through autograd.
D = 32
B_SMALL, N_MICRO = 8, 8
B_BIG = B_SMALL * N_MICRO
STEPS = 1200
BETA = 0.99


def synthetic_problem(seed=0):
    rng = np.random.default_rng(seed)
    G = rng.normal(size=D)
    G /= np.linalg.norm(G)  # |G|² = 1
    var = rng.uniform(0.5, 1.5, size=D)
    var *= 48.0 / var.sum()  # tr(Σ) = 48  ->  B_simple = 48
    z = G + rng.normal(size=(STEPS, N_MICRO, B_SMALL, D)) * np.sqrt(var)
    return G, var, z


def ema_weights(n, beta):
    """Weights of the bias-corrected EMA after n updates: estimate = Σ_i w_i x_i."""
    i = np.arange(1, n + 1)
    w = (1 - beta) * beta ** (n - i)
    return w / (1 - beta ** n)


def norms_from_samples(z):
    micro = z.mean(axis=2)  # [steps, n_micro, D]: micro-batch mean gradients
    small = (micro ** 2).sum(-1)  # [steps, n_micro]
    big = (micro.mean(axis=1) ** 2).sum(-1)  # [steps]
    return small, big


def test_estimator_recovers_known_noise_scale():
    G, var, z = synthetic_problem()
    true_sq, true_tr = float(G @ G), float(var.sum())
    small, big = norms_from_samples(z)
    gns = GradientNoiseScale(beta=BETA)
    for s, g in zip(small, big):
        gns.update_from_norms(small_batch=B_SMALL, small_sq_norms=list(s), big_batch=B_BIG,
                              big_sq_norm=float(g))

    # Per-step unbiased estimates, written out independently of the implementation.
    s_mean = small.mean(axis=1)
    sq_i = (B_BIG * big - B_SMALL * s_mean) / (B_BIG - B_SMALL)
    tr_i = (s_mean - big) / (1 / B_SMALL - 1 / B_BIG)
    w = ema_weights(STEPS, BETA)
    # the smoothing is the documented bias-corrected EMA of each estimate
    assert gns.sq_norm_estimate == pytest.approx(float(w @ sq_i), rel=1e-9)
    assert gns.trace_estimate == pytest.approx(float(w @ tr_i), rel=1e-9)
    assert gns.noise_scale == pytest.approx(float(w @ tr_i) / float(w @ sq_i), rel=1e-9)

    # Statistical tolerance. The final estimate is a fixed linear combination Σ w_i x_i of
    # independent per-step estimates x_i, so its standard deviation is sd(x)·sqrt(Σ w_i²)
    # (sd(x) measured on the 1200 samples; effective sample size 1/Σw² ≈ 200, so the sum is
    # close to Gaussian). 5 sd: a false failure has probability ~1e-6 (and the seed is fixed).
    # For the ratio, r_i = tr_i − B_true·sq_i has mean 0 exactly when the estimates are
    # unbiased, and noise_scale − B_true = (Σ w r) / (Σ w sq).
    k = 5.0 * math.sqrt(float(w @ w))
    tol_sq = k * sq_i.std()
    tol_tr = k * tr_i.std()
    true_b = true_tr / true_sq
    r = tr_i - true_b * sq_i
    tol_b = k * r.std() / gns.sq_norm_estimate
    assert abs(gns.sq_norm_estimate - true_sq) < tol_sq
    assert abs(gns.trace_estimate - true_tr) < tol_tr
    assert abs(gns.noise_scale - true_b) < tol_b
    # The tolerances are tight enough to catch the classic mistakes: the small-batch norm
    # alone is biased by tr(Σ)/b, the big-batch norm by tr(Σ)/B.
    assert tol_b < 0.25 * true_b
    assert abs(float(w @ s_mean) - true_sq) > 10 * tol_sq
    assert abs(float(w @ big) - true_sq) > 3 * tol_sq


def test_accumulation_helper_matches_estimator_on_synthetic_problem():
    G, var, z = synthetic_problem(seed=1)
    z = z[:300]
    small, big = norms_from_samples(z)
    ref = GradientNoiseScale(beta=0.9)
    for s, g in zip(small, big):
        ref.update_from_norms(small_batch=B_SMALL, small_sq_norms=list(s), big_batch=B_BIG,
                              big_sq_norm=float(g))

    w = torch.nn.Parameter(torch.zeros(D, dtype=torch.float64))
    acc = GradientAccumulationNoiseScale([w], B_SMALL, GradientNoiseScale(beta=0.9))
    zt = torch.from_numpy(z)
    for step in range(zt.shape[0]):
        for i in range(N_MICRO):
            loss = (zt[step, i] @ w).mean() / N_MICRO  # per-example gradient = z_j
            loss.backward()
            acc.micro_batch_done()
        acc.step()
        w.grad = None
    est = acc.noise_scale
    assert est.num_updates == ref.num_updates == 300
    assert est.sq_norm_estimate == pytest.approx(ref.sq_norm_estimate, rel=1e-6)
    assert est.trace_estimate == pytest.approx(ref.trace_estimate, rel=1e-6)
    assert est.noise_scale == pytest.approx(ref.noise_scale, rel=1e-6)


# --------------------------------------------------------------------------- exact algebra
@settings(max_examples=60, deadline=None)
@given(
    sq=st.floats(1e-3, 1e3), tr=st.floats(0, 1e4), b=st.integers(1, 512),
    mult=st.integers(2, 64), beta=st.floats(0, 0.999),
)
def test_expected_norms_are_inverted_exactly(sq, tr, b, mult, beta):
    # E|G_b|² = |G|² + tr(Σ)/b: fed the expectations, the estimator returns |G|² and tr(Σ).
    B = b * mult
    gns = GradientNoiseScale(beta=beta)
    for _ in range(3):
        gns.update_from_norms(small_batch=b, small_sq_norms=[sq + tr / b] * 3, big_batch=B,
                              big_sq_norm=sq + tr / B)
    assert gns.sq_norm_estimate == pytest.approx(sq, rel=1e-6, abs=1e-9 * tr)
    assert gns.trace_estimate == pytest.approx(tr, rel=1e-6, abs=1e-6 * sq * b)
    assert gns.noise_scale == pytest.approx(tr / sq, rel=1e-5, abs=1e-6 * b)


@settings(deadline=None)  # no per-example deadline: CI machines can be busy
@given(
    x=st.lists(st.tuples(st.floats(0, 100), st.floats(0, 100)), min_size=1, max_size=2),
    beta=st.floats(0, 0.99),
)
def test_bias_corrected_ema(x, beta):
    gns = GradientNoiseScale(beta=beta)
    raw = []
    for s, g in x:
        gns.update_from_norms(small_batch=4, small_sq_norms=[s], big_batch=16, big_sq_norm=g)
        raw.append(((16 * g - 4 * s) / 12, (s - g) / (1 / 4 - 1 / 16)))
    if len(raw) == 1:  # bias correction: the first estimate is the raw one, for any beta
        exp_sq, exp_tr = raw[0]
    else:  # ((1-β)(β x1 + x2)) / (1 - β²) = (β x1 + x2) / (1 + β)
        exp_sq = (beta * raw[0][0] + raw[1][0]) / (1 + beta)
        exp_tr = (beta * raw[0][1] + raw[1][1]) / (1 + beta)
    assert gns.sq_norm_estimate == pytest.approx(exp_sq, rel=1e-9, abs=1e-9)
    assert gns.trace_estimate == pytest.approx(exp_tr, rel=1e-9, abs=1e-9)
    assert float(gns.last_sq_norm) == pytest.approx(raw[-1][0], rel=1e-9, abs=1e-9)


@settings(deadline=None)  # no per-example deadline: CI machines can be busy
@given(c=st.floats(1e-3, 1e3))
def test_noise_scale_invariant_to_gradient_scale(c):
    # a constant scale of the gradients (AMP loss scale) scales the norms by c²
    pairs = [([3.0, 5.0], 3.5), ([2.5, 4.0], 3.0)]
    a, s = GradientNoiseScale(0.5), GradientNoiseScale(0.5)
    for small, big in pairs:
        a.update_from_norms(small_batch=2, small_sq_norms=small, big_batch=4, big_sq_norm=big)
        s.update_from_norms(small_batch=2, small_sq_norms=[c * c * v for v in small],
                            big_batch=4, big_sq_norm=c * c * big)
    assert a.noise_scale > 0
    assert s.noise_scale == pytest.approx(a.noise_scale, rel=1e-9)
    assert s.sq_norm_estimate == pytest.approx(c * c * a.sq_norm_estimate, rel=1e-9)


def test_tensor_inputs_equal_float_inputs():
    a, t = GradientNoiseScale(0.9), GradientNoiseScale(0.9)
    for small, big in [([3.0, 5.0, 4.0], 1.5), ([2.5, 4.0, 3.5], 1.2)]:
        a.update_from_norms(small_batch=2, small_sq_norms=small, big_batch=6, big_sq_norm=big)
        t.update_from_norms(small_batch=2, small_sq_norms=torch.tensor(small),
                            big_batch=6, big_sq_norm=torch.tensor(big))
    assert t.noise_scale == pytest.approx(a.noise_scale, rel=1e-6)
    assert t.trace_estimate == pytest.approx(a.trace_estimate, rel=1e-6)


def test_empty_estimator_and_unresolved_signal():
    gns = GradientNoiseScale()
    assert math.isnan(gns.noise_scale) and math.isnan(gns.sq_norm_estimate)
    assert math.isnan(gns.trace_estimate)
    # big-batch norm so small that the |G|² estimate is negative: noise scale undefined
    gns.update_from_norms(small_batch=1, small_sq_norms=[10.0], big_batch=2, big_sq_norm=1.0)
    assert gns.sq_norm_estimate < 0
    assert math.isnan(gns.noise_scale)


def test_state_dict_roundtrip_continues_identically():
    rng = np.random.default_rng(3)
    data = [(list(rng.uniform(1, 3, 4)), float(rng.uniform(0.5, 1))) for _ in range(20)]
    a = GradientNoiseScale(beta=0.8)
    for s, g in data[:10]:
        a.update_from_norms(small_batch=4, small_sq_norms=s, big_batch=16, big_sq_norm=g)
    sd = a.state_dict()
    torch.save(sd, buf := __import__("io").BytesIO())
    buf.seek(0)
    b = GradientNoiseScale(beta=0.3)  # beta is restored too
    b.load_state_dict(torch.load(buf))
    assert b.beta == 0.8 and b.num_updates == 10
    for s, g in data[10:]:
        for e in (a, b):
            e.update_from_norms(small_batch=4, small_sq_norms=s, big_batch=16, big_sq_norm=g)
    assert b.noise_scale == pytest.approx(a.noise_scale, rel=1e-12)
    assert b.sq_norm_estimate == pytest.approx(a.sq_norm_estimate, rel=1e-12)
    with pytest.raises(ValueError, match="missing keys"):
        b.load_state_dict({"beta": 0.5})


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(small_batch=0), r"small_batch: 0.*>= 1"),
    (dict(small_batch=2.0), r"small_batch: 2.0"),
    (dict(big_batch=4), r"big_batch: 4.*> small_batch=4"),
    (dict(big_batch=2), r"big_batch: 2.*> small_batch=4"),
    (dict(small_sq_norms=[]), r"small_sq_norms: empty"),
    (dict(small_sq_norms=torch.zeros(0)), r"small_sq_norms: empty"),
    (dict(small_sq_norms=[1.0, -1.0]), r"small_sq_norms\[1\]: -1.0.*>= 0"),
    (dict(small_sq_norms=[float("nan")]), r"small_sq_norms\[0\]: nan"),
    (dict(big_sq_norm=float("inf")), r"big_sq_norm: inf"),
    (dict(big_sq_norm=torch.ones(2)), r"big_sq_norm: a tensor with 2 elements"),
])
def test_update_rejects(kwargs, pattern):
    args = dict(small_batch=4, small_sq_norms=[1.0, 2.0], big_batch=8, big_sq_norm=1.0)
    args.update(kwargs)
    gns = GradientNoiseScale()
    with pytest.raises(ValueError, match=pattern):
        gns.update_from_norms(**args)
    assert gns.num_updates == 0


@pytest.mark.parametrize("beta", [-0.1, 1.0, 1.5, float("nan"), "0.9"])
def test_beta_rejected(beta):
    with pytest.raises(ValueError, match=r"beta.*\[0, 1\)"):
        GradientNoiseScale(beta)


# --------------------------------------------------------------------------- accumulation helper
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _micro_batches(n, b, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 5, generator=g), torch.randint(0, 3, (b,), generator=g))
            for _ in range(n)]


def _reference_norms(model, batches):
    """|g_i|² of each micro-batch mean gradient, and |mean_i g_i|², by separate autograd calls."""
    flat = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        flat.append(torch.cat([g.reshape(-1) for g in grads]).double())
    flat = torch.stack(flat)
    return (flat ** 2).sum(1), float((flat.mean(0) ** 2).sum()), flat.mean(0)


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_accumulation_helper_measures_micro_and_big_norms(mode):
    model = _mlp()
    n, b = 5, 6
    batches = _micro_batches(n, b)
    ref_small, ref_big, ref_mean_grad = _reference_norms(model, batches)

    acc = GradientAccumulationNoiseScale(model.parameters(), b, accumulation=mode)
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (loss / n if mode == "mean" else loss).backward()
        acc.micro_batch_done()
    assert acc.num_micro_batches == n
    # the hooks observe, they do not change the accumulated gradient
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    expected_grad = ref_mean_grad if mode == "mean" else ref_mean_grad * n
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    acc.step()
    gns = acc.noise_scale
    assert acc.num_micro_batches == 0
    assert float(gns.last_small_sq_norm) == pytest.approx(float(ref_small.mean()), rel=1e-5)
    assert float(gns.last_big_sq_norm) == pytest.approx(ref_big, rel=1e-5)
    ref = GradientNoiseScale()
    ref.update_from_norms(small_batch=b, small_sq_norms=ref_small.tolist(), big_batch=n * b,
                          big_sq_norm=ref_big)
    assert gns.trace_estimate == pytest.approx(ref.trace_estimate, rel=1e-4)
    assert gns.sq_norm_estimate == pytest.approx(ref.sq_norm_estimate, rel=1e-4, abs=1e-6)


def test_accumulation_helper_second_window_ignores_first():
    # zero_grad between windows: the second window's norms are its own
    model = _mlp()
    acc = GradientAccumulationNoiseScale(model.parameters(), 4)
    for seed in (1, 2):
        batches = _micro_batches(3, 4, seed=seed)
        for x, y in batches:
            (torch.nn.functional.cross_entropy(model(x), y) / 3).backward()
            acc.micro_batch_done()
        acc.step()
        model.zero_grad(set_to_none=seed == 1)  # both zero_grad styles
    ref_small, ref_big, _ = _reference_norms(model, batches)
    assert float(acc.noise_scale.last_small_sq_norm) == pytest.approx(float(ref_small.mean()),
                                                                      rel=1e-5)
    assert float(acc.noise_scale.last_big_sq_norm) == pytest.approx(ref_big, rel=1e-5)
    assert acc.noise_scale.num_updates == 2


def test_accumulation_helper_under_a_grad_scaler():
    """Gradients of losses times a changing loss scale (powers of two, as GradScaler's), with
    ``grad_scale`` passed, give the unscaled run's estimates; a window whose gradients hold an inf
    (a step the scaler skips) is left out on the device instead of making every later estimate
    NaN; a number <= 0 as grad_scale is refused."""
    estimates = []
    for scaled in (False, True):
        model = _mlp()
        acc = GradientAccumulationNoiseScale(model.parameters(), 4)
        for w, scale in enumerate((2.0 ** 10, 2.0 ** 16, 2.0 ** 15, 2.0 ** 3)):
            if scaled and w == 2:  # an overflowing window first, then the same window again
                for x, y in _micro_batches(3, 4, seed=w):
                    (torch.nn.functional.cross_entropy(model(x), y) * math.inf / 3).backward()
                    acc.micro_batch_done()
                acc.step(grad_scale=torch.tensor(scale))
                model.zero_grad()
            for x, y in _micro_batches(3, 4, seed=w):
                loss = torch.nn.functional.cross_entropy(model(x), y) / 3
                (loss * scale if scaled else loss).backward()
                acc.micro_batch_done()
            acc.step(grad_scale=scale if scaled else None)
            model.zero_grad()
        gns = acc.noise_scale
        estimates.append((gns.num_updates, gns.sq_norm_estimate, gns.trace_estimate))
    assert estimates[0][0] == 4 and math.isfinite(estimates[1][1])
    assert estimates[1] == pytest.approx(estimates[0], rel=1e-12)
    for x, y in _micro_batches(2, 4):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        acc.micro_batch_done()
    for bad in (0.0, -1.0, math.inf, "2"):
        with pytest.raises(ValueError, match="Invalid grad_scale"):
            acc.step(grad_scale=bad)
        assert acc.num_micro_batches == 2


def test_accumulation_helper_misuse_raises():
    model = _mlp()
    (x, y), = _micro_batches(1, 4)
    acc = GradientAccumulationNoiseScale(model.parameters(), 4)
    with pytest.raises(RuntimeError, match="no gradient"):
        acc.micro_batch_done()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="micro_batch_done"):
        acc.step()  # backward without micro_batch_done
    acc.discard()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    acc.micro_batch_done()
    with pytest.raises(RuntimeError, match="at least 2 micro-batches per accumulation window, got 1"):
        acc.step()
    assert acc.noise_scale.num_updates == 0
    acc.remove()  # hooks gone: a backward records nothing
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="no gradient"):
        acc.micro_batch_done()


def test_accumulation_helper_rejects_arguments():
    model = _mlp()
    with pytest.raises(ValueError, match=r"micro_batch_size: 0.*>= 1"):
        GradientAccumulationNoiseScale(model.parameters(), 0)
    with pytest.raises(ValueError, match=r"accumulation: 'avg'.*mean.*sum"):
        GradientAccumulationNoiseScale(model.parameters(), 4, accumulation="avg")
    frozen = [torch.zeros(3)]
    with pytest.raises(ValueError, match="requires_grad"):
        GradientAccumulationNoiseScale(frozen, 4)


@pytest.fixture
def one_thread():
    # tiny tensors: intra-op threads only add overhead (and contend on a busy machine)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_accumulation_helper_on_real_model_matches_per_example_truth(one_thread):
    # A nonlinear model on a finite data set. Drawing examples uniformly *with replacement*
    # makes them i.i.d. from the data set, so the true G and Σ are the mean and the (population)
    # covariance of the per-example gradients, computed here one example at a time.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    N = 150
    x = torch.randn(N, 6)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    params = list(model.parameters())
    per_ex = []
    for j in range(N):
        g = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x[j:j + 1]), y[j:j + 1]),
                                params)
        per_ex.append(torch.cat([t.reshape(-1) for t in g]).double())
    per_ex = torch.stack(per_ex)
    G = per_ex.mean(0)
    true_sq = float(G @ G)
    true_tr = float(((per_ex - G) ** 2).sum(1).mean())
    true_b = true_tr / true_sq

    b, n, windows = 8, 6, 120
    est = GradientNoiseScale(beta=0.97)
    gen = torch.Generator().manual_seed(1)
    raw = []
    with GradientAccumulationNoiseScale(params, b, est) as acc:
        for _ in range(windows):
            idx = torch.randint(0, N, (n * b,), generator=gen)
            for i in range(n):
                j = idx[i * b:(i + 1) * b]
                (torch.nn.functional.cross_entropy(model(x[j]), y[j]) / n).backward()
                acc.micro_batch_done()
            acc.step()
            raw.append((float(est.last_trace), float(est.last_sq_norm)))
            model.zero_grad(set_to_none=True)
    tr_i = np.array([t for t, _ in raw])
    sq_i = np.array([s for _, s in raw])
    # Same tolerance argument as test_estimator_recovers_known_noise_scale: 5 standard
    # deviations of the EMA-weighted sum of independent per-window estimates.
    w = ema_weights(windows, 0.97)
    k = 5.0 * math.sqrt(float(w @ w))
    assert abs(est.sq_norm_estimate - true_sq) < k * sq_i.std()
    assert abs(est.trace_estimate - true_tr) < k * tr_i.std()
    tol_b = k * (tr_i - true_b * sq_i).std() / est.sq_norm_estimate
    assert abs(est.noise_scale - true_b) < tol_b
    assert tol_b < 0.35 * true_b  # the check has teeth
    # e.g. using the mean small-batch norm as |G|² (bias tr(Σ)/b) would fail the |G|² check
    assert abs(float(w @ (sq_i + tr_i / b)) - true_sq) > k * sq_i.std()


def test_exported_from_package():
    # the API: fusedopt.GradientNoiseScale, fusedopt.GradientAccumulationNoiseScale
    import fusedopt
    from fusedopt import noise_scale

    assert fusedopt.GradientNoiseScale is noise_scale.GradientNoiseScale
    assert fusedopt.GradientAccumulationNoiseScale is noise_scale.GradientAccumulationNoiseScale
    assert fusedopt.DDPGradientNoiseScale is noise_scale.DDPGradientNoiseScale
