"""torch's own FSDP2 (`fully_shard`), its collectives compressed by ccfx: one added line.

    torchrun --nproc-per-node 2 examples/fsdp2.py                # gloo on CPU

The model is sharded with torch's `fully_shard` as usual (each block, then the model). One
call, `ccfx.integrations.register_codec`, gives every FSDP module ccfx's all-gather (int8
weights) and reduce-scatter (int4 gradients with error feedback: ZeRO++'s shape); the
optimizer and the training loop are unchanged.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ccfx
import ccfx.integrations


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:                 # torch's FSDP2, unchanged
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ccfx.integrations.register_codec(          # the one added line
        model, {"all_gather": "int8", "reduce_scatter": "int4:ef"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    data = torch.Generator().manual_seed(100 + rank)   # each rank its own batches
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 256, generator=data)
        y = x[:, :8].sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()                        # gradients reduce-scattered through int4:ef
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    if rank == 0:
        print(ccfx.plan_of(model))             # each FSDP module's gather and reduce-scatter
        print(ccfx.ledger_of(model))           # bytes per module per kind per step
        raw, wire = ccfx.ledger_of(model).totals("collective")
        print(f"fsdp2: {dist.get_world_size()} ranks, {args.steps} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, collective wire/raw {wire / raw:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
