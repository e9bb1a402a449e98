"""What each rank runs in tests/test_codec_tlc.py's 2-rank scenarios (module-level: spawn
pickles them by name): ``tlc:ef`` gradient buckets over a real process group, where the
all-gather sends only the used bytes. Workers return plain data; the test asserts on it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ccfx
from ccfx import codecs
from ccfx.wire.comm import ProcessGroupComm
from ccfx.wire.exchange import BucketLayout, exchange_for

from .dp_workers import batch, loss_fn, mlp
from .ranks import gathered, rng, train

SPEC = "tlc:ef"


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    """Rank 1's gradients are mostly zeros: its payload uses fewer bytes than rank 0's."""
    g = rng(rank, step)
    grads = [torch.randn(300, 20, generator=g), torch.randn(57, generator=g)]
    if rank == 1:
        grads = [t * (torch.rand(t.shape, generator=g) < 0.05) for t in grads]
    return grads


def gather_used(rank, world, steps=3):
    """Per step: whether the exchange's mean is, bit for bit, the rank-order mean of every
    rank's own round trip (a local ``tlc:ef`` codec on the same inputs), what it sent, every
    rank's used length, and the capacity."""
    layout = BucketLayout(((300, 20), (57,)), torch.float32)
    ex = exchange_for(layout, SPEC)
    state, mine = ex.init_state(), codecs.get(SPEC)
    rows = []
    for step in range(steps):
        grads = _grads(rank, step)
        out = layout.flat(ex.run(grads, state, ProcessGroupComm()))
        enc = mine.encode(layout.flat(grads))
        parts = gathered(mine.decode(enc).float())
        used = [int(u) for u in gathered(enc.payload[2].clone())]
        rows.append({"equal": torch.equal(out, (parts[0] + parts[1]) / world),
                     "sent": ex.sent_bytes(), "used": used, "capacity": ex.wire_bytes()})
    return rows


def ddp_ledger(rank, world, steps=2):
    """DDP with the ``tlc:ef`` comm hook: the ledger's wire bytes against the plan's capacity,
    and whether the ranks' parameters agree."""
    model = DDP(mlp(seed=rank), bucket_cap_mb=0.03)
    state, hook = ccfx.ddp_comm_hook(SPEC)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(lambda i: loss_fn(model(batch(rank, i))), opt, range(steps))
    raw, wire = ccfx.ledger_of(model).totals("bucket")
    capacity = sum(b.exchange.wire_bytes() for b in state.buckets.values()) * steps
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    same = all(torch.equal(flat, other) for other in gathered(flat))
    dist.barrier()
    return {"raw": raw, "wire": wire, "capacity": capacity, "same": same}
