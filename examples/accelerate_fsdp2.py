"""Accelerate's FSDP2 plugin, its gathers and reduce-scatters compressed by ccfx: one added line.

    accelerate launch --num_processes 2 examples/accelerate_fsdp2.py   # 2 GPUs (NCCL)

`FullyShardedDataParallelPlugin(fsdp_version=2)` makes `accelerator.prepare` shard the model
with torch's `fully_shard`: each `Block` (the auto-wrap policy picks it by class name), then
the model. `register_codec` on the model `prepare` returned gives every one of those FSDP
modules ccfx's all-gather (int8 weights) and reduce-scatter (int4 gradients with error
feedback). On CPU accelerate ignores the plugin and wraps the model in DDP (its FSDP path is
for GPUs and other accelerators only): `register_codec` then says so and what to use instead.
"""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, gather_object
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

import ccfx
from ccfx.integrations import register_codec


class Block(nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"])      # each Block its own FSDP module
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32 * args.steps * accelerator.num_processes, 256,
                    generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x[:, :8].sum(dim=1, keepdim=True)), batch_size=32)

    model, opt, data = accelerator.prepare(model, opt, data)   # fully_shard, by accelerate
    codecs = register_codec(                   # the one added line
        model, {"all_gather": "int8", "reduce_scatter": "int4:ef"})

    losses = []
    for x, y in data:                          # the training loop, as usual
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)             # gradients reduce-scattered through int4:ef
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    sharded = sum(isinstance(m, FSDPModule) for m in model.modules())  # the blocks and root
    steps = gather_object([codecs.ledger.steps])   # every rank's codecs counted every step
    if accelerator.is_main_process:
        print(ccfx.plan_of(model))             # each FSDP module's gather and reduce-scatter
        print(ccfx.ledger_of(model))           # bytes per module per kind per step
        raw, wire = ccfx.ledger_of(model).totals("collective")
        print(f"accelerate_fsdp2: {accelerator.num_processes} ranks, {len(losses)} steps, "
              f"{sharded} FSDP modules, steps counted per rank {steps}, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, collective wire/raw {wire / raw:.3f}")
    accelerator.wait_for_everyone()
    accelerator.end_training()                 # tears the process group down


if __name__ == "__main__":
    main()
