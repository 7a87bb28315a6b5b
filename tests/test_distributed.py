"""Distributed training (issue 7): FSDP2-sharded norms, ZeRO, DDP/FSDP2 gradient accumulation.

One job of 2 gloo processes on CPU (tests/dist_utils.py) runs every scenario once per module; the
tests below read its per-rank results. Each distributed run is compared with one process training
the same model on the same global batch.
"""
from __future__ import annotations

import contextlib
import re
import types

import pytest
import torch
import torch.distributed as dist

import fusedopt
import dist_utils
from dist_utils import ALLREDUCE_PER_STEP, BACKENDS, OPT_CASES
from fusedopt.distributed import (accumulate, enable_fsdp1, enable_zero_global_clipping,
                                  reducer_for)

REL = 1e-5  # the distributed result vs one process, per tensor max|Δ| / max|ref|

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this build",
)


def _backends():
    out = []
    for be in BACKENDS:
        reason = (f"backend {be!r} is not available here "
                  f"(fusedopt.available_backends() = {fusedopt.available_backends()})")
        out.append(pytest.param(be, id=be, marks=pytest.mark.skipif(
            be not in fusedopt.available_backends(), reason=reason)))
    return out


BACKEND_PARAMS = _backends()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    backends = [b for b in BACKENDS if b in fusedopt.available_backends()]
    return dist_utils.run_job(str(tmp_path_factory.mktemp("dist")), backends)


def results(job, name: str) -> list[dict]:
    """The scenario's result on every rank; fails with the worker's traceback if it raised."""
    out = []
    for rank, per_rank in enumerate(job):
        if name not in per_rank:
            pytest.fail(f"scenario {name} did not run on rank {rank}")
        res = per_rank[name]
        if not res["ok"]:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{res['error']}")
        out.append(res)
    return out


# ------------------------------------------------------------------------------------ FSDP2
@needs_gloo
@pytest.mark.parametrize("case", list(OPT_CASES))
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp2_matches_one_process(job, backend, case):
    per_rank = results(job, f"fsdp2-{backend}-{case}")
    for rank, res in enumerate(per_rank):
        assert res["err"] <= REL, f"rank {rank}: rel err {res['err']:.3g}"
        assert res["placements"] == ["(Shard(dim=0),)"]
        assert res["state_types"] == ["DTensor"], "optimizer state should be sharded like the params"
    # uneven shards (dim 0 of 5 and 7) and empty local shards ([1, 7] and [1] on rank 1)
    n0, n1 = per_rank[0]["local_numels"], per_rank[1]["local_numels"]
    assert n0[0] != n1[0] and n1[-2:] == [0, 0]


@needs_gloo
@pytest.mark.parametrize("case", list(OPT_CASES))
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp2_collectives_per_step(job, backend, case):
    """LARS and LAMB: one all-reduce per step; with max_grad_norm one more (the clipping total is
    needed before pass 1). Nothing else: no gather of any parameter, no per-tensor collective."""
    expected = {"gloo:all_reduce": ALLREDUCE_PER_STEP[case]}
    for rank, res in enumerate(results(job, f"fsdp2-{backend}-{case}")):
        for step, counts in enumerate(res["collectives"]):
            assert counts == expected, f"rank {rank}, step {step}: {counts}"


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_clipping_cases_are_sensitive(job, backend):
    """A global norm off by sqrt(2) (one rank's half of the gradient forgotten) moves the
    one-process result far more than REL: the clipping equivalence tests would see that bug."""
    for res in results(job, f"clip_sensitivity-{backend}"):
        assert res["lamb_clip"] > 1e3 * REL and res["lars_clip"] > 1e3 * REL, res


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp2_state_dict_roundtrip(job, backend):
    """Optimizer.state_dict() and torch.distributed.checkpoint's get/set_optimizer_state_dict."""
    per_rank = results(job, f"fsdp2_state_dict-{backend}")
    for res in per_rank:
        assert res["bitwise"], "a reloaded optimizer should continue bit-for-bit"
        assert res["bitwise_dcp"], "a state set by set_optimizer_state_dict should continue bit-for-bit"
        assert res["loaded_exp_avg"] == "DTensor"
        assert res["loaded_placements"] == "(Shard(dim=0),)"
    assert per_rank[0]["full_exp_avg_shape"] == [5, 6], "full_state_dict gathers the whole tensor"


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp2_compiled_step_equals_uncompiled(job, backend):
    """torch.compile(opt.step) over FSDP2 params (it failed inside dynamo: the local shards are
    fresh tensors at every step) steps as the uncompiled optimizer does, bit for bit."""
    for res in results(job, f"fsdp2_compiled-{backend}"):
        assert res["moved"] and res["equal"]


@needs_gloo
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp2_low_precision_state(job, backend, kind):
    """state_precision on DTensor shards whose rows are not whole 8-bit blocks: bf16 (8-bit
    asked), within bf16 rounding of one process with bf16 state."""
    # LARS rounds its buffer to nearest: as one process up to fp32 rounding. LAMB's v draws its
    # random bits by the element's index in the local shard, other bits than one process draws:
    # the two differ by stochastic rounding, which stays below one bf16 step (2^-8)
    bound = REL if kind == "lars" else 2.0 ** -8
    for res in results(job, f"fsdp2_low_precision-{backend}-{kind}"):
        assert res["state_dtypes"] == ["torch.bfloat16"]
        assert res["err"] <= bound, res["err"]


@needs_gloo
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp2_8bit_state(job, backend, kind, dtype):
    """8-bit state on FSDP2 shards whose rows are whole blocks (Note [sharded 8-bit state]):
    stored as 8 bits; a torch.distributed.checkpoint save loads into a new optimizer on the same
    mesh (bit for bit on), into one on a mesh of one rank and into one process without
    DTensors (the gathered codes, block words and steps equal the saved ones), and that process's
    state dict into shards again (equal); a state dict converts to full state and back, shard by
    shard; training follows one process with 8-bit state. bf16 params: with master weights
    (DTensors)."""
    name = "fsdp2_8bit" if dtype == "float32" else "fsdp2_8bit_bf16"
    for res in results(job, f"{name}-{backend}-{kind}"):
        assert res["masters"] == ([] if dtype == "float32" else ["DTensor"])
        dtypes = res["state_dtypes"]
        assert {dtypes[n] for n in ("a.weight", "b.weight", "c.weight")} == {"torch.uint8"}
        assert {d for n, d in dtypes.items() if "weight" not in n or n == "n.weight"} == {
            "torch.bfloat16"}, dtypes
        assert res["bitwise_dcp"], "a state loaded by torch.distributed.checkpoint should continue"
        assert res["resharded_state_differs"] == []
        assert res["one_process_state_differs"] == res["from_one_process_state_differs"] == []
        assert res["warnings_to_full"] == res["warnings_to_8bit"] == 1
        assert res["full_type"] == "DTensor" and res["full_equal"] and res["back_equal"], res
        # Stepped with the sharded run's gradients, one process stores the same codes, up to a
        # code flipped where the norms' summation order (the clipping total, the trust ratios)
        # moves a value across a rounding boundary: LAMB's v draws the random bits of each
        # element's place in the whole tensor (docs/math.md, "Random bits"), so the shards round
        # as one process does. A misplaced block, scale or random bit changes a code in most
        # places; one flipped code moves its element by a step of its map.
        assert res["replayed_codes_differ"] <= 1e-3, res
        assert res["err_replayed"] <= res["err_8bit_vs_full"] / 2, res
        # Trained on its own, one process's forward and backward round otherwise, and the flips
        # grow over the steps; a sharded model's bf16 forward and backward also round otherwise
        bound = res["err_8bit_vs_full"] / 2 if dtype == "float32" else 2.0 ** -5
        assert res["err_one_process"] <= bound, res
        assert res["err_resharded"] <= bound, res


# ------------------------------------------------------------------------ mixed placements
@needs_gloo
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_mixed_shard_replicate_plain(job, backend, kind):
    """Shard(0) uneven/empty, Shard(1), Replicate and a plain tensor in one step (with clipping):
    replicated values are counted once in every sum, 2 all-reduces per step."""
    for rank, res in enumerate(results(job, f"mixed_placements-{backend}-{kind}")):
        assert res["err"] <= REL, f"rank {rank}: rel err {res['err']:.3g}"
        assert res["sums_err"] <= REL and res["total_err"] <= REL, res
        assert all(c == {"gloo:all_reduce": 2} for c in res["collectives"]), res["collectives"]


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_2d_mesh_mixed_placements(job, backend):
    """(Replicate, Shard(0)), (Shard(0), Replicate) and replicated tensors on a 2-D mesh."""
    for rank, res in enumerate(results(job, f"mesh_2d-{backend}")):
        assert res["err"] <= REL, f"rank {rank}: rel err {res['err']:.3g}"
        assert res["sums_err"] <= REL and res["total_err"] <= REL, res
        assert all(c == {"gloo:all_reduce": 2} for c in res["collectives"]), res["collectives"]


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_two_meshes(job, backend):
    """Params on two meshes: one trust-sum all-reduce per mesh, plus the clipping total."""
    for rank, res in enumerate(results(job, f"two_meshes-{backend}")):
        assert res["err"] <= REL, f"rank {rank}: rel err {res['err']:.3g}"
        assert res["sums_err"] <= REL and res["total_err"] <= REL, res
        assert all(c == {"gloo:all_reduce": 3} for c in res["collectives"]), res["collectives"]


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_refused_layouts(job, backend):
    """Partial placements and grads laid out unlike their params raise, params untouched."""
    expected = {
        "partial": r"Partial placements are not supported .*\(Partial\(sum\),\)",
        "grad_mesh": r"grad of a DTensor param must be a DTensor with the same mesh and placements",
        "grad_placements": r"same mesh and placements; .*Replicate.*its grad: .*Partial",
    }
    for res in results(job, f"errors-{backend}"):
        for case, pattern in expected.items():
            assert res[case] is not None and re.search(pattern, res[case]), (case, res[case])
            assert res[case + "_unchanged"], case


@needs_gloo
def test_flattened_mesh_group(job):
    for res in results(job, "flat_group"):
        assert res["value"] == 3.0


# ------------------------------------------------------------------------------------ ZeRO
@needs_gloo
@pytest.mark.parametrize("case", ["lamb", "lamb_clip", "lars"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_zero_redundancy_optimizer(job, backend, case):
    clip = OPT_CASES[case][1].get("max_grad_norm") is not None
    for rank, res in enumerate(results(job, f"zero-{backend}-{case}")):
        assert res["err"] <= REL, f"rank {rank}: rel err {res['err']:.3g}"
        assert 0 < res["owned"] < res["total"], "each rank should own a part of the params"
        # ZeRO's own broadcasts of the updated params, plus the clipping total when enabled
        for counts in res["collectives"]:
            assert counts.get("gloo:all_reduce", 0) == (1 if clip else 0), counts


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_zero_clipping_without_enable_is_refused(job, backend):
    """Without enable_zero_global_clipping each rank would clip (or skip a non-finite step) by
    the norm of the gradients it owns, which is not the global norm: a step with max_grad_norm,
    or with skip_nonfinite, refuses, naming the call, and changes nothing (the local optimizer is
    recognized as built by ZeRO)."""
    for res in results(job, f"zero_unsynced_clip-{backend}"):
        for r in (res, res["skip"]):  # max_grad_norm; skip_nonfinite alone
            assert "enable_zero_global_clipping(zero_optimizer)" in r["refused"], res
            assert r["unchanged"], res


@needs_gloo
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_zero_low_precision_state_matches_one_process(job, backend, precision):
    """enable_zero_global_clipping numbers each rank's params as one process does, so LAMB's
    random bits, and with them its low-precision v, are those of one process (the trust-ratio
    sums are whole tensors on each rank; only the clipping total is summed in another order).
    Numbered from 0 on each rank, the run is about as far from one process as low-precision state
    is from full state."""
    for res in results(job, f"zero_low_precision-{backend}-{precision}"):
        assert res["err"] <= res["err_vs_full"] / 1000, res
        assert res["err_local_keys"] >= res["err_vs_full"] / 10, res


@needs_gloo
@pytest.mark.parametrize("precision", ["bf16", "8bit"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_zero_resumes_low_precision_state_from_its_consolidated_checkpoint(job, backend,
                                                                            precision):
    """torch's ZeroRedundancyOptimizer.load_state_dict puts each rank's saved state (8-bit: codes
    and block words) straight into the local optimizer; the step takes it in: the resumed run
    equals the one not stopped, bit for bit, with the state in its format."""
    want = "torch.uint8" if precision == "8bit" else "torch.bfloat16"
    for rank, res in enumerate(results(job, f"zero_resume-{backend}-{precision}")):
        assert res["same"], f"rank {rank}"
        assert want in res["formats"], res["formats"]


# ------------------------------------------------------------------------------------ FSDP1
@needs_gloo
@pytest.mark.parametrize("case", list(OPT_CASES))
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp1_matches_one_process(job, backend, case):
    """FSDP1 with use_orig_params=True and enable_fsdp1: the same params as one process (the
    groups of fusedopt.param_groups as one process makes them), with the all-reduces of FSDP2;
    without enable_fsdp1 (each rank's pieces would get trust ratios of their own) the step
    refuses, naming the call, and changes nothing."""
    expected = {"gloo:all_reduce": ALLREDUCE_PER_STEP[case]}
    for rank, res in enumerate(results(job, f"fsdp1-{backend}-{case}")):
        assert res["err"] <= REL, f"rank {rank}: rel err {res['err']:.3g}"
        assert "enable_fsdp1(model, optimizer)" in res["without"]["refused"], res
        assert res["without"]["unchanged"], res
        assert len(res["groups"]) == (2 if OPT_CASES[case][2] else 1), res
        for step, counts in enumerate(res["collectives"]):
            assert counts == expected, f"rank {rank}, step {step}: {counts}"


@needs_gloo
@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp1_low_precision_state_matches_one_process(job, backend, kind):
    """bf16 state on FSDP1 pieces (8-bit asked) follows one process with bf16 state up to fp32
    rounding (the pieces' norms sum in another order), as full state does; random bits drawn
    otherwise than one process draws them would move it by bf16 rounding, as far as bf16 is
    from full state, at least ten times REL."""
    for res in results(job, f"fsdp1_low_precision-{backend}-{kind}"):
        assert res["dtypes"] == ["torch.bfloat16", "torch.float32"], res
        assert res["err"] <= REL < res["err_vs_full"] / 10, res


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp1_checkpoint_continues_bit_for_bit(job, backend):
    for res in results(job, f"fsdp1_state_dict-{backend}"):
        assert res["full"] and res["bf16"], res


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp1_compiled_step_equals_uncompiled(job, backend):
    for res in results(job, f"fsdp1_compiled-{backend}"):
        assert res["equal"], res


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp1_param_group_added_after_enable(job, backend):
    for res in results(job, f"fsdp1_added_group-{backend}"):
        assert res["error"] is not None and "enable_fsdp1 did not register" in res["error"], res
        assert res["unchanged"], res
        assert res["err"] <= REL, res


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp1_with_sharded_grad_scaler_skips_and_accumulation(job, backend):
    for res in results(job, f"fsdp1_scaler_skip_accumulate-{backend}"):
        assert res["scaler_equal"] and res["skipped"], res
        assert res["accumulate_err"] <= REL, res


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp1_refusals(job, backend):
    for res in results(job, f"fsdp1_refusals-{backend}"):
        assert res["flat"] is not None and "use_orig_params=True" in res["flat"], res
        assert res["ignored"] is not None and "2 param(s) of the optimizer are not sharded" \
            in res["ignored"], res
        assert res["no_shard"] is None, res
        for case in ("flat_step", "ignored_step", "no_shard_without"):
            assert "enable_fsdp1(model, optimizer)" in res[case]["refused"], (case, res)
            assert res[case]["unchanged"], (case, res)
        assert res["no_shard_step"]["refused"] is None, res
        assert not res["no_shard_step"]["unchanged"], res  # it stepped


# ---------------------------------------------------------------------------- accumulation
@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_ddp_over_flattened_params(job, backend):
    """fusedopt.flatten_parameters before DDP: same steps as one process, grads stay in the flat
    grad buffer."""
    for rank, res in enumerate(results(job, f"ddp_flat-{backend}")):
        assert res["err"] <= REL, f"rank {rank}: rel err {res['err']:.3g}"
        assert res["in_buffer"] == [True] * len(res["in_buffer"]) and res["in_buffer"], res


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_ddp_accumulate(job, backend):
    """3 micro-batches per rank with loss / 3 == one batch of 12; DDP all-reduces only once."""
    for rank, res in enumerate(results(job, f"ddp_accumulate-{backend}")):
        assert res["err"] <= REL, f"rank {rank}: rel err {res['err']:.3g}"
        assert res["sync_count"] >= 1
        assert all(c == res["sync_count"] for c in res["acc_counts"]), res


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fsdp2_accumulate(job, backend):
    for rank, res in enumerate(results(job, f"fsdp2_accumulate-{backend}")):
        assert res["err"] <= REL, f"rank {rank}: rel err {res['err']:.3g}"


class _FakeDDP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sync = True

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


class _FakeFSDP2(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sync = True

    def set_requires_gradient_sync(self, flag):
        self.sync = flag


@pytest.mark.parametrize("model_cls", [_FakeDDP, _FakeFSDP2],
                         ids=["no_sync", "set_requires_gradient_sync"])
@pytest.mark.parametrize("n", [0, 1, 3])
def test_accumulate_syncs_last_micro_batch_only(model_cls, n):
    model = model_cls()
    seen = [(x, model.sync) for x in accumulate(model, (i for i in range(n)))]  # a generator
    assert seen == [(i, i == n - 1) for i in range(n)]
    assert model.sync


def test_accumulate_restores_sync_on_break():
    model = _FakeDDP()
    for _ in accumulate(model, range(3)):
        assert not model.sync
        break
    assert model.sync


def test_accumulate_plain_module():
    assert list(accumulate(torch.nn.Linear(2, 2), [1, 2])) == [1, 2]


# ------------------------------------------------------------------------------ local checks
def test_no_reducer_without_sharded_params():
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    opt = fusedopt.FusedLAMB([p], backend="eager")
    opt.step()
    assert reducer_for([opt._group(opt.param_groups[0])], opt.param_groups) is None


def test_enable_zero_global_clipping_errors():
    with pytest.raises(RuntimeError, match="overlap_with_ddp"):
        enable_zero_global_clipping(object())
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError, match="FusedLAMB or FusedLARS"):
        enable_zero_global_clipping(types.SimpleNamespace(optim=sgd, process_group=None))


def test_enable_fsdp1_outside_fsdp():
    """Another optimizer is refused; a model without FSDP1 units leaves the optimizer as it was
    (whole tensors: no reducer, no keys)."""
    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match="FusedLAMB or FusedLARS"):
        enable_fsdp1(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = fusedopt.FusedLAMB(model.parameters())
    enable_fsdp1(model, opt)
    enable_fsdp1(model, types.SimpleNamespace(optimizer=opt))  # a wrapper, as accelerate's
    assert opt._sharding.reducer is None and not opt._sharding.keys and not opt._sharding.wholes
    with pytest.raises(TypeError, match="FusedLAMB or FusedLARS"):
        enable_fsdp1(model, types.SimpleNamespace(optimizer=object()))


@needs_gloo
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_sharded_row_selection_is_uploaded_once_per_layout(job, backend):
    """Through three opt.step() calls on a group that mixes a sharded DTensor and a plain param:
    the index (and keep) tensors of the stacked all-reduce are made at the first step only (the
    reducer is kept while the step's DTensor params are the same; a pageable upload from a
    Python list at every step would sync the host and cannot be captured in a CUDA graph), and
    the steps match one process."""
    for res in results(job, f"reducer_uploads-{backend}"):
        assert res["made_per_step"][0] >= 1 and res["made_per_step"][1:] == [0, 0], res
        assert res["err"] <= REL, res
