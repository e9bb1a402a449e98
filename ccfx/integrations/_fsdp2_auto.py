"""``register_codec(model, "auto", options={"link_gbps": ...})`` on an FSDP2 model: a codec
for each FSDP module's buffer of each kind, priced before the first step.

Each FSDP module's buffers are known from its parameters once ``fully_shard`` ran: the
all-gather's input is the module's shards padded to the world (dim 0 a multiple of ``W``), the
reduce-scatter's ``W`` times that, HSDP's all-reduce the reduce-scatter's output. Each is priced
as the compiled graphs' ``collective_codec="auto"`` prices a collective
(:func:`ccfx.planner.collective_model.choose_collective_codecs`: the link from the options,
each codec's own compute measured on this machine), from the codecs within the loss budget
of its role (``auto_loss_budget``, ``auto_candidates``): a gather's parameters as forward
activations (no error feedback: the same weights are gathered twice a step), a gradient
reduction's as gradient buckets. Nothing is hidden behind compute (ccfx's compressed FSDP2
calls are synchronous), so a codec pays where its saved link time exceeds its codec time.

The predicted step counts each call as often as a step runs it: a module that reshards after
forward is gathered twice (forward, and again in backward), a root left at FSDP2's default once;
every module reduce-scatters (and under HSDP all-reduces) once. FSDP2's compute is in no graph
ccfx sees, so the prediction is of the collectives' seconds; after training steps the plan
sets it beside the seconds measured inside ccfx's comms (``FSDP2Codecs.seconds``).

Rank 0 decides and every rank takes its answer (:func:`ccfx.wire.agree.from_rank0`): codec
timings differ between ranks, and the codecs of one collective must not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _torch_compat as tc
from ..config import Config
from ..errors import ConfigError
from ..plan import Decision, Prediction
from ..planner.candidates import candidates
from ..planner.collective_model import CollectiveTraffic, choose_collective_codecs
from ..planner.plan_collectives import link_for
from ..planner.plan_edges import describe_link
from ..runtime.fsdp2_codecs import KINDS, check_spec
from ..wire import agree
from ..wire.collectives import CollectiveCall

#: The loss-budget role of each kind's payload.
ROLE = {"all_gather": "activation", "reduce_scatter": "gradient", "all_reduce": "gradient"}


def _own_parameters(modules) -> dict[str, list[torch.Tensor]]:
    """Each FSDP module's own parameters: its subtree's, less those of FSDP modules inside."""
    ids = {name: {id(p) for p in m.parameters()} for name, m in modules}
    out = {}
    for name, m in modules:
        inner = set().union(*(ids[n] for n, other in modules
                              if other is not m and _inside(other, m)))
        out[name] = [p for p in m.parameters() if id(p) not in inner]
    return out


def _inside(module: torch.nn.Module, outer: torch.nn.Module) -> bool:
    return any(sub is module for sub in outer.modules())


def per_step(modules) -> dict[tuple[str, str], int]:
    """``(module, kind)`` → calls per training step (see the module docstring)."""
    out = {}
    for name, m in modules:
        root = not any(other is not m and _inside(m, other) for _, other in modules)
        out[(name, "all_gather")] = tc.fsdp_gathers_per_step(m, root)
        out[(name, "reduce_scatter")] = out[(name, "all_reduce")] = 1
    return out


def _step_prediction(choice, rows, counts, link_text: str) -> Prediction:
    """The step's collective seconds, uncompressed and as chosen, each call counted as often
    as a step runs it."""
    raw = chosen = 0.0
    for i, ((name, kind, _), d) in enumerate(zip(rows, choice.decisions)):
        costs, n = dict(d.candidates), counts[(name, kind)]
        raw += n * costs["none"]
        chosen += n * costs[choice.codecs[i]]
    gathers = sum(counts[(n, k)] for n, k, _ in rows if k == "all_gather")
    reductions = sum(1 for _, k, _ in rows if k != "all_gather")
    return Prediction(raw, chosen, link_text, "FSDP2 step", 1,
                      "nothing (FSDP2's compute is in no graph ccfx sees): the collectives "
                      f"alone, {gathers} gathers and {reductions} reductions a step")


def _shard_numel(p: torch.Tensor, world: int) -> int:
    """Elements of one rank's shard of ``p`` (dim 0 padded to a multiple of ``world``)."""
    shape = tuple(p.shape)  # (a DTensor's: the whole parameter's)
    rows = -(-shape[0] // world) if shape else 1
    return rows * (int(torch.Size(shape[1:]).numel()) if len(shape) > 1 else 1)


def calls(modules, world: int, replicas: int | None) -> list[tuple[str, str, CollectiveCall]]:
    """``(module, kind, call)`` of every FSDP module's buffers, as FSDP2 will hand them over
    (float parameters only: a module mixing dtypes is gathered as bytes, raw anyway)."""
    out = []
    for name, params in _own_parameters(modules).items():
        floats = [p for p in params if p.is_floating_point()]
        if not floats:
            continue
        dtype = floats[0].dtype
        shard = sum(_shard_numel(p, world) for p in floats)
        out.append((name, "all_gather", CollectiveCall("all_gather", (shard,), dtype, world)))
        out.append((name, "reduce_scatter",
                    CollectiveCall("reduce_scatter", (shard * world,), dtype, world, "sum")))
        if replicas is not None:
            out.append((name, "all_reduce",
                        CollectiveCall("all_reduce", (shard,), dtype, replicas, "avg")))
    return out


def _pool(kind: str, config: Config) -> list[str]:
    """The codecs ``auto`` may give ``kind``: its role's within the budget that can serve it."""
    out = []
    for spec in candidates(ROLE[kind], config):
        try:
            out.append(check_spec(kind, spec))
        except ConfigError:
            continue  # (error feedback on a gather; a codec that cannot serve the kind)
    return out


def choose(modules, options: dict[str, Any], group, replicate) -> tuple[
        dict[tuple[str, str], str], list[tuple[tuple[str, str], Decision]], Prediction]:
    """A codec per ``(module, kind)``, the decision of each ``(module, kind)`` and the
    predicted step's collectives."""
    config = Config(**options)
    world = group.size() if group is not None else 1
    replicas = replicate.size() if replicate is not None else None
    rows = calls(modules, world, replicas)
    traffic = [CollectiveTraffic(i, call, "backward" if kind != "all_gather" else "forward")
               for i, (_, kind, call) in enumerate(rows)]
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    link = link_for(config, ranks)
    pools = {kind: _pool(kind, config) for kind in KINDS}
    choice = choose_collective_codecs(traffic, 0.0, {i: pools[kind] for i, (_, kind, _) in
                                                     enumerate(rows)},
                                      link, min_gain=config.auto_min_gain)
    specs = {(name, kind): choice.codecs[i] for i, (name, kind, _) in enumerate(rows)}
    decisions = [((name, kind), d) for (name, kind, _), d in zip(rows, choice.decisions)]
    return specs, decisions, _step_prediction(choice, rows, per_step(modules),
                                              describe_link(link))


def decide(modules, options: dict[str, Any], group, replicate):
    """:func:`choose` on rank 0, its answer on every rank (keyed by the buffers and options)."""
    desc = {"buffers": [(n, k, c.numel, str(c.dtype), c.world) for n, k, c in
                        calls(modules, group.size() if group is not None else 1,
                              replicate.size() if replicate is not None else None)],
            "options": {k: repr(v) for k, v in sorted(options.items())}}
    timeout = float(options.get("collective_timeout_s", Config().collective_timeout_s))
    return agree.from_rank0("FSDP2 auto codecs", desc,
                            lambda: choose(modules, options, group, replicate),
                            timeout_s=timeout,
                            hint="every rank must call register_codec with the same model "
                                 "and options")
