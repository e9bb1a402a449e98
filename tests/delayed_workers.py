"""What each rank runs in the delayed comm-hook tests (module-level: spawn pickles them by name).

Workers return plain data (booleans, floats, digests); tests/test_delayed.py asserts on it. The
MLP, batches and loss are the data-parallel tests' (tests/dp_workers.py). "Applied at step t" is
what DDP leaves in ``p.grad`` after backward t, with the parameters held fixed (no optimizer
step) so that the synchronous and the delayed hook see the same gradients at every step.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ccfx

from .dp_workers import batch, loss_fn, mlp
from .ranks import caught, digest, rng

#: 30 kB: the MLP's 104 kB of gradients make 2-3 DDP buckets.
SMALL_BUCKETS_MB = 0.03


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()])


def _applied(model, data, steps) -> list[torch.Tensor]:
    """The gradient DDP applies at each step (backward only: the parameters stay fixed)."""
    out = []
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        loss_fn(model(data(i))).backward()
        out.append(_flat_grads(model))
    return out


def _pair(module_of, sync_spec, spec, correct_every):
    """Twin DDP models (same parameters): the synchronous hook's (``sync_spec``) and the
    delayed hook's."""
    sync = DDP(module_of(), bucket_cap_mb=SMALL_BUCKETS_MB)
    sync.register_comm_hook(*ccfx.ddp_comm_hook(sync_spec))
    delayed = DDP(module_of(), bucket_cap_mb=SMALL_BUCKETS_MB)
    state, hook = ccfx.delayed_comm_hook(spec, correct_every=correct_every)
    delayed.register_comm_hook(state, hook)
    return sync, delayed, state


def shifted(rank, world, spec, correct_every, steps):
    """Per step t >= 1: whether the delayed hook applied exactly the synchronous hook's gradient
    of step t-1, and how far apart they are; step 0's gradient; the delayed gradients' digests
    (equal across ranks: the same bits on every rank)."""
    sync, delayed, state = _pair(lambda: mlp(seed=0), spec, spec, correct_every)
    data = lambda i: batch(rank, i)
    s, d = _applied(sync, data, steps), _applied(delayed, data, steps)
    return {"step0_zero": bool((d[0] == 0).all()),
            "equal": [torch.equal(d[t], s[t - 1]) for t in range(1, steps)],
            "err": [float((d[t] - s[t - 1]).abs().max()) for t in range(1, steps)],
            "scale": float(torch.stack(s).abs().max()),
            "digests": [digest(g) for g in d], "in_flight": state.in_flight(),
            "steps": state.steps, "found": ccfx.ledger_of(delayed) is state.ledger}


def _integer_net() -> nn.Module:
    """Two bias-free linear layers with small integer weights: on integer inputs every
    gradient, average and running sum is an exactly representable fp32 number, so sums in any
    order agree bit for bit."""
    net = nn.Sequential(nn.Linear(16, 8, bias=False), nn.Linear(8, 4, bias=False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).float())
    return net


def window_sums(rank, world, spec, correct_every, steps, integer=True):
    """The correction's invariant: after step c+1 (c a correction step), the running sum of
    the applied gradients against the running sum of the exact means up to step c. Per step t:
    ``sum(applied[:t+1]) - sum(exact[:t])``'s largest entry, and whether it is exactly zero."""
    if integer:
        module_of = _integer_net

        def data(i):
            return torch.randint(-3, 4, (4, 16), generator=rng(rank, i)).float()
    else:
        module_of, data = (lambda: mlp(seed=0)), (lambda i: batch(rank, i))
    exact, delayed, _ = _pair(module_of, "none", spec, correct_every)
    g, u = _applied(exact, data, steps), _applied(delayed, data, steps)
    gap, zero = [], []
    for t in range(1, steps):
        d = torch.stack(u[:t + 1]).sum(0) - torch.stack(g[:t]).sum(0)
        gap.append(float(d.abs().max()))
        zero.append(bool((d == 0).all()))
    return {"gap": gap, "zero": zero, "scale": float(torch.stack(g).abs().max())}


def _trained(rank, spec, correct_every, steps, compensate=None, **ddp_options):
    model = DDP(mlp(seed=rank), bucket_cap_mb=SMALL_BUCKETS_MB, **ddp_options)
    state, hook = ccfx.delayed_comm_hook(spec, correct_every=correct_every,
                                         compensate=compensate)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, state, opt


def _train(model, opt, rank, steps) -> list[str]:
    grads = []
    for i in steps:
        loss_fn(model(batch(rank, i))).backward()
        grads.append(digest(p.grad for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    return grads


def train_identical(rank, world, spec, correct_every, steps):
    """SGD with momentum through DDP's bucket rebuild: each step's applied gradients' digest,
    the parameters' digest, the raw and wire bytes the ledger counted over the steps."""
    model, state, opt = _trained(rank, spec, correct_every, steps)
    grads = _train(model, opt, rank, range(steps))
    return {"grads": grads, "params": digest(model.parameters()), "steps": state.steps,
            "bytes": ccfx.ledger_of(model).totals("bucket")}


def checkpoint_resume(rank, world, spec, correct_every, path, ddp_options, compensate=None):
    """6 steps straight, against 3 steps + checkpoint + a fresh DDP resumed for 3 more; the
    flights left after ``state_dict()`` (it drains), the saved delayed entries, the warnings."""
    model, state, opt = _trained(rank, spec, correct_every, 6, compensate, **ddp_options)
    _train(model, opt, rank, range(6))
    straight = digest(model.parameters())

    model, state, opt = _trained(rank, spec, correct_every, 6, compensate, **ddp_options)
    _train(model, opt, rank, range(3))
    saved = state.state_dict()
    file = f"{path}.rank{rank}"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": saved},
               file)
    in_flight = state.in_flight()

    model, state, opt = _trained(rank, spec, correct_every, 6, compensate, **ddp_options)
    ckpt = torch.load(file)
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["hook"])
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", ccfx.CcfxWarning)
        _train(model, opt, rank, range(3, 6))
    return {"straight": straight, "resumed": digest(model.parameters()), "in_flight": in_flight,
            "names": sorted(k.rpartition(".")[2] for k in saved["state"]),
            "delayed": saved["delayed"],
            "warnings": [str(w.message) for w in got if issubclass(w.category, ccfx.CcfxWarning)]}


def _mean_grad(module, rank, world, step) -> torch.Tensor:
    """The exact mean over the ranks of ``module``'s gradient on each rank's batch ``step``."""
    import torch.distributed as dist

    module.zero_grad(set_to_none=True)
    loss_fn(module(batch(rank, step))).backward()
    g = _flat_grads(module)
    dist.all_reduce(g)
    return g / world


def compensation(rank, world, lam, steps):
    """Codec none with ``compensate=lam``, SGD: per step t >= 2, the largest difference
    between the applied gradient and DC-ASGD-a's ``G + lam · G ⊙ G ⊙ (w_t − w_{t−1}) /
    sqrt(v)`` written out here (``G`` the exact mean of step t-1 at ``w_{t−1}``, ``v`` the
    0.95 moving mean of ``G ⊙ G``), and the size of the compensation itself; the applied
    gradients' and the weights' digests (equal across ranks)."""
    model = DDP(mlp(seed=0), bucket_cap_mb=SMALL_BUCKETS_MB)
    model.register_comm_hook(*ccfx.delayed_comm_hook("none", compensate=lam))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    twin = mlp(seed=0)
    weights, means, applied = [], [], []
    for i in range(steps):
        twin.load_state_dict(model.module.state_dict())
        weights.append(torch.cat([p.detach().reshape(-1).clone() for p in twin.parameters()]))
        means.append(_mean_grad(twin, rank, world, i))
        loss_fn(model(batch(rank, i))).backward()
        applied.append(_flat_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    err, size, v = [], [], None
    for t in range(1, steps):
        g = means[t - 1]
        v = g * g if v is None else 0.95 * v + 0.05 * g * g
        expected = g + lam * g * g * (weights[t] - weights[t - 1]) / (v.sqrt() + 1e-12)
        err.append(float((applied[t] - expected).abs().max()))
        size.append(float((expected - g).abs().max()))
    return {"err": err, "size": size, "scale": float(torch.stack(means).abs().max()),
            "digests": [digest(a) for a in applied], "params": digest(model.parameters())}


def dies_mid_run(rank, world, dead=1):
    """Delayed int8 hook (``collective_timeout_s`` 3 s): two steps on every rank, then rank
    ``dead`` exits; the survivor's next steps must fail with a named CollectiveError (at the
    wait for an exchange the dead rank never joined)."""
    import os
    import time

    from ccfx.wire import agree

    model = DDP(mlp(seed=0))
    model.register_comm_hook(*ccfx.delayed_comm_hook("int8", collective_timeout_s=3.0))
    for step in range(2):
        loss_fn(model(batch(rank, step))).backward()
    store = agree._store()
    if rank == dead:
        store.set("test/dead_at", b"1")
        os._exit(0)
    store.wait(["test/dead_at"])
    time.sleep(0.5)

    def steps():
        for step in range(2, 5):
            loss_fn(model(batch(rank, step))).backward()

    return caught(steps)
