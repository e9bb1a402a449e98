"""What each rank runs in tests/test_agreement.py (module-level: spawn pickles them by name).

Extra models compiled on one rank only (an eval copy, a rank-0-only evaluation mid-training)
must not disturb the training the ranks run together, and ranks that truly diverge must fail
with an error that says so (``ccfx.wire.agree``)."""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

import ccfx

from .ranks import caught, digest, rng

STEPS = 4


def model(seed: int, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, 4))


def options(**extra) -> dict:
    return {"data_parallel": True, "gradient_codec": "int8", "lowering": "eager",
            "compress_min_numel": 0, "collective_timeout_s": 60, **extra}


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=rng(rank, step))


def train(rank: int, world: int, extra: str = "none", dropout: float = 0.0) -> dict:
    """``STEPS`` data-parallel steps from rank-dependent initialisations (ccfx broadcasts rank
    0's). ``extra`` on rank 0 only: "eval copy first" compiles and runs a copy of the model
    with the same options under no_grad before training; "eval mid-training" evaluates the
    training model itself in eval mode (under no_grad, then with grad and no backward) after
    the second step, which recompiles on rank 0 alone."""
    torch.manual_seed(1234)  # the dropout masks: the same stream with or without the extra
    m = model(seed=rank, dropout=dropout)
    compiled = torch.compile(m, backend="ccfx", options=options())
    if extra == "eval copy first" and rank == 0:
        ev = copy.deepcopy(m).eval()
        ev_compiled = torch.compile(ev, backend="ccfx", options=options())
        with torch.no_grad():
            ev_compiled(batch(rank, 99))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        if extra == "eval mid-training" and rank == 0 and step == 2:
            m.eval()
            with torch.no_grad():
                compiled(batch(rank, 98))
            compiled(batch(rank, 97)).sum()  # with grad, no backward: a graph of its own
            m.train()
        loss = compiled(batch(rank, step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": digest(list(m.parameters())),
            "graphs": len(ccfx.plan_of(compiled).graphs)}


def pipeline_auto(rank: int, world: int, extra: bool) -> dict:
    """A 2-stage pipeline with ``activation_codec="auto"``; with ``extra``, rank 0 compiles
    another (wider) model with the same options first. Each rank's codec choice per edge."""
    from . import toy_models

    opts = {"stages": 2, "activation_codec": "auto", "link_gbps": 0.001, "lowering": "eager",
            "balance": "params"}
    if extra and rank == 0:
        torch.manual_seed(5)
        other = torch.compile(toy_models.MLP(width=48, depth=4), backend="ccfx",
                              fullgraph=True, dynamic=False, options=opts)
        other(torch.randn(4, 48))
    torch.manual_seed(0)
    m = toy_models.MLP(width=32, depth=4)
    compiled = torch.compile(m, backend="ccfx", fullgraph=True, dynamic=False, options=opts)
    compiled(torch.randn(4, 32))
    plan = ccfx.plan_of(compiled)
    stages = ccfx.build_stages(compiled, rank, "cpu")  # the ranks agree on the stage plan
    return {"choice": [(e.index, e.codec, e.grad_codec) for g in plan.graphs for e in g.edges],
            "stages": [s.stage_index for s in stages]}


def diverged(rank: int, world: int) -> dict:
    """Rank 1 compiles with another gradient codec: a ConfigError on both ranks, quickly."""
    m = model(seed=rank)
    compiled = torch.compile(m, backend="ccfx",
                             options=options(gradient_codec="int8" if rank == 0 else "none"))
    got = caught(lambda: compiled(batch(rank, 0)))
    time.sleep(2)  # rank 0 hosts the store: its peer reads the verdict before it ends
    return got


def met_again(rank: int, world: int) -> dict:
    """The ranks diverge at an agreement (rank 0 arrives first: rank 1 gives up on seeing it),
    then meet at rank 0's description again, rank 1 late: rank 1's old verdict was about rank
    0's first wait, not this one, so the second meeting succeeds."""
    from ccfx.wire import agree

    what = "a test agreement"
    time.sleep(0.5 * rank)
    first = caught(lambda: agree.meet(what, {"x": rank}, timeout_s=30))
    time.sleep(1.5 * rank)  # rank 0 waits again while rank 1's record still says it gave up
    second = caught(lambda: agree.meet(what, {"x": 0}, timeout_s=30))
    time.sleep(1)  # rank 0 hosts the store
    return {"first": first, "second": second}
