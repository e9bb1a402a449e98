"""Tensor parallel with torch's own styles, every collective compressed by ccfx.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py      # gloo on CPU

torch's `parallelize_module` splits the first Linear by columns and the second by rows
(Megatron's MLP), so the forward ends in an all-reduce of the ranks' partial outputs. ccfx
finds the collectives in the compiled forward and backward graphs and replaces each by its
compressed form (int8 here); every rank decodes the same bytes, so the ranks' outputs stay
bit-identical.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ccfx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))   # one tensor-parallel group of every rank

    torch.manual_seed(0)                       # the same model on every rank, before splitting
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    compiled = torch.compile(model, backend="ccfx", options={
        "collective_codec": "int8"})           # or per kind: "collective_overrides": {...}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    data = torch.Generator().manual_seed(1)    # a TP group computes one model: the same batch
    losses = []
    for _ in range(args.steps):
        x = torch.randn(16, 64, generator=data)
        loss = nn.functional.mse_loss(compiled(x), x.flip(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    every = [None] * world
    dist.all_gather_object(every, losses)
    if dist.get_rank() == 0:
        print(ccfx.plan_of(compiled))          # each collective: kind, shape, codec, bytes
        print(ccfx.ledger_of(compiled))
        raw, wire = ccfx.ledger_of(compiled).totals("collective")
        print(f"tensor_parallel: {world} ranks, {args.steps} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, collective wire/raw {wire / raw:.3f}, "
              f"ranks equal: {all(r == losses for r in every)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
