"""``ccfx.plan_of(model)`` for a model sharded with torch's FSDP2: one row per FSDP module per
collective kind, as it last ran (its buffer, the codec, raw and wire bytes per call, and why a
buffer runs raw)."""

from __future__ import annotations

import torch.distributed as dist

from .fsdp2_codecs import FSDP2Codecs


def plan_of_fsdp2(state: FSDP2Codecs):
    """A :class:`~ccfx.Plan` of the FSDP modules' collectives (the module's name in the
    ``graph`` column; ``none``: torch's own collective, and why)."""
    from ..config import Config
    from ..plan import Collective, DataParallelInfo, GraphPlan, Plan, Stage

    rows = [Collective(graph=0, index=ch.index, part=ch.module, kind=ch.kind, group=ch.group,
                       group_size=ch.call.world, shape=list(ch.call.shape),
                       dtype=str(ch.call.dtype), codec=ch.codec, raw_bytes=ch.raw_bytes,
                       wire_bytes=ch.wire_bytes, reduce_op=ch.call.reduce_op,
                       reason=ch.reason)
            for ch in state.channels.values() if ch.call is not None]
    note = ("torch's FSDP2 (fully_shard): each FSDP module's all-gather and reduce-scatter "
            "through ccfx's custom comms (ccfx.integrations.register_codec)")
    if state.replicate is not None:
        note += (", and HSDP's all-reduce across replicas through its all-reduce hook "
                 f"({state.replicate.size()} replicas)")
    note += "; below, the 'graph' column names the FSDP module"
    if not rows:
        note += "; no collective ran yet (run one forward and backward)"
    notes = [note] + _measured(state)
    gathers = [ch.call for ch in state.channels.values()
               if ch.kind == "all_gather" and ch.call is not None]
    whole = Stage(graph=0, index=0, nodes=[], cost=0.0, cost_expr="0", flops=0,
                  param_bytes=sum(c.numel * c.world * c.dtype.itemsize for c in gathers),
                  params=list(state.modules))
    graph = GraphPlan(index=0, requested_stages=1, num_stages=1, balance="fsdp2",
                      stages=[whole], edges=[], shared=[], notes=notes, collectives=rows,
                      decisions=list(state.decisions), prediction=state.prediction)
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    backend = str(dist.get_backend()) if initialized else "none"
    config = Config(collective_overrides={k: v for k, v in state.specs.items()
                                          if k in state.kinds and v != "auto"} or None)
    gradient = state.specs["all_reduce" if state.replicate is not None else "reduce_scatter"]
    return Plan(config.to_dict(), [graph],
                option_sources={"collective_overrides": "register_codec (FSDP2)"},
                data_parallel=DataParallelInfo(world, backend, gradient,
                                               note="torch's FSDP2 with ccfx's comms; the "
                                               "gradient codec is its reduce-scatters' (HSDP: "
                                               "the replicas' all-reduce's)"))


def _measured(state: FSDP2Codecs) -> list[str]:
    """The seconds a step spent inside ccfx's comms so far, beside ``auto``'s prediction."""
    if not state.steps:
        return []
    text = (f"measured: {state.seconds / state.steps:.4g} s per step inside ccfx's FSDP2 "
            f"comms (mean of {state.steps} steps, the first included)")
    if state.prediction is not None:
        text += f"; auto predicted {state.prediction.chosen_s:.4g} s"
    return [text]
