"""Rank functions for tests/test_gossip.py (module level: spawn pickles them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import ccfx

from . import ranks


class Vector(nn.Module):
    """One trainable vector: the model of the quadratic and averaging tests."""

    def __init__(self, n: int):
        super().__init__()
        self.x = nn.Parameter(torch.zeros(n))


def _set(model: Vector, value: torch.Tensor) -> None:
    with torch.no_grad():
        model.x.copy_(value)


def _start(rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s own starting point (different on every rank)."""
    return torch.randn(n, generator=ranks.rng(rank, stride=7))


def exact_average(rank, world, n):
    """Identity codec, γ = 1, ring: every rank set to its own vector, one gossip step; what it
    held before and after, and a digest of every public copy it keeps (by group rank)."""
    model = Vector(n)
    g = ccfx.gossip(model, spec="none", gamma=1.0, topology="ring")
    before = _start(rank, n)
    _set(model, before)
    g.step()
    return {"before": before, "after": model.x.detach().clone(), "neighbours": g.neighbours,
            "public": {r: ranks.digest(t) for r, t in g.public.items()},
            "steps": g.steps, "sent": g.wire_bytes}


def mean_kept(rank, world, n, spec, gamma, steps):
    """Rank-specific vectors, then ``steps`` gossip steps with nothing else moving them: the
    mean over ranks (exact fp32 all-reduce) before and after each step, and the consensus
    error before and after."""
    model = Vector(n)
    g = ccfx.gossip(model, spec=spec, gamma=gamma)
    _set(model, _start(rank, n))
    means = [ranks.mean_over_ranks(model.x.detach())]
    first = g.consensus()
    for _ in range(steps):
        g.step()
        means.append(ranks.mean_over_ranks(model.x.detach()))
    return {"means": means, "consensus": [first, g.consensus()],
            "scale": float(model.x.detach().abs().max())}


def quadratic(rank, world, n, spec, gamma, steps, every):
    """SGD (lr 0.05) on f_i(x) = ½||x − b_i||², b_i different on every rank, starting from
    rank-specific points; gossip through the optimizer's hook. The consensus error every
    ``every`` steps, the bytes sent, and the distance of the mean model to the optimum of
    Σ f_i (the mean of the b_i)."""
    model = Vector(n)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = ccfx.gossip(model, opt, spec=spec, gamma=gamma)
    target = torch.randn(n, generator=ranks.rng(rank, 1, stride=7))
    _set(model, _start(rank, n))
    errors = [g.consensus()]
    for i in range(steps):
        loss = 0.5 * ((model.x - target) ** 2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if (i + 1) % every == 0:
            errors.append(g.consensus())
    best = ranks.mean_over_ranks(target)
    mean = ranks.mean_over_ranks(model.x.detach())
    spread_b = float(((target - best) ** 2).sum() / (best * best).sum())
    return {"consensus": errors, "steps": g.steps, "calls": g.calls, "sent": g.wire_bytes,
            "to_optimum": float((mean - best).norm() / best.norm()),
            "consensus_of_targets": float(ranks.mean_over_ranks(torch.tensor(spread_b)))}


def world_one(rank, world):
    """A group of this rank alone: gossip's error as text."""
    groups = [dist.new_group([r]) for r in range(world)]
    return ranks.raised(rank, world, lambda *_: ccfx.gossip(Vector(4), group=groups[rank]))


def neighbour_dies(rank, world, dead):
    """One gossip step on every rank, then rank ``dead`` is SIGKILLed; the others' next step
    fails, its error as data."""
    import os
    import signal

    from ccfx.wire import agree

    from .collectives_workers import _until_survivors_failed

    model = Vector(16)
    g = ccfx.gossip(model, spec="int8", gamma=0.5, collective_timeout_s=30.0)
    g.step()
    dist.barrier()
    store = agree._store()
    if rank == dead:
        store.set("test/victim", b"1")
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["test/victim"])
    got = ranks.caught(g.step)
    _until_survivors_failed(store, rank, world)
    return got
