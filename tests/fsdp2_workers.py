"""What each rank runs in tests/test_fsdp2.py (module level: spawn pickles them by name).

The model is torch's own FSDP2: a 3-block MLP, ``fully_shard`` on each block and on the model
(whose head is the root's own parameters), trained with AdamW, each rank on its own batches.
Workers return plain data (losses, digests, ledger and plan figures); the assertions are in
the test file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ccfx
from ccfx.integrations import register_codec
from ccfx.runtime import fsdp2_comms

from .ranks import caught, digest, rng

WIDTH = 32


class MLP(nn.Module):
    """Three blocks (one FSDP module each) and a head (the root FSDP module's own)."""

    def __init__(self, width: int = WIDTH, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sharded(world: int, seed: int = 0, mesh=None, compile: bool = False) -> MLP:
    """The MLP (the same values on every rank), sharded with fully_shard (on ``mesh``: a
    1-D mesh of every rank by default); ``compile``: each block compiled (inductor)."""
    torch.manual_seed(seed)
    model = MLP()
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
        if compile:
            block.compile()
    fully_shard(model, mesh=mesh)
    return model


def _watch_gathers(model: MLP) -> list[str]:
    """Digests of every block's gathered (unsharded) parameters, at each forward (of copies:
    numpy's view of a tensor makes its storage one FSDP can no longer free)."""
    seen: list[str] = []
    for block in model.blocks:
        block[0].register_forward_pre_hook(
            lambda m, args: seen.append(digest([p.detach().clone() for p in m.parameters()])))
    return seen


def _steps(model, opt, rank: int, steps: int) -> list[float]:
    """``steps`` AdamW steps, each rank on its own fixed batch: the losses."""
    losses = []
    x = torch.randn(16, WIDTH, generator=rng(rank))  # each rank its own batch, every step
    y = x[:, :4].sin()
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(rank: int, world: int, spec, steps: int = 5, compile: bool = False) -> dict:
    """``steps`` AdamW steps of the sharded MLP, with ccfx's comms (``spec``) or plain FSDP2
    (``spec`` None), eager or each block compiled: losses, the full parameters' digest and
    values, the gathered parameters' digests, and with a spec the ledger's figures and the
    plan's text."""
    model = sharded(world, compile=compile)
    state = register_codec(model, spec) if spec is not None else None
    gathers = _watch_gathers(model) if not compile else []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _steps(model, opt, rank, steps)
    full = [p.full_tensor() for p in model.parameters()]
    out = {"losses": losses, "params": digest(full), "values": [p.tolist() for p in full],
           "gathers": gathers}
    if state is not None:
        out.update(_figures(model, state))
    return out


def _figures(model, state) -> dict:
    """What the ledger and the plan say, as plain data."""
    ledger = ccfx.ledger_of(model)
    by_kind: dict[str, list[int]] = {}
    calls: dict[str, int] = {}
    for ch in state.channels.values():
        row = [e for e in ledger.entries("collective") if e.edge == ch.index]
        raw, wire = by_kind.setdefault(ch.kind, [0, 0])
        by_kind[ch.kind] = [raw + sum(e.raw_bytes for e in row),
                            wire + sum(e.wire_bytes for e in row)]
        calls[f"{ch.module}.{ch.kind}"] = sum(e.calls for e in row)
    return {"ledger_is_state": ledger is state.ledger, "steps": ledger.steps,
            "bytes": by_kind, "calls": calls, "plan": str(ccfx.plan_of(model)),
            "codecs": {f"{ch.module}.{ch.kind}": ch.codec for ch in state.channels.values()},
            "state": sorted(state.state_tensors())}


def reduce_ops(rank: int, world: int) -> dict:
    """ccfx's int8 reduce-scatter called as FSDP calls it, with each op FSDP may pass, against
    torch's exact fp32 sum: the largest error, and the largest input (for the bound)."""
    x = torch.randn(world * 64, generator=rng(rank, 7))
    exact = torch.empty(64)
    dist.reduce_scatter_tensor(exact, x.clone(), op=dist.ReduceOp.SUM)
    peak = x.abs().max().clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    out = {"peak": peak.item()}
    for name, op, scale in (("sum", dist.ReduceOp.SUM, 1.0), ("avg", dist.ReduceOp.AVG,
                                                               1 / world),
                            ("premul", dist.ReduceOp.PREMUL_SUM(0.25), 0.25)):
        state = fsdp2_comms.FSDP2Codecs({"reduce_scatter": "int8"})
        channel = state.add_module("m")["reduce_scatter"]
        comm = fsdp2_comms.CodecReduceScatter(state, channel)
        got = comm.allocate((64,), dtype=torch.float32, device=torch.device("cpu"))
        work = comm(got, x.clone(), dist.group.WORLD, op)
        out[name] = {"error": (got - exact * scale).abs().max().item(), "work": work,
                     "codec": channel.codec}
    return out


class Mixed(nn.Module):
    """One FSDP module whose parameters mix fp32 and bf16 (a frozen one: FSDP2 wants its
    trainable parameters of one dtype): FSDP2 gathers a uint8 view."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x):
        return self.lin(x) * self.scale.float()


def mixed_dtypes(rank: int, world: int) -> dict:
    """A forward of a mixed-dtype FSDP module under int8 gathers: what ran, and why."""
    torch.manual_seed(0)
    model = Mixed()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    state = register_codec(model, {"all_gather": "int8"})
    with torch.no_grad():
        y = model(torch.randn(2, 8, generator=rng(0)))
    ch = state.channels[("root", "all_gather")]
    return {"codec": ch.codec, "reason": ch.reason, "dtype": str(ch.call.dtype),
            "out": digest(y), "plan": str(ccfx.plan_of(model))}


# -- HSDP: 2 replicas x 2 shards ------------------------------------------------------------


def hsdp(rank: int, world: int, spec, steps: int = 5) -> dict:
    """The MLP on a (replicate 2, shard 2) mesh: torch's own HSDP (``spec`` None:
    fully_shard on the 2-D mesh), or FSDP over ``mesh["shard"]`` with ccfx averaging across
    ``mesh["replicate"]`` (``spec``: register_codec's). Losses, the full parameters (each
    replica's), and with a spec the ledger's all-reduce figures and the plan's text."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    native = spec is None
    model = sharded(world, mesh=mesh if native else mesh["shard"])
    state = None if native else register_codec(model, spec, replicate=mesh["replicate"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _steps(model, opt, rank, steps)
    full = [p.full_tensor() for p in model.parameters()]
    out = {"losses": losses, "params": digest(full), "values": [p.tolist() for p in full]}
    if state is not None:
        out.update(_figures(model, state))
    return out


# -- checkpoints -----------------------------------------------------------------------------


def resume(rank: int, world: int, folder: str, spec=None) -> dict:
    """3 steps, a checkpoint (torch.distributed.checkpoint of get_state_dict(model, opt), and
    ccfx's codec state, each rank its own file), 2 steps more; then a new model and optimizer
    resumed from it for the same 2 steps: both runs' last losses and parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    spec = spec or {"all_gather": "int8", "reduce_scatter": "int4:ef"}
    model = sharded(world)
    codecs = register_codec(model, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, rank, 3)
    weights, optim = get_state_dict(model, opt)
    dcp.save({"model": weights, "optim": optim}, checkpoint_id=folder)
    codecs.save(folder)
    straight = _steps(model, opt, rank, 2)
    full = digest([p.full_tensor() for p in model.parameters()])

    again = sharded(world, seed=1)  # other initial values: all must come from the checkpoint
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    resumed_codecs = register_codec(again, spec, resume_from=folder)
    weights, optim = get_state_dict(again, opt2)
    dcp.load({"model": weights, "optim": optim}, checkpoint_id=folder)
    set_state_dict(again, opt2, model_state_dict=weights, optim_state_dict=optim)
    resumed = _steps(again, opt2, rank, 2)
    return {"straight": straight, "resumed": resumed, "params": full,
            "fresh": _without_codec_state(world, rank, spec, folder),
            "resumed_params": digest([p.full_tensor() for p in again.parameters()]),
            "pending": sorted(k for ch in resumed_codecs.channels.values()
                              for k in (ch.pending or {})),
            "saved": sorted(codecs.state_tensors())}


def _without_codec_state(world: int, rank: int, spec, folder: str) -> list[float]:
    """The same resume with the parameters and optimizer only (error feedback from zero)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = sharded(world, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    register_codec(model, spec)
    weights, optim = get_state_dict(model, opt)
    dcp.load({"model": weights, "optim": optim}, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=weights, optim_state_dict=optim)
    return _steps(model, opt, rank, 2)


# -- auto ----------------------------------------------------------------------------------


def auto(rank: int, world: int, link_gbps: float) -> dict:
    """``register_codec(model, "auto")`` on a link of ``link_gbps``, then 2 steps: the codec of
    each channel, the buffer sizes auto priced and those FSDP2 handed over, the explanation."""
    from ccfx.integrations import _fsdp2_auto

    model = sharded(world)
    state = register_codec(model, "auto", options={"link_gbps": link_gbps,
                                                   "link_latency_ms": 0.05})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _steps(model, opt, rank, 2)
    priced = {f"{m}.{k}": c.numel for m, k, c in
              _fsdp2_auto.calls(fsdp2_comms.fsdp_modules(model), world, None)}
    calls = {e.edge: e.calls for e in state.ledger.entries()}
    counted = {f"{m}.{k}": n for (m, k), n in
               _fsdp2_auto.per_step(fsdp2_comms.fsdp_modules(model)).items()
               if (m, k) in state.channels}
    return {"codecs": {f"{c.module}.{c.kind}": c.codec for c in state.channels.values()},
            "priced": priced, "losses": losses, "explain": ccfx.explain(model),
            "ran": {f"{c.module}.{c.kind}": c.call.numel for c in state.channels.values()},
            "counted": counted, "plan": str(ccfx.plan_of(model)),
            "calls": {f"{c.module}.{c.kind}": calls[c.index] // 2
                      for c in state.channels.values()}}


# -- failures ------------------------------------------------------------------------------


def dies_mid_step(rank: int, world: int, dead: int = 1) -> dict:
    """One step of ZeRO++'s codecs on every rank, then rank ``dead`` exits; the others' next
    forward must fail in a gather naming the module, the codec and the dead rank."""
    import os
    import time

    model = sharded(world)
    register_codec(model, {"all_gather": "int8", "reduce_scatter": "int4:ef"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, rank, 1)
    if rank == dead:
        os._exit(0)
    time.sleep(0.5)
    return caught(lambda: _steps(model, opt, rank, 1))


def freezes_mid_step(rank: int, world: int, codec: str, timeout_s: float,
                     frozen: int = 1) -> dict:
    """One step on every rank with ``codec`` on both kinds and ``collective_timeout_s`` =
    ``timeout_s``, then rank ``frozen`` stops itself (SIGSTOP); the others' next step must
    fail within the timeout naming it. ``since``: seconds from the freeze to the error. Once
    it has its error, rank 0 kills the frozen rank (its pid: what ranks publish)."""
    import json
    import os
    import signal
    import time

    from ccfx.wire import agree

    model = sharded(world)
    register_codec(model, codec, options={"collective_timeout_s": timeout_s})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, rank, 1)
    store = agree._store()
    if rank == frozen:
        store.set("test/frozen_at", repr(time.time()).encode())
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(3)  # woken by the kill below: never reached
    store.wait(["test/frozen_at"])
    got = caught(lambda: _steps(model, opt, rank, 1))
    got["since"] = time.time() - float(store.get("test/frozen_at").decode())
    proc = json.loads(store.get(f"ccfx/agree/proc/{frozen}").decode())
    os.kill(proc["pid"], signal.SIGKILL)
    return got


def assert_trains_like_plain(plain: list[dict], coded: list[dict], fall: float) -> None:
    """In the test: each rank's compressed losses fall by at least ``fall`` and stay within
    10 % of plain FSDP2's at every step (a lost or doubled gradient misses both); the ranks
    hold one sharded model, and the codecs changed it."""
    for rank in range(len(coded)):
        losses = coded[rank]["losses"]
        assert losses[-1] < losses[0] - fall, losses
        for got, want in zip(losses, plain[rank]["losses"]):
            assert abs(got - want) <= 0.1 * want, (losses, plain[rank]["losses"])
    assert coded[0]["params"] == coded[1]["params"]  # one model, sharded
    assert coded[0]["params"] != plain[0]["params"]  # the codecs ran
