"""``torch.compile`` of ``opt.step()`` and of a whole training step: graph breaks, graphs and
recompiles counted with dynamo's own counters, against torch's ``Adam(foreach=True,
capturable=True, lr=tensor)`` run through the same procedure; results against eager mode (bit for
bit on cpp and triton, whose compiled graphs call the same kernels through their operators;
within float32 rounding on eager). Triton runs in its interpreter here (tests/conftest.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import fusedopt

from helpers import backend_params

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


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_skips_a_nonfinite_step(backend):
    """skip_nonfinite inside the compiled step: a NaN gradient changes nothing and is counted."""
    model = _model()
    opt = _fused("lamb", backend, model)
    step = torch.compile(opt.step)
    x, y = _data()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    step()
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
