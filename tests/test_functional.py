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


def _args(kind):
    """Fresh arguments of functional.lamb / lars: (positional lists, keywords)."""
    ps = _params()
    steps = [torch.zeros(()) for _ in ps]
    state = [[torch.zeros_like(p) for p in ps] for _ in range(2 if kind == "lamb" else 1)]
    return [ps, [p.grad for p in ps], *state, steps], dict(lr=0.01)


def _overlapping_params(a, kw):
    """params 0 and 1 made views of one tensor that share elements 5 to 9."""
    base = torch.zeros(20)
    a[0][0], a[0][1] = base[:10], base[5:15]
    a[1][0], a[1][1] = torch.ones(10), torch.ones(10)
    for lst in a[2:-1]:
        lst[0], lst[1] = torch.zeros(10), torch.zeros(10)


def _overlapping_moments(a, kw):
    """The first state list's entries 1 and 2 made views of one tensor that share elements."""
    base = torch.zeros(20)
    a[2][1], a[2][2] = base[:7], base[4:12].view(2, 2, 2)


def _param_twice(a, kw):
    a[0][2], a[1][2] = a[0][0], a[1][0]
    for lst in a[2:-1]:
        lst[2] = torch.zeros(5, 3)


# (name, edit(args, kw), exception, message): every row is refused before anything is written
BAD_INPUT = [
    ("short_state", lambda a, kw: a.__setitem__(2, a[2][:2]), ValueError,
     r"has 3 params but 2 (exp_avgs|momentum_buffers)"),
    ("none_grad", lambda a, kw: a[1].__setitem__(1, None), TypeError,
     r"grads\[1\] is None \(a param without a gradient\?\), not a tensor"),
    ("not_a_tensor", lambda a, kw: a[2].__setitem__(0, [0.0]), TypeError,
     r"param 0 of those with grads: state '(exp_avg|momentum_buffer)' is list"),
    ("shared_step", lambda a, kw: a[-1].__setitem__(1, a[-1][0]), ValueError,
     r"holds the same tensor twice \(steps\[0\] and steps\[1\]"),
    ("overlapping_moments", _overlapping_moments, ValueError,
     r"(exp_avgs|momentum_buffers)\[1\] and (exp_avgs|momentum_buffers)\[2\] overlap in memory"),
    ("param_twice", _param_twice, ValueError,
     r"holds the same param twice \(params\[0\] and params\[2\]"),
    ("grad_is_the_param", lambda a, kw: a[1].__setitem__(0, a[0][0]), ValueError,
     r"holds the same tensor twice \(params\[0\] and grads\[0\]"),
    ("overlapping_params", _overlapping_params, ValueError,
     r"params\[0\] and params\[1\] overlap in memory"),
    ("moment_is_the_param", lambda a, kw: a[2].__setitem__(0, a[0][0].detach()), ValueError,
     r"params\[0\] and (exp_avgs|momentum_buffers)\[0\]|(exp_avgs|momentum_buffers)\[0\] "
     r"and params\[0\]"),
    ("grad_scale_shape", lambda a, kw: kw.update(grad_scale=torch.ones(3)), ValueError,
     r"grad_scale must be a floating tensor of one element, got torch.float32 of shape \[3\]"),
    ("grad_scale_number", lambda a, kw: kw.update(grad_scale=2.0), TypeError,
     r"grad_scale must be a tensor of one element or None, got float"),
    ("found_inf_shape", lambda a, kw: kw.update(found_inf=torch.zeros(2)), ValueError,
     r"found_inf must be a floating tensor of one element"),
    ("found_inf_int", lambda a, kw: kw.update(found_inf=torch.zeros((), dtype=torch.int32)),
     ValueError, r"found_inf must be a floating tensor of one element, got torch.int32"),
    ("skipped_steps_number", lambda a, kw: kw.update(skip_nonfinite=True, skipped_steps=0),
     TypeError, r"skipped_steps must be a tensor"),
    ("step_int64", lambda a, kw: a[-1].__setitem__(0, torch.zeros((), dtype=torch.int64)),
     RuntimeError, r"state 'step' must be a 0-dim float32 tensor on cpu, got torch.int64"),
    ("grad_shape", lambda a, kw: a[1].__setitem__(1, torch.zeros(8)), RuntimeError,
     r"has a grad of shape \(8,\) for a param of shape \(7,\)"),
    ("masters_length", lambda a, kw: kw.update(masters=[None]), ValueError,
     r"has 3 params but 1 masters"),
    ("lr_too_large", lambda a, kw: kw.update(lr=10 ** 400), ValueError,
     r"Invalid lr: an int of 401 digits"),
    ("lr_nan_tensor", lambda a, kw: kw.update(lr=torch.tensor(float("nan"))), ValueError,
     r"Invalid lr: a tensor lr holds nan"),
    ("packed_state_size", lambda a, kw: a[2].__setitem__(0, torch.zeros(9, dtype=torch.uint8)),
     RuntimeError, r"param 0 of those with grads \(shape \(5, 3\), torch.float32\): state "
     r"'(exp_avg|momentum_buffer)' is uint8 but not the packed 8-bit state of this param"),
]


@pytest.mark.parametrize("case", [c[0] for c in BAD_INPUT])
@pytest.mark.parametrize("backend", backend_params(("eager", "cpp", "triton")))
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_functional_refuses_bad_input_with_nothing_changed(kind, backend, case):
    """The functional API checks what the classes check, before any write, on every backend: a
    table of bad inputs, each refused with an exception naming the problem, every tensor given
    unchanged."""
    _, edit, exc, match = next(c for c in BAD_INPUT if c[0] == case)
    args, kw = _args(kind)
    edit(args, kw)
    before = [t.clone() for lst in args for t in lst if isinstance(t, torch.Tensor)]
    fn = functional.lamb if kind == "lamb" else functional.lars
    with pytest.raises(exc, match=match):
        fn(*args, backend=backend, **kw)
    after = [t for lst in args for t in lst if isinstance(t, torch.Tensor)]
    assert all(map(torch.equal, before, after))


@pytest.mark.parametrize("backend", backend_params(("eager", "cpp", "triton")))
def test_functional_refuses_lamb_moments_of_two_formats(backend):
    """LAMB's m and v of one param in two formats (bf16 m, float32 v) are refused before any
    write: the kernels read both in one format."""
    args, kw = _args("lamb")
    args[2][1] = args[2][1].bfloat16()
    before = [t.clone() for lst in args for t in lst]
    with pytest.raises(RuntimeError, match=r"param 1 of those with grads .*state 'exp_avg' "
                       r"\(torch.bfloat16\) and 'exp_avg_sq' \(torch.float32\) must share a format"):
        functional.lamb(*args, backend=backend, **kw)
    assert all(map(torch.equal, before, [t for lst in args for t in lst]))


def test_functional_rejects_bad_options_and_keywords():
    args, _ = _args("lamb")
    with pytest.raises(ValueError, match="Invalid lr"):
        functional.lamb(*args, lr=-1.0)
    args, _ = _args("lars")
    with pytest.raises(ValueError, match="Invalid backend"):
        functional.lars(*args, lr=0.1, backend="bogus")
    with pytest.raises(TypeError, match=r"lars\(\) got unexpected keyword arguments \['grad_scal'\]"):
        functional.lars(*args, lr=0.1, grad_scal=torch.ones(()))
    with pytest.raises(ValueError, match="kind must be 'lamb' or 'lars'"):
        functional.trust_ratio_step("adam", [])


def test_trust_ratio_step_names_lists_of_other_lengths():
    """A TensorGroup built by hand with lists of other lengths (a bare IndexError before)."""
    ps = _params()
    g = functional.TensorGroup(ps, [p.grad for p in ps], [torch.zeros(())],
                               exp_avgs=[torch.zeros_like(p) for p in ps],
                               exp_avg_sqs=[torch.zeros_like(p) for p in ps],
                               hyper=fusedopt._hyper.lamb_hyper(fusedopt._hyper.LAMB_DEFAULTS))
    with pytest.raises(ValueError, match="param group 0 has 3 params but 1 steps"):
        functional.trust_ratio_step("lamb", [g])


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


def test_functional_defaults_are_the_classes():
    """functional.lamb / lars take every default from the one table the classes take theirs
    from (fusedopt._hyper.LAMB_DEFAULTS / LARS_DEFAULTS)."""
    import inspect

    from fusedopt._hyper import LAMB_DEFAULTS, LARS_DEFAULTS
    for fn, cls, table in ((functional.lamb, fusedopt.FusedLAMB, LAMB_DEFAULTS),
                           (functional.lars, fusedopt.FusedLARS, LARS_DEFAULTS)):
        f_params = inspect.signature(fn).parameters
        c_params = inspect.signature(cls).parameters
        for name, value in table.items():
            assert f_params[name].default == value == c_params[name].default, (fn, name)
        assert "lr" in table, (fn, "lr")
