"""Behaviour users expect from torch optimizers, bad input, and the exclusion helper."""
import ast
import collections
import copy
import inspect
import io
from pathlib import Path

import pytest
import torch

import fusedopt
from fusedopt.reference import LAMB_SPEC, LARS_SPEC
from helpers import backend_params

ROOT = Path(__file__).resolve().parents[1]
OPTS = {
    "lamb": lambda params, **kw: fusedopt.FusedLAMB(params, **{"lr": 1e-2, **kw}),
    "lars": lambda params, **kw: fusedopt.FusedLARS(params, **{"lr": 0.1, "weight_decay": 1e-4, **kw}),
}
KINDS = list(OPTS)


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def train(opt, m, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()


# ------------------------------------------------------------------- defaults and documentation
@pytest.mark.parametrize("cls,spec", [(fusedopt.FusedLAMB, LAMB_SPEC), (fusedopt.FusedLARS, LARS_SPEC)],
                         ids=["lamb", "lars"])
def test_signature_defaults_equal_spec(cls, spec):
    sig = inspect.signature(cls.__init__).parameters
    for name, value in spec.items():
        assert sig[name].default == value, name
    if cls is fusedopt.FusedLARS:
        # torch SGD's default lr, so that FusedLARS(params) constructs as SGD(params) does
        assert sig["lr"].default == inspect.signature(torch.optim.SGD.__init__).parameters[
            "lr"].default == 1e-3


def _readme_signature(name):
    """The ``name(params, ...)`` signature block of the README, parsed into {arg: default}."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"{name}(params")
    depth, i = 0, start + len(name)
    while True:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            break
        i += 1
    fn = ast.parse(f"def f{text[start + len(name):i + 1]}: pass").body[0].args
    pos = fn.args[len(fn.args) - len(fn.defaults):]
    out = {a.arg: ast.literal_eval(d) for a, d in zip(pos, fn.defaults)}
    out.update({a.arg: ast.literal_eval(d) for a, d in zip(fn.kwonlyargs, fn.kw_defaults) if d is not None})
    return out


@pytest.mark.parametrize("cls,spec", [(fusedopt.FusedLAMB, LAMB_SPEC), (fusedopt.FusedLARS, LARS_SPEC)],
                         ids=["lamb", "lars"])
def test_readme_documents_the_same_defaults(cls, spec):
    documented = _readme_signature(cls.__name__)
    sig = inspect.signature(cls.__init__).parameters
    for name, value in spec.items():
        assert documented[name] == value, name
    for name, value in documented.items():
        assert sig[name].default == value, name


def test_keyword_only_after_weight_decay():
    sig = inspect.signature(fusedopt.FusedLAMB.__init__).parameters
    assert sig["bias_correction"].kind is inspect.Parameter.KEYWORD_ONLY
    sig = inspect.signature(fusedopt.FusedLARS.__init__).parameters
    assert sig["trust_coefficient"].kind is inspect.Parameter.KEYWORD_ONLY


def test_repr_shows_hyper_parameters():
    r = repr(fusedopt.FusedLAMB(model().parameters(), lr=0.25, betas=(0.8, 0.95)))
    assert "lr: 0.25" in r and "betas: (0.8, 0.95)" in r and "trust_ratio_bounds" in r


# ------------------------------------------------------------------------- torch behaviour
@pytest.mark.parametrize("kind", KINDS)
def test_closure_is_evaluated_with_grad_and_loss_returned(kind):
    m = model()
    opt = OPTS[kind](m.parameters())
    x = torch.randn(4, 6)

    def closure():
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in m.parameters()]
    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.ndim == 0
    assert any(not torch.equal(b, p) for b, p in zip(before, m.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_params_without_grad_are_skipped(kind):
    m = model()
    opt = OPTS[kind](m.parameters())
    frozen = m[2].weight
    before = frozen.detach().clone()
    x = torch.randn(4, 6)
    m(x).square().mean().backward()
    frozen.grad = None
    opt.step()
    assert torch.equal(frozen, before)
    assert frozen not in opt.state
    assert opt.state[m[0].weight]["step"].item() == 1


@pytest.mark.parametrize("kind", KINDS)
def test_zero_grad_sets_none(kind):
    m = model()
    opt = OPTS[kind](m.parameters())
    m(torch.randn(2, 6)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_add_param_group_validates_and_steps(kind):
    m, extra = model(), torch.nn.Parameter(torch.randn(3, 3))
    opt = OPTS[kind](m.parameters())
    with pytest.raises(ValueError, match="weight_decay"):
        opt.add_param_group({"params": [extra], "weight_decay": -1.0})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [extra], "lr": 0.5})
    extra.grad = torch.randn(3, 3)
    before = extra.detach().clone()
    opt.step()
    assert not torch.equal(extra, before)
    assert opt.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_group_params_given_as_a_generator_are_all_kept(kind):
    """{"params": model.parameters()} (a generator), in the constructor and in add_param_group,
    as torch's optimizers take it (they read it into a list; reading it once before them left
    the group empty)."""
    m, extra = model(), torch.nn.Linear(3, 2)
    opt = OPTS[kind]([{"params": m.parameters()}])
    opt.add_param_group({"params": extra.parameters(), "lr": 0.5})
    ref = torch.optim.SGD([{"params": model().parameters()}], lr=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [len(ref.param_groups[0]["params"]), 2]
    train(opt, m, 1)
    assert all(p in opt.state for p in m.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_lr_scheduler_drives_the_group_lr(kind):
    m = model()
    opt = OPTS[kind](m.parameters(), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    train(opt, m, 1)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = [p.detach().clone() for p in m.parameters()]
    train(opt, m, 2)
    if kind == "lamb":  # lr = 0: no change at all
        assert all(torch.equal(b, p) for b, p in zip(before, m.parameters()))
    else:  # LARS with lr in the momentum: the buffer still carries the earlier lr * d
        assert any(not torch.equal(b, p) for b, p in zip(before, m.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_state_uses_torch_keys(kind):
    m = model()
    opt = OPTS[kind](m.parameters())
    train(opt, m, 2)
    st = opt.state[m[0].weight]
    keys = {"lamb": {"step", "exp_avg", "exp_avg_sq"}, "lars": {"step", "momentum_buffer"}}[kind]
    assert set(st) == keys
    assert st["step"].dtype == torch.float32 and st["step"].ndim == 0 and st["step"].item() == 2


STATE_KEYS = {"lamb": ("exp_avg", "exp_avg_sq"), "lars": ("momentum_buffer",)}


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("kind", KINDS)
def test_state_lies_in_one_aligned_buffer_per_key(kind):
    """Note [flat state] in fusedopt/_state.py: dense params of any layout share a buffer per
    key, each state tensor with its param's strides; a param that is not dense and another
    dtype get tensors of their own."""
    m = model()
    transposed = torch.nn.Parameter(torch.randn(4, 3).t())  # dense in another order
    conv = torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    gapped = torch.nn.Parameter(torch.randn(4, 6)[:, ::2])  # not dense: state of its own
    double = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))  # another dtype: other buffers
    extra = [transposed, conv, gapped, double]
    opt = OPTS[kind]([*m.parameters(), *extra])
    m(torch.randn(8, 6)).square().mean().backward()
    for p in extra:
        p.grad = torch.ones_like(p)
    opt.step()
    plain = [*m.parameters(), transposed, conv]
    for key in ("step", *STATE_KEYS[kind]):
        ts = [opt.state[p][key] for p in plain]
        assert len({_storage(t) for t in ts}) == 1, key
        spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in ts)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"{key}: tensors overlap"
        assert all(t._base is None and t.stride() == p.stride() and t.shape == p.shape
                   for t, p in zip(ts, plain) if key != "step")
        if key != "step":
            assert all(t.data_ptr() % 64 == 0 for t in ts), key
        others = {_storage(opt.state[p][key]) for p in (gapped, double)}
        assert len(others) == 2 and _storage(ts[0]) not in others, key
    # each tensor keeps a version counter of its own
    st0, st1 = opt.state[plain[0]], opt.state[plain[1]]
    v1 = st1[STATE_KEYS[kind][0]]._version
    st0[STATE_KEYS[kind][0]].add_(0.0)
    assert st1[STATE_KEYS[kind][0]]._version == v1


def test_master_weights_lie_in_one_buffer_with_the_param_values():
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in [(3, 5), (7,), (0,)]]
    opt = fusedopt.FusedLAMB(params, lr=1e-2)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.found_inf = torch.ones(())  # a skipped step: masters still equal the params
    opt.step()
    masters = [opt.state[p]["master_param"] for p in params]
    assert len({_storage(t) for t in masters}) == 1
    assert all(t.dtype == torch.float32 and torch.equal(t, p.float()) for t, p in zip(masters, params))


@pytest.mark.parametrize("kind", KINDS)
def test_saved_state_writes_each_buffer_once_and_loads_shared(kind):
    ps = [torch.nn.Parameter(torch.randn(300)) for _ in range(20)]
    opt = OPTS[kind](ps)
    for p in ps:
        p.grad = torch.randn(300)
    opt.step()
    state_bytes = sum(t.nbytes for st in opt.state.values() for t in st.values())
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    assert buf.tell() < 1.2 * state_bytes + 20_000  # twenty copies of each buffer would be 20x
    buf.seek(0)
    loaded = torch.load(buf)
    for key in STATE_KEYS[kind]:
        assert len({_storage(st[key]) for st in loaded["state"].values()}) == 1
    opt2 = OPTS[kind]([torch.nn.Parameter(p.detach().clone()) for p in ps])
    opt2.load_state_dict(loaded)
    for st, st2 in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(st[k], st2[k]) for k in st)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last],
                         ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("kind", KINDS)
def test_distributed_checkpoint_writes_each_tensor_once(kind, layout, tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    ps = [torch.nn.Parameter(torch.randn(4, 5, 3, 5).to(memory_format=layout)) for _ in range(20)]
    opt = OPTS[kind](ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    state = {f"{i}.{k}": v for i, st in enumerate(opt.state.values()) for k, v in st.items()}
    separate = {k: v.clone() for k, v in state.items()}  # one allocation each: the yardstick
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=tmp_path / "flat")
        dcp.save(separate, checkpoint_id=tmp_path / "separate")
        restored = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(restored, checkpoint_id=tmp_path / "flat")
    written = {d: sum(f.stat().st_size for f in (tmp_path / d).iterdir()) for d in ("flat", "separate")}
    assert written["flat"] < 1.05 * written["separate"]  # a whole buffer per tensor would be ~10x
    assert all(torch.equal(restored[k], v) for k, v in state.items())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["eager", "auto"])
def test_state_dict_round_trip_continues_bit_for_bit(kind, backend):
    m_full = model()
    opt_full = OPTS[kind](m_full.parameters(), backend=backend, max_grad_norm=1.0)
    train(opt_full, m_full, 3, seed=1)
    train(opt_full, m_full, 3, seed=2)

    m_a = model()
    opt_a = OPTS[kind](m_a.parameters(), backend=backend, max_grad_norm=1.0)
    train(opt_a, m_a, 3, seed=1)
    buf = io.BytesIO()
    torch.save({"model": m_a.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    m_b = model(seed=5)
    m_b.load_state_dict(ckpt["model"])
    opt_b = OPTS[kind](m_b.parameters(), backend=backend, max_grad_norm=1.0)
    opt_b.load_state_dict(ckpt["opt"])
    train(opt_b, m_b, 3, seed=2)
    for p, q in zip(m_full.parameters(), m_b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_is_independent(kind):
    m = model()
    opt = OPTS[kind](m.parameters())
    train(opt, m, 1)
    clone = copy.deepcopy(opt)
    assert clone.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    st = next(iter(clone.state.values()))
    key = "exp_avg" if kind == "lamb" else "momentum_buffer"
    st[key].add_(1.0)
    assert not torch.equal(st[key], opt.state[m[0].weight][key])


@pytest.mark.parametrize("kind", KINDS)
def test_step_never_modifies_grads(kind):
    m = model()
    opt = OPTS[kind](m.parameters(), max_grad_norm=1e-3)
    m(torch.randn(4, 6)).square().mean().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    opt.step()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, m.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_params_are_updated_in_place(kind):
    base = torch.randn(6, 8, dtype=torch.float64)
    w = torch.nn.Parameter(base.clone().t())  # dense, transposed strides
    strided = torch.nn.Parameter(torch.randn(6, 16, dtype=torch.float64)[:, ::2])  # not dense
    ref_opt_params = [torch.nn.Parameter(w.detach().contiguous()), torch.nn.Parameter(strided.detach().contiguous())]
    opt = OPTS[kind]([w, strided])
    ref = OPTS[kind](ref_opt_params, backend="eager")
    for _ in range(3):
        g1, g2 = torch.randn(8, 6, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
        w.grad, strided.grad = g1, g2
        ref_opt_params[0].grad, ref_opt_params[1].grad = g1.contiguous(), g2.contiguous()
        opt.step()
        ref.step()
    torch.testing.assert_close(w.detach(), ref_opt_params[0].detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(strided.detach(), ref_opt_params[1].detach(), rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------- bad input
# Bad hyper-parameters at construction, bad input at step() and an explicitly named backend that
# cannot run: rows of fusedopt.testing.BAD_INPUTS, run by tests/test_hardening.py.


# ------------------------------------------------------------------------- param_groups
def test_param_groups_default_excludes_one_dimensional():
    m = model()
    groups = fusedopt.param_groups(m, weight_decay=0.1, lr=0.3)
    names = {id(p): n for n, p in m.named_parameters()}
    regular, excluded = groups
    assert sorted(names[id(p)] for p in regular["params"]) == ["0.weight", "2.weight"]
    assert sorted(names[id(p)] for p in excluded["params"]) == ["0.bias", "1.bias", "1.weight", "2.bias"]
    assert regular["weight_decay"] == 0.1 and "adapt" not in regular and regular["lr"] == 0.3
    assert excluded["weight_decay"] == 0.0 and excluded["adapt"] is False and excluded["lr"] == 0.3


@pytest.mark.parametrize("exclude,expected", [
    (("bias",), ["0.bias", "1.bias", "2.bias"]),
    ("^1\\.", ["1.bias", "1.weight"]),
    (lambda name, p: p.shape[0] == 3, ["2.bias", "2.weight"]),
], ids=["patterns", "regex", "callable"])
def test_param_groups_exclude_forms(exclude, expected):
    m = model()
    groups = fusedopt.param_groups(m.named_parameters(), weight_decay=0.1, exclude=exclude)
    names = {id(p): n for n, p in m.named_parameters()}
    assert sorted(names[id(p)] for p in groups[1]["params"]) == expected


def test_param_groups_only_one_of_the_two():
    g = fusedopt.param_groups(model(), weight_decay=0.1, exclude_from_adaptation=False)
    assert g[1]["weight_decay"] == 0.0 and g[1]["adapt"] is True
    g = fusedopt.param_groups(model(), weight_decay=0.1, exclude_from_weight_decay=False)
    assert g[1]["weight_decay"] == 0.1 and g[1]["adapt"] is False


def test_param_groups_full_state_keeps_named_params_in_full_state():
    """The params full_state names get groups of their own with state_precision="full", beside
    the regular and excluded groups; an optimizer stores their moments in float32."""
    m = model()
    names = {id(p): n for n, p in m.named_parameters()}
    groups = fusedopt.param_groups(m, weight_decay=0.1, full_state="^0\\.",
                                   state_precision="8bit", lr=0.3)
    got = [(sorted(names[id(p)] for p in g["params"]), g["state_precision"], g["weight_decay"],
            g.get("adapt", True), g["lr"]) for g in groups]
    assert got == [(["2.weight"], "8bit", 0.1, True, 0.3),
                   (["1.bias", "1.weight", "2.bias"], "8bit", 0.0, False, 0.3),
                   (["0.weight"], "full", 0.1, True, 0.3),
                   (["0.bias"], "full", 0.0, False, 0.3)]
    opt = fusedopt.FusedLAMB(groups, state_min_numel=0, backend="eager")
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    dtypes = {names[id(p)]: st["exp_avg"].dtype for p, st in opt.state.items()}
    assert dtypes["0.weight"] == dtypes["0.bias"] == torch.float32
    assert dtypes["2.weight"] == torch.uint8
    with pytest.raises(TypeError, match="Invalid full_state"):
        fusedopt.param_groups(m, weight_decay=0.1, full_state=3)


def test_param_groups_skip_frozen_and_reject_bad_exclude():
    m = model()
    m[0].weight.requires_grad_(False)
    groups = fusedopt.param_groups(m, weight_decay=0.1)
    assert all(p is not m[0].weight for g in groups for p in g["params"])
    with pytest.raises(TypeError, match="Invalid exclude"):
        fusedopt.param_groups(m, weight_decay=0.1, exclude=3)


@pytest.mark.parametrize("kind", KINDS)
def test_excluded_group_gets_plain_update(kind):
    """adapt=False, weight_decay=0: LAMB's step is lr*u, LARS's the plain momentum step."""
    m = model()
    opt = OPTS[kind](fusedopt.param_groups(m, weight_decay=0.1))
    bias = m[0].bias
    before = bias.detach().clone()
    m(torch.randn(4, 6)).square().mean().backward()
    g = bias.grad.clone()
    opt.step()
    if kind == "lamb":
        expected = before - 1e-2 * g / (g.abs() + 1e-6)
    else:
        expected = before - 0.1 * g
    torch.testing.assert_close(bias.detach(), expected, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- step cache (Note [step cache])
@pytest.mark.parametrize("kind", KINDS)
def test_kept_buckets_follow_replaced_state_tensors_and_grad_changes(kind):
    """Note [step cache]: the lists are gathered at every step; a state tensor replaced by hand
    is updated by the next step, whatever the cache keeps."""
    m = model()
    opt = OPTS[kind](m.parameters())
    train(opt, m, 2)
    assert opt._cache.single, "a steady group should be kept"
    key = "exp_avg" if kind == "lamb" else "momentum_buffer"
    w = m[0].weight
    fresh = torch.zeros_like(opt.state[w][key])
    opt.state[w][key] = fresh  # replaced by hand: the next step must update the new tensor
    train(opt, m, 1)
    assert fresh.abs().sum() > 0
    # a param losing its grad, a non-contiguous grad, and a changed backend all gather again
    m(torch.randn(4, 6)).square().mean().backward()
    m[2].bias.grad = None
    before = m[2].bias.detach().clone()
    m[0].weight.grad = m[0].weight.grad.t().contiguous().t()
    opt.param_groups[0]["backend"] = "eager"
    opt.step()
    assert torch.equal(m[2].bias, before)
    assert opt.state[m[2].bias]["step"].item() == 3 and opt.state[w]["step"].item() == 4


@pytest.mark.parametrize("kind", KINDS)
def test_cached_lists_follow_an_edited_params_list(kind):
    """Replacing a param inside the group's own list (same list object) is seen by the cache."""
    m, other = model(), model()
    opt = OPTS[kind](m.parameters())
    train(opt, m, 2)
    w, new_w = m[0].weight, other[0].weight
    opt.param_groups[0]["params"][0] = new_w
    new_w.grad = torch.ones_like(new_w)
    for p in m.parameters():
        p.grad = None
    before = w.detach().clone()
    opt.step()
    assert torch.equal(w, before)
    assert opt.state[new_w]["step"].item() == 1


@pytest.mark.parametrize("reset", ["del_state", "new_state_dict", "updated", "set_by_default",
                                   "new_mapping", "cleared"])
@pytest.mark.parametrize("backend", backend_params(("eager", "cpp")))
@pytest.mark.parametrize("kind", KINDS)
def test_cached_lists_see_a_state_reset_by_hand(kind, backend, reset):
    """Resetting one param's state, or all of it (``opt.state = defaultdict(dict)``, as some
    training loops do), restarts it on the next step, with the list cache as without it: the
    step then equals a fresh optimizer's, and the optimizer still pickles."""
    m = model()
    opt = OPTS[kind](m.parameters(), backend=backend)
    train(opt, m, 2)
    w = m[0].weight
    key = "exp_avg" if kind == "lamb" else "momentum_buffer"
    if reset == "del_state":
        del opt.state[w]
    elif reset == "new_state_dict":
        opt.state[w] = {}
    elif reset == "updated":
        opt.state.update({w: {}})
    elif reset == "set_by_default":
        opt.state.pop(w)
        assert opt.state.setdefault(w) == {}
    elif reset == "new_mapping":
        opt.state = collections.defaultdict(dict)
    else:
        opt.state.clear()
    fresh = copy.deepcopy(m)
    train(opt, m, 1)
    assert opt.state[w]["step"].item() == 1
    assert opt.state[w][key].abs().sum() > 0
    if reset not in ("new_mapping", "cleared"):
        assert opt.state[m[0].bias]["step"].item() == 3
        return
    train(OPTS[kind](fresh.parameters(), backend=backend), fresh, 1)
    assert all(map(torch.equal, m.parameters(), fresh.parameters()))
    copy.deepcopy(opt)


@pytest.mark.parametrize("change", ["transposed_grad", "bf16_grads"])
@pytest.mark.parametrize("backend", backend_params(("eager", "cpp")))
@pytest.mark.parametrize("kind", KINDS)
def test_kept_bucket_refuses_grads_it_cannot_take(kind, backend, change):
    """Backend.bind(check=False): a grad with other strides or another dtype sends the step down
    the checked path, which gives the same bits as a step without any cache."""
    results = []
    for use_cache in (True, False):
        m = model()
        opt = OPTS[kind](m.parameters(), backend=backend)
        gen = torch.Generator().manual_seed(3)
        for step in range(3):
            opt.zero_grad()
            m(torch.randn(8, 6, generator=gen)).square().mean().backward()
            if step == 2:
                w = m[0].weight
                if change == "transposed_grad":
                    w.grad = w.grad.t().contiguous().t()
                else:
                    for p in m.parameters():
                        g, p.grad = p.grad, None
                        p.grad_dtype = torch.bfloat16  # torch >= 2.10 checks grad dtypes
                        p.grad = g.to(torch.bfloat16)
            if not use_cache:
                opt._fresh()
            opt.step()
        results.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("kind", KINDS)
def test_kept_and_fresh_steps_agree(kind):
    results = []
    for use_cache in (True, False):
        m = model()
        opt = OPTS[kind](m.parameters(), backend="eager")
        gen = torch.Generator().manual_seed(3)
        for _ in range(4):
            opt.zero_grad()
            m(torch.randn(8, 6, generator=gen)).square().mean().backward()
            if not use_cache:
                opt._fresh()
            opt.step()
        results.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("backend", backend_params())
def test_a_param_whose_dtype_changed_after_steps_is_seen_by_the_kept_lists(backend):
    """Note [group plans]: a param made bf16 in place after steps (its state has no master) is
    refused as on a step that gathers its lists afresh, not stepped without a master."""
    errors = []
    for fresh in (False, True):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(8, 4)) for _ in range(3)]
        opt = fusedopt.FusedLAMB(ps, lr=1e-2, backend=backend)
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn_like(p)
            opt.step()
        ps[1].data = ps[1].data.to(torch.bfloat16)
        ps[1].grad = torch.randn_like(ps[1])
        if fresh:
            opt._fresh()
        before = [p.detach().clone() for p in ps]
        with pytest.raises(RuntimeError, match="master weights switched on") as info:
            opt.step()
        errors.append(str(info.value))
        assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert errors[0] == errors[1]


def test_an_empty_param_group_is_skipped():
    """A group without params (torch.optim allows one; DeepSpeed ZeRO-3 empties each group
    between its steps) takes no part in a step."""
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    p.grad = q.grad = torch.full((3,), 0.5)
    opt = fusedopt.FusedLAMB([{"params": [p]}, {"params": []}], lr=0.1)
    ref = fusedopt.FusedLAMB([q], lr=0.1)
    opt.step()
    ref.step()
    assert torch.equal(p, q)
    opt.param_groups[0]["params"] = []
    opt.step()  # nothing to step
    assert torch.equal(p, q)
