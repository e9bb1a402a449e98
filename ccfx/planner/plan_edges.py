"""``activation_codec="auto"`` at compile time: price a partitioned graph's cut edges and pick
each one's codecs before ``cut_edges`` inserts them.

What is known at that point: the stages (every node's ``stage``), each node's FLOPs, and the
tensors that cross (``passes.cut_edges.crossings``) at the compiled shape, which for a
pipeline is the microbatch. Compute comes from FLOPs and the machine's measured rate
(:func:`ccfx.planner.compute.from_flops`): nothing has run yet. The link, the schedule and the
number of microbatches come from the options.

The links: ``link_gbps`` and friends, one link for every hop; or, with the ``cluster`` option,
each hop s → s+1 on the link between the devices of stages s and s+1
(:mod:`ccfx.planner.links`: ``placement``, replicas, NIC contention), and every decision says
which link its edge was priced on.
"""

from __future__ import annotations

import torch
import torch.fx

from ..config import AUTO, Config
from ..errors import ConfigError
from ..passes.cut_edges import crossings
from ..passes.facts import NodeFacts, fact, stage_of
from ..passes.graph_utils import val
from ..plan import Prediction
from ..wire.link import Link
from .auto import PipelineDecisions, choose_pipeline_codecs
from .candidates import candidates
from .compute import from_flops, machine_rate
from .links import PricedLink, describe_hops, hop_links
from .pipeline_model import EdgeTraffic, PipelineModel
from .steps_model import for_config as steps_multiplier_for


def link_of(config: Config) -> Link:
    """The one link of the options (``link_gbps``, ``link_latency_ms``, ``link_shared``)."""
    if config.link_gbps is None:
        raise ConfigError("this plan needs the link it runs on: give link_gbps (Gbit/s) and "
                          "link_latency_ms, or a cluster")
    return Link(config.link_gbps, config.link_latency_ms, config.link_shared)


def pipeline_shape(num_stages: int, world: int = 1) -> tuple[int, int]:
    """(pipeline ranks, replicas) of a pipeline of ``num_stages`` stages in a world of
    ``world`` ranks: the world runs one pipeline when its stages fill it (or share its ranks:
    ``num_stages`` a multiple of ``world``), ``world / num_stages`` replicas of it when it holds
    several; the single-process simulation (``world`` 1) one pipeline of a rank per stage."""
    if world > num_stages and world % num_stages == 0:
        return num_stages, world // num_stages
    if 1 < world < num_stages and num_stages % world == 0:
        return world, 1
    return num_stages, 1


def priced_hops(config: Config, num_stages: int, world: int = 1) -> list[PricedLink] | None:
    """With the ``cluster`` option, the link each hop is priced on; None without one."""
    cluster = config.cluster_description()
    if cluster is None:
        return None
    p, replicas = pipeline_shape(num_stages, world)
    return hop_links(cluster, num_stages, replicas=replicas, pipeline_ranks=p,
                     placement=config.placement)


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
                     num_stages: int, world: int = 1) -> PipelineDecisions:
    """The codecs of every cut edge of ``gm`` (partitioned, not yet cut), chosen by the cost
    model where the options say ``auto``; fixed options and ``codec_overrides`` are kept.
    ``world``: the ranks the plan runs on (1: the single-process simulation), which with a
    cluster says where the stages sit (:func:`pipeline_shape`)."""
    edges = edge_traffic(gm)
    flops, ops = stage_work(gm, num_stages)
    compute = from_flops(flops, ops, device=_device(gm))
    priced = priced_hops(config, num_stages, world)
    links = [p.link for p in priced] if priced is not None else link_of(config)
    model = PipelineModel(compute, edges, links, schedule=config.pipeline_schedule,
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
        return candidates(role, config, steps=True)

    decided = choose_pipeline_codecs(model, pool, min_gain=config.auto_min_gain,
                                     steps_multiplier=steps_multiplier_for(config, edges))
    if priced is not None:
        _say_links(decided, edges, priced)
    rate, op_s = machine_rate(_device(gm))
    decided.prediction = Prediction(
        decided.uncompressed.step_s, decided.chosen.step_s,
        describe_link(model.link) if priced is None else describe_hops(priced),
        model.schedule, model.microbatches,
        f"FLOPs at {rate:.3g} FLOP/s plus {op_s * 1e6:.1f} us per op (measured on this machine)")
    return decided


def _say_links(decided: PipelineDecisions, edges: list[EdgeTraffic],
               priced: list[PricedLink]) -> None:
    """Each edge's decision ends with the links its hops were priced on."""
    hops = {e.index: e.hops for e in edges}
    for d in decided.decisions:
        kind, _, rest = d.what.partition(" ")
        if kind != "edge":
            continue
        on = "; ".join(f"hop {a}→{b}: {priced[a].describe()}"
                       for a, b in hops.get(int(rest.split()[0]), ()) if a < len(priced))
        if on:
            d.reason += f" [priced on {on}]"


def describe_link(link: Link) -> str:
    return (f"{link.gbps:g} Gbit/s, {link.latency_ms:g} ms latency"
            + (", one shared medium" if link.shared else ", a link per pair of ranks"))


def _device(gm: torch.fx.GraphModule) -> torch.device:
    for n in gm.graph.nodes:
        v = val(n)
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")
