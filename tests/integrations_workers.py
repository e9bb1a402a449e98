"""What each rank runs in tests/test_integrations.py: the real Hugging Face Trainer, Accelerate
and Lightning on 2 gloo ranks, ccfx's codec registered through ccfx.integrations
(module-level: spawn pickles them by name). Workers return plain data; the tests assert.

The ranks' process group exists before a framework starts (tests/ranks.py makes it, with
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR in the environment, as torchrun does): accelerate
and Lightning take it as it is. Every model is tiny and every run a few steps: the module's
ranks start once and run all of this.
"""

from __future__ import annotations

import contextlib
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


def _tiny_gpt2(seed: int, layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=layers, n_head=2,
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

    options = {"output_dir": folder, "max_steps": steps, "per_device_train_batch_size": 8,
               "learning_rate": 3e-3, "logging_steps": 1, "report_to": [],
               "save_strategy": "no", "disable_tqdm": True, "use_cpu": True, "seed": 0,
               "dataloader_num_workers": 0}
    return TrainingArguments(**{**options, **kw})


def _whole_graphs_under_ddp():
    """What a model compiled by ccfx inside DDP needs (ccfx.integrations refuses it otherwise):
    Dynamo's DDP optimizer off, so that the model's graph reaches ccfx whole, not split at
    DDP's bucket boundaries. Set for one scenario only: the ranks run the others after it."""
    return torch._dynamo.config.patch(optimize_ddp=False)


def hf_trainer(rank: int, world: int, spec: str, steps: int, compiled: bool, layers: int = 2,
               **args) -> dict:
    """The Trainer on ``world`` ranks, ccfx's codec registered with one line
    (``register_codec(trainer, spec)``); ``compiled``: the model also compiled by ccfx with
    stages before the Trainer sees it (``model.compile(backend="ccfx", options=...)``)."""
    _quiet()
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import Trainer

    model = _tiny_gpt2(seed=rank, layers=layers)  # DDP broadcasts rank 0's parameters
    if compiled:
        model.compile(backend="ccfx", options=STAGES)
    with tempfile.TemporaryDirectory() as folder, _whole_graphs_under_ddp():
        trainer = Trainer(model=model, args=_training_args(folder, steps, **args),
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
            "graphs": ([g.num_stages for g in ccfx.plan_of(model).graphs] if compiled else None),
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
    with warnings.catch_warnings(record=True) as seen, _whole_graphs_under_ddp():
        warnings.simplefilter("always")
        trainer.fit(module, data)
    ccfx_warnings = [str(w.message) for w in seen if issubclass(w.category, ccfx.CcfxWarning)]
    return {"losses": module.losses, "global_step": trainer.global_step,
            "ledger": _ledger(callback.state, module), "plan": str(callback.plan()),
            "ledger_of_ddp_is_state": ccfx.ledger_of(callback.ddp_model) is callback.state.ledger,
            "warnings": ccfx_warnings,
            "compiled": _compiled_ledger(module.net) if compiled else None,
            "digest": digest(module.parameters())}


# -- checkpoints: the hook's state saved and resumed through each framework -----------------------


@contextlib.contextmanager
def _shared_folder():
    """One temporary folder for every rank (rank 0 makes it and tells the others), as a
    checkpoint folder is on a shared file system: the frameworks write their files from rank
    0 only, and every rank reads them back."""
    import shutil

    import torch.distributed as dist

    name = [tempfile.mkdtemp(prefix="ccfx-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    try:
        yield name[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(name[0], ignore_errors=True)


def _same_state(a: dict, b: dict) -> bool:
    """Two CommHookState.state_dict()s hold the same steps, buckets and bits."""
    if a["steps"] != b["steps"] or a["buckets"] != b["buckets"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][k].cpu(), b["state"][k].cpu()) for k in a["state"])


def _summary(sd: dict) -> dict:
    return {"steps": sd["steps"], "buckets": len(sd["buckets"]), "tensors": len(sd["state"]),
            "nonzero": sum(int(t.abs().sum().item() > 0) for t in sd["state"].values())}


def hf_trainer_resume(rank: int, world: int, spec: str, steps: int, save_at: int) -> dict:
    """The Trainer saves at step ``save_at`` (and at the end); a fresh Trainer and model resume
    from ``checkpoint-<save_at>`` and train to ``steps``. Returns whether the hook state it
    restored equals the uninterrupted run's at ``save_at`` (recorded in memory), and both runs'
    final parameters and hook states."""
    _quiet()
    from transformers import Trainer, TrainerCallback

    class Snapshot(TrainerCallback):
        """The hook state at ``at`` (step end) or at train begin (``at`` None)."""

        def __init__(self, hook_state, at):
            self.hook_state, self.at, self.taken = hook_state, at, None

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == self.at:
                self.taken = self.hook_state.state_dict()

        def on_train_begin(self, args, state, control, **kw):
            if self.at is None:
                self.taken = self.hook_state.state_dict()

    data = _counting_dataset(8 * world * steps)
    out: dict = {}
    with _shared_folder() as folder:
        def trainer_for(seed):
            args = _training_args(folder, steps, ddp_find_unused_parameters=True,
                                  save_strategy="steps", save_steps=save_at,
                                  save_only_model=False)
            return Trainer(model=_tiny_gpt2(seed), args=args, train_dataset=data)

        first = trainer_for(seed=rank)
        state_a = integrations.register_codec(first, spec)
        snap_a = Snapshot(state_a, save_at)
        first.add_callback(snap_a)
        first.train()
        files = sorted(os.listdir(os.path.join(folder, f"checkpoint-{save_at}")))
        second = trainer_for(seed=100 + rank)  # other weights: the checkpoint must restore them
        state_b = integrations.register_codec(second, spec)
        snap_b = Snapshot(state_b, None)
        second.add_callback(snap_b)
        callback = next(c for c in second.callback_handler.callbacks
                        if isinstance(c, integrations.HFCodecCallback))
        second.train(resume_from_checkpoint=os.path.join(folder, f"checkpoint-{save_at}"))
        out["restored_from"] = os.path.basename(callback.restored_from or "")
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (first, second)]
    out.update({
        "files": files,
        "saved": _summary(snap_a.taken), "restored": _summary(snap_b.taken),
        "restored_equals_saved": _same_state(snap_a.taken, snap_b.taken),
        "final_states_equal": _same_state(state_a.state_dict(), state_b.state_dict()),
        "digests": [digest(first.model.parameters()), digest(second.model.parameters())],
        "losses": losses, "steps_b": state_b.steps})
    return out


def accelerate_resume(rank: int, world: int, spec: str, steps: int, save_at: int) -> dict:
    """``accelerator.save_state`` at ``save_at``; a new Accelerator, model and optimizer
    ``load_state`` it and train to ``steps``: the hook state restored equals the one saved,
    the run ends bit-equal to the uninterrupted one."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    def run(seed, folder, load, with_state=True):
        # find_unused_parameters=True: DDP never regroups its buckets, so the restored state
        # fits them from the first step (ccfx.runtime.comm_hook's docstring)
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(
            bucket_cap_mb=0.001, find_unused_parameters=True)])
        model = _mlp(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ddp, opt = accelerator.prepare(model, opt)
        state = integrations.register_codec(ddp, spec,
                                            accelerator=accelerator if with_state else None)
        saved, start = None, 0
        if load:
            accelerator.load_state(folder)
            saved, start = state.state_dict(), save_at
        for step in range(start, steps):
            x, y = _regression_batch(rank, step)
            accelerator.backward(torch.nn.functional.mse_loss(ddp(x), y))
            opt.step()
            opt.zero_grad()
            if not load and step + 1 == save_at:
                accelerator.save_state(folder)
                saved = state.state_dict()
        return state, saved, digest(ddp.parameters())

    with _shared_folder() as folder:
        state_a, saved_a, digest_a = run(rank, folder, load=False)
        files = sorted(f for f in os.listdir(folder) if f.startswith("ccfx"))
        state_b, restored_b, digest_b = run(100 + rank, folder, load=True)
        # the control: the same resume without ccfx's state (its codec starts fresh) differs
        _, fresh, digest_c = run(100 + rank, folder, load=True, with_state=False)
    return {"fresh_restored": _summary(fresh), "digest_without_state": digest_c,
            "files": files, "saved": _summary(saved_a), "restored": _summary(restored_b),
            "restored_equals_saved": _same_state(saved_a, restored_b),
            "final_states_equal": _same_state(state_a.state_dict(), state_b.state_dict()),
            "digests": [digest_a, digest_b]}


def lightning_resume(rank: int, world: int, spec: str, per_epoch: int, epochs: int) -> dict:
    """Lightning saves a ``.ckpt`` at every epoch end (ModelCheckpoint); a fresh Trainer,
    module and callback ``fit(ckpt_path=<epoch 0's>)`` to the same end. Epoch boundaries: a
    plain DataLoader resumed mid-epoch would start its epoch again."""
    _quiet()
    import glob

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    class Snapshot(pl.Callback):
        def __init__(self, hook_state, epoch_end: bool):
            self.hook_state, self.epoch_end, self.taken = hook_state, epoch_end, None

        def on_train_epoch_end(self, trainer, pl_module):
            if self.epoch_end and self.taken is None:
                self.taken = self.hook_state.state_dict()

        def on_train_start(self, trainer, pl_module):
            if not self.epoch_end:
                self.taken = self.hook_state.state_dict()

    xs, ys = zip(*(_regression_batch(r, s) for s in range(per_epoch) for r in range(world)),
                 strict=True)
    data = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=32)

    def fit(folder, ckpt_path=None):
        torch.manual_seed(rank)
        module = _lightning_module(compiled=False)
        callback = integrations.LightningCodecCallback(spec)
        snap = Snapshot(callback.state, epoch_end=ckpt_path is None)
        saver = ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1,
                                save_on_train_epoch_end=True)
        trainer = pl.Trainer(
            accelerator="cpu", devices=world, num_nodes=1, max_epochs=epochs,
            strategy=DDPStrategy(process_group_backend="gloo", find_unused_parameters=True),
            callbacks=[callback, snap, saver], logger=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, data, ckpt_path=ckpt_path)
        return callback, snap.taken, digest(module.parameters()), trainer.global_step

    with _shared_folder() as folder:
        cb_a, saved_a, digest_a, steps_a = fit(folder)
        first = min(glob.glob(os.path.join(folder, "epoch=0-*.ckpt")))
        stored = torch.load(first, map_location="cpu", weights_only=False)["callbacks"]
        ours = next(v for k, v in stored.items() if "LightningCodecCallback" in k)
        with _shared_folder() as again:
            cb_b, restored_b, digest_b, steps_b = fit(again, ckpt_path=first)
    return {"ranks_in_ckpt": sorted(ours["ranks"]), "world_in_ckpt": ours["world_size"],
            "saved": _summary(saved_a), "restored": _summary(restored_b),
            "restored_equals_saved": _same_state(saved_a, restored_b),
            "final_states_equal": _same_state(cb_a.state.state_dict(), cb_b.state.state_dict()),
            "digests": [digest_a, digest_b], "global_steps": [steps_a, steps_b]}


def checkpoint_refusals(rank: int, world: int) -> dict:
    """Another world size's or another rank's entry is a ConfigError naming the problem."""
    from ccfx.integrations import _checkpoint
    from ccfx.runtime.comm_hook import CommHookState

    state = CommHookState("int8")
    mine = _checkpoint.entry(state)
    other_world = {**mine, "world_size": world + 1}
    other_rank = {**mine, "rank": (rank + 1) % world}
    return {"world": caught(lambda: _checkpoint.load_entry(state, other_world, "test")),
            "rank": caught(lambda: _checkpoint.load_entry(state, other_rank, "test")),
            "gathered_world": caught(lambda: _checkpoint.load_gathered(
                state, {"world_size": world + 1, "ranks": {}}, "test"))}


def compiled_under_ddp_optimizer(rank: int, world: int) -> dict:
    """A model compiled by ccfx inside DDP while Dynamo's DDP optimizer is on (torch's
    default): register_codec refuses it, naming the setting that works; with it, it
    registers."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp(seed=0)
    model.fc1.compile(backend="ccfx", options=STAGES)  # a submodule, as in a LightningModule
    ddp = DDP(model)
    with torch._dynamo.config.patch(optimize_ddp=True):
        refused = caught(lambda: integrations.register_codec(ddp, "int8"))
    with _whole_graphs_under_ddp():
        state = integrations.register_codec(ddp, "int8")
    plain = caught(lambda: integrations.register_codec(DDP(_mlp(seed=0)), "int8"))["error"]
    return {"refused": refused, "registered": ccfx.ledger_of(ddp) is state.ledger,
            "plain": plain}
