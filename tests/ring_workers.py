"""What each rank runs in tests/test_ring.py (module level: spawn pickles them by name).

Workers return plain data (digests, floats, strings); the assertions are in the test file.
Every rank draws its own input from a seed of (rank, case), and the true mean is computed
from all ranks' inputs, gathered raw.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from ccfx.codecs import ops
from ccfx.errors import CollectiveError
from ccfx.wire.comm import ProcessGroupComm
from ccfx.wire.exchange import BucketLayout, GatherExchange
from ccfx.wire.ring import ring_all_reduce

from .ranks import digest, gathered, rng


def sample(rank: int, case: int, numel: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(numel, generator=rng(case, rank, stride=7919)) * scale


def everyone(x: torch.Tensor, group=None) -> torch.Tensor:
    """``(world, numel)``: every rank's ``x`` (raw, for the reference mean)."""
    return torch.stack(gathered(x, group))


def _errors(out: torch.Tensor, xs: torch.Tensor) -> dict:
    mean = xs.double().mean(0)
    err = (out.double() - mean).abs()
    return {"max_err": err.max().item() if err.numel() else 0.0,
            "rel_l2": (err.norm() / mean.norm().clamp_min(1e-30)).item() if err.numel() else 0.0,
            "absmax": xs.abs().max().item() if xs.numel() else 0.0}


def ring_cases(rank, cases, group=None):
    """Per ``(spec, numel)``: the ring's result digest (equal on every rank), its error against
    the true mean, and the all-gather exchange's error on the same inputs (``group``'s ranks:
    all call it, and group ranks differ from global ones for a subgroup)."""
    out = {}
    comm = ProcessGroupComm(group)
    for case, (spec, numel) in enumerate(cases):
        x = sample(rank, case, numel)
        xs = everyone(x, group)
        state = ops.init_state(spec, (numel,), x.dtype)
        y = ring_all_reduce(x, spec, group, state)
        row = {"digest": digest(y), "dtype": str(y.dtype), "shape": tuple(y.shape),
               **_errors(y, xs)}
        if spec in ("int8", "int4", "fp8") and numel:  # the bounded ones, against the gather
            ex = GatherExchange(BucketLayout(((numel,),), x.dtype), spec)
            (g,) = ex.run([x], ex.init_state(), comm)
            row["gather"] = _errors(g, xs)
        out[(spec, numel)] = row
    return out


def error_feedback(rank, world, spec, calls):
    """The same input ``calls`` times through ``spec`` with and without error feedback: the
    accumulated error ``||Σ out − calls · mean||`` after each call, and whether the residual
    moved. With EF what one call dropped is sent by the next."""
    x = sample(rank, 99, 600)
    mean = everyone(x).double().mean(0)
    result = {}
    for name, s in (("ef", spec + ",ef"), ("plain", spec)):
        state = ops.init_state(s, (600,), x.dtype)
        total = torch.zeros(600, dtype=torch.float64)
        acc, digests = [], []
        for k in range(calls):
            y = ring_all_reduce(x, s, None, state)
            total += y.double()
            acc.append((total - (k + 1) * mean).norm().item())
            digests.append(digest(y))
        result[name] = {"accumulated": acc, "digests": digests,
                        "residual_norm": state[0].norm().item() if state else 0.0}
    return result


def opcheck_alone(rank, world):
    """``torch.library.opcheck`` of the op on a one-rank group of each rank's own (world size
    1: the codec's round trip)."""
    singles = [dist.new_group([r]) for r in range(world)]
    x = sample(rank, 5, 300)
    out = {}
    name = singles[rank].group_name
    torch.library.opcheck(torch.ops.ccfx.ring_all_reduce.default, (x, "int8", name, []))
    state = ops.init_state("int8:ef", (300,), x.dtype)
    torch.library.opcheck(torch.ops.ccfx.ring_all_reduce.default, (x, "int8:ef", name, state))
    y, new = torch.ops.ccfx.ring_all_reduce(x, "int8:ef", name, state)
    # world size 1: the codec's round trip, the residual exactly what it lost, inputs untouched
    out["single_residual_exact"] = bool(torch.equal(new[0], x - y)
                                        and not state[0].any())
    return out


def stalled_peer(rank, world, timeout_s):
    """The last rank never joins the ring: the others must fail within about the group's
    timeout with an error naming themselves, the hop and the peer."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    if rank == world - 1:
        time.sleep(timeout_s + 3)
        return {"error": None}
    t0 = time.monotonic()
    try:
        ring_all_reduce(sample(rank, 0, 40), "int8", group)
    except CollectiveError as e:
        return {"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}
    return {"error": "none raised", "elapsed": time.monotonic() - t0}


def compiled_ring_training(rank, world, steps):
    """The tiny MLP of the data-parallel tests, compiled with int8 on the ring, trained
    ``steps`` SGD steps; per step the gradients' digest (equal on every rank) and their error
    against the true mean of every rank's local gradients."""
    import copy

    import ccfx

    from . import dp_workers

    model = dp_workers.mlp(seed=rank)
    compiled = dp_workers.compile_dp(model, "int8", gradient_collective="ring")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    digests, errors, scales = [], [], []
    for step in range(steps):
        x = dp_workers.batch(rank, step)
        if step:  # rank 0's parameters are broadcast at the first call
            ref = copy.deepcopy(model)
            dp_workers.loss_fn(ref(x)).backward()
            local = [p.grad.clone() for p in ref.parameters()]
        dp_workers.loss_fn(compiled(x)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        digests.append(digest(grads))
        if step:
            means = [everyone(g.reshape(-1)).double().mean(0) for g in local]
            errors.append(max((g.reshape(-1).double() - m).abs().max().item()
                              for g, m in zip(grads, means)))
            scales.append(max(everyone(g.reshape(-1)).abs().max().item() for g in local))
        opt.step()
        opt.zero_grad()
    plan = ccfx.plan_of(compiled)
    return {"digests": digests, "errors": errors, "scales": scales,
            "params": digest(model.parameters()),
            "buckets": [(b.codec, b.collective, b.wire_bytes) for b in plan.buckets]}


def suite(rank, world, cases):
    """The eager ring tests in one spawn of 4 ranks (starting ranks is what costs): ``cases``
    (world → its list) on every rank (W = 4) and on the subgroup of ranks 1, 2, 3 (W = 3,
    group rank = global rank − 1), error feedback, opcheck, and last (it breaks a group on
    purpose) the stalled peer."""
    sub = dist.new_group(list(range(1, world)))
    out = {world: ring_cases(rank, cases[world])}
    if rank >= 1:
        out[world - 1] = ring_cases(rank, cases[world - 1], sub)
    out["ef"] = error_feedback(rank, world, "topk:ratio=0.1", 3)
    out["alone"] = opcheck_alone(rank, world)
    out["stall"] = stalled_peer(rank, world, 2.0)
    return out
