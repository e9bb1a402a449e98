"""Data parallel with compressed gradients, no DDP wrapper.

    torchrun --nproc-per-node 2 examples/data_parallel.py        # gloo on CPU

Every rank runs the whole model on its own batches. ccfx averages the gradients across ranks
from inside the compiled backward, bucket by bucket through a codec (PowerSGD rank 4 with error
feedback here), so every rank ends each step with the same averaged gradients.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn

import ccfx


class MLP(nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (nn.Linear(width, width), nn.Linear(width, width),
                                        nn.Linear(width, 1))

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def digest(module: nn.Module) -> str:
    """A fingerprint of the parameters, to compare the ranks'."""
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in module.parameters())).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")            # "nccl" on GPUs; torchrun sets rank and world
    rank = dist.get_rank()
    torch.manual_seed(rank)                    # any init: rank 0's parameters are broadcast
    model = MLP()
    compiled = torch.compile(model, backend="ccfx", options={
        "data_parallel": True, "gradient_codec": "powersgd:rank=4,ef", "bucket_mb": 25})
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)

    data = torch.Generator().manual_seed(100 + rank)   # each rank its own shard of the data
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 256, generator=data)
        y = x[:, :8].sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(compiled(x), y)
        loss.backward()                        # the gradients come back already averaged
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(model))
    if rank == 0:
        print(ccfx.plan_of(compiled))          # the buckets: parameters, codec, collective, bytes
        print(ccfx.ledger_of(compiled))        # bytes per bucket per step, raw -> wire
        raw, wire = ccfx.ledger_of(compiled).totals("bucket")
        print(f"data_parallel: {len(digests)} ranks, {args.steps} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, gradient wire/raw {wire / raw:.3f}, "
              f"ranks equal: {len(set(digests)) == 1}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
