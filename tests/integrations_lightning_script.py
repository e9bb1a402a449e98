"""The README's Lightning recipe as a user runs it: ``python this.py OUT``, and Lightning
(``strategy="ddp"``, ``devices=2`` on CPU) starts the second rank itself by running this script
again. Each rank writes what it saw to ``OUT.rank<r>.json`` (tests/test_integrations.py reads
them). Not a test module: pytest does not collect it."""

from __future__ import annotations

import hashlib
import json
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ccfx
from ccfx.integrations import LightningCodecCallback

STEPS = 4


class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(out: str) -> None:
    x = torch.randn(64 * STEPS, 32, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=32)
    codec = LightningCodecCallback("int8")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[codec],
                         max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = Lit()
    trainer.fit(module, data)
    raw, wire = ccfx.ledger_of(codec.state).totals("bucket")
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in module.parameters())).hexdigest()
    with open(f"{out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump({"world": trainer.world_size, "steps": trainer.global_step,
                   "hook_steps": codec.state.steps, "raw": raw, "wire": wire,
                   "digest": digest}, f)
    # Lightning leaves its process group up: leave together and tear it down before the
    # interpreter exits, as the torchrun script does (rank 0 aborted at exit once, "terminate
    # called without an active exception", in session 16's CI run on a loaded machine)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
