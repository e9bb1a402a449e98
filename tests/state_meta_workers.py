"""Rank functions for tests/test_state_meta.py: codec state that records what it was made for
(issue #17 part 4) and pipeline ranks told which edge's codec differs (part 6). Each saves a
checkpoint, loads one where it does not belong and returns the error as data (``ranks.caught``);
the tests assert."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ccfx

from . import local_steps_workers as lw
from . import pipeline_workers as pw
from .ranks import caught

N_MICRO = 2


def _error(fn) -> dict:
    got = caught(fn)
    got.pop("value", None)
    return got


def _stages(rank: int, stages: int, codec: str, grad_codec: str = "none", **extra):
    """This rank's stages of the MLP cut in ``stages`` (built, not run: the codec state and its
    meta exist once they are built)."""
    torch._dynamo.reset()
    model = pw.make_model("mlp")
    compiled = torch.compile(model, backend="ccfx", fullgraph=True,
                             options=pw.options(stages, codec, grad_codec, extra=extra))
    compiled(pw.batches(1)[0][0].chunk(N_MICRO)[0])
    return ccfx.build_stages(compiled, rank, "cpu"), compiled


def pipeline_places(rank: int, world: int, path: str) -> dict:
    """Two stages, int8 with error feedback both ways: each rank saves its stage's state_dict; then
    loads the peer's (another stage) and, into the first stage of a 4-stage plan, the 2-stage
    plan's own (another plan). Its own still loads."""
    (stage,), _ = _stages(rank, 2, "int8:ef", "int8:ef")
    mine = f"{path}.stage{rank}"
    saved = stage.submod.state_dict()
    torch.save(saved, mine)
    dist.barrier()
    peer = torch.load(f"{path}.stage{1 - rank}")
    out = {"meta": sorted(k for k in saved if ".meta." in k),
           "peer's": _error(lambda: stage.submod.load_state_dict(peer)),
           "own": _error(lambda: stage.submod.load_state_dict(torch.load(mine)))}
    four, _ = _stages(rank, 4, "int8:ef", "int8:ef")  # rank r holds stages r and r + 2
    first = next(s for s in four if s.stage_index == rank)
    out["other plan"] = _error(lambda: first.submod.load_state_dict(torch.load(mine)))
    return out


def pipeline_dp_places(rank: int, world: int, path: str) -> dict:
    """PP × DP with one stage and two replicas: the stage's gradient buckets keep PowerSGD's Q
    and error feedback per replica: the peer replica's checkpoint is refused."""
    from torch.distributed.pipelining import ScheduleGPipe

    torch._dynamo.reset()
    model = pw.make_model("mlp")
    opts = {**pw.options(1, "none", None), "gradient_codec": "powersgd:rank=2,ef",
            "compress_min_numel": 16}
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options=opts)
    x, y = pw.batches(1)[0]
    x, y = x.chunk(2)[rank], y.chunk(2)[rank]
    compiled(x.chunk(N_MICRO)[0])
    own_pipeline = dist.new_group([rank], use_local_synchronization=True)
    built = ccfx.build_stages(compiled, 0, "cpu", own_pipeline, dp_group=dist.group.WORLD)
    stage = built[0]
    ScheduleGPipe(stage, n_microbatches=N_MICRO, loss_fn=pw.loss_fn).step(x, target=y)
    ccfx.sync_grads(built)
    file = f"{path}.replica{rank}"
    torch.save(stage.submod.state_dict(), file)
    dist.barrier()
    peer = torch.load(f"{path}.replica{1 - rank}")
    return {"peer's": _error(lambda: stage.submod.load_state_dict(peer)),
            "own": _error(lambda: stage.submod.load_state_dict(torch.load(file)))}


def hook_places(rank: int, world: int, path: str) -> dict:
    """DDP with ccfx's int8 hook with error feedback: the peer's hook state is refused; a
    checkpoint saved before ccfx recorded the place loads. The file of each rank stays for the
    test's world-1 load."""
    from .dp_workers import batch, loss_fn, mlp

    model = DDP(mlp(seed=rank), bucket_cap_mb=0.03)
    state, hook = ccfx.ddp_comm_hook("int8:ef")
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(2):
        loss_fn(model(batch(rank, i))).backward()
        opt.step()
        opt.zero_grad()
    saved = state.state_dict()
    file = f"{path}.hook{rank}"
    torch.save(saved, file)
    dist.barrier()
    peer = torch.load(f"{path}.hook{1 - rank}")
    unrecorded = {k: v for k, v in saved.items() if k not in ("world_size", "rank")}
    return {"place": (saved["world_size"], saved["rank"]),
            "peer's": _error(lambda: state.load_state_dict(peer)),
            "unrecorded": _error(lambda: state.load_state_dict(unrecorded)),
            "own": _error(lambda: state.load_state_dict(torch.load(file)))}


def local_steps_places(rank: int, world: int, path: str) -> dict:
    """Local steps (H = 2, int8 with error feedback): the peer replica's state is refused; so
    is a state whose parameters have other shapes."""
    model = lw.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, **OUTER)
    for i in range(3):
        lw.loss_of(model, rank, i).backward()
        opt.step()
        opt.zero_grad()
    saved = outer.state_dict()
    file = f"{path}.outer{rank}"
    torch.save(saved, file)
    dist.barrier()
    peer = torch.load(f"{path}.outer{1 - rank}")
    wider = {**saved, "fragments": [
        {**f, "global": [torch.zeros(2, *g.shape) for g in f["global"]]}
        for f in saved["fragments"]]}
    out = {"place": (saved["world_size"], saved["rank"]),
           "peer's": _error(lambda: outer.load_state_dict(peer)),
           "shapes": _error(lambda: outer.load_state_dict(wider)),
           "own": _error(lambda: outer.load_state_dict(torch.load(file)))}
    outer.close()
    return out


#: The local-steps options of :func:`local_steps_places` (the test's world-1 load uses them).
OUTER = {"sync_every": 2, "outer_codec": "int8:ef", "compress_min_numel": 0}


def ddp_join(rank: int, world: int, spec: str) -> dict:
    """Uneven inputs under eager DDP with ccfx's comm hook and torch's own ``Join``: rank 0 has
    3 batches, rank 1 has 5; the joined rank shadows the last two steps' bucket exchanges
    (DDP runs the hook on zero gradients) and DDP gives it the last rank's parameters."""
    from torch.distributed.algorithms.join import Join

    from .dp_workers import batch, loss_fn, mlp
    from .ranks import digest

    model = DDP(mlp(seed=rank), bucket_cap_mb=0.03)
    state, hook = ccfx.ddp_comm_hook(spec)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for i in range(3 if rank == 0 else 5):
            loss_fn(model(batch(rank, i))).backward()
            opt.step()
            opt.zero_grad()
    return {"params": digest(model.parameters()), "steps": state.steps}


def pipeline_codecs_differ(rank: int, world: int) -> dict:
    """Rank 0 compiles the MLP with int8 on its cut edges, rank 1 with fp8: building the stages
    fails on both, naming the edge and direction that differ."""
    torch._dynamo.reset()
    model = pw.make_model("mlp")
    codec = "int8" if rank == 0 else "fp8"
    compiled = torch.compile(model, backend="ccfx", fullgraph=True,
                             options=pw.options(2, codec, "none"))
    compiled(pw.batches(1)[0][0].chunk(N_MICRO)[0])
    edges = [e.index for e in ccfx.plan_of(compiled).graphs[0].edges]
    got = _error(lambda: ccfx.build_stages(compiled, rank, "cpu"))
    return {**got, "edges": edges}
