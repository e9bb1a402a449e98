"""What each rank runs in tests/test_collectives_pass.py (module-level: spawn pickles them by
name). Every worker returns plain data; the tests assert on it.

The tensor-parallel model is torch's own: ``parallelize_module`` with ``ColwiseParallel`` then
``RowwiseParallel`` on a 1-D DeviceMesh of every rank, the same initialisation and the same
input on every rank (a tensor-parallel group computes one model). Its forward graph holds the
row-wise layer's all-reduce; its backward the column-wise layer's input-gradient all-reduce
(the input requires grad).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import ccfx
from ccfx.backends.compiler import backend_of

from .ranks import caught, digest

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default


def tp_model(world: int, seed: int = 0, hidden: int = 64) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 16))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def tp_input(requires_grad: bool = True, batch: int = 8) -> torch.Tensor:
    x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(7))
    return x.requires_grad_(requires_grad)


def compile_tp(model, codec, lowering="eager", **options):
    return torch.compile(model, backend="ccfx",
                         options={"lowering": lowering, "collective_codec": codec, **options})


def plan_rows(compiled) -> list[dict]:
    return [dataclasses.asdict(c) for c in ccfx.plan_of(compiled).collectives]


def raw_all_reduces(compiled) -> list[int]:
    """All-reduce nodes left in the recorded forward and backward graphs."""
    lowered = backend_of(compiled).graphs[0].lowered
    return [sum(n.target is ALL_REDUCE for g in graphs for n in g.graph.nodes)
            for graphs in (lowered.forward, lowered.backward)]


def _partials(model, x: torch.Tensor) -> tuple[float, float]:
    """The largest |value| of every rank's partial sums (before the all-reduces): the row-wise
    layer's output and the column-wise layer's input gradient, computed on the local shards."""
    w0, b0 = model[0].weight.to_local(), model[0].bias.to_local()
    w2, b2 = model[2].weight.to_local(), model[2].bias.to_local()
    xl = x.detach().clone().requires_grad_(True)
    p = torch.relu(xl @ w0.T + b0) @ w2.T + b2 / dist.get_world_size()
    (q,) = torch.autograd.grad(p.sum(), xl)
    t = torch.stack([p.detach().abs().max(), q.abs().max()])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def tp_compare(rank, world, codec, lowering):
    """One forward and backward with ``codec`` against the same model compiled without a
    collective codec: the errors, their scales, the digest, the plan, the graphs."""
    model, plain_model = tp_model(world), tp_model(world)
    compiled = compile_tp(model, codec, lowering)
    plain = torch.compile(plain_model, backend="ccfx", options={"lowering": lowering})
    x, x_plain = tp_input(), tp_input()
    y, y_plain = compiled(x), plain(x_plain)
    y.sum().backward()
    y_plain.sum().backward()
    p_scale, q_scale = _partials(plain_model, x_plain)
    grads = [p.grad.to_local() for p in model.parameters()]
    plain_grads = [p.grad.to_local() for p in plain_model.parameters()]
    return {
        "same_as_plain": torch.equal(y, y_plain) and torch.equal(x.grad, x_plain.grad)
        and all(torch.equal(a, b) for a, b in zip(grads, plain_grads)),
        "out_err": float((y - y_plain).detach().abs().max()),
        "out_scale": max(p_scale, float(y_plain.detach().abs().max())),
        "grad_err": float((x.grad - x_plain.grad).abs().max()),
        "grad_scale": max(q_scale, float(x_plain.grad.abs().max())),
        "digest": digest([y.detach(), x.grad]),
        "plan": plan_rows(compiled),
        "raw_all_reduces": raw_all_reduces(compiled),
    }


def tp_train(rank, world, codec, steps):
    """``steps`` SGD steps of the tensor-parallel model towards a fixed target."""
    model = tp_model(world)
    compiled = compile_tp(model, codec)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    x = tp_input()
    target = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(steps):
        loss = (compiled(x) - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        x.grad = None
        losses.append(loss.item())
    book = ccfx.ledger_of(compiled)
    return {
        "losses": losses,
        "steps": steps,
        "replicated": digest(model[2].bias.to_local()),
        "sharded": digest(model[0].weight.to_local()),
        "plan": plan_rows(compiled),
        "ledger": [(e.edge, e.calls, e.raw_bytes, e.wire_bytes)
                   for e in book.entries("collective")],
    }


def tp_plan(rank, world, codec, overrides, **options):
    compiled = compile_tp(tp_model(world), codec, collective_overrides=overrides, **options)
    compiled(tp_input()).sum().backward()
    plan = ccfx.plan_of(compiled)
    decisions = [dataclasses.asdict(d) for d in plan.graphs[0].decisions]
    predicted = plan.graphs[0].prediction
    return {"plan": plan_rows(compiled), "text": str(plan), "explain": ccfx.explain(compiled),
            "decisions": decisions,
            "prediction": dataclasses.asdict(predicted) if predicted is not None else None}


def tp_drawn(rank, world, codec):
    """The plan as JSON (what ``ccfx report plan.json`` reads) and the forward and backward
    drawings of the tensor-parallel model, its forward all-reduce in ``codec``, its backward
    one left alone (``collective 1``: none): tests/test_viz_collectives.py's single process
    has no group of two."""
    from ccfx import viz

    compiled = compile_tp(tp_model(world), codec, collective_overrides={"collective 1": "none"})
    compiled(tp_input()).sum().backward()
    return {"plan": ccfx.plan_of(compiled).to_json(),
            "forward": viz.to_dot(compiled, which="forward", depth=None),
            "backward": viz.to_dot(compiled, which="backward", depth=2)}


class Kinds(nn.Module):
    """The user's own funcol code: each kind of collective, and a max reduction."""

    def forward(self, x, y):
        from torch.distributed import _functional_collectives as funcol

        group = dist.group.WORLD
        a = funcol.all_gather_single(x, 0, group)
        b = funcol.reduce_scatter_single(y, "sum", 0, group)
        c = funcol.all_to_all_single(y, None, None, group)
        d = funcol.all_reduce(x, "max", group)
        return a * 1, b * 1, c * 1, d * 1


def funcol_kinds(rank, world, codec):
    """The inference graph of :class:`Kinds` (no input requires grad) with ``codec``, against
    the same collectives uncompressed (eager)."""
    gen = torch.Generator().manual_seed(100 + rank)  # each rank's own data
    x, y = torch.randn(6, 40, generator=gen), torch.randn(4 * world, 40, generator=gen)
    compiled = torch.compile(Kinds(), backend="ccfx",
                             options={"lowering": "eager", "collective_codec": codec})
    got = [t.clone() for t in compiled(x, y)]
    want = [t.clone() for t in Kinds()(x, y)]
    scale = torch.stack([x.abs().max(), y.abs().max()])
    dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    sx, sy = float(scale[0]), float(scale[1])
    names = ["all_gather", "reduce_scatter", "all_to_all"]
    return {
        "plan": plan_rows(compiled),
        "text": str(ccfx.plan_of(compiled)),
        "errors": {k: float((g - t).abs().max()) for k, g, t in zip(names, got, want)},
        # int8: half a quantisation step (max |block| / 127) per encoded value; summed over
        # the ranks for the reduce-scatter
        "bounds": {"all_gather": sx / 254 + 1e-6, "reduce_scatter": world * sy / 254 + 1e-6,
                   "all_to_all": sy / 254 + 1e-6},
        "max_exact": torch.equal(got[3], want[3]),
    }


class Doubled(nn.Module):
    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1


def only_rank0_compiles(rank, world):
    """Rank 0 runs a funcol all-reduce compiled with ccfx (collective codec none), the others
    the same module eagerly: nothing in ccfx may wait for a peer that does not compile."""
    import time

    x = torch.full((4, 8), float(rank + 1))
    model = Doubled()
    run = (torch.compile(model, backend="ccfx",
                         options={"lowering": "eager", "collective_timeout_s": 30.0})
           if rank == 0 else model)
    start = time.monotonic()
    out = run(x)
    return {"out": out.clone(), "elapsed": time.monotonic() - start}


class Scatter(nn.Module):
    def forward(self, y):
        from torch.distributed import _functional_collectives as funcol

        return funcol.reduce_scatter_tensor(y, "sum", 0, dist.group.WORLD) * 1


def funcol_ef_state(rank, world, spec):
    """A reduce-scatter with an error-feedback codec: its residuals in ``codec_state``."""
    compiled = torch.compile(Scatter(), backend="ccfx",
                             options={"lowering": "eager", "collective_codec": spec})
    y = torch.randn(4 * world, 40, generator=torch.Generator().manual_seed(rank))
    compiled(y)
    state = backend_of(compiled).codec_state
    channels = [c for c in state.channels() if ".collective" in c]
    before = {k: v.clone() for k, v in state.state_dict().items() if "collective" in k}
    compiled(y * 3)
    after = {k: v for k, v in state.state_dict().items() if "collective" in k}
    return {"channels": channels,
            "residual_changed": bool(before) and any(not torch.equal(before[k], after[k])
                                                     for k in before)}


def mismatched_codecs(rank, world):
    """Rank 0 asks int8, the others fp8: the compile must fail on every rank, saying so. (A
    batch of 5, a graph no earlier scenario compiled: ranks meet keyed by what they compile,
    and rank 0's int8 graph of batch 8 was agreed on before.)"""
    codec = "int8" if rank == 0 else "fp8"
    compiled = compile_tp(tp_model(world), codec, collective_timeout_s=60.0)
    got = caught(lambda: compiled(tp_input(batch=5)))
    return {"error": got["error"], "message": got.get("message", "")}


def sharded_zero_pp(rank, world, steps):
    """ccfx.shard's weight all-gathers in int8 and gradient reduce-scatters in int4 with error
    feedback (ZeRO++'s qwZ and qgZ as collective_overrides), a few SGD steps on each rank's
    own data."""
    torch.manual_seed(0)
    model = ccfx.shard(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)))
    compiled = torch.compile(model, backend="ccfx", options={
        "lowering": "eager",
        "collective_overrides": {"all_gather": "int8", "reduce_scatter": "int4:ef"}})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(steps):
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    book = ccfx.ledger_of(compiled)
    return {"plan": plan_rows(compiled), "losses": losses,
            "ledger": [(e.edge, e.calls, e.wire_bytes) for e in book.entries("collective")]}


class Gathered(nn.Module):
    """Data parallel whose forward all-gathers an activation (differentiable: the backward
    reduce-scatters its gradient), so the backward graph holds a collective of the model's
    and ccfx's own gradient buckets."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        h = torch.relu(self.a(x))
        return self.b(funcol.all_gather_tensor_autograd(h, 0, dist.group.WORLD))


def with_data_parallel(rank, world, codec):
    """``data_parallel=True`` (int8 buckets) with and without ``collective_codec``: the
    gradients of both, the plan of the compressed one."""
    out = {}
    for spec in ("none", codec):
        torch.manual_seed(0)
        model = Gathered()
        compiled = torch.compile(model, backend="ccfx", options={
            "lowering": "eager", "data_parallel": True, "gradient_codec": "int8",
            "compress_min_numel": 0, "collective_codec": spec})
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
        compiled(x).square().mean().backward()
        out[spec] = [p.grad.clone() for p in model.parameters()]
        plan = ccfx.plan_of(compiled)
    return {"err": max(float((a - b).abs().max()) for a, b in zip(out["none"], out[codec])),
            "scale": max(float(g.abs().max()) for g in out["none"]),
            "digest": digest(out[codec]),
            "buckets": [b.codec for b in plan.buckets],
            "collectives": [(c.part, c.kind, c.codec) for c in plan.collectives]}


# -- a rank of the tensor-parallel group dies or freezes (issue 36) ----------------------------


def _group_model(kind: str, world: int) -> nn.Module:
    """Tensor parallel (``"tp"``) or ``ccfx.shard`` (``"shard"``) over every rank, every
    sharded size a multiple of ``world``."""
    if kind == "tp":
        return tp_model(world, hidden=16 * world)
    torch.manual_seed(0)
    return ccfx.shard(nn.Sequential(nn.Linear(16, 16 * world), nn.ReLU(),
                                    nn.Linear(16 * world, 8 * world)))


def _until_survivors_failed(store, rank: int, world: int) -> None:
    """Every survivor (all but one rank) counts its error in; rank 0, which hosts the store
    their blame reads, returns (and takes the store down) only once all have."""
    import time

    store.add("test/failed", 1)
    deadline = time.monotonic() + 60
    while rank == 0 and store.add("test/failed", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.1)


def rank_fails(rank, world, kind, how, victim, timeout_s):
    """A model on the user's groups (:func:`_group_model`) with int8 collectives: a step on
    every rank, then rank ``victim`` is SIGKILLed (``how="dies"``) or SIGSTOPped
    (``"frozen"``); the others' next step fails, its error as data with ``since``: seconds
    from the kill or freeze to the error. Once every survivor has its error, rank 0 kills a
    frozen victim (its pid: what ranks publish)."""
    import json
    import os
    import signal
    import time

    from ccfx.wire import agree

    model = _group_model(kind, world)
    compiled = compile_tp(model, "int8", collective_timeout_s=timeout_s)
    x = tp_input()
    compiled(x).sum().backward()  # compiles, agrees and runs on every rank
    dist.barrier()
    store = agree._store()
    if rank == victim:
        store.set("test/victim_at", repr(time.time()).encode())
        os.kill(os.getpid(), signal.SIGKILL if how == "dies" else signal.SIGSTOP)
        os._exit(3)  # woken: the survivors are done
    store.wait(["test/victim_at"])
    victim_at = float(store.get("test/victim_at").decode())
    got = caught(lambda: compiled(x).sum().backward())
    got["since"] = time.time() - victim_at
    _until_survivors_failed(store, rank, world)
    if how == "frozen" and rank == 0:
        proc = json.loads(store.get(f"ccfx/agree/proc/{victim}").decode())
        try:
            os.kill(proc["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    return got
