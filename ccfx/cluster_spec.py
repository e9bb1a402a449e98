"""A cluster's description: its devices (memory, compute rate) and the link between every pair.

Plain frozen data, checked at construction (every mistake a :class:`ConfigError` naming the
field and the fix). It sits below :mod:`ccfx.config`, which reads a cluster option into it;
the planner's :class:`ccfx.planner.cluster.Cluster` adds what needs the planner or the live
group (the measured compute rate, the probe, the fingerprint) and the dict and file forms
(:mod:`ccfx.cluster_files`).

The links, given one of two ways:

* **levels** (nested groups): the devices of a node share its link (``intra_node``), the nodes
  of a region the region's (``inter_node``), the regions one ``inter_region`` link; a node or a
  region may have its own in place of the level's. Two devices talk over the link of the
  level at which they part (their node's when they share one, else their region's, else the
  link between regions): a message crosses that level's link, and the levels inside it are not
  added in (a GPU reaches the network through its own NIC, not through its node's NVLink).
* **matrix**: a link per ordered pair, row → column (what ``Cluster.probe`` measures).

Units, everywhere: bandwidth in Gbit/s (10⁹ bits per second), latency one way in ms, memory in
bytes (files may write ``"80GiB"`` or ``"80GB"``), compute in FLOP/s (``None``: measured on the
machine the planner runs on).

Transports (:data:`TRANSPORTS`): ``"buffered"`` (gloo's TCP: a send completes once the socket
takes the bytes, and the sender computes on while the link drains; the :class:`Link` defaults)
and ``"blocking"`` (NCCL's P2P: a message leaves only once its receiver posted the receive, and
the send completes when it has arrived: ``rendezvous=True, buffered_sends=False``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from .errors import ConfigError

#: transport name -> (Link.rendezvous, Link.buffered_sends)
TRANSPORTS = {"buffered": (False, True), "blocking": (True, False)}
#: The levels of the nested form, innermost first.
LEVELS = ("intra_node", "inter_node", "inter_region")

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}

#: The keys of a link's table in a cluster file.
LINK_KEYS = ("gbps", "latency_ms", "transport", "shared")


@dataclass(frozen=True)
class Link:
    """Bandwidth in Gbit/s and one-way latency in ms. ``shared``: every message of every rank
    crosses one medium (a single switch port, the shaped loopback), not a link per pair. What a
    cluster's devices are joined by, and what the wire layer prices (``ccfx.wire.link``)."""

    gbps: float
    latency_ms: float = 0.05
    shared: bool = False
    #: A message leaves only once its receiver has posted the receive (else: at the send).
    rendezvous: bool = False
    #: A send's work completes when the transport takes the bytes (socket buffers), not when
    #: they arrive: the sender goes on computing while the link drains.
    buffered_sends: bool = True

    def seconds(self, nbytes: float) -> float:
        return self.latency_ms * 1e-3 + nbytes * 8 / (self.gbps * 1e9)


# -- values ---------------------------------------------------------------------------------------


def _number(value, where: str, *, positive: bool = True) -> float:
    """``value`` as a finite float, > 0 (``positive``) or ≥ 0; else a ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"cluster: {where} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        need = "a finite number above 0" if positive else "a finite number ≥ 0"
        raise ConfigError(f"cluster: {where} is {value!r}: it must be {need}")
    return v


def parse_memory(value, where: str = "memory") -> int:
    """Bytes from an int, an integral float, or a string with a unit: ``"80GiB"`` (2³⁰),
    ``"80 GB"`` (10⁹), ``"512MiB"``, ``"1.5TB"``."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"cluster: {where} is {value!r}: write bytes as a number or with a "
                              "unit, e.g. 85899345920, \"80GiB\" or \"80GB\" (B, KB, MB, GB, TB, "
                              "KiB, MiB, GiB, TiB)")
        value = float(m.group(1)) * _UNITS[unit]
    v = _number(value, where)
    if v != int(v):
        raise ConfigError(f"cluster: {where} is {value!r}: memory is a whole number of bytes")
    return int(v)


def make_link(gbps, latency_ms, transport: str = "buffered", shared: bool = False, *,
              where: str = "link") -> Link:
    """A checked :class:`Link`: ``gbps`` > 0, ``latency_ms`` ≥ 0, a known ``transport``."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"cluster: {where}.transport is {transport!r}: use one of "
                          f"{sorted(TRANSPORTS)} (\"blocking\" for NCCL-like P2P, \"buffered\" "
                          "for gloo's TCP)")
    if not isinstance(shared, bool):
        raise ConfigError(f"cluster: {where}.shared must be true or false, got {shared!r}")
    rendezvous, buffered = TRANSPORTS[transport]
    return Link(_number(gbps, f"{where}.gbps"),
                _number(latency_ms, f"{where}.latency_ms", positive=False),
                shared, rendezvous, buffered)


def transport_of(link: Link, where: str = "link") -> str:
    """``"buffered"`` or ``"blocking"``: the transport a Link's flags describe."""
    for name, flags in TRANSPORTS.items():
        if (link.rendezvous, link.buffered_sends) == flags:
            return name
    raise ConfigError(
        f"cluster: {where} has rendezvous={link.rendezvous}, buffered_sends="
        f"{link.buffered_sends}, which is no transport a cluster knows: make it with "
        "ccfx.planner.cluster.make_link(gbps, latency_ms, transport=\"blocking\" or \"buffered\")")


def _keys(data, allowed, where: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(f"cluster: {where} must be a table (a dict), got {data!r}")
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ConfigError(f"cluster: {where} has unknown key(s) {unknown}: the keys are "
                          f"{list(allowed)}")


def link_from_dict(data, where: str) -> Link:
    _keys(data, LINK_KEYS, where)
    for key in ("gbps", "latency_ms"):
        if key not in data:
            raise ConfigError(f"cluster: {where} has no {key}: a link needs gbps (Gbit/s) and "
                              "latency_ms (one way, in ms)")
    return make_link(data["gbps"], data["latency_ms"], data.get("transport", "buffered"),
                     data.get("shared", False), where=where)


def _checked_link(link, where: str) -> Link:
    """``link`` (a Link, a ``(gbps, latency_ms[, transport])`` tuple or a dict of those keys)
    as a checked Link."""
    if isinstance(link, Link):
        transport = transport_of(link, where)
        return make_link(link.gbps, link.latency_ms, transport, link.shared, where=where)
    if isinstance(link, Mapping):
        return link_from_dict(link, where)
    if isinstance(link, (tuple, list)) and len(link) in (2, 3):
        return make_link(*link, where=where)
    raise ConfigError(f"cluster: {where} is {link!r}: give a ccfx.wire.link.Link, a tuple "
                      "(gbps, latency_ms[, transport]) or a dict with gbps and latency_ms")


def _label(value, where: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"cluster: {where} must be a non-empty string, got {value!r}")
    return value


# -- devices --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """One device: ``memory`` in bytes (or a string with a unit, e.g. ``"80GiB"``), ``flops``
    its compute rate in FLOP/s (None: measured on the machine the planner runs on), and the
    ``node`` and ``region`` it sits in (labels; None: the one node / region of the cluster)."""

    name: str
    memory: int
    flops: float | None = None
    node: str | None = None
    region: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"cluster: a device's name must be a non-empty string, got "
                              f"{self.name!r}")
        where = f"device {self.name!r}"
        object.__setattr__(self, "memory", parse_memory(self.memory, f"{where}.memory"))
        if isinstance(self.flops, str):
            raise ConfigError(f"cluster: {where}.flops is {self.flops!r}: give FLOP/s as a "
                              "number (e.g. 9.89e14), or leave it out (in a file: \"measure\") "
                              "to measure it on the machine the planner runs on")
        if self.flops is not None:
            object.__setattr__(self, "flops", _number(self.flops, f"{where}.flops"))
        _label(self.node, f"{where}.node")
        _label(self.region, f"{where}.region")


# -- the cluster ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    """Devices and the links between them, as levels or as a matrix (the module's docstring).

    ``devices`` are in rank order where a rank → device placement is not given. Links by level:
    ``intra_node``, ``inter_node``, ``inter_region`` and per-node / per-region replacements
    (``node_links``: node → its link inside; ``region_links``: region → its link between its
    nodes). Or ``matrix[i][j]``: the link from device i to device j (the diagonal is None).
    Every mistake is a :class:`ConfigError` naming the field and the fix, at construction."""

    devices: tuple[Device, ...]
    intra_node: Link | None = None
    inter_node: Link | None = None
    inter_region: Link | None = None
    node_links: tuple[tuple[str, Link], ...] = ()
    region_links: tuple[tuple[str, Link], ...] = ()
    matrix: tuple[tuple[Link | None, ...], ...] | None = field(default=None, repr=False)

    def __post_init__(self):
        devices = tuple(self.devices)
        if not devices:
            raise ConfigError("cluster: no devices: list at least one")
        for i, d in enumerate(devices):
            if not isinstance(d, Device):
                raise ConfigError(f"cluster: devices[{i}] is {d!r}: give ccfx.planner.cluster."
                                  "Device objects (or use ccfx.Cluster.from_dict)")
        seen: dict[str, int] = {}
        for i, d in enumerate(devices):
            if d.name in seen:
                raise ConfigError(f"cluster: devices[{seen[d.name]}] and devices[{i}] are both "
                                  f"named {d.name!r}: give every device its own name")
            seen[d.name] = i
        object.__setattr__(self, "devices", devices)
        _check_labels(devices)
        for name in LEVELS:
            link = getattr(self, name)
            if link is not None:
                object.__setattr__(self, name, _checked_link(link, f"links.{name}"))
        object.__setattr__(self, "node_links", self._overrides(
            self.node_links, "node", {d.node for d in devices}, "nodes"))
        object.__setattr__(self, "region_links", self._overrides(
            self.region_links, "region", {d.region for d in devices}, "regions"))
        if self.matrix is not None:
            given = [n for n in LEVELS if getattr(self, n) is not None]
            if given or self.node_links or self.region_links:
                raise ConfigError(
                    f"cluster: both a matrix and links by level "
                    f"({', '.join(given) or 'per node or region'}) are given: describe the "
                    "links one way, the levels (intra_node, inter_node, inter_region) or a "
                    "matrix of every ordered pair")
            object.__setattr__(self, "matrix", _checked_matrix(self.matrix, devices))
        else:
            self._check_levels()

    @staticmethod
    def _overrides(pairs, kind: str, known: set, table: str) -> tuple[tuple[str, Link], ...]:
        items = pairs.items() if isinstance(pairs, Mapping) else pairs
        out = {}
        for name, link in items:
            if name not in known:
                raise ConfigError(
                    f"cluster: {table}.{name}.link is given, but no device is in the {kind} "
                    f"{name!r} (the {kind}s: {sorted(k for k in known if k is not None)}): "
                    "fix the name or put devices in it")
            out[name] = _checked_link(link, f"{table}.{name}.link")
        return tuple(sorted(out.items()))

    def _check_levels(self) -> None:
        """Every level that separates two devices has a link."""
        nodes = self.by_node()
        regions: dict[str | None, set] = {}
        for d in self.devices:
            regions.setdefault(d.region, set()).add(d.node)
        own_nodes = dict(self.node_links)
        for node, members in nodes.items():
            if len(members) > 1 and self.intra_node is None and node not in own_nodes:
                where = "" if node is None else f" of node {node!r}"
                raise ConfigError(
                    f"cluster: devices {members[0]!r} and {members[1]!r}{where} share a node "
                    "but no link inside it is given: give links.intra_node (or that node's own "
                    "link)" + ("; without nodes every device is in one node" if node is None
                               else ""))
        own_regions = dict(self.region_links)
        for region, members in regions.items():
            if len(members) > 1 and self.inter_node is None and region not in own_regions:
                a, b = sorted(members, key=str)[:2]
                raise ConfigError(
                    f"cluster: nodes {a!r} and {b!r} are in one region but no link between "
                    "nodes is given: give links.inter_node (or that region's own link)")
        if len(regions) > 1 and self.inter_region is None:
            a, b = sorted(regions, key=str)[:2]
            raise ConfigError(f"cluster: devices sit in regions {a!r} and {b!r} but no link "
                              "between regions is given: give links.inter_region")

    # -- what the planner asks -----------------------------------------------------------------

    @property
    def world(self) -> int:
        """The number of devices."""
        return len(self.devices)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    @property
    def kind(self) -> str:
        """``"levels"`` or ``"matrix"``: how the links were given."""
        return "levels" if self.matrix is None else "matrix"

    @cached_property
    def _index_of(self) -> dict[str, int]:
        return {d.name: i for i, d in enumerate(self.devices)}

    def index(self, device) -> int:
        """A device's position: from its name, a :class:`Device`, or a position itself."""
        if isinstance(device, Device):
            device = device.name
        if isinstance(device, str):
            if device not in self._index_of:
                known = ", ".join(self.names[:8]) + (", ..." if self.world > 8 else "")
                raise ConfigError(f"cluster: no device named {device!r} (devices: {known})")
            return self._index_of[device]
        if isinstance(device, int) and not isinstance(device, bool):
            if not 0 <= device < self.world:
                raise ConfigError(f"cluster: device {device} is out of range: the cluster has "
                                  f"{self.world} devices (0 to {self.world - 1})")
            return device
        raise ConfigError(f"cluster: {device!r} names no device: give a name, a Device or a "
                          "position")

    def device(self, device) -> Device:
        return self.devices[self.index(device)]

    def link(self, a, b) -> Link:
        """The link a message from ``a`` to ``b`` crosses (names, Devices or positions)."""
        i, j = self.index(a), self.index(b)
        if i == j:
            raise ConfigError(f"cluster: link({self.names[i]!r}, {self.names[j]!r}): a device "
                              "has no link to itself; ask for two different devices")
        if self.matrix is not None:
            return self.matrix[i][j]
        da, db = self.devices[i], self.devices[j]
        if da.node == db.node:
            return dict(self.node_links).get(da.node, self.intra_node)
        if da.region == db.region:
            return dict(self.region_links).get(da.region, self.inter_node)
        return self.inter_region

    def slowest_link(self, devices: Iterable) -> Link:
        """What a collective over ``devices`` sees: the link of the slowest ordered pair among
        them (lowest bandwidth; of equals, the highest latency), with the highest latency of
        any pair (a collective waits for its last message). One pair's Link unchanged when a
        single link joins them all."""
        return self.slowest_pair(devices)[1]

    def slowest_pair(self, devices: Iterable) -> tuple[tuple[int, int], Link]:
        """The ordered pair (positions) of :meth:`slowest_link`'s link, and that link."""
        idx = sorted({self.index(d) for d in devices})
        if len(idx) < 2:
            raise ConfigError(f"cluster: slowest_link needs two devices or more, got "
                              f"{[self.names[i] for i in idx]}")
        links = {pair: self.link(*pair) for pair in self.pair_kinds(idx)}
        pair = min(links, key=lambda p: (links[p].gbps, -links[p].latency_ms))
        latency = max(link.latency_ms for link in links.values())
        return pair, replace(links[pair], latency_ms=latency)

    def pair_kinds(self, idx: Sequence[int]) -> list[tuple[int, int]]:
        """Among the devices at the sorted positions ``idx``, one ordered pair per kind of link
        between two of them, each the first of its kind in ``(i, j)`` order, sorted: inside a
        node, between two nodes of a region, between regions (a pair's link depends on nothing
        else). Every pair for a matrix. What 512 devices' 261,632 pairs reduce to."""
        if self.matrix is not None:
            return [(i, j) for i in idx for j in idx if i != j]
        devices = self.devices
        pairs = []
        by_node: dict = {}
        by_region: dict = {}
        for i in idx:
            by_node.setdefault(devices[i].node, []).append(i)
            by_region.setdefault(devices[i].region, []).append(i)
        pairs += [(m[0], m[1]) for m in by_node.values() if len(m) > 1]
        for members in by_region.values():
            node = devices[members[0]].node
            j = next((j for j in members if devices[j].node != node), None)
            pairs += [(members[0], j)] if j is not None else []
        region = devices[idx[0]].region
        j = next((j for j in idx if devices[j].region != region), None)
        pairs += [(idx[0], j)] if j is not None else []
        return sorted(pairs)

    def select(self, devices: Iterable) -> ClusterSpec:
        """The cluster of ``devices`` only, in that order (a placement: rank r runs on
        ``devices[r]``), with the same links between them."""
        idx = [self.index(d) for d in devices]
        if len(set(idx)) != len(idx):
            twice = next(self.names[i] for i in idx if idx.count(i) > 1)
            raise ConfigError(f"cluster: select lists device {twice!r} twice: a device runs "
                              "one rank")
        picked = tuple(self.devices[i] for i in idx)
        if self.matrix is not None:
            return type(self)(picked, matrix=tuple(tuple(self.matrix[i][j] for j in idx)
                                                for i in idx))
        nodes, regions = {d.node for d in picked}, {d.region for d in picked}
        return type(self)(picked, self.intra_node, self.inter_node, self.inter_region,
                       tuple(x for x in self.node_links if x[0] in nodes),
                       tuple(x for x in self.region_links if x[0] in regions))

    def memory(self, device) -> int:
        """A device's memory in bytes."""
        return self.device(device).memory

    def by_node(self) -> dict[str | None, tuple[str, ...]]:
        """Node label → its devices' names, in device order (None: devices without a node)."""
        out: dict[str | None, list[str]] = {}
        for d in self.devices:
            out.setdefault(d.node, []).append(d.name)
        return {k: tuple(v) for k, v in out.items()}

    # -- the common shapes ----------------------------------------------------------------------

    @classmethod
    def homogeneous(cls, n: int, gbps: float, latency_ms: float, memory, *,
                    flops: float | None = None, transport: str = "buffered",
                    shared: bool = False) -> ClusterSpec:
        """``n`` devices (``d0`` …) of ``memory`` each, one link between every pair."""
        _count(n, "n")
        return cls(tuple(Device(f"d{i}", memory, flops) for i in range(n)),
                   intra_node=make_link(gbps, latency_ms, transport, shared,
                                        where="links.intra_node"))

    @classmethod
    def nodes(cls, nodes: int, per_node: int, *, intra, inter, memory,
              flops: float | None = None) -> ClusterSpec:
        """``nodes`` × ``per_node`` devices (``n0.d0`` …, in node ``n0`` …) of ``memory`` each;
        ``intra`` the link inside a node, ``inter`` between nodes: each a ``(gbps,
        latency_ms[, transport])`` tuple, a dict or a Link."""
        _count(nodes, "nodes")
        _count(per_node, "per_node")
        devices = tuple(Device(f"n{i}.d{j}", memory, flops, node=f"n{i}")
                        for i in range(nodes) for j in range(per_node))
        return cls(devices, intra_node=_checked_link(intra, "intra"),
                   inter_node=_checked_link(inter, "inter"))


def _count(n, where: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"cluster: {where} must be a whole number ≥ 1, got {n!r}")


def _check_labels(devices: tuple[Device, ...]) -> None:
    """Node and region labels: on every device or on none; a node in one region only."""
    for what in ("node", "region"):
        labelled = [d.name for d in devices if getattr(d, what) is not None]
        if labelled and len(labelled) != len(devices):
            bare = next(d.name for d in devices if getattr(d, what) is None)
            raise ConfigError(f"cluster: device {labelled[0]!r} has a {what} and {bare!r} has "
                              f"none: give every device a {what}, or none")
    region_of: dict[str, tuple[str | None, str]] = {}
    for d in devices:
        if d.node is None:
            continue
        region, first = region_of.setdefault(d.node, (d.region, d.name))
        if region != d.region:
            raise ConfigError(f"cluster: node {d.node!r} is in two regions: {region!r} (device "
                              f"{first!r}) and {d.region!r} (device {d.name!r}): a node sits "
                              "in one region")


def _checked_matrix(matrix, devices: tuple[Device, ...]) -> tuple[tuple[Link | None, ...], ...]:
    n = len(devices)
    rows = list(matrix)
    if len(rows) != n or any(len(row) != n for row in rows):
        shape = f"{len(rows)} rows of lengths {sorted({len(r) for r in rows})}"
        raise ConfigError(f"cluster: the matrix must be square, {n} × {n} (one row and one "
                          f"column per device), got {shape}")
    out = []
    for i, row in enumerate(rows):
        cells = []
        for j, link in enumerate(row):
            if i == j:
                cells.append(None)
            elif link is None:
                raise ConfigError(
                    f"cluster: the matrix misses the link from {devices[i].name!r} to "
                    f"{devices[j].name!r} (matrix[{i}][{j}]): every ordered pair needs one")
            else:
                cells.append(_checked_link(link, f"matrix[{i}][{j}]"))
        out.append(tuple(cells))
    return tuple(out)
