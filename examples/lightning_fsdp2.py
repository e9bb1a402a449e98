"""Lightning's ModelParallelStrategy (torch's FSDP2), its collectives compressed by ccfx.

    python examples/lightning_fsdp2.py         # Lightning starts the second process itself

The LightningModule shards itself in `configure_model` with torch's `fully_shard` on the
strategy's device mesh (each block, then the module), as Lightning asks, and registers
ccfx's codecs on the line after: every FSDP module's all-gather runs through int8 and its
reduce-scatter through int4 with error feedback. `configure_model` is where the FSDP modules
first exist, in every process, before the optimizer is built; a Callback's `setup` runs before
it (nothing sharded yet). Lightning may call `configure_model` again (`validate`, `test`):
the guard keeps the sharding and the codecs from being applied twice.
"""

import argparse

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset

import ccfx
import ccfx.integrations


class Lit(pl.LightningModule):
    def __init__(self, width: int = 256, depth: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.codecs, self.losses = None, []

    def configure_model(self):
        if isinstance(self, FSDPModule):       # sharded already (a later fit/validate/test)
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:              # torch's FSDP2, as Lightning asks
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)
        self.codecs = ccfx.integrations.register_codec(   # the one added line
            self, {"all_gather": "int8", "reduce_scatter": "int4:ef"})

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    x = torch.randn(2 * 32 * args.steps, 256, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x[:, :8].sum(dim=1, keepdim=True)), batch_size=32)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)  # FSDP x2
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = Lit()
    trainer.fit(module, data)

    steps = [None] * trainer.world_size        # every rank's codecs counted every step
    torch.distributed.all_gather_object(steps, module.codecs.ledger.steps)
    if trainer.global_rank == 0:
        print(ccfx.plan_of(module))            # each FSDP module's gather and reduce-scatter
        print(ccfx.ledger_of(module))          # bytes per module per kind per step
        raw, wire = ccfx.ledger_of(module).totals("collective")
        losses = module.losses
        print(f"lightning_fsdp2: {trainer.world_size} ranks, {trainer.global_step} steps, "
              f"steps counted per rank {steps}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"collective wire/raw {wire / raw:.3f}")
    # Lightning leaves its process group up: leave together, then tear it down.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
