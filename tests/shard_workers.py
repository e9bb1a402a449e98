"""What each rank runs in tests/test_shard.py (module level: spawn pickles them by name).

Workers return plain data (losses, digests, byte counts, error strings); the assertions are in
the test file. The reference of every comparison is the same model unsharded, trained with
DDP's arithmetic: each rank's gradient all-reduced (sum) and divided by the world size, then
the same optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ccfx
from ccfx.runtime import shard as shard_module

from .ranks import caught, digest, rng

# -- models ---------------------------------------------------------------------------------------


class Odd(nn.Module):
    """Every kind of parameter ``shard`` meets: rows not divisible by the world (5, 3), fewer
    rows than ranks (1: an empty shard on rank 1), 1-D, 0-d, and a buffer (replicated)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)
        self.one = nn.Parameter(torch.randn(1, 3))
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("offset", torch.randn(3))

    def forward(self, x):
        return self.scale * self.b(F.gelu(self.a(x))) + self.one + self.offset


def mlp(width: int = 16, depth: int = 2) -> nn.Module:
    layers = [nn.Linear(8, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 5), nn.LayerNorm(5))


def tiny_gpt() -> nn.Module:
    from ccfx.models.tiny_gpt import GPTConfig, TinyGPT

    return TinyGPT(GPTConfig(vocab_size=33, block_size=16, n_layer=2, n_head=2, n_embd=24))


MODELS = {"mlp": mlp, "odd": Odd, "gpt": tiny_gpt}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def batch(name: str, data_rank: int, step: int):
    g = rng(data_rank, step)
    if name == "gpt":
        return torch.randint(0, 33, (2, 16), generator=g)
    return torch.randn(4, 6 if name == "odd" else 8, generator=g)


def loss_of(name: str, model, x) -> torch.Tensor:
    out = model(x)
    if name == "gpt":
        out = out[0] if isinstance(out, tuple) else out
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), x.reshape(-1))
    return out.square().mean()


def compiled(model, backend: str | None, options: dict | None = None):
    if backend is None:
        return model
    if backend == "ccfx":
        return torch.compile(model, backend="ccfx", options=options or {"lowering": "eager"})
    return torch.compile(model, backend=backend)


def full(p: torch.Tensor, outer=None) -> torch.Tensor:
    """A sharded parameter's whole value (a TP parameter, ``outer`` its rewrapping: the TP
    DTensor's whole value)."""
    from torch.distributed.tensor import DTensor

    value = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    if outer is not None:
        value = DTensor.from_local(value, outer.mesh, outer.placements, shape=outer.shape,
                                   stride=outer.stride).full_tensor()
    return value.detach()


def optimizer(name: str, params) -> torch.optim.Optimizer:
    """AdamW where the sharded and the reference step run the same kernels (it moves near-zero
    gradients by about lr whatever their size, so it magnifies rounding differences); SGD with
    momentum where the compiled graphs sum in other orders than eager."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def average_grads(model: nn.Module) -> None:
    """DDP's arithmetic: sum over the world, divide by its size (ranks of one TP group hold
    equal gradients, so the world's mean is the data-parallel mean)."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


# -- scenarios ------------------------------------------------------------------------------------


def train_vs_reference(rank, world, name: str, backend: str | None, opt: str = "sgd",
                       steps: int = 3, options: dict | None = None) -> dict:
    """Train ``name`` sharded (compiled with ``backend``) and unsharded (eager, DDP-averaged)
    side by side for ``steps`` steps of ``opt``. Losses per step, the largest parameter
    difference after each step, and the digest of the gathered parameters (equal on every
    rank)."""
    ref = build(name)
    model = build(name)
    with torch.no_grad():  # shard must give every rank rank 0's buffers
        for buf in model.buffers():
            buf.add_(rank)
    model = ccfx.shard(model)
    run_ref, run = ref, compiled(model, backend, options)
    opt_ref, opt = optimizer(opt, ref.parameters()), optimizer(opt, model.parameters())
    rows = []
    for step in range(steps):
        x = batch(name, rank, step)
        loss_ref = loss_of(name, run_ref, x)
        loss_ref.backward()
        average_grads(ref)
        opt_ref.step()
        opt_ref.zero_grad()
        loss = loss_of(name, run, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        diff = max((a.detach() - full(b)).abs().max().item()
                   for a, b in zip(ref.parameters(), model.parameters(), strict=True))
        rows.append({"loss_ref": loss_ref.item(), "loss": loss.item(), "max_diff": diff})
    local = {n: (tuple(p.to_local().shape), str(p.placements[0]))
             for n, p in model.named_parameters()}
    out = {"steps": rows, "digest": digest([full(p) for p in model.parameters()]),
           "local": local, "buffers": digest(list(model.buffers()))}
    if backend == "ccfx":
        out["plan"] = [(c.part, c.kind, c.codec, c.reduce_op, c.raw_bytes, c.wire_bytes)
                       for c in ccfx.plan_of(run).collectives]
        out["state"] = sorted(ccfx.codec_state(run).state_dict())
        out["graphs"] = lowered_collectives(run, model)
    return out


def _collectives(gms) -> dict[str, int]:
    counts: dict[str, int] = {}
    for gm in gms:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "_c10d_functional" in str(node.target):
                key = str(node.target).split(".")[1]
                counts[key] = counts.get(key, 0) + 1
    return counts


def lowered_collectives(run, model) -> dict:
    """Which functional collectives the lowered forward and backward graphs of a model compiled
    by ccfx hold, and how many weights the forward hands to the backward whole (a forward
    output shaped like a whole 2-D parameter)."""
    from ccfx.backends.compiler import backend_of

    lowered = backend_of(run).graphs[0].lowered
    whole = {tuple(full(p).shape) for p in model.parameters() if full(p).dim() == 2}
    saved = [n for gm in lowered.forward for n in gm.graph.find_nodes(op="output")]
    saved_shapes = [tuple(v.meta["val"].shape) for n in saved for v in n.args[0]
                    if hasattr(v, "meta") and hasattr(v.meta.get("val"), "shape")]
    return {"forward": _collectives(lowered.forward), "backward": _collectives(lowered.backward),
            "params": len(list(model.parameters())),
            "matrices": sum(1 for p in model.parameters() if p.dim() == 2),
            "whole_saved": sum(1 for s in saved_shapes if s in whole),
            "reduce_ops": sorted({str(n.args[1]) for gm in lowered.backward
                                  for n in gm.graph.nodes
                                  if "reduce_scatter_tensor" in str(n.target)})}


def memory(rank, world, width: int = 192, depth: int = 6) -> dict:
    """Peak memory of one eager training step (forward, backward, AdamW step) per rank, by
    category (torch.distributed._tools.MemTracker: parameters, gradients, optimizer state,
    activations, temporaries), unsharded and sharded; the first step (AdamW allocates its
    state) runs before the tracked one. Eager only: under MemTracker's dispatch mode a compiled
    model does not run its compiled graphs (checked: a counting backend sees no call), so the
    compiled case is :func:`compiled_memory`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    out = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = mlp(width, depth)
        if sharded:
            model = ccfx.shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, 8, generator=rng(rank))

        def step(model=model, opt=opt, x=x):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        step()
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        out["sharded" if sharded else "unsharded"] = {
            str(k).split(".")[-1]: v for k, v in peak.items()}
        out["layer_bytes"] = width * width * 4
    return out


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def compiled_memory(rank, world, width: int = 192, depth: int = 6) -> dict:
    """Under ``backend="ccfx"``: this rank's bytes of parameters, gradients (after the compiled
    backward) and AdamW state (after its step), sharded against unsharded, and what the
    compiled forward hands to the backward (:func:`lowered_collectives`: no whole weight)."""
    out = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = mlp(width, depth)
        if sharded:
            model = ccfx.shard(model)
        run = compiled(model, "ccfx")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run(torch.randn(8, 8, generator=rng(rank))).square().mean().backward()
        grads = sum(_local_bytes(p.grad) for p in model.parameters())
        opt.step()
        out["sharded" if sharded else "unsharded"] = {
            "params": sum(_local_bytes(p) for p in model.parameters()), "grads": grads,
            "optimizer": sum(_local_bytes(v) for st in opt.state.values() for v in st.values())}
        if sharded:
            out["graphs"] = lowered_collectives(run, model)
        torch._dynamo.reset()
    return out


def checkpoint_resume(rank, world, path: str, backend: str | None,
                      options: dict | None = None) -> dict:
    """Train 2 steps, save model + AdamW state with torch.distributed.checkpoint (and, compiled
    by ccfx, this rank's codec state: error-feedback residuals), train 2 more; then a fresh
    sharded model and optimizer (another seed) load the checkpoint and train the same 2 steps.
    The digests of both runs' gathered parameters, optimizer state and codec state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh(seed):
        model = ccfx.shard(build("mlp", seed))
        return (model, compiled(model, backend, options),
                torch.optim.AdamW(model.parameters(), lr=1e-2))

    def steps(run, opt, which):
        for step in which:
            loss_of("mlp", run, batch("mlp", rank, step)).backward()
            opt.step()
            opt.zero_grad()

    def codec_state(run):
        return ccfx.codec_state(run).state_dict() if backend == "ccfx" else {}

    def state_digest(model, opt, run):
        tensors = [full(p) for p in model.parameters()]
        for p in model.parameters():
            tensors += [full(v) for v in opt.state[p].values()]
        return digest(tensors + list(codec_state(run).values()))

    model, run, opt = fresh(0)
    steps(run, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    torch.save({k: v.clone() for k, v in codec_state(run).items()}, f"{path}/codec{rank}.pt")
    steps(run, opt, range(2, 4))
    first = state_digest(model, opt, run)

    torch._dynamo.reset()
    model2, run2, opt2 = fresh(1)  # other initial values: the checkpoint must bring them back
    if backend == "ccfx":  # ccfx makes its codec state when it compiles the training graph
        run2(batch("mlp", rank, 0))
        ccfx.codec_state(run2).load_state_dict(torch.load(f"{path}/codec{rank}.pt"))
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    steps(run2, opt2, range(2, 4))
    return {"first": first, "resumed": state_digest(model2, opt2, run2),
            "keys": sorted(model.state_dict()), "codec_state": sorted(codec_state(run))}


def rank0_values(rank, world) -> dict:
    """Every rank builds the model from its own seed: after ``shard`` the gathered parameters
    and the buffer are rank 0's (the seed-0 model's) on every rank."""
    model = build("odd", seed=rank)
    model = ccfx.shard(model)
    want = build("odd", seed=0)
    return {"params": all(torch.equal(full(p), q) for p, q in
                          zip(model.parameters(), want.parameters(), strict=True)),
            "buffers": all(torch.equal(b, c) for b, c in
                           zip(model.buffers(), want.buffers(), strict=True)),
            "differed": not torch.equal(build("odd", seed=rank).a.weight, want.a.weight)}


def errors(rank, world) -> dict:
    """The errors ``shard`` raises with a process group: a model sharded twice, a 2-D mesh,
    something that is not a mesh, something that is not a module."""
    from torch.distributed.device_mesh import init_device_mesh

    twice = ccfx.shard(build("mlp"))
    mesh2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    got = {
        "twice": caught(lambda: ccfx.shard(twice)),
        "twice_inner": caught(lambda: ccfx.shard(nn.Sequential(twice))),
        "mesh_2d": caught(lambda: ccfx.shard(build("mlp"), mesh2d)),
        "not_mesh": caught(lambda: ccfx.shard(build("mlp"), "dp")),
        "not_module": caught(lambda: ccfx.shard(build("mlp").state_dict())),
    }
    return {k: (v["error"], v.get("message")) for k, v in got.items()}


def traps(rank, world) -> dict:
    """The silent traps of sharding: an optimizer made before ``shard`` (refused at each rank's
    first step), and rank 1 alone reading and printing a sharded parameter outside the forward
    (its shard: no gather, which rank 0, going on, would never join). Then both ranks train 2
    steps with an optimizer made after ``shard``: the digest of the gathered parameters, equal
    on both if the group is intact."""
    model = build("mlp")
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    ccfx.shard(model)
    loss_of("mlp", model, batch("mlp", rank, 0)).backward()
    first = caught(early.step)
    out = {"optimizer_first": (first["error"], first.get("message")), "one_rank_reads": None}
    if rank == 1:
        weight = model[2].weight
        out["one_rank_reads"] = {"local": tuple(weight.to_local().shape),
                                 "printed": "DTensor" in repr(weight)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):
        opt.zero_grad()
        loss_of("mlp", model, batch("mlp", rank, step)).backward()
        opt.step()
    out["digest"] = digest([full(p) for p in model.parameters()])
    return out


def tensor_parallel(rank, world, backend: str | None, steps: int = 3) -> dict:
    """A (dp=2, tp=2) mesh on 4 ranks: torch's parallelize_module (ColwiseParallel,
    RowwiseParallel) on "tp", then ccfx.shard on "dp"; trained against the unsharded model
    with every data-parallel replica's batch averaged (ranks of one TP group see one batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    ref = build("mlp")
    model = build("mlp")
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    ccfx.shard(model, mesh["dp"])
    outer = shard_module.sharded_info(model).outer
    run_ref, run = ref, compiled(model, backend)
    opt_ref, opt = optimizer("sgd", ref.parameters()), optimizer("sgd", model.parameters())
    dp_rank = mesh["dp"].get_local_rank()
    # eagerly: which saved tensors became notes to gather again (TP DTensors among them)
    notes = []
    pack = shard_module._EagerRecompute.pack

    def counting(t):
        got = pack(t)
        if isinstance(got, shard_module._Note):
            notes.append(got.dtensor is not None)
        return got

    shard_module._EagerRecompute.pack = counting
    rows = []
    for step in range(steps):
        x = batch("mlp", dp_rank, step)
        loss_ref = loss_of("mlp", run_ref, x)
        loss_ref.backward()
        average_grads(ref)
        opt_ref.step()
        opt_ref.zero_grad()
        loss = loss_of("mlp", run, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        diff = max((a.detach() - full(b, outer.get(n))).abs().max().item()
                   for a, (n, b) in zip(ref.parameters(), model.named_parameters(), strict=True))
        rows.append({"loss_ref": loss_ref.item(), "loss": loss.item(), "max_diff": diff})
    shard_module._EagerRecompute.pack = pack
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    return {"steps": rows, "local": local, "notes": notes,
            "digest": digest([full(p, outer.get(n)) for n, p in model.named_parameters()])}


# -- bucketing (tests/test_shard_buckets.py) --------------------------------------------------------


def _bucketed_run(rank, name: str, options: dict, steps: int = 3):
    """``name`` sharded and compiled by ccfx with ``options``, ``steps`` SGD steps on this
    rank's batches: the model, the compiled module and the losses."""
    torch._dynamo.reset()
    model = ccfx.shard(build(name))
    run = torch.compile(model, backend="ccfx", options=options)
    opt = optimizer("sgd", model.parameters())
    losses = []
    for step in range(steps):
        loss = loss_of(name, run, batch(name, rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, run, losses


def _buckets(gms) -> list[tuple[str, str, int]]:
    """(kind, block, members) of every bucket of the lowered graphs ``gms``, in order."""
    return [(b.kind, b.block, len(b.members)) for gm in gms
            for b in gm.meta.get("ccfx", {}).get("shard_buckets", ())]


def bucketing(rank, world, lowering: str, name: str = "gpt") -> dict:
    """``name`` compiled with codec none, ``shard_bucket`` "none" and "block": per policy,
    the losses of 3 SGD steps, the digest of the parameters after them, the lowered forward's
    and backward's collectives and buckets."""
    from ccfx.backends.compiler import backend_of

    out: dict = {}
    for policy in ("none", "block"):
        model, run, losses = _bucketed_run(rank, name, {"lowering": lowering,
                                                        "shard_bucket": policy})
        lowered = backend_of(run).graphs[0].lowered
        out[policy] = {"losses": losses, "digest": digest([full(p) for p in model.parameters()]),
                       "forward": _collectives(lowered.forward),
                       "backward": _collectives(lowered.backward),
                       "buckets": {"forward": _buckets(lowered.forward),
                                   "backward": _buckets(lowered.backward)}}
        out["params"] = len(list(model.parameters()))
    return out


def bucketed_ledger(rank, world, steps: int = 2) -> dict:
    """The tiny GPT bucketed, every all-gather and reduce-scatter in int8: the plan's rows by
    index, the ledger's (calls, wire bytes) by index, and (index, elements per rank) of each
    bucket's collective (its plan row: the same part and kind, shape ``(n,)`` for a gather,
    ``(W n,)`` for a reduce-scatter)."""
    from ccfx.backends.compiler import backend_of

    _, run, _ = _bucketed_run(rank, "gpt", {
        "lowering": "eager", "collective_overrides": {"all_gather": "int8",
                                                      "reduce_scatter": "int8"}}, steps)
    lowered = backend_of(run).graphs[0].lowered
    rows = ccfx.plan_of(run).collectives
    free = list(rows)
    buckets = []
    for part, gms in (("forward", lowered.forward), ("backward", lowered.backward)):
        for gm in gms:
            for b in gm.meta["ccfx"]["shard_buckets"]:
                n = sum(b.numels)
                shape = [n] if b.kind == "all_gather" else [world * n]
                row = next(c for c in free if c.part == part and c.kind == b.kind
                           and list(c.shape) == shape)
                free.remove(row)
                buckets.append((row.index, n))
    book = ccfx.ledger_of(run)
    return {"rows": {c.index: {"codec": c.codec, "wire": c.wire_bytes} for c in rows},
            "ledger": {e.edge: (e.calls, e.wire_bytes) for e in book.entries("collective")},
            "buckets": buckets, "calls": steps}
