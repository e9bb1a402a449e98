"""Local steps over slow links (DiLoCo): sync every H steps, the sync compressed.

    torchrun --nproc-per-node 2 examples/local_steps.py          # gloo on CPU

Each replica takes H steps of its own optimizer; then the pseudo-gradient (global minus local
parameters) is averaged over the replicas through int8 and an outer optimizer moves the global
parameters, which every replica takes. The link carries one compressed model every H steps
instead of a gradient every step.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn

import ccfx

H = 5                                          # inner steps between syncs (DiLoCo: 50-500)


class MLP(nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="ccfx", options={
        "sync_every": H, "outer_codec": "int8"})   # H steps, int8 pseudo-gradients
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    # The line the loop gains; FedAvg's outer step (lr 1, no momentum) suits a few syncs
    # from a random init, DiLoCo's default Nesterov (0.7, 0.9) long runs.
    outer = ccfx.local_steps(compiled, opt, outer_lr=1.0, outer_momentum=0.0)

    data = torch.Generator().manual_seed(100 + rank)   # each replica its own batches
    losses = []
    for _ in range(args.steps):                # the loop is unchanged
        x = torch.randn(32, 256, generator=data)
        loss = nn.functional.mse_loss(compiled(x), x[:, :8].sum(dim=1, keepdim=True))
        loss.backward()
        opt.step()                             # every H-th step also syncs
        opt.zero_grad()
        losses.append(loss.item())
    outer.close()                              # merges what is in flight, stops syncing
    # A checkpoint: outer.state_dict() beside the model's and the optimizer's resumes bit for
    # bit (make the model and optimizer, ccfx.local_steps, then load the three).

    digest = hashlib.sha256(b"".join(t.numpy().tobytes()
                                     for t in outer.global_parameters().values())).hexdigest()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    if rank == 0:
        print(ccfx.ledger_of(compiled))        # rows "sync": each sync's bytes, raw -> wire
        raw, wire = ccfx.ledger_of(compiled).totals("outer")   # nothing before the first sync
        ratio = f"{wire / raw:.3f}" if raw else "- (no sync yet)"
        print(f"local_steps: {len(every)} replicas, {args.steps} steps, a sync every {H}, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, sync wire/raw {ratio}, "
              f"global parameters equal: {len(set(every)) == 1}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
