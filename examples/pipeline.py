"""The pipeline on real ranks: one stage per rank, torch's own schedule, compressed sends.

    torchrun --nproc-per-node 2 examples/pipeline.py             # gloo on CPU
    ccfx run --nproc 2 --stages 2 --codec int8                   # the same, ready-made (tiny GPT)

Each rank compiles the whole model with ccfx (which plans the stages and the codecs), then keeps
only its own stage and runs it under torch.distributed.pipelining's 1F1B schedule. Activations
travel forward in int8, their gradients backward as PowerSGD rank 4.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B

import ccfx


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    n_micro = 4

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                       # every rank builds the same model
    model = MLP()
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options={
        "stages": world, "activation_codec": "int8", "activation_grad_codec": "powersgd:rank=4"})

    # The same batches on every rank: the first stage feeds the inputs, the last the targets.
    data = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        x = torch.randn(64, 256, generator=data)
        batches.append((x, x[:, :8].sum(dim=1, keepdim=True)))

    compiled(batches[0][0].chunk(n_micro)[0])  # compiles and plans at the microbatch shape
    stage = ccfx.build_stage(compiled, rank, "cpu")   # a torch PipelineStage: this rank's part
    schedule = Schedule1F1B(stage, n_microbatches=n_micro, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-3)

    step_losses = []
    for x, y in batches:
        losses = []                            # the last stage's loss per microbatch
        if stage.is_first:
            schedule.step(x)
        elif stage.is_last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()                    # a middle stage: receives and sends only
        ccfx.sync_grads([stage])               # tied weights; under PP x DP, the replicas' mean
        opt.step()
        opt.zero_grad()
        if losses:
            step_losses.append(sum(loss.item() for loss in losses) / len(losses))

    ledger = ccfx.ledger_of(compiled)          # what this rank's stage sent, per step
    sent = [None] * world
    dist.all_gather_object(sent, (ledger.totals(), step_losses))
    if rank == 0:
        print(ccfx.plan_of(compiled))
        print(ledger)                          # rank 0 sends the forward activations
        (fwd_raw, fwd_wire), _ = sent[0]       # rank 0 sends activations forward,
        (bwd_raw, bwd_wire), losses = sent[-1]   # the last rank their gradients backward
        print(f"pipeline: {world} stages on {world} ranks, {args.steps} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, wire/raw forward "
              f"{fwd_wire / fwd_raw:.3f}, backward {bwd_wire / bwd_raw:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
