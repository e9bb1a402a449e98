"""What each rank runs in the adaptive-compression tests (module-level: spawn pickles them by
name). The model, batches and loss are the data-parallel tests' (tests/dp_workers.py); ranks
build their model from different seeds, DDP broadcasts rank 0's."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ccfx

from .dp_workers import batch, loss_fn, mlp
from .ranks import digest

#: every step a detection interval, a low threshold: switches both ways within a few steps
SPEC = "adaptive:light=int8,heavy=topk:ratio=0.05,ef,eta=0.1,every=1"


def hooked(rank: int, spec: str = SPEC, **ddp_options):
    """The MLP under DDP (2-3 buckets) with the adaptive hook, and its SGD optimizer."""
    model = DDP(mlp(seed=rank), bucket_cap_mb=0.03, **ddp_options)
    state, hook = ccfx.ddp_comm_hook(spec)
    model.register_comm_hook(state, hook)
    return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def switches(state) -> list[tuple]:
    return [(s.bucket, s.step, s.old, s.new) for s in state.ledger.switches]


def train_and_watch(rank, world, steps, spec=SPEC):
    """``steps`` steps under plain DDP options (DDP regroups its buckets after the first):
    the digest of the applied gradients at each step, the switches, the final modes."""
    model, state, opt = hooked(rank, spec)
    grads = []
    for i in range(steps):
        loss_fn(model(batch(rank, i))).backward()
        grads.append(digest(p.grad for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "switches": switches(state), "modes": state.modes(),
            "params": digest(model.parameters()), "ledger": str(ccfx.ledger_of(model))}
