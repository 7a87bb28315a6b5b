"""fusedopt under DeepSpeed ZeRO stages 1, 2 and 3 (fusedopt.distributed.enable_deepspeed_zero).

One job of 2 gloo processes on CPU (tests/ds_scenarios.py, DS_ACCELERATOR=cpu) runs every
scenario; the tests read its per-rank results. ZeRO hands the optimizer one flat float32 piece per
param group (ZeRO-3: per sub-group) and rank, cut across tensor boundaries (the model's second weight and its 1-D group
are cut between the ranks). Each scenario also runs without enable_deepspeed_zero, whose step
(one trust ratio per flat partition) must refuse, naming the call, and change nothing.
"""
from __future__ import annotations

import copy
import importlib.util
import math
import types

import pytest
import torch
import torch.distributed as dist

import dist_utils
import ds_scenarios
import fusedopt
from fusedopt._sharding import Sharding
from fusedopt.distributed import enable_deepspeed_zero

# distance from one process, in units of the largest change the steps made to each tensor:
# float32 rounding of the gradient averaging, carried through 4 steps, is far below it; a trust
# ratio per partition instead of per tensor is far above (docs/distributed.md gives both)
REL = 2e-4

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available")

# the fused CPU backend where it is built, and the eager one (always there)
BACKENDS = [b for b in ("cpp", "eager") if b in fusedopt.available_backends()]


def _ds_job(tmp_path_factory, scenarios=""):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (requirements-dev.txt pins it)")
    return dist_utils.run_job(str(tmp_path_factory.mktemp("deepspeed")), BACKENDS,
                              script="ds_scenarios.py",
                              env_extra={"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
                                         "FUSEDOPT_DS_JOB": scenarios})


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return _ds_job(tmp_path_factory)


@pytest.fixture(scope="module")
def bf16_state_job(tmp_path_factory):
    return _ds_job(tmp_path_factory, "bf16state")


def results(job, name: str) -> list[dict]:
    out = []
    for rank, per_rank in enumerate(job):
        res = per_rank.get(name)
        if res is None:
            pytest.fail(f"scenario {name} did not run on rank {rank}")
        if not res["ok"]:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{res['error']}")
        out.append(res)
    return out


def assert_refused(r):
    """A step without enable_deepspeed_zero (ds_scenarios.refused_without)."""
    assert r["refused"] is not None and "enable_deepspeed_zero(engine)" in r["refused"], r
    assert r["unchanged"], r


def assert_padded(rs, stage):
    """ZeRO-3 pads each odd-sized tensor's last piece (the model's tensors of 5, 7 and 1
    elements): the NaN filled there must have reached some rank's partitions."""
    if stage == 3:
        assert sum(r["padding"] for r in rs) > 0, rs


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", list(ds_scenarios.KINDS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_matches_one_process(job, backend, kind, stage):
    """4 steps of ZeRO-1/2/3 on 2 ranks (two param groups, tensors cut between ranks) equal 4
    steps of one process on the same global batch, the partitions' padding being NaN
    (ds_scenarios.nan_padding); without the call the step refuses."""
    rs = results(job, f"zero{stage}-{kind}-{backend}")
    assert_padded(rs, stage)
    for r in rs:
        assert r["enabled"] < REL, r
        assert_refused(r["disabled"])
        # DeepSpeed calls step() once per param group (ZeRO-3: per sub-group, here one per
        # group; 2 groups, 4 steps): one all-reduce each
        assert r["collectives"] == [{"gloo:all_reduce": 1}] * (2 * ds_scenarios.STEPS), r


@pytest.mark.parametrize("name", ["bert-zero2-lamb", "bert-zero1-lars"])
def test_a_tiny_bert(job, name):
    """A transformers BERT (57 tensors, embeddings, LayerNorms, several tensors cut between the
    ranks) under ZeRO equals one process; its attention key biases are left out of the
    comparison (their exact gradient is 0: ds_scenarios.NOISE_ONLY)."""
    pytest.importorskip("transformers", reason="transformers is not installed (requirements-dev.txt pins it)")
    for r in results(job, f"{name}-{BACKENDS[0]}"):
        assert r["compared"] == r["tensors"] - 3, r  # the 3 layers' key biases
        assert r["enabled"] < REL, r
        assert_refused(r["disabled"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_accumulation(job, backend):
    for r in results(job, f"gas-{backend}"):
        assert r["enabled"] < REL, r


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_optimizer_to_cpu(job, stage):
    """offload_optimizer: cpu (the optimizer steps CPU partitions)."""
    for r in results(job, f"offload-zero{stage}-{BACKENDS[0]}"):
        assert r["enabled"] < REL, r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters(job, stage):
    """bf16 model (stage 1: DeepSpeed's BF16_Optimizer; 2 and 3: the ZeRO optimizers): the float32
    masters equal, bit for bit, one process stepping float32 copies with DeepSpeed's gradients
    (the partitions' padding NaN)."""
    rs = results(job, f"bf16-zero{stage}-{BACKENDS[0]}")
    assert_padded(rs, stage)
    for r in rs:
        assert r["enabled"] == 0.0, r
        assert_refused(r["disabled"])


@pytest.mark.parametrize("name", [f"resume-lamb-{b}" for b in BACKENDS]
                         + [f"resume-lars-{BACKENDS[0]}", f"resume-zero3-{BACKENDS[0]}"])
def test_checkpoint_resumes_bit_for_bit(job, name):
    """engine.save_checkpoint after 2 steps, load_checkpoint into a fresh engine: the next 2
    steps give the same params and optimizer state, bit for bit, and step counts of 4 (LAMB:
    enable_deepspeed_zero before load_checkpoint, ZeRO-2 and ZeRO-3; LARS, ZeRO-1: after it)."""
    for r in results(job, name):
        assert r["params"] == 0.0 and r["state"] == 0.0, r
        assert r["steps"] == [4.0, 4.0], r


def test_nonfinite_gradients(job):
    """skip_nonfinite steps normally under ZeRO; a NaN gradient on one rank is skipped on every
    rank by DeepSpeed's own overflow check before the optimizer runs (so skip_nonfinite never
    counts it)."""
    for r in results(job, f"skip-nonfinite-{BACKENDS[0]}"):
        assert r == {**r, "stepped": True, "skipped": 0, "unchanged": True}, r


def test_the_page_code_runs_as_written(job):
    """docs/distributed.md's DeepSpeed block (ZeRO-2, bf16, DeepSpeed's clipping), as written."""
    for r in results(job, "doc-block"):
        assert r["steps"] == 3 and r["partitions"] == 2, r


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_state_matches_one_process(bf16_state_job, backend, stage):
    """bf16 state (state_precision="bf16") on ZeRO-1/2/3 partitions: the flat partitions keep
    bf16 moments, and 4 steps on 2 ranks follow one process with bf16 state, each piece rounding
    v with the random bits of its elements in its tensor. Not bit for bit: the trust ratio of the
    tensor cut between the ranks is summed in another order (3.6e-6 apart with full state), and
    a bf16 rounding that this moves costs about 2^-9 of one element's update; counted from each
    piece's own start instead, the bits differ on the cut tensor and the runs move apart by more
    (with the model's seeds: 1.3e-3 against 4.8e-3, where bf16 and full state are 6.6e-3 apart)."""
    for r in results(bf16_state_job, f"bf16state-zero{stage}-{backend}"):
        assert r["state_dtypes"] == ["torch.bfloat16"], r
        assert r["enabled"] < r["bf16_vs_full"] / 3, r
        assert r["local_bits"] > 2 * r["enabled"], r


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_state_checkpoint_resumes_bit_for_bit(bf16_state_job, stage):
    """A DeepSpeed checkpoint of bf16 state, loaded into a fresh engine, continues bit for bit."""
    for r in results(bf16_state_job, f"bf16state-resume-zero{stage}-{BACKENDS[0]}"):
        assert r["params"] == 0.0 and r["state"] == 0.0, r
        assert r["steps"] == [4.0, 4.0], r


@pytest.mark.parametrize("backend", BACKENDS)
def test_refusals(job, backend):
    for r in results(job, f"refusals-{backend}"):
        assert r["max_grad_norm"].startswith("ValueError") and "gradient_clipping" in r["max_grad_norm"]
        assert r["state_precision"].startswith("ValueError") and "state_precision" in r["state_precision"]
        # set after enable_deepspeed_zero: the step refuses it and changes nothing
        assert r["late_max_grad_norm"].startswith("ValueError"), r
        # carrying on after enable_deepspeed_zero refused: the step refuses
        assert_refused(r["max_grad_norm_step"])
        assert_refused(r["state_precision_step"])
        assert r["unchanged"] is True
        assert r["elastic_checkpoint"].startswith("RuntimeError"), r
        assert "elastic_checkpoint" in r["elastic_checkpoint"]


def test_errors_without_deepspeed():
    """A fusedopt optimizer handed directly is ZeRO stage 0 (nothing to do); other objects are
    refused by name."""
    opt = fusedopt.FusedLAMB([torch.nn.Parameter(torch.ones(3))])
    enable_deepspeed_zero(opt)  # stage 0: whole tensors, nothing to map
    assert opt._sharding.partitions == {}
    with pytest.raises(TypeError, match="client optimizer"):
        enable_deepspeed_zero(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1))


# --------------------------------------------------------------- one process, no DeepSpeed
class _Mapping:
    """What DeepSpeed records on each param (``_hp_mapping``): where its piece lies in the flat
    partition, and where in the param it begins."""

    def __init__(self, start, numel, first=0):
        self.address = types.SimpleNamespace(start=start, numel=numel)
        self.lp_fragment_address = types.SimpleNamespace(start=first, numel=numel)

    def get_hp_fragment_address(self):
        return self.address


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


SHAPES = [(5, 4), (7,), (3, 3)]  # 36 elements, laid out in a flat buffer of 40 (4 of padding)


def _flat_setup(backend, kind="lamb", **opts):
    """A fused optimizer over one flat buffer of the SHAPES (as ZeRO hands it) and one over the
    same tensors apart; the flat one is registered through a stand-in for DeepSpeed's wrapper."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in SHAPES]
    flat = torch.nn.Parameter(torch.cat([t.reshape(-1) for t in tensors] + [torch.full((4,), 7.0)]))
    apart = [torch.nn.Parameter(t.clone()) for t in tensors]
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opts = {"lr": 0.1, "weight_decay": 0.01, "backend": backend, **opts}
    opt_flat, opt_apart = cls([flat], **opts), cls(apart, **opts)
    starts = [0, 20, 27]
    lps = [types.SimpleNamespace(_hp_mapping=_Mapping(s, math.prod(sh))) for s, sh in zip(starts, SHAPES)]
    wrapper = types.SimpleNamespace(optimizer=opt_flat, bit16_groups=[lps],
                                    real_dp_process_group=[dist.group.WORLD])
    enable_deepspeed_zero(types.SimpleNamespace(optimizer=wrapper))  # as an engine holds it
    return flat, apart, opt_flat, opt_apart, gen


def _grads(flat, apart, gen):
    gs = [torch.randn(p.shape, generator=gen) for p in apart]
    for p, g in zip(apart, gs):
        p.grad = g
    flat.grad = torch.cat([g.reshape(-1) for g in gs] + [torch.full((4,), float("nan"))])


def _pieces(flat):
    out, at = [], 0
    for s in SHAPES:
        n = math.prod(s)
        out.append(flat.detach()[at:at + n].view(s))
        at += n
    return out


@pytest.mark.parametrize("precision", ["full", "bf16"])
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("triton", marks=pytest.mark.skipif(
    "triton" not in fusedopt.available_backends(), reason="triton is not available here"))])
def test_flat_partition_steps_each_tensor(world_of_one, backend, kind, precision):
    """Each piece of a flat partition is stepped as its own tensor (its own trust ratio), bit for
    bit as the tensors apart, also with bf16 state (the random bits of each piece's elements are
    its tensor's); the padding (NaN grads there) is not touched; a step count set in place (as
    DeepSpeed's loaders copy state) holds for every piece; a state dict round trip continues bit
    for bit."""
    opts = dict(state_precision=precision, state_min_numel=0)
    flat, apart, opt_flat, opt_apart, gen = _flat_setup(backend, kind, **opts)
    for step in range(4):
        _grads(flat, apart, gen)
        opt_flat.step()
        opt_apart.step()
        if step == 1:
            for st in (opt_flat.state[flat], *(opt_apart.state[p] for p in apart)):
                st["step"].fill_(0.0)  # in place: every piece must take it
        for got, want in zip(_pieces(flat), apart):
            assert torch.equal(got, want.detach()), (step, (got - want).abs().max())
        assert torch.equal(flat.detach()[36:], torch.full((4,), 7.0))
    state_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {v.dtype for k, v in opt_flat.state[flat].items() if k != "step"} == {state_dtype}
    sd = copy.deepcopy(opt_flat.state_dict())  # load_state_dict would share its tensors
    flat2, _, opt2, _, _ = _flat_setup(backend, kind, **opts)
    with torch.no_grad():
        flat2.copy_(flat)
    opt2.load_state_dict(sd)
    g = torch.Generator().manual_seed(5)
    _grads(flat, apart, g)
    flat2.grad = flat.grad.clone()
    opt_flat.step()
    opt2.step()
    assert torch.equal(flat, flat2)
    assert float(opt2.state[flat2]["step"]) == float(opt_flat.state[flat]["step"]) == 3.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_piece_from_within_its_tensor_rounds_as_the_tensor(world_of_one, backend):
    """bf16 state of a piece that begins at element 10 of its tensor (as another rank's piece
    does) draws the random bits of those elements of the tensor: its v is that of the tensor's
    elements 10..29 stepped whole (v does not depend on the trust ratio); counted from the
    piece's own start instead (first 0 in the mapping), it differs."""
    def v_of_piece(first):
        gen = torch.Generator().manual_seed(0)
        whole = torch.nn.Parameter(torch.randn(40, generator=gen))
        flat = torch.nn.Parameter(torch.cat([whole.detach()[10:30].clone(), torch.zeros(4)]))
        opts = dict(lr=0.1, backend=backend, state_precision="bf16", state_min_numel=0)
        opt_whole, opt_flat = fusedopt.FusedLAMB([whole], **opts), fusedopt.FusedLAMB([flat], **opts)
        lps = [types.SimpleNamespace(_hp_mapping=_Mapping(0, 20, first))]
        enable_deepspeed_zero(types.SimpleNamespace(optimizer=types.SimpleNamespace(
            optimizer=opt_flat, bit16_groups=[lps], real_dp_process_group=[dist.group.WORLD])))
        for _ in range(3):
            g = torch.randn(40, generator=gen)
            whole.grad, flat.grad = g, torch.cat([g[10:30], torch.zeros(4)])
            opt_whole.step()
            opt_flat.step()
        return opt_flat.state[flat]["exp_avg_sq"][:20], opt_whole.state[whole]["exp_avg_sq"][10:30]
    got, want = v_of_piece(10)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got, want = v_of_piece(0)
    assert not torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_partition_compiled_step(world_of_one, backend):
    """Under torch.compile a step over flat partitions runs eagerly (a graph break: its rows are
    made at every step), with the same bits."""
    flat, apart, opt_flat, opt_apart, gen = _flat_setup(backend)
    step = torch.compile(opt_flat.step)
    for _ in range(3):
        _grads(flat, apart, gen)
        step()
        opt_apart.step()
        for got, want in zip(_pieces(flat), apart):
            assert torch.equal(got, want.detach())


def test_flat_partition_refuses_options(world_of_one):
    """Options a flat partition cannot take, at the call and at a later step (nothing changed)."""
    with pytest.raises(ValueError, match="gradient_clipping"):
        _flat_setup("eager", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="state_precision"):
        _flat_setup("eager", state_precision="8bit", state_min_numel=0)
    flat, apart, opt, _, gen = _flat_setup("eager")
    _grads(flat, apart, gen)
    opt.step()
    before = flat.detach().clone(), {k: v.clone() for k, v in opt.state[flat].items()}
    opt.param_groups[0]["max_grad_norm"] = 1.0
    with pytest.raises(ValueError, match="param group 0: max_grad_norm"):
        opt.step()
    assert torch.equal(flat, before[0])
    assert all(torch.equal(v, opt.state[flat][k]) for k, v in before[1].items())
    opt.param_groups[0]["max_grad_norm"] = None
    # a state dict of another partitioning (a shorter flat buffer): refused by name, not sliced
    opt.state[flat]["exp_avg_sq"] = torch.zeros(30)
    with pytest.raises(ValueError, match="state 'exp_avg_sq' of a flat partition of shape \\(40,\\)"):
        opt.step()
    assert torch.equal(flat, before[0])
    assert all(torch.equal(v, opt.state[flat][k]) for k, v in before[1].items() if k != "exp_avg_sq")


def _stage3_wrapper(opt, flat, sizes, **flags):
    """A stand-in for DeepSpeed's ZeRO-3 optimizer over one sub-group of params of ``sizes``
    (one rank: each piece is the whole param, laid out one after another)."""
    params = [types.SimpleNamespace(ds_numel=n, partition_numel=lambda n=n: n) for n in sizes]
    return types.SimpleNamespace(optimizer=opt, fp32_partitioned_groups_flat=[flat],
                                 fp16_groups=[params], sub_group_to_group_id={0: 0},
                                 sub_group_process_groups=[dist.group.WORLD], **flags)


def test_zero3_layout_steps_each_tensor(world_of_one):
    """ZeRO-3's sub-group buffer (each param's piece after the other) is stepped tensor by tensor,
    bit for bit as the tensors apart; then the refused ZeRO-3 variants, each by name."""
    flat, apart, opt, opt_apart, gen = _flat_setup("cpp")
    opt.set_sharding(Sharding())  # registered again below through the ZeRO-3 layout
    sizes = [math.prod(s) for s in SHAPES]
    wrapper = _stage3_wrapper(opt, flat, sizes)
    enable_deepspeed_zero(types.SimpleNamespace(optimizer=wrapper))
    for _ in range(3):
        _grads(flat, apart, gen)
        opt.step()
        opt_apart.step()
        for got, want in zip(_pieces(flat), apart):
            assert torch.equal(got, want.detach())
    for flag, value in (("swap_optimizer", True), ("zenflow", True), ("use_muon", True),
                        ("backup_optimizer", object())):
        w = _stage3_wrapper(fusedopt.FusedLAMB([flat], lr=0.1), flat, sizes, **{flag: value})
        with pytest.raises(RuntimeError, match="ZeRO-3 with"):
            enable_deepspeed_zero(types.SimpleNamespace(optimizer=w))
