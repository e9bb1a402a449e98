"""Eager DDP whose compressed gradient exchange overlaps the next step (CD-SGD).

    torchrun --nproc-per-node 2 examples/delayed_dp.py          # gloo on CPU

Each of DDP's buckets is encoded (int8) and its all-gather started in the backward of step t;
it is waited on in step t+1, so the transfer runs under the next forward and backward, and the
average is applied one step late (step 0 applies zeros). Every 5th step the residual (what the
int8 averages have not delivered since the last correction) travels exact, in fp32: the applied
gradients then sum to the exact ones. ``compensate`` moves each late average to the weights it
is applied at (DC-ASGD-a; about 3 / lr under AdamW). Every rank applies the same bits at every
step.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ccfx


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
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)))
    lr = 1e-3
    state, hook = ccfx.delayed_comm_hook("int8", correct_every=5, compensate=3 / lr)
    model.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    data = torch.Generator().manual_seed(100 + rank)   # each rank its own shard of the data
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 256, generator=data)
        y = x[:, :8].sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()                        # the gradients of the step before, averaged
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    checkpoint = state.state_dict()            # waits for the exchange still in flight first
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(model))
    if rank == 0:
        raw, wire = ccfx.ledger_of(model).totals("bucket")
        print(f"delayed_dp: {len(digests)} ranks, {state.steps} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, gradient wire/raw {wire / raw:.3f}, "
              f"in flight after saving {state.in_flight()}, saved {len(checkpoint['state'])} "
              f"tensors, ranks equal: {len(set(digests)) == 1}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
