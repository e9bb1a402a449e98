"""The README's Trainer and Accelerate recipes as a user runs them:
``torchrun --nproc-per-node 2 this.py trainer|accelerate OUT``. Each rank adds ccfx's codec in
one line (``register_codec(trainer, spec)``, or ``register_codec(model, spec,
accelerator=accelerator)`` on what ``accelerator.prepare`` returned), trains, and writes what it
saw to ``OUT.rank<r>.json`` (tests/test_integrations.py reads them). Not a test module: pytest
does not collect it."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

import torch
from torch import nn

import ccfx
from ccfx.integrations import register_codec

STEPS = 4


class Regressor(nn.Module):
    """What the Trainer needs of a model: keyword inputs, a dict with ``loss``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x, labels=None):
        out = self.fc2(nn.functional.gelu(self.fc1(x)))
        loss = None if labels is None else nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


def trainer_route(model, data):
    """``Trainer`` + ``register_codec(trainer, spec)``: (the DDP model, the hook state, steps)."""
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(output_dir=folder, max_steps=STEPS, per_device_train_batch_size=8,
                                 learning_rate=1e-2, report_to=[], save_strategy="no",
                                 disable_tqdm=True, use_cpu=True, seed=0, logging_steps=1,
                                 dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        state = register_codec(trainer, "int8")  # the one line
        trainer.train()
    return trainer.model_wrapped, state, trainer.state.global_step


def accelerate_route(model, data):
    """``accelerator.prepare`` + ``register_codec(model, spec, accelerator=...)``."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=8)
    ddp, opt, loader = accelerator.prepare(model, opt, loader)
    state = register_codec(ddp, "int8", accelerator=accelerator)  # the one line
    steps = 0
    for batch in loader:
        opt.zero_grad()
        accelerator.backward(ddp(**batch)["loss"])
        opt.step()
        steps += 1
        if steps == STEPS:
            break
    return ddp, state, steps


def main(route: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's
    model = Regressor()
    x = torch.randn(16 * STEPS, 32, generator=torch.Generator().manual_seed(1))
    data = [{"x": a, "labels": a[:8] * 0.5} for a in x]
    ddp, state, steps = {"trainer": trainer_route, "accelerate": accelerate_route}[route](
        model, data)
    raw, wire = ccfx.ledger_of(ddp).totals("bucket")
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"world": int(os.environ["WORLD_SIZE"]), "steps": steps,
                   "hook_steps": state.steps, "raw": raw, "wire": wire, "digest": digest}, f)
    # Leave together and tear the group down before the interpreter exits: a rank whose peer
    # was gone while its gloo threads still ran aborted at exit ("terminate called without an
    # active exception", SIGABRT) in one CI run.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
