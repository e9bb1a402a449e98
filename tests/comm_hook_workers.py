"""What each rank runs in the DDP comm-hook tests (module-level: spawn pickles them by name).

Workers return plain data (floats, digests, strings); the tests assert on it. The model, the
batches and the loss are the data-parallel tests' (tests/dp_workers.py). Ranks build their model
from different seeds: DDP broadcasts rank 0's parameters, as it does without a hook.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ccfx
from ccfx.wire.comm import LocalComm
from ccfx.wire.exchange import BucketLayout, exchange_for

from .dp_workers import batch, loss_fn, mlp
from .ranks import digest, gathered, mean_over_ranks, train

#: 30 kB: the MLP's 104 kB of gradients make 2-3 DDP buckets.
SMALL_BUCKETS_MB = 0.03


def _ddp(rank: int, **ddp_options) -> DDP:
    return DDP(mlp(seed=rank), bucket_cap_mb=SMALL_BUCKETS_MB, **ddp_options)


def _recording(hook, log: list):
    """``hook``, also keeping each bucket's layout, local input, parameters and result."""
    def wrapped(state, bucket):
        entry = {"shapes": [tuple(g.shape) for g in bucket.gradients()],
                 "input": bucket.buffer().clone(), "params": bucket.parameters()}
        log.append(entry)

        def keep(fut):
            entry["output"] = fut.value()
            return entry["output"]

        return hook(state, bucket).then(keep)

    return wrapped



def _reference(spec: str, entry: dict) -> torch.Tensor:
    """What the hook should return for one bucket at the first step, from every rank's local
    bucket: gather codecs average each rank's own round trip (in rank order); PowerSGD runs on
    the averaged bucket (with one shared Q, the sum of the ranks' P's is the mean's P times the
    world size); all-reduce codecs (none, fp16) the exact mean, which a cast only approximates."""
    layout = BucketLayout(tuple(entry["shapes"]), entry["input"].dtype)
    ex = exchange_for(layout, spec)
    if ex.collective == "powersgd":
        mean = mean_over_ranks(entry["input"])
        return layout.flat(ex.run(layout.unflat(mean), ex.init_state(), LocalComm()))
    if ex.collective == "all_gather":
        own = [layout.flat(ex.run(layout.unflat(x), ex.init_state(), LocalComm())).float()
               for x in gathered(entry["input"])]
        return sum(own) / len(own)
    return mean_over_ranks(entry["input"])


def _max_err(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def one_step_per_codec(rank, world, specs):
    """One backward per codec, buckets fixed from the first step (``find_unused_parameters``);
    per codec: the gradients' digest, the error against plain DDP and against the reference,
    the number of buckets and whether DDP copied each bucket's result into the gradients."""
    x = batch(rank)
    plain = _ddp(0, find_unused_parameters=True)
    loss_fn(plain(x)).backward()
    plain_grads = [p.grad for p in plain.parameters()]
    results = {}
    for spec in specs:
        model = _ddp(rank, find_unused_parameters=True)
        state, hook = ccfx.ddp_comm_hook(spec)
        log: list = []
        model.register_comm_hook(state, _recording(hook, log))
        loss_fn(model(x)).backward()
        grads = [p.grad for p in model.parameters()]
        results[spec] = {
            "digest": digest(grads),
            "err_vs_ddp": _max_err(grads, plain_grads),
            "err_vs_reference": _max_err([e["output"] for e in log],
                                         [_reference(spec, e) for e in log]),
            "buckets": len(log),
            "grads_are_results": all(
                torch.equal(torch.cat([p.grad.reshape(-1) for p in e["params"]]), e["output"])
                for e in log),
            "steps": state.steps,
        }
    return results


def _hooked(rank, spec, collective="all_gather", **ddp_options):
    model = _ddp(rank, **ddp_options)
    state, hook = ccfx.ddp_comm_hook(spec, collective=collective)
    model.register_comm_hook(state, hook)
    return model, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _steps(model, opt, rank, steps) -> list[float]:
    return train(lambda i: loss_fn(model(batch(rank, i))), opt, steps)


def train_steps(rank, world, spec, steps, collective="all_gather"):
    """A few SGD steps under plain DDP options (DDP rebuilds its buckets after the first):
    losses, the parameters' digest, the steps the hook counted and its buckets at the end."""
    model, state, opt = _hooked(rank, spec, collective)
    losses = _steps(model, opt, rank, range(steps))
    return {"losses": losses, "params": digest(model.parameters()), "steps": state.steps,
            "buckets": {i: b.layout.shapes for i, b in state.buckets.items()},
            "collectives": sorted({b.exchange.collective for b in state.buckets.values()})}


def checkpoint_resume(rank, world, spec, path, ddp_options):
    """5 steps straight, against 3 steps + checkpoint (model, optimizer, hook state) + a fresh
    DDP resumed from it for 2 steps; the CcfxWarnings the resumed run gave."""
    model, state, opt = _hooked(rank, spec, **ddp_options)
    _steps(model, opt, rank, range(5))
    straight = digest(model.parameters())

    model, state, opt = _hooked(rank, spec, **ddp_options)
    _steps(model, opt, rank, range(3))
    file = f"{path}.rank{rank}"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "hook": state.state_dict()}, file)

    model, state, opt = _hooked(rank, spec, **ddp_options)
    ckpt = torch.load(file)
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["hook"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ccfx.CcfxWarning)
        _steps(model, opt, rank, range(3, 5))
    return {"straight": straight, "resumed": digest(model.parameters()),
            "saved_buckets": len(ckpt["hook"]["buckets"]), "steps": state.steps,
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, ccfx.CcfxWarning)]}
