"""The eager backend against the float64 evaluation of docs/math.md, on the paths tests/test_parity.py's
table does not take (many tiny tensors, tensors of millions of elements, strided params)."""
import pytest
import torch

from fusedopt.testing import max_rel_err, run_backend


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_many_tiny_tensors_and_an_odd_one(kind):
    shapes = [(5,)] * 200 + [(18011,)]
    params, ref, _ = run_backend(kind, "eager", shapes, {}, steps=5)
    assert max_rel_err(params, ref) <= 1e-5


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_zero_norm_rule_gives_ratio_one(kind):
    """A zero weight: the trust ratio is exactly 1, so the step is the plain inner update."""
    hyper = {} if kind == "lamb" else dict(weight_decay=1e-4)
    params, ref, _ = run_backend(kind, "eager", [(4,)], hyper, steps=1, zero_weight=0)
    g = params[0].grad.double()
    if kind == "lamb":  # first step, bias-corrected: u = g / (|g| + eps), w = -lr * u
        expected = -1e-2 * g / (g.abs() + 1e-6)
    else:  # ratio 1, d = g, v = lr*d, w = -v
        expected = -0.5 * g
    torch.testing.assert_close(params[0].detach().double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(ref[0], expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("numel", [1 << 20, 1 << 22, 1 << 24], ids=["1M", "4M", "16M"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_large_tensor_norms_and_update_match_the_reference(kind, numel):
    """Note [chunked norms] in fusedopt/backends/eager.py: torch._foreach_norm alone lost ~1e-3 of
    Σw² at 16M float32 elements, and the update of one LAMB step then differed from the float64
    reference by up to 2.75e-3 (relative to the update). Two steps with global clipping of
    near-constant grads (whose total is the sum of squares of 16M equal values)."""
    import fusedopt
    from fusedopt.backends import get_backend
    from fusedopt.reference import ReferenceLAMB, ReferenceLARS

    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(numel, generator=gen) + 0.5
    grads = [torch.full((numel,), 1e-3) + 1e-5 * torch.randn(numel, generator=gen) for _ in range(2)]
    sq = get_backend("eager").sq_norms([w0])[0].item()
    exact = w0.double().square().sum().item()
    assert abs(sq - exact) <= 1e-6 * exact

    hyper = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0) if kind == "lamb" else dict(
        lr=0.5, weight_decay=1e-4, max_grad_norm=1.0)
    p = torch.nn.Parameter(w0.clone())
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls([p], backend="eager", **hyper)
    ref = (ReferenceLAMB if kind == "lamb" else ReferenceLARS)([hyper])
    w_ref = [[w0.double()]]
    for g in grads:
        before = p.detach().double()
        w_ref[0][0].copy_(before)  # both step from the same weights
        p.grad = g.clone()
        opt.step()
        ref.step(w_ref, [[g]])
        expected = w_ref[0][0].float().double()  # the reference's result rounded to float32
        ulp = torch.finfo(torch.float32).eps * before.abs().clamp(min=0.5)
        worst = ((p.detach().double() - expected).abs() / ulp).max().item()
        # rounding to the other side (and a weight crossing a power of two) gives up to 2; the
        # norm error before chunking moved LAMB's weights by hundreds of ulps at 16M
        assert worst <= 2.0, f"weights differ from the rounded reference by {worst:.3g} ulp"


def test_chunk_index_is_built_once_per_bucket(monkeypatch):
    """Note [chunked norms]: the chunk-to-tensor index lives in the bucket's workspace, so a
    steady step makes no host-to-device copy for it."""
    import fusedopt
    from fusedopt.backends import eager

    params = [torch.nn.Parameter(torch.randn(40_000)), torch.nn.Parameter(torch.randn(5))]
    opt = fusedopt.FusedLAMB(params, backend="eager", max_grad_norm=1.0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    built = []
    real = torch.repeat_interleave
    monkeypatch.setattr(eager.torch, "repeat_interleave",
                        lambda *a, **k: built.append(1) or real(*a, **k))
    opt.step()
    opt.step()
    assert not built, "the chunk index was built again in a steady step"


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_large_strided_params_match_contiguous_ones(kind):
    """Params above the norm chunk (Note [chunked norms]) that are not contiguous: a transposed
    one (dense in another order of its dims: its norms read in memory order) and a sliced one
    (not dense: read through a copy) step as contiguous params with the same values do."""
    import fusedopt
    from fusedopt.backends import eager

    gen = torch.Generator().manual_seed(3)
    big = eager._NORM_CHUNK + 5000
    values = [torch.randn(big // 100, 100, generator=gen), torch.randn(100, 2 * big // 100,
                                                                       generator=gen)]
    grads = [[torch.randn(v.shape, generator=gen) for v in values] for _ in range(3)]
    strided = [torch.nn.Parameter(values[0].t().contiguous().t()),
               torch.nn.Parameter(torch.stack([values[1], values[1]], 2)[..., 0])]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opts = [cls(ps, lr=1e-2, weight_decay=0.01, backend="eager", max_grad_norm=1.0)
            for ps in (strided, plain)]
    for gs in grads:
        for ps, opt in zip((strided, plain), opts):
            for p, g in zip(ps, gs):
                p.grad = torch.empty_like(p).copy_(g)  # of the param's strides, as autograd's
            opt.step()
    assert not any(p.is_contiguous() for p in strided) and not strided[0].grad.is_contiguous()
    for a, b, v in zip(strided, plain, values):
        assert not torch.equal(b.detach(), v)
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
