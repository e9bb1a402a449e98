"""What each rank runs in tests/test_links_runtime.py (module level: spawn pickles them by
name). Workers return plain data; the assertions are in the test file."""

from __future__ import annotations

import torch
from torch import nn

import ccfx

from . import toy_models as models
from .ranks import digest, rng


def eight() -> dict:
    """2 nodes x 4 devices: 100 Gbit/s and 0.05 ms inside a node, 50 Mbit/s and 1 ms between."""
    return ccfx.Cluster.nodes(2, 4, intra=(100.0, 0.05), inter=(0.05, 1.0), memory="16GiB",
                              flops=1e12).to_dict()


def four() -> dict:
    """2 nodes x 2 devices, as above."""
    return ccfx.Cluster.nodes(2, 2, intra=(100.0, 0.05), inter=(0.05, 1.0), memory="16GiB",
                              flops=1e12).to_dict()


def _decisions(compiled) -> list[tuple[str, str, str]]:
    return [(d.what, d.chosen, d.reason) for d in ccfx.plan_of(compiled).graphs[0].decisions]


def dp_on_cluster(rank: int, world: int, placement: list[int]) -> dict:
    """Data parallel over the 4 ranks placed on ``placement``'s devices, int8 buckets with
    ``gradient_collective="auto"``: one step; the buckets' collectives, the plan's decisions
    and the averaged gradients' digest (equal on every rank)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8))
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options={
        "data_parallel": True, "gradient_codec": "int8", "gradient_collective": "auto",
        "lowering": "eager", "cluster": eight(), "placement": placement})
    x = torch.randn(8, 1024, generator=rng(rank, 0))
    compiled(x).square().mean().backward()
    plan = ccfx.plan_of(compiled)
    return {"buckets": [(b.codec, b.collective, b.numel) for b in plan.graphs[0].buckets],
            "decisions": _decisions(compiled),
            "grads": digest([p.grad for p in model.parameters()])}


def pp_dp_on_cluster(rank: int, world: int, placement: list[int] | None) -> dict:
    """2 stages x 2 replicas (a ("dp", "pp") mesh) on ``four()``'s devices, int8 buckets with
    ``gradient_collective="auto"``: one step and ``sync_grads``; this rank's decisions and its
    stage's gradients' digest (equal on the replicas of a stage)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    model = models.relu_stack(4, 256)
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options={
        "stages": 2, "gradient_codec": "int8", "gradient_collective": "auto",
        "lowering": "eager", "cluster": four(), "placement": placement})
    x = torch.randn(8, 256, generator=rng(mesh.get_local_rank("dp"), 0))
    compiled(x.chunk(2)[0])
    built = ccfx.build_stages(compiled, pp_rank, "cpu", pp, dp_group=dp)
    sched = Schedule1F1B(built[0], n_microbatches=2,
                         loss_fn=lambda out, y: out.square().mean())
    sched.step(*((x,) if built[0].is_first else ()), target=x if built[0].is_last else None)
    ccfx.sync_grads(built)
    return {"stage": pp_rank, "decisions": _decisions(compiled),
            "collectives": [ex.collective for _, _, ex, _ in built[0].grad_sync.buckets],
            "grads": digest([p.grad for p in built[0].submod.parameters()])}
