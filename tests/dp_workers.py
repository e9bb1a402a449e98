"""What each rank runs in the data-parallel tests (module-level: spawn pickles them by name).

Every worker returns plain data (lists, floats, bytes digests); the test in the parent process
asserts on it. Ranks start from *different* initialisations on purpose: ccfx must broadcast
rank 0's parameters at the first call, as DDP does.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import ccfx

from .ranks import caught, digest, gathered, mean_over_ranks, rng, train


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 8))


def batch(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(16, 64, generator=rng(rank, step))


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def compile_dp(model, codec, lowering="eager", **options):
    opts = {"data_parallel": True, "gradient_codec": codec, "lowering": lowering,
            "compress_min_numel": 0, **options}
    return torch.compile(model, backend="ccfx", options=opts)


def grads_by_codec(rank, world, codecs, lowering="eager"):
    """One step per codec; per codec: the max error against the reference average, the
    digest of the gradients (equal on every rank) and whether parameters were broadcast."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = batch(rank)
    ddp = DDP(mlp(seed=0))  # DDP broadcasts rank 0's init too
    loss_fn(ddp(x)).backward()
    ddp_grads = [p.grad for p in ddp.parameters()]
    results = {}
    for codec in codecs:
        model = mlp(seed=rank)  # differs per rank until ccfx broadcasts rank 0's
        compiled = compile_dp(model, codec, lowering)
        loss_fn(compiled(x)).backward()
        same_init = all(torch.equal(a, b) for a, b in zip(model.parameters(), ddp.parameters()))
        grads = [p.grad for p in model.parameters()]
        plan = ccfx.plan_of(compiled)
        if codec == "none":
            reference = ddp_grads
        else:
            reference = _codec_reference(model, plan, x, codec)
        err = max((g - r).abs().max().item() for g, r in zip(grads, reference))
        results[codec] = {"err": err, "digest": digest(grads), "same_init": same_init,
                          "buckets": [(b.codec, b.collective, b.wire_bytes) for b in plan.buckets],
                          "ledger": ccfx.ledger_of(compiled).per_step("bucket")}
    return results


def _local_grads(model, x):
    ref = copy.deepcopy(model)
    ref.zero_grad()
    loss_fn(ref(x)).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _codec_reference(model, plan, x, codec):
    """What the buckets should compute, from every rank's local gradients, eagerly: gather
    codecs average each rank's round trip; PowerSGD on the averaged gradient (with one shared
    Q, P Pᵀ M summed is P Pᵀ of the sum)."""
    from ccfx.wire.comm import LocalComm
    from ccfx.wire.exchange import BucketLayout, exchange_for

    local = _local_grads(model, x)
    out = dict(local)
    for b in plan.buckets:
        grads = [local[n] for n in b.params]
        layout = BucketLayout(tuple(tuple(g.shape) for g in grads), grads[0].dtype)
        ex = exchange_for(layout, b.codec)
        if b.collective == "powersgd":
            mean = [mean_over_ranks(g) for g in grads]
            result = ex.run(mean, ex.init_state(), LocalComm())
        elif b.collective == "all_gather":
            per_rank = [ex.run(list(parts), ex.init_state(), LocalComm())
                        for parts in zip(*[gathered(g) for g in grads])]
            result = [sum(r[i].float() for r in per_rank) / len(per_rank)
                      for i in range(len(grads))]
        else:
            result = [mean_over_ranks(g) for g in grads]
        out.update(zip(b.params, result))
    return [out[n] for n, _ in model.named_parameters()]


def train_steps(rank, world, codec, steps, lowering="eager", **options):
    """Train the MLP a few SGD steps; returns per-step losses and the final parameters' digest."""
    model = mlp(seed=rank)
    compiled = compile_dp(model, codec, lowering, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train(lambda step: loss_fn(compiled(batch(rank, step))), opt, range(steps))
    return {"losses": losses, "params": digest(model.parameters()),
            "ledger_steps": ccfx.ledger_of(compiled).steps,
            "bucket_bytes": ccfx.ledger_of(compiled).per_step("bucket")}


def checkpoint_resume(rank, world, codec, path, **options):
    """5 steps straight, against 3 steps + checkpoint + a fresh model resumed for 2 steps
    (``options``: ccfx options, e.g. ``warmup_steps=4``: the resumed run's step 3 is the last
    warm-up step, as the straight run's). Then the checkpoint loaded where it does not belong:
    the peer rank's, and one made for another world size (both errors, as data)."""
    def build():
        model = mlp(seed=rank)
        compiled = compile_dp(model, codec, **options)
        return model, compiled, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(compiled, opt, i):
        loss_fn(compiled(batch(rank, i))).backward()
        opt.step()
        opt.zero_grad()

    model, compiled, opt = build()
    for i in range(5):
        step(compiled, opt, i)
    straight = digest(model.parameters())

    torch._dynamo.reset()
    model, compiled, opt = build()
    for i in range(3):
        step(compiled, opt, i)
    file = f"{path}.rank{rank}"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "codec": ccfx.codec_state(compiled).state_dict()}, file)
    saved_state = len(ccfx.codec_state(compiled).state_dict())

    torch._dynamo.reset()
    model, compiled, opt = build()
    ckpt = torch.load(file)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    compiled(batch(rank, 99))  # compiles the training graph: buckets and their state exist now
    ccfx.codec_state(compiled).load_state_dict(ckpt["codec"])
    for i in range(3, 5):
        step(compiled, opt, i)
    resumed = digest(model.parameters())
    dist.barrier()  # the peer's checkpoint is written
    state = ccfx.codec_state(compiled)
    peer = torch.load(f"{path}.rank{1 - rank}")["codec"]
    other_world = dict(ckpt["codec"], **{"meta.world_size": torch.tensor(world + 1)})
    return {"straight": straight, "resumed": resumed, "state_tensors": saved_state,
            "peer's": caught(lambda: state.load_state_dict(peer)),
            "other world": caught(lambda: state.load_state_dict(other_world)),
            "steps": int(state.get_meta("graph0.backward_steps"))}


def powersgd_hook_world1(rank, world, steps):
    """World size 1: ccfx's PowerSGD buckets against torch's powerSGD_hook on DDP."""
    import numpy as np
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=25)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                               start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                               min_compression_rate=2, random_seed=0)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    seed = np.random.RandomState(0).randint(1_000_000_000)
    mine = copy.deepcopy(base)
    compiled = compile_dp(mine, f"powersgd:rank=2,seed={seed},ef", warmup_steps=2,
                          compress_min_numel=0, min_compression_rate=1.0)
    errs = []
    for i in range(steps):
        x = batch(0, i)
        for m, fn in ((ddp, ddp), (mine, compiled)):
            m.zero_grad()
            loss_fn(fn(x)).backward()
        errs.append(max((a.grad - b.grad).abs().max().item()
                        for a, b in zip(ddp.module.parameters(), mine.parameters())))
        scale = max(a.grad.abs().max().item() for a in ddp.module.parameters())
        errs[-1] /= scale
    return {"rel_errs": errs, "buckets": [b.params for b in ccfx.plan_of(compiled).buckets]}


def mismatched_models(rank, world):
    """Rank 1 has an extra layer: the bucket-plan check must fail on every rank."""
    model = mlp(seed=0) if rank == 0 else nn.Sequential(mlp(seed=0), nn.Linear(8, 8))
    compiled = compile_dp(model, "int8")
    got = caught(lambda: compiled(batch(rank)))
    got.pop("value", None)
    return got


def dies_mid_step(rank, world, timeout_s, dead=1):
    """Rank ``dead`` exits after compiling; the others' backward must fail within the timeout
    (naming the dead rank)."""
    import os
    import time

    model = mlp(seed=0)
    compiled = compile_dp(model, "int8", collective_timeout_s=timeout_s)
    out = compiled(batch(rank))  # compiles (and checks the bucket plan) on both ranks
    if rank == dead:
        os._exit(0)
    time.sleep(0.5)
    return _timed_backward(out)


def hook_dies_mid_step(rank, world, how="dies", dead=1):
    """Eager DDP with ccfx's comm hook (``collective_timeout_s`` 3 s): one step on every rank,
    then rank ``dead`` exits (``how="dies"``) or stops itself (``"frozen"``: SIGSTOP, killed by
    rank 0 once it has its error); the others' backward must fail naming the bucket and the
    rank, ``since`` seconds after."""
    import json
    import os
    import signal
    import time

    from torch.nn.parallel import DistributedDataParallel

    from ccfx.wire import agree

    model = DistributedDataParallel(mlp(seed=0))
    model.register_comm_hook(*ccfx.ddp_comm_hook("int8", collective_timeout_s=3.0))
    for step in range(2):  # every rank: DDP's buckets, rebuilt in the second forward
        loss_fn(model(batch(rank, step))).backward()
    store = agree._store()
    if rank == dead:
        store.set("test/dead_at", repr(time.time()).encode())
        os.kill(os.getpid(), signal.SIGSTOP) if how == "frozen" else os._exit(0)
        os._exit(3)  # woken by the kill below: never reached
    store.wait(["test/dead_at"])
    time.sleep(0.5)
    got = caught(lambda: loss_fn(model(batch(rank, 2))).backward())
    got["since"] = time.time() - float(store.get("test/dead_at").decode())
    if how == "frozen":
        os.kill(json.loads(store.get(f"ccfx/agree/proc/{dead}").decode())["pid"],
                signal.SIGKILL)
    return got


def _timed_backward(out) -> dict:
    """Backward, and the error it raised (type, message) with the seconds it took."""
    return caught(lambda: loss_fn(out).backward())


def backward_graph(rank, world, codec):
    """The backward graph text (normalized, as in goldens) and where its collectives sit."""
    from ccfx.backends.compiler import backend_of
    from ccfx.testing import golden_text

    model = mlp(seed=0)
    compiled = compile_dp(model, codec, bucket_mb=0.06)
    loss_fn(compiled(batch(rank))).backward()
    (gm,) = backend_of(compiled).graphs[0].lowered.backward
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return {"text": golden_text(compiled, graphs=("backward",)), "targets": names,
            "buckets": len(ccfx.plan_of(compiled).buckets)}


def bn_buffers(rank, world, broadcast):
    """BatchNorm statistics after 3 training steps on per-rank data and two forwards in eval
    mode (grad enabled, as DDP's default broadcasts): equal on every rank with
    ``broadcast_buffers`` (rank 0's), per rank without."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))
    compiled = compile_dp(model, "none", broadcast_buffers=broadcast, bucket_mb=0.25)
    for i in range(3):
        loss_fn(compiled(batch(rank, i) + rank)).backward()
    trained = [b.clone() for b in model.buffers()]
    model.eval()
    for i in range(2):  # a recompile (eval mode); its second call broadcasts
        compiled(batch(rank, 10 + i))
    return {"buffers": digest([b.float() for b in model.buffers()]),
            "rank0": gathered(trained[0])[0].tolist() == model[1].running_mean.tolist()}


def uneven_last_batch(rank, world, timeout_s):
    """Two steps, then a last batch of 5 on rank 1 (16 on rank 0): rank 1 recompiles while
    rank 0 waits in the gradient collectives. Rank 1 must fail within seconds naming the
    recompile, and rank 0, blocked in gloo, as soon as rank 1 closes its connections of the
    group (well before ``timeout_s``), naming it too (both errors as data)."""
    import time

    torch._dynamo.reset()  # Dynamo's shape history of earlier scenarios (same forward code)
    model = mlp(seed=0)
    # options of its own: a group made by an earlier scenario would be shared, with the
    # timeout it was made with
    compiled = compile_dp(model, "int8", collective_timeout_s=timeout_s, bucket_mb=0.5)
    for i in range(2):
        loss_fn(compiled(batch(rank, i))).backward()
    x = batch(rank, 2)
    start = time.monotonic()
    got = caught(lambda: loss_fn(compiled(x[:5] if rank == 1 else x)).backward())
    got["elapsed"] = time.monotonic() - start
    dist.barrier()  # rank 1 fails first: both go on together
    return got


class Flagged(nn.Module):
    """The MLP with a Python flag its forward branches on (a guard for Dynamo)."""

    def __init__(self):
        super().__init__()
        self.net = mlp(seed=0)
        self.doubled = False

    def forward(self, x):
        y = self.net(x)
        return y * 2 if self.doubled else y


def branch_on_one_rank(rank, world, timeout_s):
    """Two steps, then rank 1 alone flips the flag its forward branches on: it recompiles
    (Dynamo's guard on the flag fails) while rank 0 waits in the gradient collectives. Both
    fail at once, naming the guard (both errors as data)."""
    import time

    torch._dynamo.reset()
    model = Flagged()
    compiled = compile_dp(model, "int8", collective_timeout_s=timeout_s, bucket_mb=0.5)
    for i in range(2):
        loss_fn(compiled(batch(rank, i))).backward()
    model.doubled = rank == 1
    start = time.monotonic()
    got = caught(lambda: loss_fn(compiled(batch(rank, 2))).backward())
    got["elapsed"] = time.monotonic() - start
    dist.barrier()
    return got


def stalls_mid_step(rank, world, timeout_s):
    """Rank 1 stays alive but never joins the backward's collectives: rank 0 must fail after
    about ``timeout_s``, not hang. Rank 1 stays until rank 0 has its error (a key in the
    default store), or for ``STALL_S`` at most: a rank 0 that waited for rank 1's exit instead
    of its own timeout takes at least that long, whatever the machine's load."""
    from datetime import timedelta

    model = mlp(seed=0)
    compiled = compile_dp(model, "none", collective_timeout_s=timeout_s)
    out = compiled(batch(rank))
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        try:
            store.wait(["stall: rank 0 failed"], timedelta(seconds=STALL_S))
        except RuntimeError:  # DistStoreError: rank 0 never said so
            pass
        return {"error": None, "elapsed": 0.0}
    result = _timed_backward(out)
    store.set("stall: rank 0 failed", "1")
    return result


#: How long the stalled rank stays at most (``stalls_mid_step``).
STALL_S = 120.0


def one_rank_raises(rank, world):
    """Rank 1 raises at once; rank 0 waits on it in a collective and fails when rank 1's
    process group goes away. The parent must name rank 1's error as the cause."""
    import time

    if rank == 1:
        raise ValueError("the first error, on rank 1")
    time.sleep(1.0)  # rank 1's error is reported first; rank 0 fails after it
    dist.all_reduce(torch.ones(4))
    return "rank 0 finished"


def inside_ddp(rank, world):
    """DDP(torch.compile(model)) with data_parallel: ccfx compiles inside DDP's forward and
    must refuse (the error message, or "no error")."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # (torch.compile(DDP(model)) on torch 2.13 graph-breaks at DDP's forward and never calls
    # the backend: nothing to refuse.)
    compiled = DDP(torch.compile(mlp(0), backend="ccfx",
                                 options={"data_parallel": True, "lowering": "eager"}))
    try:
        compiled(batch(0))
    except ccfx.ConfigError as e:
        return str(e)
    return "no error"
