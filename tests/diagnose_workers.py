"""What each rank runs in the ``ccfx.diagnose`` tests (module-level: spawn pickles them by name).

Every scenario trains the data-parallel tests' MLP (tests/dp_workers.py) under DDP with ccfx's
comm hook for a few steps, slows one rank or one link on purpose, and returns what
``ccfx.diagnose`` said, as plain data.
"""

from __future__ import annotations

import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ccfx
from ccfx.runtime import link_probe

from .dp_workers import batch, loss_fn, mlp


def _hooked(rank: int):
    model = DDP(mlp(seed=rank), bucket_cap_mb=0.03)  # 2-3 buckets a step
    model.register_comm_hook(*ccfx.ddp_comm_hook("int8"))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(model, opt, rank: int, steps: int, slow: int | None, extra_s: float) -> None:
    """``steps`` SGD steps; rank ``slow`` sleeps ``extra_s`` before each backward (a slower
    compute: it comes late to every exchange of the step)."""
    for i in range(steps):
        loss = loss_fn(model(batch(rank, i)))
        if rank == slow:
            time.sleep(extra_s)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _said(d: ccfx.runtime.diagnose.Diagnosis) -> dict:
    return {"slow_ranks": d.slow_ranks, "slow_links": [list(li) for li in d.slow_links],
            "late_s": {r.rank: r.late_s for r in d.ranks},
            "peers_wait_s": {r.rank: r.peers_wait_s for r in d.ranks},
            "steps": d.ranks[0].steps, "links": len(d.links), "text": str(d)}


def slow_rank(rank, world, slow, extra_s, steps):
    """Rank ``slow`` (None: none) is ``extra_s`` late at every step; then one diagnosis."""
    model, opt = _hooked(rank)
    _train(model, opt, rank, steps, slow, extra_s)
    return _said(ccfx.diagnose(model))


def slow_link(rank, world, link, delay_s, probe_bytes):
    """Two plain steps, then a diagnosis with the link probe, the directed ``link`` (sender,
    receiver) slowed by the probe's test seam (``link_probe.LINK_DELAY_S``)."""
    model, opt = _hooked(rank)
    _train(model, opt, rank, 2, None, 0.0)
    link_probe.LINK_DELAY_S[tuple(link)] = delay_s
    try:
        said = _said(ccfx.diagnose(model, links=True, probe_bytes=probe_bytes, repeats=1))
        alone = ccfx.diagnose(links=True, probe_bytes=probe_bytes, repeats=1)  # no model
        return {**said, "links_only": [list(li) for li in alone.slow_links],
                "links_only_text": str(alone)}
    finally:
        link_probe.LINK_DELAY_S.clear()


def every(rank, world, slow, extra_s, steps, period):
    """``ccfx.diagnose_every(model, period)``: the reports it handed over during ``steps``."""
    model, opt = _hooked(rank)
    reports: list = []
    ccfx.diagnose_every(model, period, reports.append)
    _train(model, opt, rank, steps, slow, extra_s)
    ccfx.diagnose_every(model, 0)
    return [_said(d) for d in reports]
