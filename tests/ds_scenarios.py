"""Scenarios of tests/test_deepspeed.py: fusedopt optimizers under DeepSpeed ZeRO, 2 gloo ranks on CPU.

Started by ``dist_utils.run_job(..., script="ds_scenarios.py")`` (one process per rank). Each
DeepSpeed run trains the same model on the same global batch as one process does with the same
fusedopt optimizer (inside each worker, on full tensors), and reports how far apart they are.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

import dist_utils
from helpers import bits_equal

STEPS = 4
GLOBAL_BATCH = 8
KINDS = {
    "lamb": dict(lr=1e-2, eps=1e-6, weight_decay=0.01),
    "lars": dict(lr=1.0, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.01),
}


def make_model() -> torch.nn.Module:
    """Two ZeRO partitions per rank: the weights (768 + 3072 + 240 elements: the second weight is
    cut between the ranks) and the 1-D params (biases and a LayerNorm, 245 elements, also cut)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 64), torch.nn.LayerNorm(64), torch.nn.Tanh(),
        torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 5),
    )


def batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(GLOBAL_BATCH, 12, generator=g).to(dtype), torch.randint(0, 5, (GLOBAL_BATCH,),
                                                                                 generator=g)


def make_opt(kind: str, model: torch.nn.Module, backend: str, **extra):
    """Weights with weight decay and trust ratio; biases and norms without (two param groups)."""
    import fusedopt

    cls = fusedopt.FusedLAMB if kind == "lamb" else fusedopt.FusedLARS
    opts = {**KINDS[kind], **extra}
    groups = fusedopt.param_groups(model, weight_decay=opts.pop("weight_decay"))
    return cls(groups, backend=backend, **opts)


def config(stage: int, gas: int = 1, bf16: bool = False, offload: bool = False) -> dict:
    """fp16 is not here: DeepSpeed's CPU accelerator refuses it ("Type fp16 is not supported")."""
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (dist_utils.WORLD * gas),
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed's default clips at 1.0
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def engine_for(kind, backend, cfg, enable=True, model_of=None, **opt_extra):
    import deepspeed

    import fusedopt.distributed

    model = (model_of or make_model)()
    if "bf16" in cfg:
        model = model.to(torch.bfloat16)
    opt = make_opt(kind, model, backend, **opt_extra)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    if enable:
        fusedopt.distributed.enable_deepspeed_zero(engine)
    return engine, opt


def nan_padding(engine, opt) -> int:
    """Fills with NaN the elements of the flat partitions of ``engine`` (enable_deepspeed_zero
    called on it) that lie in none of their pieces, the padding that DeepSpeed aligns partitions
    with (ZeRO-3 never writes its own: it holds whatever the memory held), so that a step reading
    padding would show; returns how many elements it filled."""
    filled = 0
    for flat in flat_partitions(engine):
        part = opt._sharding.partitions[id(flat)]
        outside = torch.ones(flat.numel(), dtype=torch.bool)
        for start, numel in zip(part.starts, part.numels):
            outside[start:start + numel] = False
        with torch.no_grad():
            flat[outside] = float("nan")
        filled += int(outside.sum())
    return filled


def train(ctx, engine, steps, first=0, data=None):
    rank, gas = ctx["rank"], engine.gradient_accumulation_steps()
    micro = GLOBAL_BATCH // (dist_utils.WORLD * gas)
    for step in range(first, first + steps):
        x, y = (data or batch)(step)
        # rank r's micro-batches: one contiguous slice of the global batch each
        xs, ys = x.view(dist_utils.WORLD, gas, micro, *x.shape[1:])[rank], y.view(dist_utils.WORLD, gas, micro)[rank]
        for k in range(gas):
            loss = torch.nn.functional.cross_entropy(engine(xs[k]), ys[k])
            engine.backward(loss)
            engine.step()


def reference(kind, backend, steps, model_of=None, data=None, **opt_extra):
    """The same training in one process: full global batch, the mean loss."""
    model = (model_of or make_model)()
    init = [p.detach().clone() for p in model.parameters()]
    opt = make_opt(kind, model, backend, **opt_extra)
    for step in range(steps):
        x, y = (data or batch)(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return init, [p.detach() for p in model.parameters()]


def apart(init, ref, got) -> float:
    """max over tensors of max|got - ref| / max|ref - init| (the distance in units of the
    largest change the steps made to that tensor)."""
    return max(float((g.detach().float() - r).abs().max() / (r - i).abs().max())
               for i, r, g in zip(init, ref, got))


def refused_without(ctx, engine, opt, data=None) -> dict:
    """dist_utils.refused_step of one training step of ``engine`` (enable_deepspeed_zero not
    called, or refused), over the flat partitions and the optimizer's state."""
    return dist_utils.refused_step(lambda: train(ctx, engine, 1, data=data),
                                   flat_partitions(engine), opt)


def matches(ctx, kind, backend, stage, gas=1, offload=False, disabled_too=True):
    """Trained with enable_deepspeed_zero, against one process (``enabled``: apart()); without
    it (``disabled_too``), refused_without."""
    init, ref = reference(kind, backend, STEPS)
    out = {}
    if disabled_too:
        engine, opt = engine_for(kind, backend, config(stage, gas, offload=offload), enable=False)
        out["disabled"] = refused_without(ctx, engine, opt)
    for enable in (True,):
        engine, opt = engine_for(kind, backend, config(stage, gas, offload=offload), enable=enable)
        out["padding"] = nan_padding(engine, opt)
        calls = []  # the gloo collectives of each call of the fusedopt optimizer's step
        step = opt.step

        def counted(*args, **kwargs):
            box = []
            calls.append(dist_utils.count_collectives(lambda: box.append(step(*args, **kwargs))))
            return box[0]

        opt.step = counted
        train(ctx, engine, STEPS)
        out["enabled"] = apart(init, ref, engine.module.parameters())
        out["collectives"] = [dict(c) for c in calls]
    return out


def make_bert() -> torch.nn.Module:
    """A tiny BERT classifier (transformers): 57 tensors, several of them cut between ranks."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=32, num_labels=5,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(input_ids=x).logits

    return Logits(model)


def bert_batch(step: int):
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randint(0, 300, (GLOBAL_BATCH, 12), generator=g),
            torch.randint(0, 5, (GLOBAL_BATCH,), generator=g))


# In exact arithmetic an attention key bias gets no gradient (the softmax ignores a shift of
# its scores); what reaches it is rounding, and its "updates" are noise that no two summation
# orders share, so the comparison leaves these tensors out.
NOISE_ONLY = "attention.self.key.bias"


def bert(ctx, kind, backend, stage):
    """matches() on a tiny BERT: every tensor but the attention key biases."""
    init, ref = reference(kind, backend, STEPS, make_bert, bert_batch)
    names = [n for n, _ in make_bert().named_parameters()]
    keep = [i for i, n in enumerate(names) if NOISE_ONLY not in n]
    out = {"tensors": len(names), "compared": len(keep)}
    engine, opt = engine_for(kind, backend, config(stage), enable=False, model_of=make_bert)
    out["disabled"] = refused_without(ctx, engine, opt, data=bert_batch)
    engine, _ = engine_for(kind, backend, config(stage), model_of=make_bert)
    train(ctx, engine, STEPS, data=bert_batch)
    got = list(engine.module.parameters())
    out["enabled"] = apart([init[i] for i in keep], [ref[i] for i in keep], [got[i] for i in keep])
    return out


def same_grads(ctx, kind, backend, stage):
    """Mixed precision: DeepSpeed keeps float32 masters of the bf16 model and averages float32
    grads of per-rank bf16 backward passes, which one process on the whole batch does not
    reproduce. So the reference here is one process stepping float32 copies of the masters with
    DeepSpeed's own full gradients (read after each backward): the masters must agree within
    float32 rounding."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    engine, opt = engine_for(kind, backend, config(stage, bf16=True), enable=False)
    out = {"disabled": refused_without(ctx, engine, opt, data=lambda s: batch(s, torch.bfloat16))}
    for enable in (True,):
        engine, opt = engine_for(kind, backend, config(stage, bf16=True), enable=enable)
        out["padding"] = nan_padding(engine, opt)
        params = list(engine.module.parameters())
        ref_model = make_model()
        with torch.no_grad():
            for q, p in zip(ref_model.parameters(), params):
                q.copy_(safe_get_full_fp32_param(p))
        init = [q.detach().clone() for q in ref_model.parameters()]
        ref_opt = make_opt(kind, ref_model, backend)
        worst = 0.0
        for step in range(STEPS):
            x, y = batch(step, torch.bfloat16)
            micro = GLOBAL_BATCH // dist_utils.WORLD
            sl = slice(ctx["rank"] * micro, (ctx["rank"] + 1) * micro)
            engine.backward(torch.nn.functional.cross_entropy(engine(x[sl]).float(), y[sl]))
            for q, p in zip(ref_model.parameters(), params):
                q.grad = safe_get_full_grad(p).float()
            engine.step()
            ref_opt.step()
            worst = max(worst, apart(init, [q.detach() for q in ref_model.parameters()],
                                     [safe_get_full_fp32_param(p) for p in params]))
        out["enabled"] = worst
    return out


def skip_nonfinite(ctx, backend):
    """skip_nonfinite=True (its gradient total all-reduced at every step call), then a NaN loss
    on rank 1 only: DeepSpeed's own overflow check (on by default, also in float32) skips that
    step on every rank before the optimizer runs."""
    engine, opt = engine_for("lamb", backend, config(2), skip_nonfinite=True)
    first = [g["params"][0].clone() for g in opt.param_groups]
    train(ctx, engine, 1)
    before = [g["params"][0].clone() for g in opt.param_groups]
    stepped = not any(map(bits_equal, first, before))
    x, y = batch(1)
    micro = GLOBAL_BATCH // dist_utils.WORLD
    sl = slice(ctx["rank"] * micro, (ctx["rank"] + 1) * micro)
    loss = torch.nn.functional.cross_entropy(engine(x[sl]), y[sl])
    engine.backward(loss * float("nan") if ctx["rank"] == 1 else loss)
    engine.step()
    unchanged = all(bits_equal(b, g["params"][0]) for b, g in zip(before, opt.param_groups))
    return {"stepped": stepped, "skipped": int(opt.skipped_steps), "unchanged": unchanged}


def doc_block(ctx):
    """The python block of docs/distributed.md's DeepSpeed section, as written, given a model, a
    loader of this rank's micro-batches (bf16 inputs: the block turns bf16 on) and a loss."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "distributed.md")) as f:
        section = f.read().split("## DeepSpeed ZeRO\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    micro = GLOBAL_BATCH // dist_utils.WORLD
    sl = slice(ctx["rank"] * micro, (ctx["rank"] + 1) * micro)
    loader = [(x[sl], y[sl]) for x, y in (batch(step, torch.bfloat16) for step in range(3))]
    ns = {"model": make_model(), "loader": loader,
          "loss_fn": lambda out, y: torch.nn.functional.cross_entropy(out.float(), y)}
    exec(compile(code, "docs/distributed.md, DeepSpeed block", "exec"), ns)
    return {"steps": ns["engine"].global_steps, "partitions": len(ns["opt"]._sharding.partitions)}


def resume(ctx, kind, backend, stage, enable_after_load=False, **opt_extra):
    """Save after 2 steps, train 2 more; a fresh engine loads the checkpoint and trains the same
    2: the params and the optimizer state must be equal bit for bit."""
    path = os.path.join(ctx["out_dir"], f"ckpt-{kind}-{backend}-{stage}")
    cfg = config(stage)
    a, opt_a = engine_for(kind, backend, cfg, **opt_extra)
    train(ctx, a, 2)
    a.save_checkpoint(path, tag="t")
    train(ctx, a, 2, first=2)
    b, opt_b = engine_for(kind, backend, cfg, enable=not enable_after_load, **opt_extra)
    b.load_checkpoint(path, tag="t")
    if enable_after_load:
        import fusedopt.distributed

        fusedopt.distributed.enable_deepspeed_zero(b)
    train(ctx, b, 2, first=2)
    from deepspeed.utils import safe_get_full_fp32_param

    params = max(float((safe_get_full_fp32_param(p) - safe_get_full_fp32_param(q)).abs().max())
                 for p, q in zip(a.module.parameters(), b.module.parameters()))
    state = 0.0
    for fa, fb in zip(flat_partitions(a), flat_partitions(b)):
        sa, sb = opt_a.state[fa], opt_b.state[fb]
        state = max([state, *(float((sa[k] - sb[k]).abs().max()) for k in sa)])
    steps = [float(opt_b.state[f]["step"]) for f in flat_partitions(b)]
    return {"params": params, "state": state, "steps": steps}


def flat_partitions(engine) -> list:
    """The flat float32 partitions the fusedopt optimizer steps (ZeRO-3 puts each into its group
    only for its step)."""
    zero = engine.optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)
    return list(flats) if flats is not None else [g["params"][0] for g in zero.optimizer.param_groups]


def refusals(ctx, backend):
    """What enable_deepspeed_zero and a step refuse, and that a refused step changes nothing."""
    import fusedopt.distributed

    out = {}
    for name, extra in (("max_grad_norm", dict(max_grad_norm=1.0)),
                        ("state_precision", dict(state_precision="8bit", state_min_numel=0))):
        engine, opt = engine_for("lamb", backend, config(2), enable=False, **extra)
        try:
            fusedopt.distributed.enable_deepspeed_zero(engine)
            out[name] = "accepted"
        except (ValueError, RuntimeError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        # carrying on after the refusal: the step refuses too
        out[name + "_step"] = refused_without(ctx, engine, opt)
    engine, opt = engine_for("lamb", backend, config(2))
    train(ctx, engine, 1)
    before = [(g["params"][0].clone(), {k: v.clone() for k, v in opt.state[g["params"][0]].items()})
              for g in opt.param_groups]
    opt.param_groups[0]["max_grad_norm"] = 1.0
    try:
        train(ctx, engine, 1, first=1)
        out["late_max_grad_norm"] = "accepted"
    except ValueError as e:
        out["late_max_grad_norm"] = f"ValueError: {e}"
    out["unchanged"] = all(
        bits_equal(p, g["params"][0]) and all(bits_equal(v, opt.state[g["params"][0]][k])
                                              for k, v in st.items())
        for (p, st), g in zip(before, opt.param_groups))
    cfg = config(2)
    cfg["zero_optimization"]["elastic_checkpoint"] = True
    try:
        engine_for("lamb", backend, cfg)
        out["elastic_checkpoint"] = "accepted"
    except (ValueError, RuntimeError, TypeError) as e:
        out["elastic_checkpoint"] = f"{type(e).__name__}: {e}"
    return out


def _bf16_state(ctx, backend, stage):
    """ZeRO with bf16 state against one process with bf16 state; the same with each piece's
    random bits counted from its own first element (the control); and how far one process's
    bf16 state is from its full state."""
    extra = dict(state_precision="bf16", state_min_numel=0)
    init, ref = reference("lamb", backend, STEPS, **extra)
    out = {"bf16_vs_full": apart(init, reference("lamb", backend, STEPS)[1], ref)}
    for name in ("enabled", "local_bits"):
        engine, opt = engine_for("lamb", backend, config(stage), **extra)
        if name == "local_bits":
            for part in opt._sharding.partitions.values():
                part.firsts = [0] * len(part.firsts)
        train(ctx, engine, STEPS)
        out[name] = apart(init, ref, engine.module.parameters())
    out["state_dtypes"] = sorted({str(st["exp_avg_sq"].dtype) for st in opt.state.values()})
    return out


def scenarios(backends):
    out = []
    for be in backends:
        for kind in KINDS:
            for stage in (1, 2, 3):
                out.append((f"zero{stage}-{kind}-{be}", matches, (kind, be, stage)))
        out.append((f"gas-{be}", matches, ("lamb", be, 2, 2, False, False)))
        out.append((f"resume-lamb-{be}", resume, ("lamb", be, 2)))
        out.append((f"refusals-{be}", refusals, (be,)))
    be = backends[0]
    for stage in (1, 2, 3):
        out.append((f"bf16-zero{stage}-{be}", same_grads, ("lamb", be, stage)))
    out.append((f"resume-zero3-{be}", resume, ("lamb", be, 3)))
    # ZeRO-3 with offload_optimizer is left out: after the engines of the other scenarios in the
    # same process, DeepSpeed's own all-gather of persistent params times out in its step (run
    # alone, the scenario matches; docs/distributed.md)
    for stage in (1, 2):
        out.append((f"offload-zero{stage}-{be}", matches, ("lamb", be, stage, 1, True, False)))
    out.append((f"resume-lars-{be}", resume, ("lars", be, 1, True)))
    out.append(("doc-block", doc_block, ()))
    if importlib.util.find_spec("transformers") is not None:
        out.append((f"bert-zero2-lamb-{be}", bert, ("lamb", be, 2)))
        out.append((f"bert-zero1-lars-{be}", bert, ("lars", be, 1)))
    out.append((f"skip-nonfinite-{be}", skip_nonfinite, (be,)))
    return out


def bf16_state_scenarios(backends):
    """A job of their own: run after the scenarios above in the same processes, or before them,
    a ZeRO-3 engine's collectives time out (as with offload_optimizer above)."""
    bf16 = dict(state_precision="bf16", state_min_numel=0)
    return [*((f"bf16state-zero{stage}-{be}", _bf16_state, (be, stage))
              for be in backends for stage in (1, 2, 3)),
            *((f"bf16state-resume-zero{stage}-{backends[0]}",
               lambda ctx, *a: resume(ctx, *a, **bf16), ("lamb", backends[0], stage))
              for stage in (2, 3))]


def context(rank, world, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed  # noqa: F401 - joins the process group made by dist_utils.main

    return {"rank": rank, "out_dir": out_dir}


if __name__ == "__main__":
    dist_utils.main(sys.argv[1:], bf16_state_scenarios if os.environ.get("FUSEDOPT_DS_JOB") ==
                    "bf16state" else scenarios, context)
