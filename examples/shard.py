"""Sharded data parallel (FSDP / ZeRO-3) with `ccfx.shard`, its collectives compressed.

    torchrun --nproc-per-node 2 examples/shard.py                # gloo on CPU

Every parameter becomes a DTensor sharded over the ranks: each rank keeps 1/W of its rows and
of the optimizer's state. The forward all-gathers each weight where it is used, the backward
reduce-scatters its gradient onto the shard; compiled, both are graph nodes that ccfx replaces
by compressed ones (int8 gathers and int4 reduce-scatters with error feedback: ZeRO++'s shape).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

import ccfx


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
    model = ccfx.shard(MLP())                  # shard first: rank 0's values, 1/W per rank
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # then the optimizer, on the shards
    compiled = torch.compile(model, backend="ccfx", options={
        "collective_overrides": {"all_gather": "int8", "reduce_scatter": "int4:ef"}})

    data = torch.Generator().manual_seed(100 + rank)   # each rank its own batches
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 256, generator=data)
        y = x[:, :8].sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(compiled(x), y)   # the model itself, not a submodule
        loss.backward()                        # gradients reduce-scattered and averaged
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    # What this rank holds: its shard of every parameter (the local part of each DTensor).
    held = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(ccfx.plan_of(compiled))          # every all-gather and reduce-scatter, its codec
        print(ccfx.ledger_of(compiled))        # bytes per collective per step, raw -> wire
        raw, wire = ccfx.ledger_of(compiled).totals("collective")
        print(f"shard: {dist.get_world_size()} ranks, {args.steps} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, rank 0 holds {held / total:.2f} of "
              f"the parameters, collective wire/raw {wire / raw:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
