"""The recipes of docs/integrations.md, run for a few steps each: Hugging Face Trainer, accelerate,
PyTorch Lightning (fp32 and bf16-mixed) and plain PyTorch AMP with GradScaler.

Every model is a tiny BERT built from a config (no downloads) that learns to repeat its input
tokens; every resume test compares the params after N uninterrupted optimizer steps with N/2
steps, a checkpoint, a fresh process-like rebuild and N/2 more steps, bit for bit."""
from __future__ import annotations

import os

# Nothing here downloads; make an accidental hub access fail fast instead of waiting on a network.
# Set before transformers is imported: huggingface_hub reads it at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import fusedopt
from fusedopt.schedules import WarmupPolyDecayLR

VOCAB, SEQ = 100, 16


def _needs(name):
    return pytest.importorskip(name, reason=f"{name} is not installed (pinned in requirements-dev.txt)")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def tiny_bert():
    transformers = _needs("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def token_data(n=32):
    """Random token sequences; the label of each position is its own token."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def falls(losses, by=0.05):
    """The mean of the last two losses is below the mean of the first two by ``by``."""
    assert len(losses) >= 4, losses
    return sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - by


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    diff = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not diff, f"params differ after resuming: {diff}"


# LAMB's lr is the relative step of each layer (docs/integrations.md#lr-guidance); on this toy task
# 5e-2 makes the loss fall within a handful of steps, AdamW-style 5e-5 would not move it.
LR = 5e-2


# --------------------------------------------------------------------------- Hugging Face Trainer


def _hf_args(out, **kw):
    transformers = _needs("transformers")
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=6, save_strategy="steps", save_steps=3, logging_steps=1, seed=0,
        report_to="none", use_cpu=True, disable_tqdm=True, **kw)


def _hf_trainer_with_optimizers(out, data):
    transformers = _needs("transformers")
    model = tiny_bert()
    opt = fusedopt.FusedLAMB(fusedopt.param_groups(model, weight_decay=0.01), lr=LR,
                             max_grad_norm=1.0)
    sched = WarmupPolyDecayLR(opt, warmup_steps=2, total_steps=6)
    # max_grad_norm=0: the optimizer clips (fused, on the unscaled gradients); not twice.
    trainer = transformers.Trainer(model=model, args=_hf_args(out, max_grad_norm=0.0),
                                   train_dataset=data, optimizers=(opt, sched))
    return model, trainer


def test_hf_trainer_optimizers_loss_falls_and_resume_is_bit_identical(tmp_path):
    data = token_data()
    model, trainer = _hf_trainer_with_optimizers(tmp_path, data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and falls(losses), losses
    # the fusedopt schedule steps once per optimizer step (not per micro-batch): warm-up from 0
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs[:3] == pytest.approx([0.0, LR / 2, LR])
    ckpt = tmp_path / "checkpoint-3"
    assert {"optimizer.pt", "scheduler.pt"} <= {p.name for p in ckpt.iterdir()}

    resumed, trainer2 = _hf_trainer_with_optimizers(tmp_path, data)
    trainer2.train(resume_from_checkpoint=str(ckpt))
    assert trainer2.state.global_step == 6
    assert_same_params(model, resumed)


def test_hf_trainer_optimizer_cls_and_kwargs_with_param_groups(tmp_path):
    transformers = _needs("transformers")
    data = token_data()

    # Without "params", the Trainer builds its own two groups: no weight decay for biases and
    # LayerNorm, but the trust ratio still applies to them (adapt=True).
    model = tiny_bert()
    trainer = transformers.Trainer(model=model, args=_hf_args(tmp_path / "a", weight_decay=0.01),
                                   train_dataset=data,
                                   optimizer_cls_and_kwargs=(fusedopt.FusedLAMB, {"lr": LR}))
    trainer.create_optimizer()
    groups = trainer.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert [g["adapt"] for g in groups] == [True, True]

    # With "params": fusedopt.param_groups, the groups are the intended ones.
    model = tiny_bert()
    kwargs = {"params": fusedopt.param_groups(model, weight_decay=0.01), "lr": LR,
              "max_grad_norm": 1.0}
    args = _hf_args(tmp_path / "b", max_grad_norm=0.0, warmup_steps=2, lr_scheduler_type="linear")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizer_cls_and_kwargs=(fusedopt.FusedLAMB, kwargs))
    trainer.train()
    groups = trainer.optimizer.param_groups
    assert isinstance(trainer.optimizer.optimizer, fusedopt.FusedLAMB)
    by_param = {id(p): g for g in groups for p in g["params"]}
    for name, p in model.named_parameters():
        g = by_param[id(p)]
        excluded = p.ndim <= 1  # every bias and LayerNorm weight of BERT
        assert g["adapt"] is not excluded, name
        assert g["weight_decay"] == (0.0 if excluded else 0.01), name
    assert any(("LayerNorm" in n or n.endswith("bias")) for n, p in model.named_parameters()
               if not by_param[id(p)]["adapt"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert falls(losses), losses
    # The Trainer pops "params" out of the dict it was given: build a fresh dict per Trainer.
    assert "params" not in kwargs


# --------------------------------------------------------------------------------- accelerate


def _accelerate_run(out, data, *, epochs, load_from=None, save_after_epoch=None):
    accelerate = _needs("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_bert()
    opt = fusedopt.FusedLAMB(fusedopt.param_groups(model, weight_decay=0.01), lr=LR)
    sched = WarmupPolyDecayLR(opt, warmup_steps=2, total_steps=8)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    start = 0
    if load_from is not None:
        accelerator.load_state(str(load_from))
        start = save_after_epoch
    losses = []
    for epoch in range(start, epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(loss.item())
        if save_after_epoch is not None and epoch + 1 == save_after_epoch and load_from is None:
            accelerator.save_state(str(out))
    return accelerator.unwrap_model(model), losses, opt, sched


def test_accelerate_prepare_clip_accumulate_and_resume(tmp_path):
    data = token_data()  # 8 micro-batches of 4 per epoch, 4 optimizer steps per epoch
    full, losses, opt, sched = _accelerate_run(tmp_path / "ckpt", data, epochs=2,
                                               save_after_epoch=1)
    assert falls(losses), losses
    assert isinstance(opt.optimizer, fusedopt.FusedLAMB)
    assert sched.scheduler.last_epoch == 8  # once per optimizer step, not per micro-batch
    resumed, _, _, _ = _accelerate_run(tmp_path / "ckpt", data, epochs=2,
                                    load_from=tmp_path / "ckpt", save_after_epoch=1)
    assert_same_params(full, resumed)


# ------------------------------------------------------------------------- PyTorch Lightning


def _lightning_module(max_grad_norm=None, total_steps=8):
    L = _needs("lightning")

    class TinyBert(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_bert()
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            opt = fusedopt.FusedLAMB(fusedopt.param_groups(self, weight_decay=0.01), lr=LR,
                                     max_grad_norm=max_grad_norm)
            sched = WarmupPolyDecayLR(opt, warmup_steps=2, total_steps=total_steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return TinyBert()


def _lightning_trainer(root, **kw):
    L = _needs("lightning")
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(root), **kw)


def _loader(data):
    return torch.utils.data.DataLoader(data, batch_size=4)


def test_lightning_fp32_clip_schedule_and_resume(tmp_path):
    data = token_data()  # 8 batches per epoch, accumulate 2: 4 optimizer steps per epoch
    kw = dict(gradient_clip_val=1.0, accumulate_grad_batches=2)
    full = _lightning_module()
    trainer = _lightning_trainer(tmp_path, max_epochs=2, **kw)
    trainer.fit(full, _loader(data))
    assert falls(full.losses), full.losses
    # interval="step" with accumulation: once per optimizer step, not per batch
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8

    half = _lightning_module()
    trainer = _lightning_trainer(tmp_path, max_epochs=1, **kw)
    trainer.fit(half, _loader(data))
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    resumed = _lightning_module()
    _lightning_trainer(tmp_path, max_epochs=2, **kw).fit(resumed, _loader(data),
                                                         ckpt_path=tmp_path / "half.ckpt")
    assert_same_params(full, resumed)


def test_lightning_bf16_mixed_clips_with_max_grad_norm(tmp_path):
    data = token_data()
    # Lightning refuses gradient_clip_val for optimizers that unscale inside step(), as it does
    # for torch.optim.AdamW(fused=True), even under bf16 where nothing is scaled.
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _lightning_trainer(tmp_path, max_epochs=1, precision="bf16-mixed",
                           gradient_clip_val=1.0).fit(_lightning_module(), _loader(data))
    module = _lightning_module(max_grad_norm=1.0, total_steps=16)
    _lightning_trainer(tmp_path, max_epochs=2, precision="bf16-mixed").fit(module, _loader(data))
    assert falls(module.losses), module.losses
    assert all(torch.isfinite(p).all() for p in module.parameters())


# -------------------------------------------------------------------- plain PyTorch with AMP


def _amp_train(steps, *, scaler=None, autocast=False, inf_at=None):
    model = tiny_bert()
    opt = fusedopt.FusedLAMB(fusedopt.param_groups(model, weight_decay=0.01), lr=LR,
                             max_grad_norm=1.0)
    data = token_data()
    losses = []
    for i in range(steps):
        j = 4 * (i % 8)  # two passes over the 8 batches of 4
        batch = {k: torch.stack([d[k] for d in data[j:j + 4]]) for k in data[0]}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            if i == inf_at:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(opt)  # no scaler.unscale_: the step unscales and clips as it reads
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_plain_amp_grad_scaler_unscales_and_clips_inside_the_step():
    # A power-of-two loss scale is exact, so unscaling inside the step (before the clipping norm)
    # gives bit for bit the unscaled run.
    plain, losses = _amp_train(12)
    scaled, _ = _amp_train(12, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))
    assert falls(losses), losses
    assert_same_params(plain, scaled)


def test_plain_amp_grad_scaler_skips_an_inf_step():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    skipped, _ = _amp_train(3, scaler=scaler, inf_at=2)
    two, _ = _amp_train(2)
    assert_same_params(skipped, two)  # the third step changed nothing
    assert scaler.get_scale() == 2.0 ** 11


def test_plain_amp_autocast_bf16_loss_falls():
    scaler = torch.amp.GradScaler("cpu")
    _, losses = _amp_train(12, scaler=scaler, autocast=True)
    assert falls(losses), losses


# ------------------------------------------------------------------ the page's code, as written
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "integrations.md")
# The only edits made to the page's code before it runs: step counts a test can afford. Each
# must apply somewhere, so that the table follows the page.
SHRINK = {"10_000": "4", "warmup_steps=500": "warmup_steps=1", "save_steps=1000": "save_steps=2",
          "per_device_train_batch_size=32": "per_device_train_batch_size=4"}


def _doc_blocks() -> list[str]:
    text = open(DOC, encoding="utf-8").read()
    return [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]


def test_the_page_code_runs_as_written(tmp_path, monkeypatch):
    """Every python block of docs/integrations.md, in order, in one namespace (a block may use
    what an earlier one defined), each given a fresh `model` and its data: the tiny BERT with
    `train_ds` / `loader` of token batches, or for the AMP block (`model(x)`) a small
    classifier with a loader of (x, y)."""
    for name in ("transformers", "accelerate", "lightning"):
        _needs(name)
    monkeypatch.chdir(tmp_path)  # the blocks write out/, ckpt, lightning_logs/ where they run
    blocks = _doc_blocks()
    assert len(blocks) >= 6, "docs/integrations.md lost its recipes"
    used = set()
    ns: dict = {"torch": torch}
    gen = torch.Generator().manual_seed(0)
    for i, code in enumerate(blocks):
        for old, new in SHRINK.items():
            if old in code:
                used.add(old)
                code = code.replace(old, new)
        if "model(x)" in code:
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 3))
            xs, ys = torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)
            ns.update(model=model, loader=torch.utils.data.DataLoader(
                list(zip(xs, ys)), batch_size=4))
        else:
            data = token_data()
            ns.update(model=tiny_bert(), train_ds=data, loader=_loader(data))
        try:
            exec(compile(code, f"docs/integrations.md block {i + 1}", "exec"), ns)
        except Exception as e:
            raise AssertionError(f"docs/integrations.md block {i + 1} fails as written: "
                                 f"{type(e).__name__}: {e}\n{code}") from e
    assert used == set(SHRINK), f"SHRINK entries no block needs: {set(SHRINK) - used}"
