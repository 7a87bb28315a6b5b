"""Bad input gets a clear error and changes nothing, in every group (each fault of the hardening
issue is a row of fusedopt.testing.BAD_INPUTS; tests/test_adversarial.py searches for more), and
the edits users make that are not faults keep working.

A row is one fault: how it is built (most edit the LATER group of an optimizer of two groups
stepped twice, so that a step that checked group 1 only after writing group 0 would show), the
exception type and a message that names the group, param and option. Each row runs per kind on
the eager backend: the checks are the engine's, in Python, before any backend runs. The rows whose
fault lies in tensors kept from earlier steps (``backend_matters``: the cpp backend's kept layout
vouches for them in C++ in place of the Python checks, Note [kept buckets] in
fusedopt/functional.py) run on the cpp backend too; the other backends run the SMOKE rows."""
import threading

import pytest
import torch

import fusedopt
from fusedopt.testing import BAD_INPUTS, KINDS, OPTIMIZERS, changed, snapshot, two_group_optimizer
from helpers import backend_mark, backend_params

BACKENDS = backend_params(("eager", "cpp"))
CLS = OPTIMIZERS
# the row each other backend runs besides (Triton's interpreter takes ~0.1 s a step): an option,
# and for Triton a state entry that is not a tensor, refused before the backend reads a data
# pointer (its pointer tables were once built before the engine's checks)
SMOKE = {"cpp": ("set:lr=-1",), "triton": ("state_none",)}


def _bad_input_params():
    out = []
    for row in BAD_INPUTS:
        for kind in row.kinds:
            for backend in ("eager", "cpp", "triton"):
                if backend == "eager" or (backend == "cpp" and row.backend_matters) \
                        or row.name in SMOKE[backend]:
                    out.append(pytest.param(row, kind, backend, id=f"{kind}-{row.name}-{backend}",
                                            marks=backend_mark(backend)))
    return out


@pytest.mark.filterwarnings("ignore:(invalid value|divide by zero):RuntimeWarning")
@pytest.mark.parametrize("row,kind,backend", _bad_input_params())
def test_bad_input_is_refused_naming_it_and_changes_nothing(row, kind, backend):
    trial = row.make(kind, backend)
    before = snapshot(trial.watched)
    with pytest.raises(row.exc, match=row.message(kind)):
        trial.call()
    differences = changed(before, snapshot(trial.watched))
    assert not differences, f"the refused call changed {differences}"


# ------------------------------------------------------------ edits that are not faults
@pytest.mark.parametrize("step", [2, 2.0, torch.tensor(2), torch.tensor([2.0]), torch.tensor([[2]])],
                         ids=["int", "float", "int64", "shape1", "shape11"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_loaded_step_of_any_old_format_is_converted(kind, backend, step):
    """One rule on every backend: a float32 0-dim tensor; load_state_dict converts (a step of
    another format set by hand is refused: BAD_INPUTS' step_* rows)."""
    opt, groups = two_group_optimizer(kind, backend)
    sd = opt.state_dict()
    for st in sd["state"].values():
        st["step"] = step
    opt.load_state_dict(sd)
    for p in (p for g in groups for p in g):
        s = opt.state[p]["step"]
        assert s.dtype == torch.float32 and s.dim() == 0 and s.item() == 2
    opt.step()
    assert opt.state[groups[1][0]]["step"].item() == 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_lr_tensor_of_one_element_any_shape_runs_alike(kind, backend):
    results = []
    for lr in (0.1, torch.tensor(0.1), torch.tensor([0.1]), torch.tensor([[0.1]])):
        opt, groups = two_group_optimizer(kind, backend, lr=lr)
        results.append([p.detach().clone() for g in groups for p in g])
    for r in results[1:]:
        for a, b in zip(results[0], r):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_float64_params_take_values_that_overflow_float32(kind, backend):
    """What float32 math refuses (a weight_decay of 1e40, beyond float32; LAMB's eps=1e-300,
    below its smallest normal), float64 params take: the same edit of a float32 optimizer's later
    group raises and changes nothing, a float64 one steps to finite params; LARS's momentum=1e39
    gives float64's buffer, 1e39·b + d, bit for bit."""
    edits = [("weight_decay", 1e40)] + ([("eps", 1e-300)] if kind == "lamb" else [])
    for name, value in edits:
        opt32, groups32 = two_group_optimizer(kind, backend)
        opt32.param_groups[1][name] = value
        before = snapshot([opt32])
        with pytest.raises(ValueError, match=name):
            opt32.step()
        assert not changed(before, snapshot([opt32]))
        opt, groups = two_group_optimizer(kind, backend, dtype=torch.float64)
        opt.param_groups[1][name] = value
        old = [p.detach().clone() for g in groups for p in g]
        opt.step()
        new = [p.detach() for g in groups for p in g]
        assert all(torch.isfinite(p).all() for p in new), value
        assert not torch.equal(old[2], new[2]), value  # the edited group stepped
    if kind == "lars":
        with pytest.raises(ValueError, match="momentum"):
            CLS[kind]([torch.nn.Parameter(torch.randn(3))], lr=0.1, momentum=1e39,
                      backend=backend)
        p = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
        opt = CLS[kind]([p], lr=1.0, momentum=1e39, weight_decay=0.0, adapt=False,
                        backend=backend)
        grads = [torch.randn(3, dtype=torch.float64) for _ in range(2)]
        for g in grads:
            p.grad = g.clone()
            opt.step()
        assert torch.equal(opt.state[p]["momentum_buffer"], grads[0] * 1e39 + grads[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_masters_turned_off_step_the_param_itself(backend):
    """From the step that turns master weights off, the bf16 param is the weight: the update reads
    it, not the (more precise, now stale) fp32 master, which the step drops (turning masters
    back on then names the missing master: BAD_INPUTS' stale_master_turned_back_on)."""
    p = torch.nn.Parameter(torch.randn(6, dtype=torch.bfloat16))
    opt = fusedopt.FusedLARS([p], lr=1.0, weight_decay=0.01, adapt=False, backend=backend)
    p.grad = torch.randn(6, dtype=torch.bfloat16)
    opt.step()
    assert not torch.equal(opt.state[p]["master_param"], p.float())  # the master is more precise
    opt.param_groups[0]["master_weights"] = False
    v = opt.state[p]["momentum_buffer"].clone()
    p.grad = torch.randn(6, dtype=torch.bfloat16)
    expected = 0.9 * v + (p.grad.float() + 0.01 * p.float())
    opt.step()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], expected, rtol=1e-6, atol=1e-7)
    assert "master_param" not in opt.state[p]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_state_tensor_missing_past_the_first_params_is_named(kind, backend):
    """A moment deleted from the third of three float32 params: the step refuses naming that
    param and key, and changes nothing (the search for the missing key passes params that lack
    only a master, which float32 params need not have)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, generator=gen)) for _ in range(3)]
    opt = OPTIMIZERS[kind](params, lr=0.1, backend=backend)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(4, generator=gen)
        opt.step()
    key = "exp_avg" if kind == "lamb" else "momentum_buffer"
    del opt.state[params[2]][key]
    before = snapshot([opt])
    with pytest.raises(RuntimeError, match=f"param 2 of param group 0 has no state tensor '{key}'"):
        opt.step()
    assert changed(before, snapshot([opt])) == []


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_keeps_the_constructed_backend(kind):
    """The backend is how this process runs, not state: loading another optimizer's state, or a
    state dict naming a backend that does not exist, keeps the groups' own (and steps)."""
    if fusedopt.backends.get_backend("cpp") is None:
        pytest.skip(f"needs the cpp backend: {fusedopt.backends.load_error('cpp')}")
    eager, _ = two_group_optimizer(kind, "eager")
    opt, _ = two_group_optimizer(kind, "cpp")
    opt.load_state_dict(eager.state_dict())
    assert [g["backend"] for g in opt.param_groups] == ["cpp", "cpp"]
    sd = opt.state_dict()
    sd["param_groups"][1]["backend"] = "bogus"
    opt.load_state_dict(sd)
    assert [g["backend"] for g in opt.param_groups] == ["cpp", "cpp"]
    opt.step()


@pytest.mark.parametrize("backend", BACKENDS)
def test_adam_state_warm_starts_lamb(backend):
    """Adam's exp_avg, exp_avg_sq and step mean what LAMB's do: its state loads into FusedLAMB
    and the moments go on from it (documented in docs/api.md)."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    adam = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.randn(4, 3)
    adam.step()
    lamb = fusedopt.FusedLAMB([p], lr=0.1, backend=backend)
    lamb.load_state_dict(adam.state_dict())
    m = adam.state[p]["exp_avg"].clone()
    lamb.step()
    assert lamb.state[p]["step"].item() == 2
    torch.testing.assert_close(lamb.state[p]["exp_avg"], 0.9 * m + 0.1 * p.grad)


# ---------------------------------------------------------------------- threads
# (several threads on one optimizer: tests/test_adversarial.py, test_four_threads_one_optimizer)
@pytest.mark.parametrize("backend", BACKENDS)
def test_separate_optimizers_in_threads_match_sequential(backend):
    def run(threaded):
        opts, params = [], []
        for i in range(3):
            gen = torch.Generator().manual_seed(i)
            ps = [torch.nn.Parameter(torch.randn(300, generator=gen)) for _ in range(20)]
            for p in ps:
                p.grad = torch.randn(300, generator=gen)
            opts.append(fusedopt.FusedLAMB(ps, lr=0.01, backend=backend))
            params.append(ps)

        def work(o):
            for _ in range(30):
                o.step()

        if threaded:
            ts = [threading.Thread(target=work, args=(o,)) for o in opts]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        else:
            for o in opts:
                work(o)
        return [p.detach().clone() for ps in params for p in ps]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


# ---------------------------------------------------------------------- zero-size
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_size_param_with_stride0_grad_runs_on_every_backend(kind, backend):
    p = torch.nn.Parameter(torch.zeros(0, 3))
    q = torch.nn.Parameter(torch.randn(3))
    opt = CLS[kind]([p, q], lr=0.1, backend=backend)
    p.grad = torch.zeros(1, 3).expand(0, 3)
    q.grad = torch.ones(3)
    opt.step()
    assert opt.state[p]["step"].item() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoupled_decay_factor_in_the_compute_dtype(backend):
    """float64 params with a float32 tensor lr and decoupled weight decay: ``1 - lr·λ`` is formed
    in float64 (from the float32 lr's value), as the float lr of the same value gives."""
    lr32 = torch.tensor(0.1, dtype=torch.float32)
    results = []
    for lr in (lr32, lr32.item()):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(50, generator=gen, dtype=torch.float64))
        opt = fusedopt.FusedLAMB([p], lr=lr, weight_decay=0.3, decoupled_weight_decay=True,
                                 backend=backend)
        for _ in range(3):
            p.grad = torch.randn(50, generator=gen, dtype=torch.float64)
            opt.step()
        results.append(p.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=1e-14, atol=0)
