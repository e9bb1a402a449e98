"""What each rank runs in tests/test_integrations.py: the real Hugging Face Trainer, Accelerate
and Lightning on 2 gloo ranks, ccfx's codec registered through ccfx.integrations
(module-level: spawn pickles them by name). Workers return plain data; the tests assert.

The ranks' process group exists before a framework starts (tests/ranks.py makes it, with
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR in the environment, as torchrun does): accelerate
and Lightning take it as it is. Every model is tiny and every run a few steps: the module's
ranks start once and run all of this.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import torch

import ccfx
from ccfx import integrations

from .ranks import caught, digest, mean_over_ranks, rng

#: ccfx's compile options for the compiled-stages routes; eager lowering: C++ codegen on CPU
#: would cost minutes, and what is tested is the route, not inductor.
STAGES = {"stages": 2, "activation_codec": "int8", "lowering": "eager"}


def _quiet():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*torch.compile.*")


def _ledger(state, model) -> dict:
    """What the hook's ledger counted: steps, per bucket calls / raw / wire bytes; and the
    bytes of the model's gradients (every step, each must cross the hook once)."""
    ledger = ccfx.ledger_of(state)
    rows = ledger.entries("bucket")
    return {"steps": ledger.steps, "hook_steps": state.steps,
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()
                              if p.requires_grad),
            "calls": {r.edge: r.calls for r in rows},
            "raw": sum(r.raw_bytes for r in rows), "wire": sum(r.wire_bytes for r in rows),
            "text": str(ledger)}


def _compiled_ledger(module) -> dict:
    ledger = ccfx.ledger_of(module)
    return {"fwd": ledger.totals("fwd"), "bwd": ledger.totals("bwd"),
            "stages": ccfx.plan_of(module).num_stages}


# -- Hugging Face Trainer -------------------------------------------------------------------------


def _tiny_gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _counting_dataset(n: int, length: int = 16):
    """Sequences that count up modulo the vocabulary from a random start: learnable in a few
    steps (the next token is the last one plus one)."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 64, (n,), generator=g)
    ids = (starts[:, None] + torch.arange(length)) % 64
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def _training_args(folder: str, steps: int, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=folder, max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
        seed=0, dataloader_num_workers=0, **kw)


def hf_trainer(rank: int, world: int, spec: str, steps: int, compiled: bool) -> dict:
    """The Trainer on ``world`` ranks, ccfx's codec registered with one line
    (``register_codec(trainer, spec)``); ``compiled``: the model also compiled by ccfx with
    stages before the Trainer sees it (``model.compile(backend="ccfx", options=...)``)."""
    _quiet()
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import Trainer

    model = _tiny_gpt2(seed=rank)  # DDP broadcasts rank 0's parameters
    if compiled:
        model.compile(backend="ccfx", options=STAGES)
    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(model=model, args=_training_args(folder, steps),
                          train_dataset=_counting_dataset(8 * world * steps))
        state = integrations.register_codec(trainer, spec)  # the one line
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "global_step": trainer.state.global_step,
            "wrapped_is_ddp": isinstance(trainer.model_wrapped, DDP),
            "ledger_of_ddp_is_state": ccfx.ledger_of(trainer.model_wrapped) is state.ledger,
            "ledger": _ledger(state, model),
            "plan": str(ccfx.plan_of(trainer.model_wrapped)),
            "buckets": len(ccfx.plan_of(trainer.model_wrapped).buckets),
            "compiled": _compiled_ledger(model) if compiled else None,
            "digest": digest(model.parameters())}


# -- Accelerate -----------------------------------------------------------------------------------


class MLP(torch.nn.Module):
    """Two layers. Not an ``nn.Sequential``: ``Sequential.compile()`` in place is not captured
    by Dynamo in torch 2.13 (it runs eagerly, and ccfx never sees it)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MLP()


def _regression_batch(rank: int, step: int, n: int = 32):
    """A fixed linear target (the same on every rank), inputs per rank and step."""
    target = torch.randn(32, 8, generator=torch.Generator().manual_seed(7)) / 4
    x = torch.randn(n, 32, generator=rng(rank, step))
    return x, x @ target


def accelerate_loop(rank: int, world: int, spec: str, steps: int) -> dict:
    """``accelerator.prepare`` then ``register_codec(model, spec)``; at every step the
    DDP gradients are compared with the exact mean of the ranks' local gradients (a copy of the
    model run without DDP on the same batch): averaged once, they are within the codec's error
    of it (summed without dividing, or twice, they would be a multiple of it)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    # 1 kB buckets: after its first step DDP regroups the MLP's 10 kB of gradients in 2
    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        DistributedDataParallelKwargs(bucket_cap_mb=0.001)])
    model = _mlp(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ddp, opt = accelerator.prepare(model, opt)
    state = integrations.register_codec(ddp, spec)  # the one line
    local = _mlp(seed=0)  # the same start as rank 0's, which DDP broadcast
    local.load_state_dict(ddp.module.state_dict())
    losses, errors, spread = [], [], []
    for step in range(steps):
        x, y = _regression_batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        accelerator.backward(loss)
        local.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        for p, q in zip(ddp.parameters(), local.parameters(), strict=True):
            mean = mean_over_ranks(q.grad)
            errors.append(((p.grad - mean).norm() / mean.norm()).item())
            spread.append(((q.grad - mean).norm() / mean.norm()).item())
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # the reference follows the DDP model
            for p, q in zip(ddp.parameters(), local.parameters(), strict=True):
                q.copy_(p)
        losses.append(loss.item())
    again = caught(lambda: integrations.register_codec(ddp, state)).get("error")
    other = caught(lambda: integrations.register_codec(ddp, "fp16"))
    whole = caught(lambda: integrations.register_codec(accelerator, spec))
    wrapped = torch.compile(ddp)  # what accelerate returns with a dynamo backend (not run here)
    found = (integrations.register_codec(wrapped, state) is state
             and ccfx.ledger_of(wrapped) is state.ledger)
    return {"losses": losses, "max_rel_error": max(errors), "min_local_spread": min(spread),
            "ledger": _ledger(state, ddp),
            "ledger_of_ddp_is_state": ccfx.ledger_of(ddp) is state.ledger,
            "plan": str(ccfx.plan_of(ddp)), "digest": digest(ddp.parameters()),
            "register_again": again, "second_hook": other, "accelerator": whole,
            "compiled_ddp_found": found}


# -- Lightning ------------------------------------------------------------------------------------


def _lightning_module(compiled: bool):
    import pytorch_lightning as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp(seed=int(os.environ.get("RANK", "0")))  # DDP broadcasts rank 0's
            if compiled:  # compiled stages inside a LightningModule
                self.net.compile(backend="ccfx", options=STAGES)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    return Regression()


def lightning_fit(rank: int, world: int, spec: str, steps: int, compiled: bool) -> dict:
    """``pl.Trainer(strategy=DDPStrategy(...), callbacks=[LightningCodecCallback(spec)])`` on
    CPU. The strategy is also given a ``ddp_comm_hook`` (torch's fp16 hook), which Lightning
    ignores on CPU: the callback must say so and register ccfx's codec anyway."""
    _quiet()
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.utils.data import DataLoader, TensorDataset

    xs, ys = zip(*(_regression_batch(r, s) for s in range(steps) for r in range(world)),
                 strict=True)
    data = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=32)
    module = _lightning_module(compiled)
    callback = integrations.LightningCodecCallback(spec)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, max_steps=steps, max_epochs=1,
        strategy=DDPStrategy(process_group_backend="gloo", ddp_comm_hook=fp16_compress_hook),
        callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    ccfx_warnings = [str(w.message) for w in seen if issubclass(w.category, ccfx.CcfxWarning)]
    return {"losses": module.losses, "global_step": trainer.global_step,
            "ledger": _ledger(callback.state, module), "plan": str(callback.plan()),
            "ledger_of_ddp_is_state": ccfx.ledger_of(callback.ddp_model) is callback.state.ledger,
            "warnings": ccfx_warnings,
            "compiled": _compiled_ledger(module.net) if compiled else None,
            "digest": digest(module.parameters())}
