"""``torch.compile`` of ``opt.step()`` and of a whole training step: graph breaks, graphs and
recompiles counted with dynamo's own counters, against torch's ``Adam(foreach=True,
capturable=True, lr=tensor)`` run through the same procedure; results against eager mode (bit for
bit on cpp and triton, whose compiled graphs call the same kernels through their operators;
within float32 rounding on eager). Triton runs in its interpreter here (tests/conftest.py)."""
from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
import torch._dynamo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import fusedopt
from fusedopt import backends

import test_adversarial as adversarial
from helpers import backend_params, bits_equal

BACKENDS = backend_params(("eager", "cpp", "triton"))

STEPS = 8


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4)).to(dtype)


def _fused(kind, backend, model, **kw):
    groups = fusedopt.param_groups(model, weight_decay=0.01)
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    return cls(groups, lr=torch.tensor(0.01), max_grad_norm=1.0, backend=backend,
               skip_nonfinite=True, **kw)


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), foreach=True,
                            capturable=True)


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g).to(dtype), torch.randint(0, 4, (8,), generator=g)


def _run(model, opt, *, whole: bool, compiled: bool, scaler=None):
    """The procedure: STEPS steps with a LambdaLR changing the tensor lr every step; returns
    (graph breaks, graphs, frames compiled) from dynamo's counters."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    x, y = _data(next(model.parameters()).dtype)

    def opt_step():
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()

    def train_step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        opt_step()
        opt.zero_grad()
        return loss

    torch._dynamo.reset()
    counters.clear()
    step_fn = torch.compile(opt_step) if compiled and not whole else opt_step
    train_fn = torch.compile(train_step) if compiled and whole else None
    for _ in range(STEPS):
        if whole:
            (train_fn or train_step)(x, y)
        else:
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            (loss if scaler is None else scaler.scale(loss)).backward()
            step_fn()
        sched.step()
    breaks = sum(counters["graph_break"].values())
    return breaks, counters["stats"]["unique_graphs"], counters["frames"]["ok"]


@pytest.fixture(scope="module")
def adam_counts():
    """torch's Adam through the procedure: {whole: (breaks, graphs, frames)}."""
    out = {}
    for whole in (False, True):
        model = _model()
        out[whole] = _run(model, _adam(model), whole=whole, compiled=True)
    return out


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("whole", [False, True], ids=["step", "train_step"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_is_as_clean_as_torch_adam_and_matches_eager(backend, kind, whole,
                                                                   adam_counts):
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = _fused(kind, backend, model)
    breaks, graphs, frames = _run(model, opt, whole=whole, compiled=True)
    a_breaks, a_graphs, a_frames = adam_counts[whole]
    assert breaks <= a_breaks, f"{breaks} graph breaks against torch Adam's {a_breaks}: {dict(counters['graph_break'])}"
    assert graphs <= a_graphs, f"{graphs} graphs against torch Adam's {a_graphs}"
    # frames compiled: the first step's, none after (an LR change recompiling would add frames)
    assert frames <= a_frames, f"{frames} frames compiled against torch Adam's {a_frames}"
    ref_opt = _fused(kind, backend, ref_model)
    _run(ref_model, ref_opt, whole=whole, compiled=False)
    for p, q in zip(_params(model), _params(ref_model)):
        if backend in ("cpp", "triton") and not whole:  # the same kernels, compiled or not
            assert torch.equal(p, q)
        else:  # eager's foreach ops fused by inductor; a compiled model's own grads round apart
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    assert int(opt.skipped_steps) == 0


@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_with_bf16_masters_matches_eager(backend, kind):
    model = _model(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = _fused(kind, backend, model)
    breaks, graphs, _ = _run(model, opt, whole=False, compiled=True)
    assert (breaks, graphs) <= (2, 1), dict(counters["graph_break"])
    assert all(s["master_param"].dtype == torch.float32 for s in opt.state.values())
    ref_opt = _fused(kind, backend, ref_model)
    _run(ref_model, ref_opt, whole=False, compiled=False)
    for p, q in zip(_params(model), _params(ref_model)):
        if backend in ("cpp", "triton"):
            assert torch.equal(p, q)
        else:  # one bf16 ulp where float32 rounding of the masters crosses a rounding boundary
            torch.testing.assert_close(p, q, rtol=2 ** -7, atol=1e-6)


def _conv_model(channels_last: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 8, 3), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(1, 3))
    return model.to(memory_format=torch.channels_last) if channels_last else model


@pytest.mark.parametrize("kind,precision", [("lars", "full"), ("lamb", "bf16")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_channels_last_model_compiles_as_its_contiguous_twin(backend, kind, precision):
    """A convolutional net in channels_last (LARS's ResNet setting): the compiled step has the
    graph breaks, graphs and frames of the same net in contiguous memory, and both step as their
    uncompiled runs do (the overlap check of a non-contiguous param broke the graph at every
    step, and the step ran eagerly)."""
    x = torch.randn(8, 16, 5, 5, generator=torch.Generator().manual_seed(1))
    runs = {}
    for channels_last in (False, True):
        for compiled in (False, True):
            model = _conv_model(channels_last)
            assert all(p.is_contiguous() != (channels_last and p.dim() == 4)
                       for p in model.parameters())
            cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
            opt = cls(model.parameters(), lr=torch.tensor(0.1), backend=backend,
                      state_precision=precision, state_min_numel=0)

            torch._dynamo.reset()
            counters.clear()
            step = torch.compile(opt.step) if compiled else opt.step
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            for _ in range(4):
                opt.zero_grad()
                model(x.to(memory_format=torch.channels_last if channels_last
                           else torch.contiguous_format)).square().sum().backward()
                step()
                sched.step()
            runs[channels_last, compiled] = (
                [p.detach().clone() for p in model.parameters()],
                (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                 counters["frames"]["ok"]))
    assert runs[True, True][1] == runs[False, True][1], dict(counters["graph_break"])
    for channels_last in (False, True):
        for p, q in zip(runs[channels_last, True][0], runs[channels_last, False][0]):
            if backend == "eager":  # foreach ops fused by inductor
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(p, q)


@pytest.mark.parametrize("precision", ["full", "8bit"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_grads_laid_out_otherwise_than_their_params_compile(backend, precision):
    """Grads set by hand with other strides than their params (a transposed grad of a contiguous
    param, a contiguous one of a transposed or channels_last param, both transposed): the
    compiled step equals the uncompiled one (dynamo gave such grads symbolic strides, and the
    step's comparison of strides failed inside dynamo)."""
    def run(compiled):
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(5, 4, generator=gen)),
              torch.nn.Parameter(torch.randn(5, 4, generator=gen).t()),
              torch.nn.Parameter(torch.randn(2, 3, 4, 5, generator=gen)
                                 .to(memory_format=torch.channels_last)),
              torch.nn.Parameter(torch.randn(7, 6, generator=gen).t())]
        opt = fusedopt.FusedLAMB(ps, lr=0.1, backend=backend, state_precision=precision,
                                 state_min_numel=0)
        step = torch.compile(opt.step) if compiled else opt.step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 8-bit: the non-contiguous params keep bf16 state
            for _ in range(3):
                grads = [torch.randn(4, 5, generator=gen).t(), torch.randn(4, 5, generator=gen),
                         torch.randn(2, 3, 4, 5, generator=gen),
                         torch.randn(7, 6, generator=gen).t()]
                for p, g in zip(ps, grads):
                    p.grad = g
                step()
        return [p.detach().clone() for p in ps] + _state(opt)

    _assert_same(backend, run(True), run(False))


@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_under_grad_scaler_matches_eager(backend, kind, adam_counts):
    """GradScaler's ``scaler.step(opt)`` and ``scaler.update()`` (the optimizer unscales as it
    reads: no host sync) inside the compiled function: no more breaks and graphs than torch's Adam
    without a scaler (torch's ``Adam(fused=True)``, which unscales itself too, compiles to no graph
    at all under the scaler: every frame breaks)."""
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = _fused(kind, backend, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    breaks, graphs, _ = _run(model, opt, whole=False, compiled=True, scaler=scaler)
    a_breaks, a_graphs, _ = adam_counts[False]
    assert breaks <= a_breaks and graphs <= a_graphs, (breaks, graphs, a_breaks, a_graphs)
    ref_opt = _fused(kind, backend, ref_model)
    _run(ref_model, ref_opt, whole=False, compiled=False,
         scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    assert float(scaler.get_scale()) > 0
    for p, q in zip(_params(model), _params(ref_model)):
        if backend in ("cpp", "triton"):
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _compiled_after_a_step(backend):
    """A model, its LAMB optimizer and ``torch.compile(opt.step)``, after one compiled step."""
    model = _model()
    opt = _fused("lamb", backend, model)
    step = torch.compile(opt.step)
    x, y = _data()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    step()
    return model, opt, step


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_skips_a_nonfinite_step(backend):
    """skip_nonfinite inside the compiled step: a NaN gradient changes nothing and is counted."""
    model, opt, step = _compiled_after_a_step(backend)
    before = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for s in opt.state.values() for v in s.values()]
    next(model.parameters()).grad[0, 0] = float("nan")
    step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    after = [v for s in opt.state.values() for v in s.values()]
    assert len(after) == len(state) and all(map(torch.equal, state, after))
    assert int(opt.skipped_steps) == 1


@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", backend_params(("cpp", "triton")))
def test_the_compiled_graph_calls_the_backend_operators(backend, kind):
    """The fused backends are operators in the traced graph (torch.library), not graph breaks:
    both passes and the clipping norms appear as ``torch.ops.fusedopt`` calls."""
    model = _model()
    opt = _fused(kind, backend, model)
    x, y = _data()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    targets = set()

    def record(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    torch.compile(opt.step, backend=record)()
    prefix = "fusedopt.triton_" if backend == "triton" else "fusedopt."
    expected = {f"{prefix}{name}" for name in (f"{kind}_pass1", f"{kind}_pass2", "sq_norms")}
    assert expected <= targets, sorted(t for t in targets if "fusedopt" in t)
    assert sum(counters["graph_break"].values()) <= 1, dict(counters["graph_break"])


@pytest.mark.parametrize("backend", backend_params(("cpp", "triton")))
def test_traced_flat_state_is_one_graph_input_per_storage(backend):
    """Note [traced flat state]: the state of a group lies on one storage per key; a traced step
    takes each storage once (as a graph input) and views it in the graph, so no two inputs of the
    compiled graph share a storage (AOTAutograd would clone aliased inputs the step writes)."""
    model = _model()
    opt = _fused("lamb", backend, model)
    x, y = _data()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # the state exists, flat
    storages = {id(s["exp_avg"]): s["exp_avg"].untyped_storage().data_ptr()
                for s in opt.state.values()}
    assert len(set(storages.values())) < len(storages)  # shared: what the note is about
    seen = []

    def record(gm, example_inputs):
        seen.extend(t.untyped_storage().data_ptr() for t in example_inputs
                    if isinstance(t, torch.Tensor) and t.numel())
        return gm.forward

    torch._dynamo.reset()
    torch.compile(opt.step, backend=record)()
    # the groups' tensor lr: one tensor and its view per group (Note [shared tensor lr]), read only
    lrs = {g["lr"].untyped_storage().data_ptr() for g in opt.param_groups}
    seen = [s for s in seen if s not in lrs]
    assert seen and len(seen) == len(set(seen)), "graph inputs share a storage"


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_steps_across_a_checkpoint_match_eager(backend):
    """A compiled step after ``load_state_dict`` of a ``torch.save``d state (new tensors, on new
    storages that ``torch.load`` shares as saved) recompiles on the loaded state and goes on
    exactly as an uncompiled optimizer does."""
    import io

    models = [_model(), _model()]
    opts = [_fused("lamb", backend, m) for m in models]
    x, y = _data()
    torch._dynamo.reset()
    compiled = torch.compile(opts[0].step)

    def run(i, n):
        for _ in range(n):
            opts[i].zero_grad()
            torch.nn.functional.cross_entropy(models[i](x), y).backward()
            compiled() if i == 0 else opts[1].step()

    for i in (0, 1):
        run(i, 2)
        buf = io.BytesIO()
        torch.save(opts[i].state_dict(), buf)
        buf.seek(0)
        opts[i].load_state_dict(torch.load(buf))
        run(i, 2)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        if backend in ("cpp", "triton"):
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert float(next(iter(opts[0].state.values()))["step"]) == 4


@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_with_a_number_lr_matches_eager(backend, kind):
    """A Python-number lr (a constant of the graph) reaches the update as it does uncompiled."""
    models = [_model(), _model()]
    groups = [fusedopt.param_groups(m, weight_decay=0.01) for m in models]
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opts = [cls(g, lr=0.05, backend=backend) for g in groups]
    x, y = _data()
    torch._dynamo.reset()
    steps = [torch.compile(opts[0].step), opts[1].step]
    for model, opt, step in zip(models, opts, steps):
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            step()
    start = _model()
    for p, q, s in zip(models[0].parameters(), models[1].parameters(), start.parameters()):
        assert not torch.equal(p, s)
        if backend in ("cpp", "triton"):
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- scheduled float options (Note [traced options])
SCHEDULES = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    # cycles lr and the momentum (LARS) or beta1 (LAMB) of every group
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[2 * g["lr"] for g in opt.param_groups], total_steps=40,
        cycle_momentum=True, base_momentum=0.8, max_momentum=0.95),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7),
}
SCHEDULED_STEPS = 22


def _scheduled_run(kind, backend, groups, schedule, compiled, whole=False):
    """SCHEDULED_STEPS steps of a model whose every float option changes at every step: ``lr``
    (and beta1 / momentum) by a torch scheduler, ``weight_decay`` and ``eps`` (and LARS's
    ``trust_coefficient``) by hand, as a user's schedule would. Returns the model, the optimizer
    and dynamo's (frames compiled, graphs, graph breaks)."""
    model = _model()
    params = (fusedopt.param_groups(model, weight_decay=0.01) if groups == "param_groups"
              else [{"params": list(model.parameters()), "weight_decay": 0.01}])
    if kind == "lamb":
        opt = fusedopt.FusedLAMB(params, lr=0.01, max_grad_norm=1.0, backend=backend)
    else:
        opt = fusedopt.FusedLARS(params, lr=0.1, max_grad_norm=1.0, backend=backend)
    sched = SCHEDULES[schedule](opt)
    x, y = _data()

    def train_step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def opt_step():
        opt.step()

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(opt_step) if compiled and not whole else opt_step
    train = torch.compile(train_step) if compiled and whole else None
    half = None
    for i in range(SCHEDULED_STEPS):
        if i == SCHEDULED_STEPS // 2:
            half = counters["frames"]["ok"]
        if whole:
            (train or train_step)()
        else:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            step()
        sched.step()
        for g in opt.param_groups:  # new values from the first step on, as the scheduler's
            if g["weight_decay"]:
                g["weight_decay"] = 0.01 * (1 + 0.1 * (i + 1))
            g["eps"] = (1e-6 if kind == "lamb" else 1e-8) * (2 + i)
            if kind == "lars":
                g["trust_coefficient"] = 0.001 * (1 + 0.05 * (i + 1))
    return model, opt, (counters["frames"]["ok"] - half, counters["stats"]["unique_graphs"],
                        sum(counters["graph_break"].values()))


def _assert_same(backend, a, b, whole=False):
    for p, q in zip(a, b):
        if backend in ("cpp", "triton") and not whole:  # the same kernels, compiled or not
            assert torch.equal(p, q), (p - q).abs().max()
        else:  # eager's ops fused by inductor; a compiled model's own grads round apart
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _state(opt):
    return [v for s in opt.state.values() for v in s.values()]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("groups", ["one", "param_groups"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scheduled_float_options_compiled_equal_uncompiled(backend, kind, groups, schedule):
    """A compiled step equals the uncompiled one (bit for bit on cpp and triton), over a run in
    which a scheduler changes lr (OneCycleLR also beta1 / momentum) and weight_decay, eps and
    trust_coefficient change by hand, on one group and on the groups of param_groups; and it
    compiles a few graphs in all, not one per value: the float options are graph inputs."""
    if backend == "triton" and schedule != "onecycle":
        pytest.skip("triton runs under its interpreter here: the one schedule that changes the "
                    "most options stands for the others")
    model, opt, (frames, graphs, breaks) = _scheduled_run(kind, backend, groups, schedule, True)
    ref_model, ref_opt, _ = _scheduled_run(kind, backend, groups, schedule, False)
    _assert_same(backend, model.parameters(), ref_model.parameters())
    _assert_same(backend, _state(opt), _state(ref_opt))
    assert all(float(s["step"]) == SCHEDULED_STEPS for s in opt.state.values())
    # the first values are constants of the first graph; dynamo makes the options that changed
    # inputs of the second, which every later value runs (an option that first changed later
    # would cost one more graph, once)
    assert graphs <= 2 and frames == 0, (frames, graphs, breaks)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scheduled_options_in_a_compiled_training_step(backend, kind):
    """The same run with the whole training step (forward, backward, step) compiled."""
    model, opt, (frames, graphs, _) = _scheduled_run(kind, backend, "param_groups", "onecycle",
                                                     True, whole=True)  # frames: second half
    ref_model, ref_opt, _ = _scheduled_run(kind, backend, "param_groups", "onecycle", False)
    _assert_same(backend, model.parameters(), ref_model.parameters(), whole=True)
    # the forward and backward, and the step: its first values constants, then inputs
    assert graphs <= 3 and frames == 0, (frames, graphs)


def test_torch_adam_recompiles_where_the_fused_step_does_not():
    """The comparison the issue states: torch's Adam with a float lr under the same schedule
    compiles a graph per value until dynamo's limit (then runs uncompiled)."""
    model = _model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    sched = SCHEDULES["lambda"](adam)
    x, y = _data()
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(adam.step)
    for _ in range(SCHEDULED_STEPS):
        adam.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        step()
        sched.step()
    assert counters["stats"]["unique_graphs"] > 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_refuses_a_bad_tensor_lr_and_changes_nothing(backend):
    """A nan or negative tensor lr that replaced the old one after compiling is refused, as by the
    uncompiled step, with nothing changed; a good one after it steps again (Note [group plans],
    Note [shared tensor lr]: the two groups start with one shared tensor lr)."""
    model, opt, step = _compiled_after_a_step(backend)
    step()
    for bad in (float("nan"), -1.0, float("inf")):
        opt.param_groups[1]["lr"] = torch.tensor(bad)
        params = [p.detach().clone() for p in model.parameters()]
        state = [v.clone() for v in _state(opt)]
        with pytest.raises(ValueError, match="param group 1: Invalid lr: a tensor lr holds"):
            step()
        assert all(map(torch.equal, params, model.parameters()))
        assert all(map(torch.equal, state, _state(opt)))
    opt.param_groups[1]["lr"] = torch.tensor(0.0)  # a new tensor: read, then used
    bias = fusedopt.param_groups(model, weight_decay=0.01)[1]["params"][0]
    before = bias.detach().clone()
    step()
    assert torch.equal(bias, before)  # lr 0 for the group of the biases
    assert all(float(s["step"]) == 3 for s in opt.state.values())


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("backend", backend_params(("eager", "cpp")))
def test_a_list_option_edited_in_place_is_checked_again(backend, compiled):
    """betas given as a list (as a config file gives them) and edited in place between steps:
    an invalid item is refused with nothing changed, compiled as uncompiled (BAD_INPUTS'
    *_edited_in_place rows check the uncompiled step on every kind), and a valid one is used."""
    model = _model()
    opt = fusedopt.FusedLAMB(fusedopt.param_groups(model, weight_decay=0.01),
                             lr=torch.tensor(0.01), betas=[0.9, 0.999], backend=backend)
    step = torch.compile(opt.step) if compiled else opt.step
    x, y = _data()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    step()
    opt.param_groups[1]["betas"][0] = 1.5  # the list shared by both groups
    params = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for v in _state(opt)]
    with pytest.raises(ValueError, match=r"param group 0: Invalid beta1: 1\.5"):
        step()
    assert all(map(torch.equal, params, model.parameters()))
    assert all(map(torch.equal, state, _state(opt)))
    opt.param_groups[0]["betas"][0] = 0.0  # m = (1 - 0)·g: the step reads the edited list
    step()
    for p in model.parameters():
        assert torch.equal(opt.state[p]["exp_avg"], p.grad)


@pytest.mark.parametrize("backend", backend_params(("eager", "cpp")))
def test_state_replaced_by_a_new_mapping_between_compiled_steps(backend):
    """``opt.state = defaultdict(dict)`` between compiled steps (a reset, as some training loops
    make it) restarts every param's state, as uncompiled, and an uncompiled step after it too."""
    runs = []
    for compiled in (True, False):
        model = _model()
        opt = _fused("lamb", backend, model)
        step = torch.compile(opt.step) if compiled else opt.step
        x, y = _data()
        for i in range(4):
            if i == 2:
                opt.state = collections.defaultdict(dict)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            (step if i < 3 else opt.step)()
        assert all(float(s["step"]) == 2 for s in opt.state.values())
        runs.append([p.detach().clone() for p in model.parameters()] + _state(opt))
    _assert_same(backend, *runs)


def _masters_switched_off(backend, compiled):
    """Two steps with masters, two after master weights were switched off (which drop the
    stale masters), then one refused (switched on again: no master to restore) that changes
    nothing; returns the params."""
    model = _model(torch.bfloat16)
    opt = _fused("lamb", backend, model)
    step = torch.compile(opt.step) if compiled else opt.step
    x, y = _data(torch.bfloat16)

    def run(n):
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x).float(), y).backward()
            step()

    run(2)
    for g in opt.param_groups:
        g["master_weights"] = False
    run(2)
    assert not any("master_param" in s for s in opt.state.values())
    for g in opt.param_groups:
        g["master_weights"] = None
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="has no state tensor 'master_param'"):
        run(1)
    assert all(map(torch.equal, params, model.parameters()))
    return params


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_bf16_step_after_masters_are_switched_off(backend):
    """Master weights switched off between compiled steps (two groups): the next steps update the
    bf16 params themselves, as uncompiled, and drop the stale masters; switched on again, the
    step refuses and changes nothing."""
    _assert_same(backend, _masters_switched_off(backend, True),
                 _masters_switched_off(backend, False))


def test_a_step_frame_that_dynamo_gives_up_on_runs_eagerly(monkeypatch):
    """Note [fallen back]: dynamo traces step() but gives up on the frame it calls (here told to
    skip it, as it does at its recompile limit, which every optimizer's compiles count towards)
    and would compile the frames that one calls each on its own: the step runs eagerly instead,
    dropping stale masters and refusing as uncompiled. (A skipped step() itself is what the
    refused-value tests above reach.)"""
    torch._dynamo.reset()
    monkeypatch.setattr(fusedopt.FusedLAMB, "_step",
                        torch.compiler.disable(fusedopt.FusedLAMB._step, recursive=False))
    try:
        _assert_same("cpp", _masters_switched_off("cpp", True),
                     _masters_switched_off("cpp", False))
    finally:
        torch._dynamo.reset()  # nothing compiled around the skipped frame outlives the test


@pytest.mark.parametrize("compiled", [False, True])
def test_a_shared_tensor_lr_becomes_a_view_per_group(compiled):
    """Note [shared tensor lr]: the constructor's tensor lr, shared by the groups, is a view per
    group after the first: the same storage, so a scheduler's in-place change reaches them all;
    one tensor put into two groups by hand is separated at the next step, compiled or not."""
    model = _model()
    lr = torch.tensor(0.01)
    opt = fusedopt.FusedLAMB(fusedopt.param_groups(model, weight_decay=0.01), lr=lr)
    step = torch.compile(opt.step) if compiled else opt.step
    g0, g1 = opt.param_groups
    assert g0["lr"] is lr and g1["lr"] is not lr
    assert g1["lr"].untyped_storage().data_ptr() == lr.untyped_storage().data_ptr()
    torch.nn.functional.cross_entropy(model(_data()[0]), _data()[1]).backward()
    step()
    lr.fill_(0.5)
    assert float(g1["lr"]) == 0.5
    g1["lr"] = g0["lr"]  # shared again by hand: separated at the next step
    step()
    assert g1["lr"] is not g0["lr"] and float(g1["lr"]) == 0.5
    assert g1["lr"].untyped_storage().data_ptr() == lr.untyped_storage().data_ptr()


_option_values = st.tuples(st.floats(1e-4, 0.1), st.floats(0.5, 0.99), st.floats(0.0, 0.1),
                           st.floats(1e-8, 1e-3))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["lamb", "lars"]), schedule=st.lists(_option_values, min_size=4,
                                                                  max_size=6))
def test_compiled_step_equals_uncompiled_for_drawn_option_schedules(kind, schedule):
    """Property: whatever values lr, beta1 / momentum, weight_decay and eps take from step to step
    (set on every group, as schedulers set them), the compiled cpp step gives the uncompiled
    step's bits."""
    if backends.get_backend("cpp") is None:
        pytest.skip(f"the cpp backend is not available: {backends.load_error('cpp')}")
    runs = []
    for compiled in (True, False):
        model = _model()
        cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
        opt = cls(fusedopt.param_groups(model, weight_decay=0.01), lr=0.01, max_grad_norm=1.0,
                  backend="cpp")
        step = torch.compile(opt.step) if compiled else opt.step
        x, y = _data()
        for lr, mom, wd, eps in schedule:
            for g in opt.param_groups:
                g["lr"], g["eps"] = lr, eps
                if kind == "lamb":
                    g["betas"] = (mom, g["betas"][1])
                else:
                    g["momentum"] = mom
                if g["weight_decay"]:
                    g["weight_decay"] = wd
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            step()
        runs.append([p.detach().clone() for p in model.parameters()] + _state(opt))
    assert all(map(torch.equal, *runs))


@pytest.mark.parametrize("low", [False, True], ids=["full", "low_precision"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@settings(max_examples=4, **adversarial.SETTINGS)
@given(data=st.data())
def test_compiled_step_equals_uncompiled_on_random_configs(kind, low, data):
    """The adversarial suite's random configs (0-size and 0-dim shapes, transposed and sliced
    params, transposed, sliced and stride-0 grads, every dtype, master weights on, off and auto,
    several groups, full or low-precision state), with a float lr changed at every step: the
    compiled cpp step gives the uncompiled step's bits. Grads take their param's dtype: dynamo
    cannot trace a param whose grad_dtype differs (torch's Adam neither)."""
    if backends.get_backend("cpp") is None:
        pytest.skip(f"the cpp backend is not available: {backends.load_error('cpp')}")
    cfg = data.draw(adversarial.config_st(kind, low=low))
    for gs in cfg.groups:
        gs.grad_dtype = gs.dtype
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        run = adversarial.Run(cfg, "cpp")
        step = torch.compile(run.opt.step) if compiled else run.opt.step
        for _ in range(3):
            run.set_grads()
            for g in run.opt.param_groups:
                if not isinstance(g["lr"], torch.Tensor):
                    g["lr"] = g["lr"] * 0.9
            step()
            run.steps_done += 1
        ps = run.all_params()
        runs.append([p.detach().clone() for p in ps]
                    + [v for p in ps for v in (run.opt.state.get(p) or {}).values()])
    assert len(runs[0]) == len(runs[1])
    assert all(map(bits_equal, *runs)), cfg


def test_dtensor_params_put_into_a_group_in_place_step_as_uncompiled():
    """A DTensor param appended to a group's list in place (not by add_param_group, which marks
    the optimizer as sharded) between compiled steps: the trace finds it, the step runs eagerly
    (local shards are made per step, which a graph cannot take as inputs), running torch's step
    hooks once, and every step gives the uncompiled step's bits (a fake process group of one
    rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (1,))

        def run(compiled):
            torch._dynamo.reset()
            gen = torch.Generator().manual_seed(0)
            plain = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
            dt = torch.nn.Parameter(DTensor.from_local(torch.randn(6, 2, generator=gen), mesh,
                                                       [Shard(0)], run_check=False))
            opt = fusedopt.FusedLAMB([plain], lr=0.1, backend="cpp")
            calls = []
            opt.register_step_pre_hook(lambda *_: calls.append("pre"))
            opt.register_step_post_hook(lambda *_: calls.append("post"))
            step = torch.compile(opt.step) if compiled else opt.step
            for s in range(3):
                plain.grad = torch.randn(4, 3, generator=gen)
                dt.grad = DTensor.from_local(torch.randn(6, 2, generator=gen), mesh, [Shard(0)],
                                             run_check=False)
                if s == 1:
                    opt.param_groups[0]["params"].append(dt)
                step()
            assert calls == ["pre", "post"] * 3  # torch's step hooks once per step
            return [plain.detach().clone(), dt.to_local().detach().clone()]

        assert all(map(torch.equal, run(False), run(True)))
    finally:
        dist.destroy_process_group()
