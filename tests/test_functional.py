"""The public functional layer (fusedopt.functional.lamb / lars) and skip_nonfinite."""
from __future__ import annotations

import pytest
import torch

import fusedopt
from fusedopt import functional
from helpers import backend_params

BACKENDS = backend_params(("eager", "cpp"))


def _params(seed=0, shapes=((5, 3), (7,), (2, 2, 2))):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_functional_equals_the_class_bit_for_bit(kind, backend):
    a, b = _params(), _params()
    opts = dict(lr=0.01, weight_decay=0.1, max_grad_norm=0.5)
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls(a, backend=backend, **opts)
    steps = [torch.zeros(()) for _ in b]
    bufs = [[torch.zeros_like(p) for p in b] for _ in range(2 if kind == "lamb" else 1)]
    for _ in range(3):
        opt.step()
        grads = [p.grad for p in b]
        if kind == "lamb":
            functional.lamb(b, grads, *bufs, steps, backend=backend, **opts)
        else:
            functional.lars(b, grads, *bufs, steps, backend=backend, **opts)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert all(float(s) == 3 for s in steps)


def test_functional_rejects_bad_input_with_nothing_changed():
    ps = _params()
    steps = [torch.zeros(()) for _ in ps]
    m = [torch.zeros_like(p) for p in ps]
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match="Invalid lr"):
        functional.lamb(ps, [p.grad for p in ps], m, m, steps, lr=-1.0)
    with pytest.raises(ValueError, match=r"functional.lamb\(\) has 3 params but 2 exp_avgs"):
        functional.lamb(ps, [p.grad for p in ps], m[:2], m, steps)
    with pytest.raises(ValueError, match="Invalid backend"):
        functional.lars(ps, [p.grad for p in ps], m, steps, lr=0.1, backend="bogus")
    with pytest.raises(TypeError, match=r"lars\(\) got unexpected keyword arguments \['grad_scal'\]"):
        functional.lars(ps, [p.grad for p in ps], m, steps, lr=0.1, grad_scal=torch.ones(()))
    assert all(torch.equal(p, q) for p, q in zip(ps, before))
    assert all(float(s) == 0 for s in steps)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_skip_nonfinite_changes_nothing_and_counts(kind, bad, clip, backend):
    ps = _params()
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = cls([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=0.01,
              max_grad_norm=clip, backend=backend, skip_nonfinite=True)
    opt.step()
    params = [p.detach().clone() for p in ps]
    state = [v.clone() for s in opt.state.values() for v in s.values()]
    ps[2].grad[0, 0, 1] = bad  # one element of one group
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, params))
    assert all(torch.equal(a, b) for a, b in zip(state, (v for s in opt.state.values()
                                                           for v in s.values())))
    assert int(opt.skipped_steps) == 1
    ps[2].grad[0, 0, 1] = 0.5
    opt.step()  # finite again: the step runs
    assert not torch.equal(ps[0], params[0])
    assert int(opt.skipped_steps) == 1 and all(float(s["step"]) == 2 for s in opt.state.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_skip_nonfinite_a_nan_spreads_as_in_torch(backend):
    ps = _params()
    opt = fusedopt.FusedLAMB(ps, lr=0.01, backend=backend, max_grad_norm=1.0)
    ps[0].grad[0, 0] = float("nan")
    opt.step()
    assert all(torch.isnan(p).any() for p in ps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_nonfinite_with_grad_scaler(backend):
    """GradScaler and skip_nonfinite both decide: the scaler's found_inf skips, and so does an
    inf the scaler did not see."""
    ps = _params()
    opt = fusedopt.FusedLAMB(ps, lr=0.01, backend=backend, skip_nonfinite=True)
    before = [p.detach().clone() for p in ps]
    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, before))
    assert int(opt.skipped_steps) == 0  # the scaler's skip, not a non-finite grad
    opt.found_inf = torch.tensor(0.0)
    ps[1].grad[0] = float("inf")
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, before)) and int(opt.skipped_steps) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_trust_ratio_step_takes_params_that_require_grad(backend):
    """The public step writes leaf params that require grad in place (as the optimizer's
    ``step()`` does under no_grad), and matches :func:`functional.lamb` on the same tensors."""
    from fusedopt._hyper import LAMB_DEFAULTS, lamb_hyper
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(10))
    q = p.detach().clone()
    g = torch.randn(10)
    states = [([torch.zeros(())], [torch.zeros(10)], [torch.zeros(10)]) for _ in range(2)]
    group = functional.TensorGroup([p], [g], states[0][0], exp_avgs=states[0][1],
                                   exp_avg_sqs=states[0][2], backend=backend,
                                   hyper=lamb_hyper({**LAMB_DEFAULTS, "lr": 0.1}))
    functional.trust_ratio_step("lamb", [group])
    functional.lamb([q], [g], states[1][1], states[1][2], states[1][0], lr=0.1, backend=backend)
    assert p.requires_grad and torch.equal(p.detach(), q) and not torch.equal(q, g)
