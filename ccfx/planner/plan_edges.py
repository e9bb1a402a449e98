"""``activation_codec="auto"`` at compile time: price a partitioned graph's cut edges and pick
each one's codecs before ``cut_edges`` inserts them.

What is known at that point: the stages (every node's ``stage``), each node's FLOPs, and the
tensors that cross (``passes.cut_edges.crossings``) at the compiled shape, which for a
pipeline is the microbatch. Compute comes from FLOPs and the machine's measured rate
(:func:`ccfx.planner.compute.from_flops`): nothing has run yet. The link, the schedule and the
number of microbatches come from the options.
"""

from __future__ import annotations

import torch
import torch.fx

from ..config import AUTO, Config
from ..passes.cut_edges import crossings
from ..passes.facts import NodeFacts, fact, stage_of
from ..passes.graph_utils import val
from ..plan import Prediction
from ..wire.link import Link
from .auto import PipelineDecisions, choose_pipeline_codecs
from .candidates import candidates
from .compute import from_flops, machine_rate
from .pipeline_model import EdgeTraffic, PipelineModel


def link_of(config: Config) -> Link:
    return Link(config.link_gbps, config.link_latency_ms, config.link_shared)


def edge_traffic(gm: torch.fx.GraphModule) -> list[EdgeTraffic]:
    out = []
    for c in crossings(gm):
        v = val(c.node)
        out.append(EdgeTraffic(c.index, c.node.name, tuple(int(d) for d in v.shape), v.dtype,
                               tuple(c.hops), bool(v.requires_grad)))
    return out


def stage_work(gm: torch.fx.GraphModule, num_stages: int) -> tuple[list[float], list[int]]:
    """Per stage: FLOPs at the example shapes and the number of ops."""
    flops, ops = [0.0] * num_stages, [0] * num_stages
    for n in gm.graph.nodes:
        stage, f = stage_of(n), fact(n, NodeFacts)
        if n.op in ("call_function", "call_method", "call_module") and stage is not None:
            flops[stage] += float(f.flops_hint if f is not None else 0)
            ops[stage] += 1
    return flops, ops


def plan_edge_codecs(gm: torch.fx.GraphModule, config: Config,
                     num_stages: int) -> PipelineDecisions:
    """The codecs of every cut edge of ``gm`` (partitioned, not yet cut), chosen by the cost
    model where the options say ``auto``; fixed options and ``codec_overrides`` are kept."""
    edges = edge_traffic(gm)
    flops, ops = stage_work(gm, num_stages)
    compute = from_flops(flops, ops, device=_device(gm))
    model = PipelineModel(compute, edges, link_of(config), schedule=config.pipeline_schedule,
                          microbatches=config.microbatches, epilogue_only=config.epilogue_only)
    overrides = dict(config.codec_overrides or ())

    def pool(edge: EdgeTraffic, direction: str) -> list[str]:
        source = edge.hops[0][0]
        fixed = overrides.get(f"edge {edge.index}", overrides.get(f"stage {source}"))
        if fixed is not None:
            fwd, _, bwd = fixed.partition("/")
            return [fwd if direction == "fwd" else (bwd or fwd)]
        given = (config.activation_codec if direction == "fwd"
                 else config.activation_grad_codec or config.activation_codec)
        if given != AUTO:
            return [given]
        role = "activation" if direction == "fwd" else "activation_grad"
        return candidates(role, config)

    decided = choose_pipeline_codecs(model, pool, min_gain=config.auto_min_gain)
    rate, op_s = machine_rate(_device(gm))
    decided.prediction = Prediction(
        decided.uncompressed.step_s, decided.chosen.step_s, describe_link(model.link),
        model.schedule, model.microbatches,
        f"FLOPs at {rate:.3g} FLOP/s plus {op_s * 1e6:.1f} us per op (measured on this machine)")
    return decided


def describe_link(link: Link) -> str:
    return (f"{link.gbps:g} Gbit/s, {link.latency_ms:g} ms latency"
            + (", one shared medium" if link.shared else ", a link per pair of ranks"))


def _device(gm: torch.fx.GraphModule) -> torch.device:
    for n in gm.graph.nodes:
        v = val(n)
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")
