"""Rank functions for tests/test_local_steps.py (module level: spawn pickles them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import ccfx

from . import ranks


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = ranks.rng(rank, step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return nn.functional.mse_loss(model(x), y)


def _compiled(model, **options):
    return torch.compile(model, backend="ccfx", options={"lowering": "eager", **options})


def h1_against_data_parallel(rank, world, steps):
    """Local steps with H = 1, outer SGD lr 1 without momentum, codec none, against per-step
    data parallel (ccfx's own, gradients averaged in the compiled backward); inner SGD."""
    out = {}
    ref = mlp(0)
    compiled = _compiled(ref, data_parallel=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ranks.train(lambda i: loss_of(compiled, rank, i), opt, range(steps))
    out["dp"] = ranks.params(ref)
    model = mlp(0)
    compiled = _compiled(model, sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                         outer_codec="none")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(compiled, opt)
    ranks.train(lambda i: loss_of(compiled, rank, i), opt, range(steps))
    out["local"] = ranks.params(model)
    out["syncs"] = outer.syncs
    out["warning"] = _compile_without_local_steps()
    return out


def _compile_without_local_steps() -> str:
    """The CcfxWarnings of compiling with sync_every and no ccfx.local_steps."""
    import warnings

    model = nn.Linear(4, 2)
    compiled = _compiled(model, sync_every=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(2, 4))
    return " ".join(str(c.message) for c in caught if issubclass(c.category, ccfx.CcfxWarning))


def replicas_after_sync(rank, world, codecs, steps, options):
    """Per codec: the global parameters and each replica's parameters after ``steps`` inner
    steps (a multiple of sync_every), and the bytes counted."""
    out = {}
    for spec in codecs:
        model = mlp(rank)  # different on purpose: local_steps starts every replica from rank 0's
        compiled = _compiled(model, outer_codec=spec, **options)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        outer = ccfx.local_steps(compiled, opt, compress_min_numel=0)
        ranks.train(lambda i, m=compiled: loss_of(m, rank, i), opt, range(steps))
        outer.finish()
        out[spec] = {"local": ranks.params(model),
                     "global": [g.clone() for g in outer.global_parameters().values()],
                     "syncs": outer.syncs, "wire": outer.wire_bytes, "raw": outer.raw_bytes,
                     "collectives": outer.collectives,
                     "ledger": ccfx.ledger_of(compiled).totals("outer")}
        outer.close()
    return out


def _run(model, opt, rank, start, stop):
    ranks.train(lambda i: loss_of(model, rank, i), opt, range(start, stop))


def checkpoint_resumes(rank, world, options, stops, steps):
    """:func:`checkpoint_resume` for each of ``stops``, in one process."""
    return {stop: checkpoint_resume(rank, world, options, stop, steps) for stop in stops}


def checkpoint_resume(rank, world, options, stop_at, steps):
    """An uninterrupted run against one saved at ``stop_at`` (possibly with an exchange in
    flight), rebuilt from the checkpoint and continued."""
    model = mlp(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    outer = ccfx.local_steps(model, opt, **options)
    _run(model, opt, rank, 0, stop_at)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": opt.state_dict(), "outer": outer.state_dict()}
    saved = torch.utils._pytree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, saved)
    in_flight = any(f["pending"] is not None for f in saved["outer"]["fragments"])
    _run(model, opt, rank, stop_at, steps)
    outer.finish()
    straight = ranks.params(model)
    outer.close()

    model = mlp(1)
    model.load_state_dict(saved["model"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(saved["opt"])
    outer = ccfx.local_steps(model, opt, **options)
    outer.load_state_dict(saved["outer"])
    _run(model, opt, rank, stop_at, steps)
    outer.finish()
    resumed = ranks.params(model)
    return {"straight": straight, "resumed": resumed, "in_flight": in_flight,
            "step": outer.step}


def streaming_overlap(rank, world, options, steps):
    """Each sync's start and merge steps, and whether the exchange ran on the sync thread."""
    import threading

    from ccfx.runtime import local_steps as ls

    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, **options)
    events = []
    start, exchange, merge = ls.LocalSteps._start, ls.LocalSteps._exchange, ls.LocalSteps._merge

    def traced_start(self, frag):
        events.append(("start", frag.index, self.step))
        return start(self, frag)

    def traced_exchange(self, frag, delta):
        events.append(("exchange", frag.index, threading.current_thread().name))
        return exchange(self, frag, delta)

    def traced_merge(self, frag):
        events.append(("merge", frag.index, self.step, frag.in_flight.started))
        return merge(self, frag)

    ls.LocalSteps._start, ls.LocalSteps._exchange = traced_start, traced_exchange
    ls.LocalSteps._merge = traced_merge
    try:
        _run(model, opt, rank, 0, steps)
    finally:
        ls.LocalSteps._start, ls.LocalSteps._exchange, ls.LocalSteps._merge = (
            start, exchange, merge)
    outer.finish()
    return {"events": events, "global": [g.clone() for g in outer.global_parameters().values()],
            "local": ranks.params(model), "sizes": [f.numel for f in outer.fragments]}


def pipeline_dp_local_steps(rank, world, steps, sync_every):
    """PP × DP: 2 stages × 2 replicas; each stage syncs over its data-parallel group every
    ``sync_every`` steps, and no per-step gradient buckets run."""
    from torch.distributed.pipelining import ScheduleGPipe

    stages_n, replicas = 2, world // 2
    replica, stage_rank = divmod(rank, stages_n)
    pp_groups = [dist.new_group([r * stages_n + s for s in range(stages_n)])
                 for r in range(replicas)]
    dp_groups = [dist.new_group([r * stages_n + s for r in range(replicas)])
                 for s in range(stages_n)]
    pp, dp = pp_groups[replica], dp_groups[stage_rank]
    model = mlp(0)
    compiled = torch.compile(model, backend="ccfx", options={
        "stages": 2, "lowering": "eager", "sync_every": sync_every, "outer_codec": "int8"})
    x, _ = batch(0, 0)
    compiled(x[:4])
    stages = ccfx.build_stages(compiled, group=pp, dp_group=dp)
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.Adam(params, lr=0.01)
    outer = ccfx.local_steps(stages, opt, compress_min_numel=0)
    schedule = ScheduleGPipe(stages[0], n_microbatches=4,
                             loss_fn=lambda out, y: nn.functional.mse_loss(out, y))
    for i in range(steps):
        x, y = batch(replica, i)
        if stage_rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        ccfx.sync_grads(stages)
        opt.step()
        opt.zero_grad()
    return {"replica": replica, "stage": stage_rank, "params": [p.detach().clone() for p in params],
            "buckets": len(stages[0].grad_sync.buckets), "syncs": outer.syncs,
            "global": [g.clone() for g in outer.global_parameters().values()]}


def one_replica_stops(rank, world, delays):
    """Per delay: rank 1 stops stepping after one step; rank 0 reaches the sync at step 2 and
    must fail with a CollectiveError within collective_timeout_s, not hang."""
    out = {}
    for delay in delays:
        dist.barrier()  # rank 1 waits here for rank 0's failure (group creation times out too)
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        options = {"sync_every": 2, "collective_timeout_s": 3.0, "outer_codec": "int8"}
        if delay:
            options.update(fragments=2, fragment_delay=delay, sync_every=4)
        ccfx.local_steps(model, opt, **options)
        steps = 1 if rank == 1 else 6
        try:
            _run(model, opt, rank, 0, steps)
            out[delay] = "finished"
        except ccfx.CcfxError as e:
            out[delay] = f"{type(e).__name__}: {e}"
    return out


def ring_replica_dies(rank, world, dead):
    """Local steps over the ring (``outer_collective="ring"``): one sync on every replica, then
    rank ``dead`` is SIGKILLed; the others' next sync fails, its error as data with ``since``:
    seconds from the kill to the error."""
    import os
    import signal
    import time

    from ccfx.wire import agree

    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ccfx.local_steps(model, opt, sync_every=2, outer_codec="int8", outer_collective="ring",
                     collective_timeout_s=60.0, compress_min_numel=0)
    _run(model, opt, rank, 0, 3)  # the sync at step 2 on every replica
    dist.barrier()
    store = agree._store()
    if rank == dead:
        store.set("test/victim_at", repr(time.time()).encode())
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["test/victim_at"])
    victim_at = float(store.get("test/victim_at").decode())
    got = ranks.caught(lambda: _run(model, opt, rank, 3, 6))  # the sync at step 4
    got["since"] = time.time() - victim_at
    from .collectives_workers import _until_survivors_failed

    _until_survivors_failed(store, rank, world)
    return got
