"""HSDP across nodes with torch's FSDP2: shard inside a node, compress only the replicas'
all-reduce across the slow link; checkpoint and resume the codec state with the model.

    torchrun --nproc-per-node 2 examples/fsdp2_hsdp.py --save ckpt        # 2 replicas x 1
    torchrun --nproc-per-node 2 examples/fsdp2_hsdp.py --resume ckpt
    torchrun --nproc-per-node 4 examples/fsdp2_hsdp.py --shard 2          # 2 replicas x 2

The mesh is (replicate, shard): `fully_shard` over `mesh["shard"]` (the fast link inside a
node), and `register_codec(..., replicate=mesh["replicate"])` averages each FSDP module's
gradients across the replicas through int8 with error feedback; the shards' own collectives
stay raw. Every replica ends each step with the same bits.
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
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
    parser.add_argument("--shard", type=int, default=1, help="ranks per replica (node)")
    parser.add_argument("--save", help="checkpoint folder to write after the last step")
    parser.add_argument("--resume", help="checkpoint folder to resume from")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.shard, args.shard),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = MLP()
    for block in model.blocks:                 # FSDP inside a node only
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    codecs = ccfx.integrations.register_codec(  # the replicas' all-reduce through int8:ef
        model, {"all_reduce": "int8:ef"}, replicate=mesh["replicate"],
        resume_from=args.resume)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.resume:                            # parameters and optimizer: torch's DCP
        weights, optim = get_state_dict(model, opt)
        dcp.load({"model": weights, "optim": optim}, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=weights, optim_state_dict=optim)

    data = torch.Generator().manual_seed(100 + rank)   # each rank its own batches
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 256, generator=data)
        y = x[:, :8].sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()                        # reduce-scatter raw, then int8:ef across replicas
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    if args.save:                              # every rank: DCP's shards and its codec state
        weights, optim = get_state_dict(model, opt)
        dcp.save({"model": weights, "optim": optim}, checkpoint_id=args.save)
        codecs.save(args.save)
    full = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    ends = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(ends, full)
    if rank == 0:
        print(ccfx.plan_of(model))             # each module's gather, scatter and all-reduce
        raw, wire = ccfx.ledger_of(model).totals("collective")
        same = all(torch.equal(ends[0], e) for e in ends)
        print(f"fsdp2_hsdp: {world // args.shard} replicas x {args.shard}, {args.steps} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, collective wire/raw "
              f"{wire / raw:.3f}, replicas equal: {same}"
              + (f", resumed from {args.resume}" if args.resume else ""))
    dist.barrier()                             # no rank tears its groups down while a peer
    dist.destroy_process_group()               # still uses them (rank 0 prints above)


if __name__ == "__main__":
    main()
