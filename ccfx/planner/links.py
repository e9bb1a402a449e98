"""Which link of a :class:`~ccfx.planner.cluster.Cluster` each pipeline hop and each
data-parallel group is priced on (issue 19: "codecs per hop, bucket and collective priced on
*that* link").

Where the ranks sit: rank r runs on the cluster's device r, or on ``placement[r]`` (the
``placement`` option: device indices). Under PP × DP ranks count as a ``("dp", "pp")``
DeviceMesh does (what ``ccfx-pipeline`` and the tests build): replica d's pipeline rank p is
global rank ``d × P + p``, P the pipeline's ranks; stage s runs on pipeline rank ``s mod P``
(torch's loop placement). In the single-process simulation there is one replica and P is the
number of stages: stage s on device s (or ``placement[s]``).

* **A pipeline hop** s → s+1 is priced on ``cluster.link(device of s, device of s+1)``; with
  several replicas (one plan for all of them) on the slowest of their hops s → s+1.
* **A data-parallel group** (all ranks in plain data parallel; stage s's replicas under
  PP × DP) is priced on its slowest link (:meth:`Cluster.slowest_link`), as collectives are.

NIC contention, modelled simply: flows that leave one node on the same level (the link at which
their two ends part: ``inter_node``, ``inter_region``, a region's own link; or, in a matrix
cluster whose devices carry node labels, any pair of different nodes) share that node's way
out, so each gets the link's bandwidth divided by their number. Counted as concurrent are a
pipeline's forward sends of every hop and every replica (in 1F1B's steady state every stage
sends at once; the backward sends are their mirror image, and each direction of a pair is its
own link), and the data-parallel groups of all stages (their exchanges run at the step's end).
Flows inside a node never contend (a link per pair, like NVLink), nor do flows on a link the
cluster marks ``shared`` (one medium already carries every byte in turn). One group counts as
one flow whatever its ring crosses. Pure: no ``torch.distributed``; the layout search calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..wire.link import Link
from .cluster import Cluster

#: what two stages on one device exchange through (memory, not a link)
SAME_DEVICE = Link(1e6, 0.0)


@dataclass(frozen=True)
class PricedLink:
    """The link a hop or a group is priced on: ``link`` as the model prices it (bandwidth
    already divided among ``flows``), ``level`` where it runs ("intra_node", "inter_node",
    "inter_region", "node n0" / "region eu" for a node's or region's own link, "matrix",
    "same device"), and the devices it joins (names)."""

    link: Link
    level: str
    flows: int = 1
    devices: tuple[str, ...] = ()

    def describe(self) -> str:
        """``"inter_node 0.05 Gbit/s, 1 ms"`` (and how many flows share it)."""
        whole = self.link.gbps * self.flows
        text = f"{self.level} {whole:g} Gbit/s, {self.link.latency_ms:g} ms"
        if self.flows > 1:
            text += f", shared by {self.flows} flows ({self.link.gbps:g} Gbit/s each)"
        return text


def level_of(cluster: Cluster, a: int, b: int) -> str:
    """The level at which devices ``a`` and ``b`` part: the name of the link a message between
    them crosses."""
    if cluster.matrix is not None:
        return "matrix"
    da, db = cluster.devices[a], cluster.devices[b]
    if da.node == db.node:
        return f"node {da.node}" if da.node in dict(cluster.node_links) else "intra_node"
    if da.region == db.region:
        return (f"region {da.region}" if da.region in dict(cluster.region_links)
                else "inter_node")
    return "inter_region"


def _leaving(cluster: Cluster, idx: Sequence[int], level: str) -> set:
    """The nodes of the devices ``idx`` with a flow to another of them that leaves the node
    through a contending link of ``level``. Without a matrix, in one pass: a device has one
    when its region holds another of the nodes (level: its region's) or another region holds
    one of the devices (level ``inter_region``)."""
    if cluster.matrix is not None:
        return {cluster.devices[i].node for i in idx
                if any(_leaves_node(cluster, i, j) and level_of(cluster, i, j) == level
                       for j in idx)}
    devices = cluster.devices
    nodes_in: dict = {}
    for i in idx:
        nodes_in.setdefault(devices[i].region, set()).add(devices[i].node)
    regions = dict(cluster.region_links)
    out = set()
    for region, nodes in nodes_in.items():
        inside = regions.get(region, cluster.inter_node)
        if len(nodes) > 1 and not inside.shared and level == (
                f"region {region}" if region in regions else "inter_node"):
            out |= nodes
        if len(nodes_in) > 1 and not cluster.inter_region.shared and level == "inter_region":
            out |= nodes
    return out


def _leaves_node(cluster: Cluster, a: int, b: int) -> bool:
    """A flow a → b goes out of a's node through a link that contends (see the docstring)."""
    na, nb = cluster.devices[a].node, cluster.devices[b].node
    return na != nb and not cluster.link(a, b).shared


def devices_of(cluster: Cluster, ranks: int, placement: Sequence[int] | None = None
               ) -> list[int]:
    """The device index of each of ``ranks`` ranks: ``placement[r]``, or r."""
    devices = list(placement) if placement is not None else list(range(cluster.world))
    if len(devices) < ranks:
        where = f"placement lists {len(devices)} devices" if placement is not None else \
            f"the cluster has {cluster.world} devices"
        raise ConfigError(f"{where}, but the plan needs {ranks} ranks: "
                          + ("give a device for every rank in placement"
                             if placement is not None else
                             "describe every rank's device in the cluster (rank r runs on its "
                             "device r), or map ranks to devices with the placement option"))
    for d in devices[:ranks]:
        cluster.index(d)  # a ConfigError for a device the cluster does not have
    return devices[:ranks]


def rank_devices(cluster: Cluster, ranks: Sequence[int],
                 placement: Sequence[int] | None = None) -> list[int]:
    """The device index of each of ``ranks`` (global ranks): ``placement[r]``, or r. What a
    collective over those ranks is priced on: ``cluster.slowest_link(rank_devices(...))``."""
    devices = devices_of(cluster, max(ranks) + 1, placement) if ranks else []
    return [devices[r] for r in ranks]


def stage_devices(cluster: Cluster, num_stages: int, *, replicas: int = 1,
                  pipeline_ranks: int | None = None,
                  placement: Sequence[int] | None = None) -> list[list[int]]:
    """``out[d][s]``: the device of stage ``s`` in replica ``d`` (the module's docstring)."""
    p = pipeline_ranks or num_stages
    devices = devices_of(cluster, replicas * p, placement)
    return [[devices[d * p + s % p] for s in range(num_stages)] for d in range(replicas)]


def _contended(cluster: Cluster, flows: Sequence[tuple[int, int]]
               ) -> dict[tuple[int, int], int]:
    """Per flow (a, b): how many of ``flows`` share its way out of a's node (1: none)."""
    out_of: dict[tuple[object, str], set[tuple[int, int]]] = {}
    for a, b in flows:
        if _leaves_node(cluster, a, b):
            out_of.setdefault((cluster.devices[a].node, level_of(cluster, a, b)),
                              set()).add((a, b))
    return {(a, b): len(out_of.get((cluster.devices[a].node, level_of(cluster, a, b)), ()))
            if _leaves_node(cluster, a, b) else 1 for a, b in flows}


def _priced(cluster: Cluster, a: int, b: int, flows: int) -> PricedLink:
    link = cluster.link(a, b)
    return PricedLink(replace(link, gbps=link.gbps / flows), level_of(cluster, a, b), flows,
                      (cluster.names[a], cluster.names[b]))


def hop_links(cluster: Cluster, num_stages: int, *, replicas: int = 1,
              pipeline_ranks: int | None = None,
              placement: Sequence[int] | None = None) -> list[PricedLink]:
    """Per hop s → s+1 (``num_stages - 1`` of them), the link it is priced on: the slowest of
    the replicas' hops s → s+1 after contention."""
    rows = stage_devices(cluster, num_stages, replicas=replicas, pipeline_ranks=pipeline_ranks,
                         placement=placement)
    flows = [(row[s], row[s + 1]) for row in rows for s in range(num_stages - 1)
             if row[s] != row[s + 1]]
    share = _contended(cluster, flows)
    out = []
    for s in range(num_stages - 1):
        options = [PricedLink(SAME_DEVICE, "same device", 1, (cluster.names[row[s]],))
                   if row[s] == row[s + 1] else _priced(cluster, row[s], row[s + 1],
                                                        share[(row[s], row[s + 1])])
                   for row in rows]
        out.append(min(options, key=lambda p: (p.link.gbps, -p.link.latency_ms)))
    return out


def group_links(cluster: Cluster, groups: Sequence[Sequence[int]]) -> list[PricedLink]:
    """Per group of devices (the data-parallel groups that exchange at once), the link its
    collectives are priced on: its slowest link (:meth:`Cluster.slowest_link`), its bandwidth
    divided among the groups that leave one node on the same level."""
    leaving: dict[tuple[object, str], int] = {}
    slowest = []
    for group in groups:
        idx = sorted({cluster.index(d) for d in group})
        if len(idx) < 2:
            slowest.append(None)
            continue
        (a, b), link = cluster.slowest_pair(idx)
        level = level_of(cluster, a, b)
        outs = _leaving(cluster, idx, level) if not link.shared else set()
        for node in outs:
            leaving[(node, level)] = leaving.get((node, level), 0) + 1
        slowest.append((idx, link, level, outs))
    out = []
    for group, found in zip(groups, slowest, strict=True):
        if found is None:
            out.append(PricedLink(SAME_DEVICE, "same device", 1,
                                  tuple(cluster.names[cluster.index(d)] for d in group)))
            continue
        idx, link, level, outs = found
        flows = max((leaving[(node, level)] for node in outs), default=1)
        out.append(PricedLink(replace(link, gbps=link.gbps / flows), level, flows,
                              tuple(cluster.names[i] for i in idx)))
    return out


def stage_group_links(cluster: Cluster, num_stages: int, replicas: int, *,
                      pipeline_ranks: int | None = None,
                      placement: Sequence[int] | None = None) -> list[PricedLink]:
    """Under PP × DP, per stage, the link its data-parallel group (its ``replicas`` copies) is
    priced on."""
    rows = stage_devices(cluster, num_stages, replicas=replicas, pipeline_ranks=pipeline_ranks,
                         placement=placement)
    p = pipeline_ranks or num_stages
    # one group per pipeline rank (stages on one rank share its group)
    groups = [[row[r] for row in rows] for r in range(p)]
    priced = group_links(cluster, groups)
    return [priced[s % p] for s in range(num_stages)]


def data_parallel_link(cluster: Cluster, world: int,
                       placement: Sequence[int] | None = None) -> PricedLink:
    """Plain data parallel over ``world`` ranks: the link the gradient buckets are priced on."""
    return group_links(cluster, [devices_of(cluster, world, placement)])[0]


def describe_hops(priced: Sequence[PricedLink]) -> str:
    """``"hop 0→1: intra_node 100 Gbit/s, 0.01 ms; hop 1→2: inter_node ..."``."""
    return "; ".join(f"hop {s}→{s + 1}: {p.describe()}" for s, p in enumerate(priced))
