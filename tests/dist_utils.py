"""Scenarios of tests/test_distributed.py, run by 2 gloo processes on CPU.

Started as ``python tests/dist_utils.py RANK WORLD PORT OUT_DIR BACKENDS`` (one process per rank, see
``run_job``). Each rank runs every scenario in order, in one process group, and writes
``OUT_DIR/rank{RANK}.json``: per scenario either the measured values or the error (traceback). The
single-process references run inside each worker, on full tensors with the same global batch.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import Counter
from datetime import timedelta

import torch

from helpers import bits_equal

WORLD = 2
GLOBAL_BATCH = 8
STEPS = 4

# FSDP2 equivalence: name -> (optimizer, kwargs, exclude 1-D params into a second group)
OPT_CASES = {
    "lamb": ("lamb", dict(lr=1e-2, weight_decay=0.01, eps=1e-3), False),
    "lamb_clip": ("lamb", dict(lr=1e-2, weight_decay=0.01, eps=1e-3, max_grad_norm=0.05), True),
    "lars": ("lars", dict(lr=1.0, weight_decay=1e-3, trust_coefficient=0.01), False),
    "lars_clip": ("lars", dict(lr=1.0, weight_decay=1e-3, trust_coefficient=0.01,
                              max_grad_norm=0.05), True),
}
# all-reduces per step() allowed by the design (docs/math.md: the clipping total is needed before pass 1)
ALLREDUCE_PER_STEP = {"lamb": 1, "lamb_clip": 2, "lars": 1, "lars_clip": 2}
BACKENDS = ("eager", "cpp")


# ---------------------------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(out_dir: str, backends: list[str], timeout: float = 300.0, only: str = "",
            script: str = "dist_utils.py", env_extra: dict | None = None) -> list[dict]:
    """Start WORLD worker processes of ``script`` (in tests/), wait for them, return each rank's
    results (raises on failure). ``only``: comma-separated scenario-name prefixes to run (default
    all; for debugging)."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}),
               PYTHONPATH=os.pathsep.join([root, here, os.environ.get("PYTHONPATH", "")]))
    last_err = ""
    for _attempt in range(2):  # a free port can be taken between the probe and the bind
        port = free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, os.path.join(here, script), str(r), str(WORLD), str(port),
                 out_dir, ",".join(backends), only],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,  # a kill reaches the processes a worker started too
            )
            for r in range(WORLD)
        ]
        deadline = time.monotonic() + timeout
        logs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    with contextlib.suppress(ProcessLookupError):  # every process gone already
                        os.killpg(q.pid, signal.SIGKILL)
                out, _ = p.communicate()
                out += f"\n[killed after {timeout:.0f} s]"
            logs.append(out)
        if all(p.returncode == 0 for p in procs):
            return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(WORLD)]
        last_err = "\n".join(f"--- rank {r} (rc {p.returncode}):\n{log[-6000:]}"
                             for r, (p, log) in enumerate(zip(procs, logs)))
        if "address already in use" not in last_err.lower():
            break
    raise RuntimeError(f"distributed workers failed:\n{last_err}")


# ---------------------------------------------------------------------------------- helpers
def count_collectives(fn) -> Counter:
    """Names of the gloo collectives issued while ``fn()`` runs (whatever API issued them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))


def make_model(seed: int = 0) -> torch.nn.Module:
    """Linear + LayerNorm layers; dim 0 of 5 and 7 split unevenly over 2 ranks, and the last
    layer's weight [1, 7] and bias [1] leave rank 1 with empty local shards."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Tanh(),
        torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Tanh(),
        torch.nn.Linear(7, 1),
    )


def batch(step: int, size: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 6, generator=g), torch.randn(size, 1, generator=g)


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def make_opt(kind: str, params, kw: dict, backend: str):
    import fusedopt

    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    return cls(params, backend=backend, **kw)


def groups(model, exclude: bool):
    """One group, or matrices + (1-D params with weight_decay=0, adapt=False)."""
    ps = list(model.parameters())
    if not exclude:
        return ps
    return [{"params": [p for p in ps if p.ndim > 1]},
            {"params": [p for p in ps if p.ndim <= 1], "weight_decay": 0.0, "adapt": False}]


def cached(ctx: dict, key: str, make):
    """A mesh created once per job (creating one is a collective: every rank, same order)."""
    if key not in ctx:
        ctx[key] = make()
    return ctx[key]


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Largest per-tensor ``max|got - ref| / max|ref|``."""
    worst = 0.0
    for a, b in zip(got, ref):
        a, b = a.detach().double(), b.detach().double()
        scale = b.abs().max().item() or 1.0
        worst = max(worst, (a - b).abs().max().item() / scale)
    return worst


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def train_reference(kind, kw, exclude, backend, steps=STEPS, model=None):
    model = model or make_model()
    opt = make_opt(kind, groups(model, exclude), kw, backend)
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def local_rows(x: torch.Tensor, rank: int) -> torch.Tensor:
    n = x.shape[0] // WORLD
    return x[rank * n:(rank + 1) * n]


def train_counted(ctx, model, opt) -> list[dict]:
    """STEPS steps on this rank's rows of the global batch; the collectives of each step()."""
    counts = []
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        loss_fn(model, local_rows(x, ctx["rank"]), local_rows(y, ctx["rank"])).backward()
        counts.append(dict(count_collectives(opt.step)))
    return counts


def refused_step(step, params, opt) -> dict:
    """Calls ``step`` (one that must refuse: an adapter of fusedopt.distributed was not enabled):
    ``refused``, its RuntimeError's message (None if it stepped), and ``unchanged``, whether the
    params (local pieces) and ``opt``'s state stayed as they were."""
    params = list(params)
    before = [_local(p).detach().clone() for p in params]
    state = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in st.items()}
             for k, st in opt.state.items()}
    try:
        step()
        message = None
    except RuntimeError as e:
        message = str(e)
    same_state = opt.state.keys() == state.keys() and all(
        st.keys() == opt.state[k].keys() and all(
            bits_equal(v, opt.state[k][n]) if isinstance(v, torch.Tensor) else v == opt.state[k][n]
            for n, v in st.items()) for k, st in state.items())
    return dict(refused=message, unchanged=same_state and all(
        map(bits_equal, before, (_local(p).detach() for p in params))))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def backward_once(ctx, model):
    """This rank's rows of the first global batch, forward and backward."""
    x, y = batch(0)
    loss_fn(model, local_rows(x, ctx["rank"]), local_rows(y, ctx["rank"])).backward()


# ---------------------------------------------------------------------------------- scenarios
def fsdp2_model(mesh):
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def scenario_fsdp2(ctx, name: str, backend: str):
    """FSDP2-sharded training == one process with the same global batch; collectives per step."""
    kind, kw, exclude = OPT_CASES[name]
    model = fsdp2_model(ctx["mesh"])
    opt = make_opt(kind, groups(model, exclude), kw, backend)
    counts = train_counted(ctx, model, opt)
    ref = train_reference(kind, kw, exclude, backend)
    got = [full(p) for p in model.parameters()]
    placements = sorted({str(tuple(p.placements)) for p in model.parameters()})
    local_numels = [p.to_local().numel() for p in model.parameters()]
    state_types = sorted({type(v).__name__ for st in opt.state.values() for k, v in st.items()
                          if k != "step"})
    return dict(err=rel_err(got, ref), collectives=counts, placements=placements,
                local_numels=local_numels, state_types=state_types)


def scenario_fsdp2_compiled(ctx, backend: str):
    """torch.compile(opt.step) over DTensor params runs the uncompiled step (one graph break:
    dynamo cannot give the local shards sources): the same bits, with clipping, bf16 state and
    an lr changed between steps."""
    kw = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, state_precision="bf16",
              state_min_numel=0)

    def make():
        model = fsdp2_model(ctx["mesh"])
        return model, make_opt("lamb", groups(model, True), kw, backend)

    first = list(make_model().parameters())  # the same values, unsharded
    runs = compiled_and_uncompiled(ctx, make, lambda m: [full(p) for p in m.parameters()])
    return dict(equal=all(map(torch.equal, *runs)),
                moved=not any(map(torch.equal, first, runs[1])))


def compiled_and_uncompiled(ctx, make, params_of) -> list[list[torch.Tensor]]:
    """The params (``params_of(model)``) after three steps of ``make()``'s model and optimizer,
    uncompiled and under torch.compile(opt.step), with the first group's lr changed between
    steps."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model, opt = make()
        step = torch.compile(opt.step) if compiled else opt.step
        for s in range(3):
            opt.param_groups[0]["lr"] = 1e-2 * (s + 1)
            x, y = batch(s)
            opt.zero_grad()
            loss_fn(model, local_rows(x, ctx["rank"]), local_rows(y, ctx["rank"])).backward()
            step()
        runs.append([p.detach().clone() for p in params_of(model)])
    return runs


def scenario_fsdp2_low_precision(ctx, kind: str, backend: str):
    """Low-precision state on FSDP2 shards (docs/math.md "Low-precision state"): "8bit" is
    stored as bf16 on these shards (their rows, of 5 to 7 elements, are not whole 8-bit blocks),
    and training follows one process with bf16 state to bf16 accuracy (the random bits of LAMB's
    v follow the element's index in the local shard)."""
    base = OPT_CASES[kind]
    kw = dict(base[1], state_precision="8bit", state_min_numel=0)
    rank = ctx["rank"]
    model = fsdp2_model(ctx["mesh"])
    opt = make_opt(base[0], groups(model, base[2]), kw, backend)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        loss_fn(model, local_rows(x, rank), local_rows(y, rank)).backward()
        opt.step()
    ref = train_reference(base[0], dict(kw, state_precision="bf16"), base[2], backend)
    key = "exp_avg" if base[0] == "lamb" else "momentum_buffer"
    dtypes = sorted({str(st[key].to_local().dtype) for st in opt.state.values()})
    return dict(err=rel_err([full(p) for p in model.parameters()], ref), state_dtypes=dtypes)


class RowsModel(torch.nn.Module):
    """Weights whose rows are whole 8-bit blocks: [512, 256] (even shards), [3, 512] (uneven)
    and [1, 512] (rank 1's shard empty); and 1-D params, whose shards are not (bf16 state)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = torch.nn.Linear(256, 512)
        self.n = torch.nn.LayerNorm(512)
        self.b = torch.nn.Linear(512, 3)
        self.c = torch.nn.Linear(512, 1)

    def forward(self, x):
        h = torch.tanh(self.n(self.a(x)))
        return self.b(h).sum(-1, keepdim=True) + self.c(h)


def rows_batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randn(GLOBAL_BATCH, 256, generator=g).to(dtype),
            torch.randn(GLOBAL_BATCH, 1, generator=g).to(dtype))


def rows_fsdp2(mesh, dtype=torch.float32):
    from torch.distributed.fsdp import fully_shard

    model = RowsModel().to(dtype)
    for layer in model.children():
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def rows_groups(model):
    """The matrices with the options given, the 1-D params (bf16 state: their shards are not whole
    blocks) with weight_decay=0 and adapt=False."""
    out = groups(model, True)
    out[1]["state_precision"] = "bf16"
    return out


def _convert_8bit(model, opt, kind, kw, backend, key):
    """Optimizer.state_dict() of sharded 8-bit state loaded into a full-state optimizer and
    back: each load converts shard by shard, with one warning."""
    import warnings

    from fusedopt import lowp

    p = model.a.weight
    lp = p.to_local()
    out = {}

    def load(precision, sd):
        o = make_opt(kind, rows_groups(model), dict(kw, state_precision=precision), backend)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            o.load_state_dict(sd)
        out[f"warnings_to_{precision}"] = sum("converted" in str(w.message) for w in caught)
        return o

    keys = opt._state_keys
    full_opt = load("full", opt.state_dict())
    full_state = {k: full_opt.state[p][k] for k in keys}
    out["full_type"] = type(full_state[key]).__name__
    values = lowp.moments({k: opt.state[p][k] for k in keys}, lp.shape)
    out["full_equal"] = all(torch.equal(full_state[k].to_local(), values[k]) for k in keys)
    back = load("8bit", full_opt.state_dict())
    eps = (lowp.lamb_eps(kw.get("eps", 1e-6), kw.get("betas", (0.9, 0.999))[1], True,
                         float(opt.state[p]["step"])) if kind == "lamb" else None)
    want = lowp.stored({k: full_state[k].to_local() for k in keys}, "8bit", lp, eps=eps)
    out["back_equal"] = all(torch.equal(back.state[p][k], want[k]) for k in keys)
    return out


def _rows_run(ctx, kind, kw, backend, dtype):
    """Helpers of scenario_fsdp2_8bit: make(mesh) -> (model, optimizer), the mesh None for one
    process without DTensors; train(model, opt, steps) -> the full params after the steps."""
    def make(mesh, options=kw, params=None):
        model = RowsModel().to(dtype) if mesh is None else rows_fsdp2(mesh, dtype)
        with torch.no_grad():
            for p, v in zip(model.parameters(), params or ()):
                p.copy_(v if mesh is None else distribute_like(v, p))
        return model, make_opt(kind, rows_groups(model), options, backend)

    def train(model, opt, steps, record=None):
        for s in steps:
            x, y = rows_batch(s, dtype)
            if hasattr(model.a.weight, "device_mesh") and model.a.weight.device_mesh.size() > 1:
                x, y = local_rows(x, ctx["rank"]), local_rows(y, ctx["rank"])
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            if record is not None:
                record.append([full(p.grad).clone() for p in model.parameters()])
            opt.step()
        return [full(p).detach().clone() for p in model.parameters()]

    return make, train


def replay(model, opt, recorded) -> list[torch.Tensor]:
    """Steps ``opt`` (of a model in one process) with the whole gradients ``recorded`` by
    ``train(..., record=)`` of a sharded run: the params after the steps."""
    for grads in recorded:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def distribute_like(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole tensor ``v`` (the same on every rank) as a DTensor placed like ``p``."""
    from torch.distributed.tensor import Replicate

    mesh = p.device_mesh
    return type(p).from_local(v, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, p.placements)


def scenario_fsdp2_8bit(ctx, kind: str, backend: str, dtype: str = "float32"):
    """8-bit state on FSDP2 shards whose rows are whole blocks (Note [sharded 8-bit state]), of
    params of ``dtype`` (bf16: with master weights): training against one process with 8-bit
    state; a torch.distributed.checkpoint save mid-run loaded into a new optimizer on the same
    mesh (continuing bit for bit), on a mesh of one rank per process and in one process without
    DTensors; that process's state dict set into shards again
    (each compared with the saved state, gathered); one process stepped with the
    sharded run's whole gradients (its codes and params compared)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from fusedopt import lowp

    base = OPT_CASES[kind + "_clip"]
    kw = dict(base[1], state_precision="8bit", state_min_numel=0)
    whole = StateDictOptions(full_state_dict=True)
    make, train = _rows_run(ctx, base[0], kw, backend, getattr(torch, dtype))
    model, opt = make(ctx["mesh"])
    recorded = []
    train(model, opt, range(2), recorded)
    saved_params = [full(p).detach().clone() for p in model.parameters()]
    path = os.path.join(ctx["out_dir"], f"ckpt-8bit-{kind}-{backend}-{dtype}")
    dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=path)
    gathered = copy.deepcopy(get_optimizer_state_dict(model, opt, options=whole))
    key = "exp_avg" if kind == "lamb" else "momentum_buffer"
    out = dict(_convert_8bit(model, opt, base[0], kw, backend, key),
               state_dtypes={n: str(st[key].dtype) for n, st in gathered["state"].items()},
               masters=sorted({type(st["master_param"]).__name__ for st in opt.state.values()
                               if "master_param" in st}))
    a = train(model, opt, range(2, 4), recorded)

    def loaded(mesh):
        m, o = make(mesh, params=saved_params)
        osd = get_optimizer_state_dict(m, o)
        dcp.load(osd, checkpoint_id=path)
        set_optimizer_state_dict(m, o, osd)
        return m, o

    def differ(m, o):
        """The entries of (m, o)'s gathered state that differ from the saved ones."""
        sd = get_optimizer_state_dict(m, o, options=whole)
        return sorted(f"{n}.{k}" for n, st in gathered["state"].items() for k, v in st.items()
                      if not torch.equal(full(sd["state"][n][k]), v))

    m2, o2 = loaded(ctx["mesh"])
    out["bitwise_dcp"] = all(map(torch.equal, a, train(m2, o2, range(2, 4))))
    one = cached(ctx, "mesh2d", lambda: init_device_mesh(
        "cpu", (2, 1), mesh_dim_names=("rep", "shard")))["shard"]
    m1, o1 = loaded(one)
    out["resharded_state_differs"] = differ(m1, o1)
    out["err_resharded"] = rel_err(train(m1, o1, range(2, 4)), a)
    m0, o0 = loaded(None)
    out["one_process_state_differs"] = differ(m0, o0)
    m3, o3 = make(ctx["mesh"])
    set_optimizer_state_dict(m3, o3, copy.deepcopy(get_optimizer_state_dict(m0, o0)),
                             options=whole)
    out["from_one_process_state_differs"] = differ(m3, o3)
    ref = train(*make(None), range(4))
    out["err_one_process"] = rel_err(a, ref)
    out["err_8bit_vs_full"] = rel_err(ref, train(*make(None, dict(kw, state_precision="full")),
                                                range(4)))
    m4, o4 = make(None)
    out["err_replayed"] = rel_err(a, replay(m4, o4, recorded))
    final = get_optimizer_state_dict(model, opt, options=whole)["state"]
    alone = get_optimizer_state_dict(m4, o4, options=whole)["state"]
    codes = [(full(v), alone[n][k]) for n, st in final.items() for k, v in st.items()
             if v.dtype == torch.uint8 and not k.endswith("_blocks")]
    out["replayed_codes_differ"] = (sum(int((a != b).sum()) for a, b in codes)
                                    / sum(a.numel() for a, _ in codes))
    return out


def scenario_reducer_uploads(ctx, backend: str):
    """A group of a Shard(0) DTensor beside a plain param (so that the stacked all-reduce selects
    rows by an index tensor), three opt.step() calls: the tensors of fusedopt.distributed._const
    made at each step (its cache misses), and whether the DTensor's update matched the same
    step of one process."""
    import fusedopt
    from fusedopt import distributed as dist_mod
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(5)
    w0, b0 = torch.randn(8, 4, generator=gen), torch.randn(5, generator=gen)
    w = torch.nn.Parameter(distribute_tensor(w0.clone(), ctx["mesh"], [Shard(0)]))
    b = torch.nn.Parameter(b0.clone())
    opt = fusedopt.FusedLAMB([w, b], lr=1e-2, backend=backend)
    ref_w = torch.nn.Parameter(w0.clone())
    ref = fusedopt.FusedLAMB([ref_w, torch.nn.Parameter(b0.clone())], lr=1e-2, backend=backend)
    made, real = [], dist_mod._const

    def counted(consts, values, dtype, device):
        if (tuple(values), dtype, device) not in consts:
            made.append(list(values))
        return real(consts, values, dtype, device)

    per_step = []
    dist_mod._const = counted
    try:
        for _ in range(3):
            gw, gb = torch.randn(8, 4, generator=gen), torch.randn(5, generator=gen)
            w.grad = distribute_tensor(gw, ctx["mesh"], [Shard(0)])
            b.grad = gb.clone()
            ref_w.grad, ref.param_groups[0]["params"][1].grad = gw.clone(), gb.clone()
            first = len(made)
            opt.step()
            ref.step()
            per_step.append(len(made) - first)
    finally:
        dist_mod._const = real
    return dict(made_per_step=per_step, err=rel_err([w.full_tensor()], [ref_w]))


def scenario_clip_sensitivity(ctx, backend: str):
    """How much the single-process result moves when the clipping norm is off by sqrt(2) (the error
    of forgetting the other rank's half of the gradient): the equivalence tests can see it."""
    out = {}
    for name in ("lamb_clip", "lars_clip"):
        kind, kw, exclude = OPT_CASES[name]
        a = train_reference(kind, kw, exclude, backend)
        b = train_reference(kind, dict(kw, max_grad_norm=kw["max_grad_norm"] * 2 ** 0.5), exclude,
                            backend)
        out[name] = rel_err(a, b)
    return out


def scenario_fsdp2_state_dict(ctx, backend: str):
    """A state_dict taken mid-run (DTensor state), by ``Optimizer.state_dict()`` or by
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, loads into a new optimizer
    that continues bit-for-bit."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    kind, kw, exclude = OPT_CASES["lamb_clip"]
    rank = ctx["rank"]
    model = fsdp2_model(ctx["mesh"])
    opt = make_opt(kind, groups(model, exclude), kw, backend)

    def train(o, steps):
        for s in steps:
            x, y = batch(s)
            o.zero_grad()
            loss_fn(model, local_rows(x, rank), local_rows(y, rank)).backward()
            o.step()
        return [p.to_local().clone() for p in model.parameters()]

    def restore(params):
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.to_local().copy_(v)

    train(opt, range(2))
    saved_params = [p.to_local().clone() for p in model.parameters()]
    saved_state = copy.deepcopy(opt.state_dict())
    dcp_state = copy.deepcopy(get_optimizer_state_dict(model, opt))
    full_state = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    a = train(opt, range(2, 4))
    restore(saved_params)
    opt2 = make_opt(kind, groups(model, exclude), kw, backend)
    opt2.load_state_dict(saved_state)
    st = opt2.state[next(iter(model.parameters()))]
    loaded = (type(st["exp_avg"]).__name__, str(tuple(st["exp_avg"].placements)))
    b = train(opt2, range(2, 4))
    restore(saved_params)
    opt3 = make_opt(kind, groups(model, exclude), kw, backend)
    set_optimizer_state_dict(model, opt3, dcp_state)
    c = train(opt3, range(2, 4))
    # full_state_dict with cpu_offload: rank 0 holds the gathered state, the other ranks nothing
    first = next(iter(full_state["state"].values())) if rank == 0 else None
    return dict(bitwise=all(torch.equal(x, y) for x, y in zip(a, b)),
                bitwise_dcp=all(torch.equal(x, y) for x, y in zip(a, c)),
                loaded_exp_avg=loaded[0], loaded_placements=loaded[1],
                full_exp_avg_shape=list(first["exp_avg"].shape) if rank == 0 else None)


def _manual_run(ctx, specs, kind, kw, backend, steps=3):
    """Params given as (shape, mesh or None, placements): DTensors built from full values without
    communication; the same full grads on every rank. Returns (rel err vs one process, collectives
    per step)."""
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(7)
    fulls = [torch.randn(shape, generator=gen) for shape, _, _ in specs]

    def place(t, mesh, placements):
        if mesh is None:
            return t.clone()
        return distribute_tensor(t.clone(), mesh, placements, src_data_rank=None)

    params = [torch.nn.Parameter(place(t, m, pl)) for t, (_, m, pl) in zip(fulls, specs)]
    ref = [torch.nn.Parameter(t.clone()) for t in fulls]
    opt = make_opt(kind, params, kw, backend)
    ref_opt = make_opt(kind, ref, kw, backend)
    counts = []
    for s in range(steps):
        grads = [torch.randn(shape, generator=gen) for shape, _, _ in specs]
        for p, r, g, (_, m, pl) in zip(params, ref, grads, specs):
            p.grad = place(g, m, pl)
            r.grad = g.clone()
        counts.append(dict(count_collectives(opt.step)))
        ref_opt.step()
    return rel_err([full(p) for p in params], ref), counts


def _check_sums(ctx, specs, backend, steps=2):
    """The reduced sums themselves, which the trust ratios hide (φ = ‖w‖/‖u‖ does not change when
    both sums are counted twice): LARS with a clipping threshold that never clips, whose trust sums
    are (‖w‖², ‖g‖²) of the full tensors and whose clipping total is Σ‖g‖² over all full grads.
    Returns the largest relative error of each against float64 values of the full tensors."""
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(11)
    fulls = [torch.randn(shape, generator=gen) for shape, _, _ in specs]
    params = [torch.nn.Parameter(t.clone() if m is None else
                                 distribute_tensor(t.clone(), m, pl, src_data_rank=None))
              for t, (_, m, pl) in zip(fulls, specs)]
    opt = make_opt("lars", params, dict(lr=0.1, max_grad_norm=1e9), backend)
    seen = {}

    class Recorder:
        def __init__(self, inner):
            self.inner = inner

        def reduce_grad_sq(self, total):
            self.inner.reduce_grad_sq(total)
            seen["total"] = total.item()

        def reduce_trust_sums(self, sums, buckets):
            self.inner.reduce_trust_sums(sums, buckets)
            seen["rows"] = [(p, row) for b, s in zip(buckets, sums)
                            for p, row in zip(b.sources if b.sources is not None else b.params,
                                                   s.double().tolist())]

    import fusedopt.distributed
    inner_reducer = fusedopt.distributed.reducer_for
    fusedopt.distributed.reducer_for = lambda *args: Recorder(inner_reducer(*args))
    try:
        total_err = sums_err = 0.0
        index = {id(p): i for i, p in enumerate(params)}
        for _ in range(steps):
            grads = [torch.randn(shape, generator=gen) for shape, _, _ in specs]
            for p, g, (_, m, pl) in zip(params, grads, specs):
                p.grad = g.clone() if m is None else distribute_tensor(g.clone(), m, pl, src_data_rank=None)
            w_sq = [float(full(p).detach().double().square().sum()) for p in params]
            g_sq = [float(g.double().square().sum()) for g in grads]
            opt.step()
            total_err = max(total_err, abs(seen["total"] - sum(g_sq)) / sum(g_sq))
            for p, (w, g) in seen["rows"]:
                i = index[id(p)]
                sums_err = max(sums_err, abs(w - w_sq[i]) / w_sq[i], abs(g - g_sq[i]) / g_sq[i])
    finally:
        fusedopt.distributed.reducer_for = inner_reducer
    return dict(sums_err=sums_err, total_err=total_err)


def scenario_mixed_placements(ctx, kind: str, backend: str):
    """1-D mesh: Shard(0) uneven and empty, Shard(1), Replicate and a plain tensor in one step."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = ctx["mesh"]
    specs = [((5, 3), mesh, [Shard(0)]), ((1, 4), mesh, [Shard(0)]), ((4, 3), mesh, [Shard(1)]),
             ((6,), mesh, [Replicate()]), ((3,), None, None), ((3, 2), mesh, [Replicate()])]
    kw = dict(OPT_CASES[kind + "_clip"][1])
    err, counts = _manual_run(ctx, specs, kind, kw, backend)
    return dict(err=err, collectives=counts, **_check_sums(ctx, specs, backend))


def scenario_mesh_2d(ctx, backend: str):
    """2-D mesh (2, 1): HSDP-like (Replicate, Shard(0)) with (Shard(0), Replicate) and fully
    replicated tensors: each piece counted once over the flattened mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = cached(ctx, "mesh2d",
                  lambda: init_device_mesh("cpu", (2, 1), mesh_dim_names=("rep", "shard")))
    specs = [((5, 3), mesh, [Replicate(), Shard(0)]), ((5, 2), mesh, [Shard(0), Replicate()]),
             ((4,), mesh, [Replicate(), Replicate()]), ((2,), None, None)]
    err, counts = _manual_run(ctx, specs, "lamb", OPT_CASES["lamb_clip"][1], backend)
    return dict(err=err, collectives=counts, **_check_sums(ctx, specs, backend))


def scenario_two_meshes(ctx, backend: str):
    """Params on two meshes: one trust-sum all-reduce per mesh, the clipping total on the default
    group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = ctx["mesh"]
    # a second mesh object over the same ranks (DTensor itself mishandles permuted rank orders)
    other = cached(ctx, "mesh_b", lambda: DeviceMesh("cpu", torch.arange(WORLD), mesh_dim_names=("b",)))
    if other == mesh:
        raise RuntimeError("the two meshes compare equal; the scenario needs distinct meshes")
    specs = [((5, 3), mesh, [Shard(0)]), ((3, 3), other, [Shard(0)]), ((4,), other, [Replicate()]),
             ((3,), None, None)]
    err, counts = _manual_run(ctx, specs, "lamb", OPT_CASES["lamb_clip"][1], backend)
    return dict(err=err, collectives=counts, **_check_sums(ctx, specs, backend))


def scenario_errors(ctx, backend: str):
    """Refused inputs raise before anything is modified: a Partial param, a grad whose placements
    differ from its param's. Returns the messages and whether the params stayed unchanged."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from torch.distributed.device_mesh import DeviceMesh

    mesh = ctx["mesh"]
    other = cached(ctx, "mesh_b", lambda: DeviceMesh("cpu", torch.arange(WORLD), mesh_dim_names=("b",)))
    out = {}
    cases = {
        "partial": (lambda t: DTensor.from_local(t, mesh, [Partial()], run_check=False),
                    lambda t: DTensor.from_local(t, mesh, [Partial()], run_check=False)),
        "grad_mesh": (lambda t: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None),
                      lambda t: distribute_tensor(t, other, [Shard(0)], src_data_rank=None)),
        "grad_placements": (lambda t: distribute_tensor(t, mesh, [Replicate()], src_data_rank=None),
                            lambda t: DTensor.from_local(t, mesh, [Partial()], run_check=False)),
    }
    for name, (make_p, make_g) in cases.items():
        sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)],
                                                       src_data_rank=None))
        sharded.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)], src_data_rank=None)
        p = torch.nn.Parameter(make_p(torch.ones(4, 3)))
        p.grad = make_g(torch.ones(4, 3))  # local shapes agree: only the placements differ
        opt = make_opt("lamb", [sharded, p], dict(lr=0.1), backend)
        before = [sharded.to_local().clone(), p.to_local().clone()]
        try:
            opt.step()
            out[name] = None
        except RuntimeError as e:
            out[name] = str(e)
        out[name + "_unchanged"] = (torch.equal(before[0], sharded.to_local())
                                    and torch.equal(before[1], p.to_local()))
    return out


def scenario_flat_group(ctx):
    """The flattened-sub-mesh path of the all-reduce over several mesh dims (not reached by a
    2-rank mesh, where the default group is used instead)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fusedopt.distributed import _flat_group

    mesh = cached(ctx, "mesh2d",
                  lambda: init_device_mesh("cpu", (2, 1), mesh_dim_names=("rep", "shard")))
    t = torch.tensor([float(ctx["rank"] + 1)])
    for g in _flat_group(mesh, (0, 1)):
        dist.all_reduce(t, group=g)
    return dict(value=t.item())


def scenario_zero(ctx, name: str, backend: str, enable: bool = True):
    """ZeroRedundancyOptimizer(optimizer_class=FusedLAMB/LARS) over a DDP model == one process;
    without enable_zero_global_clipping a step with max_grad_norm, or with skip_nonfinite,
    refuses (refused_step)."""
    import fusedopt
    from fusedopt.distributed import enable_zero_global_clipping
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    kind, kw, exclude = OPT_CASES[name]
    model = DDP(make_model())
    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, backend=backend, **kw)
    if enable:
        enable_zero_global_clipping(opt)
    else:  # max_grad_norm: each rank would clip by its own part of the norm
        backward_once(ctx, model)
        out = refused_step(opt.step, model.parameters(), opt.optim)
        # skip_nonfinite alone: each rank would skip by its own gradients
        skip = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, backend=backend,
                                       lr=kw["lr"], skip_nonfinite=True)
        return dict(out, skip=refused_step(skip.step, model.parameters(), skip.optim))
    owned = len([p for g in opt.optim.param_groups for p in g["params"]])
    counts = train_counted(ctx, model, opt)
    ref = train_reference(kind, kw, False, backend)
    return dict(err=rel_err([p for p in model.module.parameters()], ref), owned=owned,
                total=len(list(model.parameters())), collectives=counts)


def scenario_zero_low_precision(ctx, precision: str, backend: str):
    """ZeroRedundancyOptimizer with low-precision LAMB state == one process: with
    enable_zero_global_clipping each rank keys its params' random bits as one process does."""
    import fusedopt
    from fusedopt.distributed import _ZeroGradSqReducer, enable_zero_global_clipping
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = ctx["rank"]
    kw = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, state_precision=precision,
              state_min_numel=0)
    out = {}
    for enable in (True, False):
        model = DDP(make_model())
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=fusedopt.FusedLAMB,
                                      backend=backend, **kw)
        if enable:
            enable_zero_global_clipping(opt)
        else:  # the clipping alone, each rank numbering its own params from 0
            opt.optim.set_grad_norm_reducer(_ZeroGradSqReducer(opt.process_group))
        for s in range(STEPS):
            x, y = batch(s)
            opt.zero_grad()
            loss_fn(model, local_rows(x, rank), local_rows(y, rank)).backward()
            opt.step()
        out["err" if enable else "err_local_keys"] = rel_err(list(model.module.parameters()),
                                                             train_reference("lamb", kw, False,
                                                                             backend))
    full = train_reference("lamb", dict(kw, state_precision="full"), False, backend)
    out["err_vs_full"] = rel_err(train_reference("lamb", kw, False, backend), full)
    return out


def scenario_zero_resume(ctx, precision: str, backend: str):
    """ZeroRedundancyOptimizer with low-precision LAMB state: consolidated after two steps, saved
    by rank 0 and loaded by a new ZeRO optimizer on every rank (torch's loader puts each rank's
    saved state straight into its local optimizer), the run continues as the one not stopped,
    bit for bit."""
    import torch.distributed as dist

    import fusedopt
    from fusedopt.distributed import enable_zero_global_clipping
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = ctx["rank"]
    kw = dict(lr=1e-2, weight_decay=0.01, state_precision=precision, state_min_numel=0)

    def make(model):
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=fusedopt.FusedLAMB,
                                      backend=backend, **kw)
        enable_zero_global_clipping(opt)
        return opt

    def steps(model, opt, first, count):
        for s in range(first, first + count):
            x, y = batch(s)
            opt.zero_grad()
            loss_fn(model, local_rows(x, rank), local_rows(y, rank)).backward()
            opt.step()

    model = DDP(make_model())
    opt = make(model)
    steps(model, opt, 0, 2)
    opt.consolidate_state_dict(to=0)
    path = os.path.join(ctx["out_dir"], f"zero_resume_{precision}_{backend}.pt")
    if rank == 0:
        torch.save(opt.state_dict(), path)
    dist.barrier()
    twin = DDP(make_model())
    twin.module.load_state_dict(model.module.state_dict())
    topt = make(twin)
    topt.load_state_dict(torch.load(path, weights_only=True))
    formats = sorted({str(t.dtype) for st in topt.optim.state.values() for t in st.values()})
    steps(model, opt, 2, 2)
    steps(twin, topt, 2, 2)
    same = all(torch.equal(a, b) for a, b in zip(model.module.parameters(),
                                                  twin.module.parameters()))
    return dict(same=same, formats=formats)


def fsdp1_model():
    """make_model() in FSDP1, one unit per Linear (pieces of one tensor on both ranks, and
    units whose flat params the ranks split inside a tensor), params kept as their own."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(make_model(), device_id=torch.device("cpu"), use_orig_params=True,
                auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))


def _fsdp1_run(ctx, kind, kw, exclude, backend, enable=True):
    """Trains fsdp1_model() (groups by fusedopt.param_groups, which sees each piece's own
    shape); returns the full params and the collectives of each step. Without enable_fsdp1:
    refused_step of the first step."""
    import fusedopt
    from fusedopt.distributed import enable_fsdp1
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = fsdp1_model()
    params = (fusedopt.param_groups(model, weight_decay=kw["weight_decay"]) if exclude
              else list(model.parameters()))
    opt = make_opt(kind, params, kw, backend)
    if not enable:
        backward_once(ctx, model)
        return refused_step(opt.step, model.parameters(), opt)
    enable_fsdp1(model, opt)
    counts = train_counted(ctx, model, opt)
    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()], counts, opt


def scenario_fsdp1(ctx, name: str, backend: str):
    """FSDP1 (use_orig_params=True) with enable_fsdp1 == one process with the same global batch;
    without it (each rank's pieces of a tensor would get trust ratios, and clipping totals, of
    their own) the step refuses."""
    kind, kw, exclude = OPT_CASES[name]
    got, counts, opt = _fsdp1_run(ctx, kind, kw, exclude, backend)
    ref = train_reference(kind, kw, exclude, backend)
    return dict(err=rel_err(got, ref), without=_fsdp1_run(ctx, kind, kw, exclude, backend, False),
                collectives=counts, groups=[len(g["params"]) for g in opt.param_groups])


def scenario_fsdp1_low_precision(ctx, kind: str, backend: str):
    """FSDP1 with bf16 state (8-bit asked: the pieces keep bf16) == one process with bf16 state:
    each piece's random bits are keyed as its elements are in one process, and its format is its
    whole tensor's (state_min_numel=20 keeps the biases and norms full, as in one process)."""
    base_kind, base, exclude = OPT_CASES[kind]
    kw = dict(base, state_precision="8bit", state_min_numel=20)
    got, _, opt = _fsdp1_run(ctx, base_kind, kw, exclude, backend)
    bf16 = dict(kw, state_precision="bf16")
    ref = train_reference(base_kind, bf16, exclude, backend)
    full = train_reference(base_kind, dict(kw, state_precision="full"), exclude, backend)
    return dict(err=rel_err(got, ref), err_vs_full=rel_err(ref, full),
                dtypes=sorted({str(v.dtype) for st in opt.state.values()
                               for k, v in st.items() if k != "step"}))


def scenario_fsdp1_state_dict(ctx, backend: str):
    """FSDP1 checkpoints through torch.distributed.checkpoint.state_dict (model and optimizer),
    taken mid-run, load into a new model and optimizer that continue bit for bit: full state, and
    bf16 state of every param (FSDP1 gathers the states of a unit in one dtype)."""
    import fusedopt
    from fusedopt.distributed import enable_fsdp1
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank = ctx["rank"]
    kind, kw, _ = OPT_CASES["lamb_clip"]

    def make(precision):
        model = fsdp1_model()
        opt = make_opt(kind, fusedopt.param_groups(model, weight_decay=kw["weight_decay"]),
                       dict(kw, state_precision=precision, state_min_numel=0), backend)
        enable_fsdp1(model, opt)
        return model, opt

    def train(model, opt, steps):
        for s in steps:
            x, y = batch(s)
            opt.zero_grad()
            loss_fn(model, local_rows(x, rank), local_rows(y, rank)).backward()
            opt.step()
        with FSDP.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]

    out = {}
    for precision in ("full", "bf16"):
        model, opt = make(precision)
        train(model, opt, range(2))
        saved = copy.deepcopy((get_model_state_dict(model), get_optimizer_state_dict(model, opt)))
        a = train(model, opt, range(2, 4))
        model, opt = make(precision)
        set_model_state_dict(model, saved[0])
        set_optimizer_state_dict(model, opt, saved[1])
        out[precision] = all(map(torch.equal, a, train(model, opt, range(2, 4))))
    return out


def scenario_fsdp1_compiled(ctx, backend: str):
    """torch.compile(opt.step) after enable_fsdp1 gives the uncompiled step's bits, with
    clipping, bf16 state and an lr changed between steps."""
    import fusedopt
    from fusedopt.distributed import enable_fsdp1
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def make():
        model = fsdp1_model()
        opt = make_opt("lamb", fusedopt.param_groups(model, weight_decay=0.01),
                       dict(lr=1e-2, max_grad_norm=0.05, state_precision="bf16",
                            state_min_numel=0), backend)
        enable_fsdp1(model, opt)
        return model, opt

    def params_of(model):
        with FSDP.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]

    return dict(equal=all(map(torch.equal, *compiled_and_uncompiled(ctx, make, params_of))))


def scenario_fsdp1_added_group(ctx, backend: str):
    """A param group added after enable_fsdp1 is refused at the next step, which changes
    nothing; enable_fsdp1 called again registers it, and the run equals one process's with the
    two groups."""
    import fusedopt
    from fusedopt.distributed import enable_fsdp1
    from fusedopt.testing import changed, snapshot
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank = ctx["rank"]
    kind, kw, _ = OPT_CASES["lamb_clip"]
    model = fsdp1_model()
    split = fusedopt.param_groups(model, weight_decay=kw["weight_decay"])
    opt = make_opt(kind, [split[0]], kw, backend)
    enable_fsdp1(model, opt)
    opt.add_param_group(split[1])
    x, y = batch(0)
    loss_fn(model, local_rows(x, rank), local_rows(y, rank)).backward()
    before = snapshot([opt])
    try:
        opt.step()
        error = None
    except RuntimeError as e:
        error = str(e)
    unchanged = not changed(before, snapshot([opt]))
    enable_fsdp1(model, opt)
    opt.zero_grad()
    train_counted(ctx, model, opt)
    with FSDP.summon_full_params(model):
        got = [p.detach().clone() for p in model.parameters()]
    return dict(error=error, unchanged=unchanged,
                err=rel_err(got, train_reference(kind, kw, True, backend)))


def scenario_fsdp1_scaler_skip_accumulate(ctx, backend: str):
    """FSDP1 with enable_fsdp1 beside torch's tools: ShardedGradScaler (a power-of-two scale)
    gives the unscaled run's bits; an inf in one rank's grads makes skip_nonfinite skip the step
    on every rank (the total is all-reduced); accumulate() over two micro-batches (no_sync on
    the first) equals one process."""
    import fusedopt
    from fusedopt.distributed import accumulate, enable_fsdp1
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    rank = ctx["rank"]
    kind, kw, _ = OPT_CASES["lamb_clip"]

    def make(**extra):
        model = fsdp1_model()
        opt = make_opt(kind, fusedopt.param_groups(model, weight_decay=kw["weight_decay"]),
                       kw, backend)
        for k, v in extra.items():
            setattr(opt, k, v)
        enable_fsdp1(model, opt)
        return model, opt

    def full_params(model):
        with FSDP.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]

    runs = []
    for scaler in (None, ShardedGradScaler(device="cpu", init_scale=1024.0)):
        model, opt = make()
        for s in range(3):
            x, y = batch(s)
            opt.zero_grad()
            loss = loss_fn(model, local_rows(x, rank), local_rows(y, rank))
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        runs.append(full_params(model))

    model, opt = make(skip_nonfinite=True)
    x, y = batch(0)
    loss_fn(model, local_rows(x, rank), local_rows(y, rank)).backward()
    if rank == 1:
        next(p for p in model.parameters() if p.grad is not None and p.numel()).grad[0] = math.inf
    before = full_params(model)
    opt.step()
    skipped = int(opt.skipped_steps.item()) == 1 and all(map(torch.equal, before,
                                                             full_params(model)))

    model, opt = make()
    for s in range(STEPS):
        x, y = batch(s)
        xs, ys = local_rows(x, rank), local_rows(y, rank)
        opt.zero_grad()
        for xm, ym in accumulate(model, [(xs[:2], ys[:2]), (xs[2:], ys[2:])]):
            (loss_fn(model, xm, ym) / 2).backward()
        opt.step()
    return dict(scaler_equal=all(map(torch.equal, *runs)), skipped=skipped,
                accumulate_err=rel_err(full_params(model), train_reference(kind, kw, True,
                                                                           backend)))


def scenario_fsdp1_refusals(ctx, backend: str):
    """use_orig_params=False (flat params of many tensors) is refused, naming the option, and so
    are params that FSDP1 leaves whole (an ignored module) beside its pieces; the step refuses
    after either, and under NO_SHARD until enable_fsdp1 registers its whole params."""
    import fusedopt
    from fusedopt.distributed import enable_fsdp1
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from torch.distributed.fsdp import ShardingStrategy

    out = {}
    for case in ("flat", "ignored", "no_shard"):
        inner = make_model()
        model = FSDP(inner, device_id=torch.device("cpu"), use_orig_params=case != "flat",
                     ignored_modules=[inner[6]] if case == "ignored" else None,
                     sharding_strategy=(ShardingStrategy.NO_SHARD if case == "no_shard"
                                        else ShardingStrategy.FULL_SHARD))
        opt = fusedopt.FusedLAMB(model.parameters(), lr=1e-2, backend=backend)
        backward_once(ctx, model)
        if case == "no_shard":  # FSDP1 marks NO_SHARD's params too: refused until enabled
            out["no_shard_without"] = refused_step(opt.step, model.parameters(), opt)
        try:
            enable_fsdp1(model, opt)
            out[case] = None
        except (TypeError, RuntimeError) as e:
            out[case] = f"{type(e).__name__}: {e}"
        # the step after a refused enable_fsdp1 refuses too; after one that passed, it steps
        out[case + "_step"] = refused_step(opt.step, model.parameters(), opt)
    return out


def scenario_ddp_accumulate(ctx, backend: str, k: int = 3):
    """DDP with fusedopt.distributed.accumulate: k micro-batches per rank == one big batch; the
    gradient all-reduce runs on the last micro-batch only."""
    from fusedopt.distributed import accumulate
    from torch.nn.parallel import DistributedDataParallel as DDP

    kind, kw, _ = OPT_CASES["lamb_clip"]
    rank = ctx["rank"]
    model = DDP(make_model())
    opt = make_opt(kind, model.parameters(), kw, backend)
    per_micro = 2
    big = per_micro * k * WORLD
    acc_counts = []
    for s in range(STEPS):
        x, y = batch(s, big)
        xl, yl = local_rows(x, rank), local_rows(y, rank)
        micro = list(zip(xl.split(per_micro), yl.split(per_micro)))

        def accumulate_grads():
            for xm, ym in accumulate(model, micro):
                (loss_fn(model, xm, ym) / len(micro)).backward()

        opt.zero_grad()
        acc_counts.append(count_collectives(accumulate_grads).get("gloo:all_reduce", 0))
        opt.step()
    # gloo all-reduces of one synchronized backward, for comparison
    x, y = batch(0, big)
    sync_count = count_collectives(
        lambda: loss_fn(model, local_rows(x, rank), local_rows(y, rank)).backward()
    ).get("gloo:all_reduce", 0)
    ref_model = make_model()
    ref_opt = make_opt(kind, ref_model.parameters(), kw, backend)
    for s in range(STEPS):
        x, y = batch(s, big)
        ref_opt.zero_grad()
        loss_fn(ref_model, x, y).backward()
        ref_opt.step()
    return dict(err=rel_err(list(model.module.parameters()), list(ref_model.parameters())),
                acc_counts=acc_counts, sync_count=sync_count)


def scenario_ddp_flat(ctx, backend: str):
    """DDP over params and grads flattened by fusedopt.flatten_parameters (before wrapping), grads
    zeroed by FlatParameters.zero_grad: the same steps as one process, and DDP writes the reduced
    grads into the flat grad buffer (each grad stays its slice)."""
    import fusedopt
    from torch.nn.parallel import DistributedDataParallel as DDP

    kind, kw, exclude = OPT_CASES["lamb_clip"]
    rank = ctx["rank"]
    inner = make_model()
    flat = fusedopt.flatten_parameters(inner)
    model = DDP(inner)
    opt = make_opt(kind, groups(inner, exclude), kw, backend)
    storage = flat.grad_buffers[(torch.device("cpu"), torch.float32)].untyped_storage().data_ptr()
    in_buffer = []
    for s in range(STEPS):
        x, y = batch(s)
        flat.zero_grad()
        loss_fn(model, local_rows(x, rank), local_rows(y, rank)).backward()
        in_buffer.append(all(p.grad.untyped_storage().data_ptr() == storage
                             for p in inner.parameters()))
        opt.step()
    ref = train_reference(kind, kw, exclude, backend)
    return dict(err=rel_err(list(inner.parameters()), ref), in_buffer=in_buffer)


def scenario_fsdp2_accumulate(ctx, backend: str, k: int = 2):
    """FSDP2 with accumulate (set_requires_gradient_sync): k micro-batches == one big batch."""
    from fusedopt.distributed import accumulate

    kind, kw, exclude = OPT_CASES["lamb"]
    rank = ctx["rank"]
    model = fsdp2_model(ctx["mesh"])
    opt = make_opt(kind, groups(model, exclude), kw, backend)
    for s in range(STEPS):
        x, y = batch(s)
        xl, yl = local_rows(x, rank), local_rows(y, rank)
        micro = list(zip(xl.split(len(xl) // k), yl.split(len(yl) // k)))
        opt.zero_grad()
        for xm, ym in accumulate(model, micro):
            (loss_fn(model, xm, ym) / len(micro)).backward()
        opt.step()
    ref = train_reference(kind, kw, exclude, backend)
    return dict(err=rel_err([full(p) for p in model.parameters()], ref))


def scenarios(backends: list[str]):
    """(name, function, args) in the order every rank runs them."""
    out = []
    for be in backends:
        for name in OPT_CASES:
            out.append((f"fsdp2-{be}-{name}", scenario_fsdp2, (name, be)))
        out.append((f"clip_sensitivity-{be}", scenario_clip_sensitivity, (be,)))
        out.append((f"reducer_uploads-{be}", scenario_reducer_uploads, (be,)))
        out.append((f"fsdp2_state_dict-{be}", scenario_fsdp2_state_dict, (be,)))
        out.append((f"fsdp2_compiled-{be}", scenario_fsdp2_compiled, (be,)))
        for kind in ("lamb", "lars"):
            out.append((f"fsdp2_low_precision-{be}-{kind}", scenario_fsdp2_low_precision,
                        (kind, be)))
            out.append((f"fsdp2_8bit-{be}-{kind}", scenario_fsdp2_8bit, (kind, be)))
            out.append((f"fsdp2_8bit_bf16-{be}-{kind}", scenario_fsdp2_8bit,
                        (kind, be, "bfloat16")))
        for kind in ("lamb", "lars"):
            out.append((f"mixed_placements-{be}-{kind}", scenario_mixed_placements, (kind, be)))
        out.append((f"mesh_2d-{be}", scenario_mesh_2d, (be,)))
        out.append((f"two_meshes-{be}", scenario_two_meshes, (be,)))
        for name in ("lamb", "lamb_clip", "lars"):
            out.append((f"zero-{be}-{name}", scenario_zero, (name, be)))
        out.append((f"zero_unsynced_clip-{be}", scenario_zero, ("lamb_clip", be, False)))
        for precision in ("bf16", "8bit"):
            out.append((f"zero_low_precision-{be}-{precision}", scenario_zero_low_precision,
                        (precision, be)))
            out.append((f"zero_resume-{be}-{precision}", scenario_zero_resume, (precision, be)))
        out.append((f"errors-{be}", scenario_errors, (be,)))
        for name in OPT_CASES:
            out.append((f"fsdp1-{be}-{name}", scenario_fsdp1, (name, be)))
        for kind in ("lamb", "lars"):
            out.append((f"fsdp1_low_precision-{be}-{kind}", scenario_fsdp1_low_precision,
                        (kind, be)))
        out.append((f"fsdp1_state_dict-{be}", scenario_fsdp1_state_dict, (be,)))
        out.append((f"fsdp1_compiled-{be}", scenario_fsdp1_compiled, (be,)))
        out.append((f"fsdp1_added_group-{be}", scenario_fsdp1_added_group, (be,)))
        out.append((f"fsdp1_scaler_skip_accumulate-{be}", scenario_fsdp1_scaler_skip_accumulate,
                    (be,)))
        out.append((f"fsdp1_refusals-{be}", scenario_fsdp1_refusals, (be,)))
        out.append((f"ddp_accumulate-{be}", scenario_ddp_accumulate, (be,)))
        out.append((f"fsdp2_accumulate-{be}", scenario_fsdp2_accumulate, (be,)))
        out.append((f"ddp_flat-{be}", scenario_ddp_flat, (be,)))
    out.append(("flat_group", scenario_flat_group, ()))
    return out


def main(argv, scenarios_of=None, context=None):
    """One worker: join the gloo group, run the scenarios of ``scenarios_of(backends)`` (default:
    this module's) with the context ``context(rank, world, out_dir)`` makes, and write the
    results."""
    rank, world, port, out_dir, backends = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    only = tuple(x for x in (argv[5] if len(argv) > 5 else "").split(",") if x)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    if context is None:
        from torch.distributed.device_mesh import init_device_mesh

        ctx = {"rank": rank, "out_dir": out_dir,
               "mesh": init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))}
    else:
        ctx = context(rank, world, out_dir)
    results = {}
    try:
        for name, fn, args in (scenarios_of or scenarios)([b for b in backends.split(",") if b]):
            if only and not name.startswith(only):
                continue
            t0 = time.perf_counter()
            try:
                res = fn(ctx, *args)
                results[name] = {"ok": True, **res}
            except Exception:  # noqa: BLE001 - reported per scenario by the test
                results[name] = {"ok": False, "error": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - t0
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)
        dist.destroy_process_group()
    # The results are written: leave without the interpreter's teardown, where a background thread
    # of torch's profiler (which some scenarios run) can abort the process ("terminate called
    # without an active exception") after everything of the test has finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
