"""fusedopt under DeepSpeed ZeRO stages 1 and 2 (fusedopt.distributed.enable_deepspeed_zero).

One job of 2 gloo processes on CPU (tests/ds_scenarios.py, DS_ACCELERATOR=cpu) runs every
scenario; the tests read its per-rank results. ZeRO hands the optimizer one flat float32 piece per
param group and rank, cut across tensor boundaries (the model's second weight and its 1-D group
are cut between the ranks). Each scenario also runs without enable_deepspeed_zero, which must be
far off: the comparison can see a wrong trust ratio.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch.distributed as dist

import dist_utils
import ds_scenarios
import fusedopt
from fusedopt.distributed import enable_deepspeed_zero

# distance from one process, in units of the largest change the steps made to each tensor:
# float32 rounding of the gradient averaging, carried through 4 steps (measured 4e-6 without and
# 4e-5 with accumulation; a per-partition trust ratio gives 0.65 and more)
REL = 2e-4

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (requirements-dev.txt pins it)"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with the gloo backend is not available"),
]
# the fused CPU backend where it is built, and the eager one (always there)
BACKENDS = [b for b in ("cpp", "eager") if b in fusedopt.available_backends()]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return dist_utils.run_job(str(tmp_path_factory.mktemp("deepspeed")), BACKENDS,
                              script="ds_scenarios.py",
                              env_extra={"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1"})


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


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", list(ds_scenarios.KINDS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_matches_one_process(job, backend, kind, stage):
    """4 steps of ZeRO-1/2 on 2 ranks (two param groups, tensors cut between ranks) equal 4
    steps of one process on the same global batch; without the call they do not."""
    for r in results(job, f"zero{stage}-{kind}-{backend}"):
        assert r["enabled"] < REL, r
        assert r["disabled"] > 100 * REL, r
        # DeepSpeed calls step() once per param group (2 groups, 4 steps): one all-reduce each
        assert r["collectives"] == [{"gloo:all_reduce": 1}] * (2 * ds_scenarios.STEPS), r


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_accumulation(job, backend):
    for r in results(job, f"gas-{backend}"):
        assert r["enabled"] < REL, r


def test_offload_optimizer_to_cpu(job):
    """ZeRO-2 with offload_optimizer: cpu (the optimizer steps CPU partitions)."""
    for r in results(job, f"offload-{BACKENDS[0]}"):
        assert r["enabled"] < REL, r


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_masters(job, stage):
    """bf16 model (stage 1: DeepSpeed's BF16_Optimizer; stage 2: the ZeRO optimizer): the float32
    masters equal, bit for bit, one process stepping float32 copies with DeepSpeed's gradients."""
    for r in results(job, f"bf16-zero{stage}-{BACKENDS[0]}"):
        assert r["enabled"] == 0.0, r
        assert r["disabled"] > 100 * REL, r


@pytest.mark.parametrize("name", [f"resume-lamb-{b}" for b in BACKENDS] + [f"resume-lars-{BACKENDS[0]}"])
def test_checkpoint_resumes_bit_for_bit(job, name):
    """engine.save_checkpoint after 2 steps, load_checkpoint into a fresh engine: the next 2
    steps give the same params and optimizer state, bit for bit, and step counts of 4 (LAMB:
    enable_deepspeed_zero before load_checkpoint; LARS, ZeRO-1: after it)."""
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_refusals(job, backend):
    for r in results(job, f"refusals-{backend}"):
        assert r["max_grad_norm"].startswith("ValueError") and "gradient_clipping" in r["max_grad_norm"]
        assert r["state_precision"].startswith("ValueError") and "state_precision" in r["state_precision"]
        # set after enable_deepspeed_zero: the step refuses it and changes nothing
        assert r["late_max_grad_norm"].startswith("ValueError"), r
        assert r["unchanged"] is True
        assert r["stage3"].startswith("RuntimeError") and "stage 3" in r["stage3"]


def test_errors_without_deepspeed():
    """A fusedopt optimizer handed directly is ZeRO stage 0 (nothing to do); other objects are
    refused by name."""
    import torch

    opt = fusedopt.FusedLAMB([torch.nn.Parameter(torch.ones(3))])
    enable_deepspeed_zero(opt)  # stage 0: whole tensors, nothing to map
    assert opt._partitions == {}
    with pytest.raises(TypeError, match="client optimizer"):
        enable_deepspeed_zero(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=1))
