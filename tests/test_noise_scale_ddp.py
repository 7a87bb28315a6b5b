"""DDPGradientNoiseScale with 2 gloo processes on CPU (FileStore rendezvous, no network port)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
LOCAL_BATCH = 6


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(LOCAL_BATCH, 5, generator=g), torch.randint(0, 3, (LOCAL_BATCH,), generator=g)


def _flat_grad(params):
    return torch.cat([p.grad.reshape(-1) for p in params]).double()


def _worker(rank, store_path):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fusedopt.noise_scale import DDPGradientNoiseScale, GradientNoiseScale

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        ref_model = _model()  # same init on both ranks, trained identically below
        net = _model()
        # tiny buckets: several buckets per backward, each hooked separately
        ddp = DDP(net, bucket_cap_mb=0.0005)
        helper = DDPGradientNoiseScale(ddp, LOCAL_BATCH, GradientNoiseScale(beta=0.5))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        ref_est = GradientNoiseScale(beta=0.5)
        for step in range(4):
            x, y = _batch(rank, step)
            scale = 2.0 ** 8 if step == 2 else 1.0  # a loss scale (AMP), divided out by step()
            (torch.nn.functional.cross_entropy(ddp(x), y) * scale).backward()
            helper.step(grad_scale=scale if step == 2 else None)
            for q in ddp.parameters():
                q.grad.div_(scale)

            # Reference without DDP: this rank's local mean gradient, gathered from all ranks.
            ref_model.zero_grad()
            torch.nn.functional.cross_entropy(ref_model(x), y).backward()
            local = _flat_grad(ref_model.parameters())
            every = [torch.empty_like(local) for _ in range(WORLD)]
            dist.all_gather(every, local)
            every = torch.stack(every)
            exp_small = (every ** 2).sum(1)  # |G_b|² of each rank
            exp_big = float((every.mean(0) ** 2).sum())  # |G_B|² of the global mean
            est = helper.noise_scale
            assert float(est.last_small_sq_norm) == pytest.approx(float(exp_small.mean()), rel=1e-5)
            assert float(est.last_big_sq_norm) == pytest.approx(exp_big, rel=1e-5)
            # the wrapped hook still averages the gradients as DDP does
            torch.testing.assert_close(_flat_grad(ddp.parameters()), every.mean(0),
                                       rtol=1e-5, atol=1e-7)
            ref_est.update_from_norms(small_batch=LOCAL_BATCH, small_sq_norms=exp_small.tolist(),
                                      big_batch=WORLD * LOCAL_BATCH, big_sq_norm=exp_big)
            assert est.num_updates == step + 1
            assert est.sq_norm_estimate == pytest.approx(ref_est.sq_norm_estimate, rel=1e-4)
            assert est.trace_estimate == pytest.approx(ref_est.trace_estimate, rel=1e-4)

            # keep the reference model in step with the DDP model
            for p, q in zip(ref_model.parameters(), ddp.parameters()):
                p.grad.copy_(q.grad)
            opt.step(); opt.zero_grad()
            ref_opt.step()

        # every rank holds the same estimate
        mine = torch.tensor([helper.noise_scale.trace_estimate,
                             helper.noise_scale.sq_norm_estimate], dtype=torch.float64)
        other = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(other, mine)
        torch.testing.assert_close(other[0], other[1])

        # misuse: step() without a synchronizing backward
        with pytest.raises(RuntimeError, match="without a completed synchronizing"):
            helper.step()
        # a one-rank process group cannot give two batch sizes
        solo = [dist.new_group([r]) for r in range(WORLD)][rank]
        with pytest.raises(ValueError, match="world size 1"):
            DDPGradientNoiseScale(DDP(_model(), process_group=solo), LOCAL_BATCH)
        with pytest.raises(ValueError, match="local_batch_size: 0"):
            DDPGradientNoiseScale(DDP(_model()), 0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.skipif(sys.platform == "win32", reason="FileStore rendezvous test is POSIX-only")
def test_ddp_noise_scale_two_ranks(tmp_path):
    store = os.path.join(tmp_path, "store")
    mp.spawn(_worker, args=(store,), nprocs=WORLD, join=True)
