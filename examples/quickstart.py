"""Quick start: one process, the simulation of a 4-stage pipeline with int8 on every cut.

    python examples/quickstart.py

The whole model runs here; every tensor that would cross a stage boundary goes through the
int8 round trip a real pipeline applies (forward, and its gradient backward), and the ledger
counts the bytes that would have crossed the wire.
"""

import argparse

import torch
from torch import nn

import ccfx


class MLP(nn.Module):
    """Four blocks, so that four stages have something each."""

    def __init__(self, width: int = 256, depth: int = 4):
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

    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)                   # a fixed batch and a target to fit
    y = x[:, :8].sum(dim=1, keepdim=True)

    # The one line: cut into 4 stages, int8 on each cut (activations and their gradients).
    compiled = torch.compile(model, backend="ccfx",
                             options={"stages": 4, "activation_codec": "int8"})

    losses = []
    for _ in range(args.steps):                # trains as usual
        loss = nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    print(ccfx.plan_of(compiled))              # stages, cut edges, codecs, raw -> wire bytes
    print(ccfx.ledger_of(compiled))            # bytes per step that crossed, per edge and direction
    raw, wire = ccfx.ledger_of(compiled).totals()
    print(f"quickstart: {args.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"wire/raw {wire / raw:.3f} ({wire} of {raw} bytes)")


if __name__ == "__main__":
    main()
