"""``collective_codec="auto"`` at compile time: price a graph's collectives and pick each one's
codec before ``passes.compress_collectives`` rewrites them.

What is known then: the graph (aot_autograd's forward, backward or inference graph, one at a
time), every node's FLOPs, and each collective's call (kind, shape, dtype, group size) with
the nodes of its issue and its wait. The compute comes from FLOPs and the machine's measured
rate (:func:`ccfx.planner.compute.machine_rate`), the link from the options (``link_gbps``,
``link_latency_ms``, ``link_shared``); :mod:`ccfx.planner.collective_model` does the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.fx

from .. import codecs
from ..config import Config
from ..cost import evaluate, node_flops
from ..errors import ConfigError
from ..plan import Decision, Prediction
from ..wire.collectives import CollectiveCall
from ..wire.link import Link
from .candidates import candidates
from .codec_cost import CodecTimer
from .collective_model import CollectiveTraffic, choose_collective_codecs, prediction
from .compute import machine_rate
from .links import rank_devices
from .plan_edges import describe_link, link_of


@dataclass(frozen=True)
class GraphCollective:
    """A collective of the graph being planned: the plan's index, its call, the names of its
    node and of its wait."""

    index: int
    call: CollectiveCall
    node: str
    wait: str
    backend: str = ""  # the process group's ("gloo", "nccl"; "" unknown)


def _seconds(nodes: Sequence[torch.fx.Node], rate: float, op_s: float) -> float:
    flops, ops = 0.0, 0
    for n in nodes:
        if n.op != "call_function":
            continue
        ops += 1
        try:
            flops += float(evaluate(node_flops(n), None))
        except (ValueError, TypeError):
            pass  # a symbolic size: the node counts as free
    return flops / rate + ops * op_s


def _within_all(roles: Sequence[str], config: Config) -> list[str]:
    """The candidates within the loss budget of every role, in the first role's order."""
    pools = [candidates(r, config) for r in roles]
    return [s for s in pools[0] if all(s in p for p in pools[1:])]


def _pool(call: CollectiveCall, specs: list[str]) -> list[str]:
    """``specs`` for ``call``; an expert all-to-all (unequal splits: :attr:`~ccfx.wire.
    collectives.CollectiveCall.by_rows`) keeps only codecs without state. Its rows are other
    tokens at every step, so a residual kept per row would carry one token's error into
    another's; and a recompile (or ``capture_scalar_outputs``) makes its row count symbolic,
    where the wire layer refuses state per element: a rank that recompiled alone would run the
    same collective with another codec than its peers."""
    if not call.by_rows:
        return specs
    return [s for s in specs if not codecs.get(s).state_layout((call.row,), call.dtype)]


def link_for(config: Config, ranks: Sequence[int] | None) -> Link:
    """The link a collective over ``ranks`` (global ranks) crosses: with the ``cluster``
    option, the slowest link among those ranks' devices (rank r on device ``placement[r]``,
    or r); else the ``link_gbps`` link."""
    cluster = config.cluster_description()
    if cluster is None or not ranks:
        return link_of(config)
    if config.placement is None and max(ranks) >= cluster.world:
        raise ConfigError(f"cluster describes {cluster.world} devices, but a group holds rank "
                          f"{max(ranks)}: describe every rank's device (rank r runs on the "
                          "cluster's device r, or on placement[r])")
    return cluster.slowest_link(rank_devices(cluster, list(ranks), config.placement))


def plan_collective_codecs(gm: torch.fx.GraphModule, part: str,
                           collectives: Sequence[GraphCollective], config: Config, *,
                           timer: CodecTimer | None = None,
                           rate: tuple[float, float] | None = None,
                           ranks: Sequence[int] | None = None
                           ) -> tuple[dict[int, str], list[Decision], Prediction]:
    """A codec for each of ``collectives`` (the graph's collectives whose option is "auto",
    on one group: ``ranks``), the decisions and the predicted time of the ``part`` graph."""
    flops_per_s, op_s = rate or machine_rate()
    nodes = list(gm.graph.nodes)
    pos = {n.name: i for i, n in enumerate(nodes)}
    compute_s = _seconds(nodes, flops_per_s, op_s)
    traffic = [CollectiveTraffic(c.index, c.call, part,
                                 _seconds(nodes[pos[c.node] + 1: pos[c.wait]], flops_per_s, op_s),
                                 c.backend)
               for c in collectives]
    pool: Mapping[int, Sequence[str]] = {t.index: _pool(t.call, _within_all(t.roles, config))
                                         for t in traffic}
    link = link_for(config, ranks)
    choice = choose_collective_codecs(traffic, compute_s, pool, link, timer=timer,
                                      min_gain=config.auto_min_gain)
    compute = (f"the {part} graph's FLOPs at {flops_per_s:.3g} FLOP/s plus {op_s * 1e6:.1f} us "
               "per op (measured on this machine)")
    return choice.codecs, choice.decisions, prediction(choice, describe_link(link), compute)
