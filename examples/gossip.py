"""Compressed gossip (CHOCO-SGD): neighbours only, no all-reduce, no coordinator.

    torchrun --nproc-per-node 4 examples/gossip.py               # gloo on CPU, a ring of 4

After each optimizer step every rank sends the top 10 % of the change of its model since its
last message to its two neighbours on a ring, and moves its model towards theirs. Nothing is
averaged over all ranks: the models stay close (the consensus error), not equal.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main() -> None:
    import ccfx

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The line the loop gains: each opt.step() is followed by a gossip step.
    g = ccfx.gossip(model, opt, spec="topk:ratio=0.1", gamma=0.5, topology="ring")

    data = torch.Generator().manual_seed(100 + rank)   # each rank its own batches
    losses = []
    for _ in range(args.steps):                        # the loop is unchanged
        x = torch.randn(32, 256, generator=data)
        loss = nn.functional.mse_loss(model(x), x[:, :8].sum(dim=1, keepdim=True))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    consensus = g.consensus()                          # one all-reduce: for reports only
    g.close()
    if rank == 0:
        raw = 4 * sum(p.numel() for p in model.parameters())
        print(f"gossip: {dist.get_world_size()} ranks on a ring, {args.steps} steps, "
              f"neighbours {g.neighbours}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"sent/raw per neighbour {g.bytes_per_step / len(g.neighbours) / raw:.3f}, "
              f"consensus {consensus:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
