"""A cluster (:class:`~ccfx.cluster_spec.ClusterSpec`, the planner's ``Cluster``) as plain
data and files, and its description.

The schema (TOML shown; JSON and YAML hold the same keys; ``examples/cluster.toml`` is a whole
one)::

    [[devices]]                       # in rank order
    name = "a0"
    memory = "80GiB"                  # bytes: a number, or a string with B/KB/MB/GB/TB/KiB/.../TiB
    flops = 9.9e14                    # FLOP/s; left out (or "measure"): measured here

    [links]                           # by level, innermost first: {gbps, latency_ms,
    intra_node = {gbps = 900, latency_ms = 0.005, transport = "blocking"}   # transport, shared}
    inter_node = {gbps = 100, latency_ms = 0.02}          # transport: "buffered" by default
    inter_region = {gbps = 1, latency_ms = 40}

    [nodes]                           # node -> its devices, or {devices = [...], link = {...}}
    a = ["a0", "a1"]
    [regions]                         # region -> its nodes, or {nodes = [...], link = {...}}
    eu = ["a"]

or, in place of ``links`` (``nodes`` / ``regions`` then only label the devices)::

    [matrix]                          # row: from, column: to; the diagonal is ignored
    gbps = [[0, 25.0], [24.1, 0]]
    latency_ms = [[0, 0.03], [0.03, 0]]
    transport = "buffered"            # or a matrix of them; shared: a bool or a matrix

A device may also carry ``node = "a"`` / ``region = "eu"`` itself. Without ``nodes`` every
device is in one node, without ``regions`` every node in one region. Unknown keys are errors
(a typo must not silently drop a link). TOML is read with the standard library's ``tomllib``
and written by the small writer here (the schema needs tables, inline tables and arrays only);
YAML needs PyYAML, which ccfx does not depend on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from .cluster_spec import (
    ClusterSpec,
    Device,
    Link,
    _keys,
    link_from_dict,
    make_link,
    transport_of,
)
from .errors import ConfigError

TOP_KEYS = ("devices", "links", "nodes", "regions", "matrix")
DEVICE_KEYS = ("name", "memory", "flops", "node", "region")
LEVEL_KEYS = ("intra_node", "inter_node", "inter_region")
MATRIX_KEYS = ("gbps", "latency_ms", "transport", "shared")
SUFFIXES = (".toml", ".json", ".yaml", ".yml")


# -- reading --------------------------------------------------------------------------------------


def _members(spec, inner: str, where: str) -> tuple[list, Mapping | None]:
    """A ``nodes`` / ``regions`` entry: a list of members, or ``{inner: [...], link: {...}}``."""
    if isinstance(spec, Mapping):
        _keys(spec, (inner, "link"), where)
        members, link = spec.get(inner), spec.get("link")
    else:
        members, link = spec, None
    if not isinstance(members, list) or not members or \
            not all(isinstance(m, str) for m in members):
        raise ConfigError(f"cluster: {where} must list its {inner} by name (a non-empty list "
                          f"of strings, or a table with {inner} = [...] and an optional link), "
                          f"got {spec!r}")
    return members, link


def from_dict(data, cls=ClusterSpec):
    """The cluster ``data`` describes (the module's schema), a ``cls``."""
    _keys(data, TOP_KEYS, "the cluster")
    raw = data.get("devices")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("cluster: devices must be a non-empty list of devices, each with a "
                          "name and memory")
    entries = []
    for i, d in enumerate(raw):
        where = f"devices[{i}]"
        _keys(d, DEVICE_KEYS, where)
        for key in ("name", "memory"):
            if key not in d:
                raise ConfigError(f"cluster: {where} has no {key}: every device needs a name "
                                  "and its memory (bytes, or e.g. \"80GiB\")")
        flops = d.get("flops")
        entries.append({"name": d["name"], "memory": d["memory"],
                        "flops": None if flops == "measure" else flops,
                        "node": d.get("node"), "region": d.get("region")})
    names = [e["name"] for e in entries]
    by_name = {e["name"]: e for e in entries}
    node_links = _assign(data.get("nodes"), "nodes", "devices", by_name, "node", names)
    node_names = sorted({e["node"] for e in entries if e["node"] is not None})
    region_links = _assign_regions(data.get("regions"), entries, node_names)
    devices = tuple(Device(**e) for e in entries)
    if "matrix" in data:
        if "links" in data:
            raise ConfigError("cluster: both links and matrix are given: describe the links one "
                              "way, by level (links) or per ordered pair (matrix)")
        return cls(devices, node_links=node_links, region_links=region_links,
                       matrix=matrix_from_dict(data["matrix"], len(devices), names))
    links = data.get("links", {})
    _keys(links, LEVEL_KEYS, "links")
    levels = {k: link_from_dict(v, f"links.{k}") for k, v in links.items()}
    return cls(devices, node_links=node_links, region_links=region_links, **levels)


def _assign(table, where: str, inner: str, by_name: dict, attr: str, names: list) -> dict:
    """Put each listed member's ``attr`` (its node) from ``table``; the table's own links."""
    if table is None:
        return {}
    _keys(table, list(table), where)
    links = {}
    for group, spec in table.items():
        members, link = _members(spec, inner, f"{where}.{group}")
        for m in members:
            if m not in by_name:
                raise ConfigError(f"cluster: {where}.{group} lists {m!r}, which is no device "
                                  f"(devices: {', '.join(names[:8])}"
                                  f"{', ...' if len(names) > 8 else ''})")
            now = by_name[m][attr]
            if now is not None and now != group:
                raise ConfigError(f"cluster: device {m!r} is in two {where}: {now!r} and "
                                  f"{group!r}: a device sits in one {attr}")
            by_name[m][attr] = group
        if link is not None:
            links[group] = link_from_dict(link, f"{where}.{group}.link")
    missing = [n for n in names if by_name[n][attr] is None]
    if missing:
        raise ConfigError(f"cluster: device {missing[0]!r} is in no {attr}: {where} is given, so "
                          f"list every device in one (or give no {where}: then every device is "
                          f"in one {attr})")
    return links


def _assign_regions(table, entries: list, node_names: list) -> dict:
    """Each node's region from ``regions``; a device's own region label must agree."""
    if table is None:
        return {}
    _keys(table, list(table), "regions")
    region_of: dict[str, str] = {}
    links = {}
    for region, spec in table.items():
        members, link = _members(spec, "nodes", f"regions.{region}")
        for node in members:
            if node not in node_names:
                raise ConfigError(f"cluster: regions.{region} lists {node!r}, which is no node "
                                  f"(nodes: {', '.join(node_names) or 'none: give nodes first'})")
            if node in region_of and region_of[node] != region:
                raise ConfigError(f"cluster: node {node!r} is in two regions: "
                                  f"{region_of[node]!r} and {region!r}: a node sits in one")
            region_of[node] = region
        if link is not None:
            links[region] = link_from_dict(link, f"regions.{region}.link")
    for e in entries:
        region = region_of.get(e["node"])
        if region is None:
            raise ConfigError(f"cluster: node {e['node']!r} is in no region: regions is given, "
                              "so list every node in one (or give no regions)")
        if e["region"] is not None and e["region"] != region:
            raise ConfigError(f"cluster: device {e['name']!r} says region {e['region']!r} but "
                              f"its node {e['node']!r} is in region {region!r}: a device sits in "
                              "its node's region")
        e["region"] = region
    return links


def matrix_from_dict(data, n: int, names: list | None = None) -> tuple[tuple[Link | None, ...],
                                                                        ...]:
    """``matrix = {gbps, latency_ms, transport, shared}`` as rows of Links (None on the
    diagonal)."""
    _keys(data, MATRIX_KEYS, "matrix")
    names = names or [str(i) for i in range(n)]
    grids = {}
    for key, default in (("gbps", None), ("latency_ms", None), ("transport", "buffered"),
                         ("shared", False)):
        value = data.get(key, default)
        if value is None:
            raise ConfigError(f"cluster: matrix.{key} is missing: give an {n} × {n} list of "
                              "rows (row: from, column: to)")
        if key in ("transport", "shared") and not isinstance(value, list):
            value = [[value] * n for _ in range(n)]
        if not isinstance(value, list) or len(value) != n or \
                any(not isinstance(row, list) or len(row) != n for row in value):
            got = (f"{len(value)} rows of lengths "
                   f"{sorted({len(r) if isinstance(r, list) else -1 for r in value})}"
                   if isinstance(value, list) else repr(value))
            raise ConfigError(f"cluster: matrix.{key} must be square, {n} × {n} (a row and a "
                              f"column per device, in device order), got {got}")
        grids[key] = value
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append(None)
                continue
            gbps, latency = grids["gbps"][i][j], grids["latency_ms"][i][j]
            if gbps is None or latency is None:
                which = "gbps" if gbps is None else "latency_ms"
                raise ConfigError(f"cluster: matrix.{which}[{i}][{j}] is missing: the link from "
                                  f"{names[i]!r} to {names[j]!r}; every ordered pair needs one")
            row.append(make_link(gbps, latency, grids["transport"][i][j],
                                 grids["shared"][i][j], where=f"matrix[{i}][{j}]"))
        rows.append(tuple(row))
    return tuple(rows)


# -- writing --------------------------------------------------------------------------------------


def link_dict(link: Link) -> dict:
    out = {"gbps": link.gbps, "latency_ms": link.latency_ms, "transport": transport_of(link)}
    if link.shared:
        out["shared"] = True
    return out


def to_dict(cluster: ClusterSpec) -> dict:
    out: dict = {"devices": []}
    for d in cluster.devices:
        entry = {"name": d.name, "memory": d.memory}
        if d.flops is not None:
            entry["flops"] = d.flops
        out["devices"].append(entry)
    nodes = {k: v for k, v in cluster.by_node().items() if k is not None}
    if nodes:
        own = dict(cluster.node_links)
        out["nodes"] = {k: ({"devices": list(v), "link": link_dict(own[k])} if k in own
                            else list(v)) for k, v in nodes.items()}
    regions: dict[str, list[str]] = {}
    for d in cluster.devices:
        if d.region is not None and d.node not in regions.setdefault(d.region, []):
            regions[d.region].append(d.node)
    if regions:
        own = dict(cluster.region_links)
        out["regions"] = {k: ({"nodes": v, "link": link_dict(own[k])} if k in own else v)
                          for k, v in regions.items()}
    if cluster.matrix is None:
        out["links"] = {k: link_dict(getattr(cluster, k)) for k in LEVEL_KEYS
                        if getattr(cluster, k) is not None}
        return out
    n = cluster.world
    cells = [[cluster.matrix[i][j] for j in range(n)] for i in range(n)]
    links = [c for row in cells for c in row if c is not None]
    matrix: dict = {
        "gbps": [[0.0 if c is None else c.gbps for c in row] for row in cells],
        "latency_ms": [[0.0 if c is None else c.latency_ms for c in row] for row in cells]}
    transports = {transport_of(c) for c in links}
    if len(transports) > 1:
        matrix["transport"] = [["buffered" if c is None else transport_of(c) for c in row]
                               for row in cells]
    else:
        matrix["transport"] = transports.pop() if transports else "buffered"
    shared = {c.shared for c in links}
    if len(shared) > 1:
        matrix["shared"] = [[c is not None and c.shared for c in row] for row in cells]
    elif shared == {True}:
        matrix["shared"] = True
    out["matrix"] = matrix
    return out


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # "1e-05", "100.0", "inf", "nan": all TOML floats
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"cluster: cannot write {v!r} to TOML")


def dumps_toml(data: Mapping) -> str:
    """TOML for the schema's shape: top-level scalars, tables of values (nested ones inline),
    and arrays of flat tables."""
    head, tables, arrays = [], [], []
    for key, value in data.items():
        if isinstance(value, Mapping):
            tables.append(f"\n[{_toml_key(key)}]")
            tables += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()]
        elif isinstance(value, list) and value and all(isinstance(x, Mapping) for x in value):
            for item in value:
                arrays.append(f"\n[[{_toml_key(key)}]]")
                arrays += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in item.items()]
        else:
            head.append(f"{_toml_key(key)} = {_toml_value(value)}")
    return "\n".join(head + arrays + tables).lstrip("\n") + "\n"


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ConfigError("cluster: a .yaml cluster file needs PyYAML, which ccfx does not "
                          "install: `pip install pyyaml`, or write the cluster as .toml or "
                          ".json") from None
    return yaml


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(f"cluster: {path} is not a cluster file ccfx reads: name it .toml, "
                          ".json or (with PyYAML) .yaml")
    return suffix


def read(path, cls=ClusterSpec):
    """The cluster a ``.toml``, ``.json`` or ``.yaml`` file describes, a ``cls``."""
    path = Path(path)
    suffix = _suffix(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cluster: cannot read {path}: {e.strerror or e}") from None
    try:
        if suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            yaml = _yaml()
            data = yaml.safe_load(text)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 (each parser's own error type: reported the same way)
        raise ConfigError(f"cluster: {path} is not valid {suffix[1:].upper()}: {e}") from None
    try:
        return from_dict(data, cls)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def write(cluster: ClusterSpec, path) -> None:
    path = Path(path)
    suffix = _suffix(path)
    data = to_dict(cluster)
    if suffix == ".toml":
        text = dumps_toml(data)
    elif suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = _yaml().safe_dump(data, sort_keys=False)
    path.write_text(text)


# -- describe -------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _rate(flops: float | None) -> str:
    return "compute measured here" if flops is None else f"{flops:.3g} FLOP/s"


def _link(link: Link) -> str:
    shared = ", one shared medium" if link.shared else ""
    return f"{link.gbps:.4g} Gbit/s, {link.latency_ms:.3g} ms, {transport_of(link)}{shared}"


def _devices(cluster: ClusterSpec, names) -> str:
    devs = [cluster.device(n) for n in names]
    if len({(d.memory, d.flops) for d in devs}) == 1:
        each = "each " if len(devs) > 1 else ""
        return f"{', '.join(names)} ({each}{_bytes(devs[0].memory)}, {_rate(devs[0].flops)})"
    return ", ".join(f"{d.name} ({_bytes(d.memory)}, {_rate(d.flops)})" for d in devs)


def describe(cluster: ClusterSpec) -> str:
    nodes = cluster.by_node()
    regions = {d.region for d in cluster.devices}
    total = _bytes(sum(d.memory for d in cluster.devices))
    if cluster.matrix is None:
        where = f"{len(nodes)} node{'s' * (len(nodes) > 1)}"
        if len(regions) > 1:
            where += f" in {len(regions)} regions"
        lines = [f"cluster: {cluster.world} devices, {where}; {total} of memory in all"]
        own = dict(cluster.node_links)
        for node, names in nodes.items():
            link = own.get(node, cluster.intra_node)
            inside = f"; inside: {_link(link)}" if len(names) > 1 else ""
            label = "devices" if node is None else f"node {node}"
            lines.append(f"  {label}: {_devices(cluster, names)}{inside}")
        own = dict(cluster.region_links)
        for region in sorted(regions, key=str):
            members = {d.node for d in cluster.devices if d.region == region}
            if len(members) < 2:
                continue
            label = "between nodes" if region is None else f"region {region}, between its nodes"
            lines.append(f"  {label}: {_link(own.get(region, cluster.inter_node))}")
        if len(regions) > 1:
            lines.append(f"  between regions: {_link(cluster.inter_region)}")
        return "\n".join(lines)
    n = cluster.world
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    lines = [(f"cluster: {n} device{'s' * (n > 1)}, a link per ordered pair; {total} of "
              "memory in all")]
    for node, names in nodes.items():
        label = "devices" if node is None else f"node {node}"
        lines.append(f"  {label}: {_devices(cluster, names)}")
    if not pairs:
        return "\n".join(lines)
    links = [cluster.matrix[i][j] for i, j in pairs]
    gbps = [x.gbps for x in links]
    lat = [x.latency_ms for x in links]
    lines.append(f"  links: {min(gbps):.4g} to {max(gbps):.4g} Gbit/s, {min(lat):.3g} to "
                 f"{max(lat):.3g} ms, " + " and ".join(sorted({transport_of(x) for x in links})))
    if n <= 8:
        width = max(6, *(len(x) for x in cluster.names))
        lines.append("  Gbit/s " + "from \\ to".rjust(width) + " " +
                     " ".join(x.rjust(width) for x in cluster.names))
        for i, name in enumerate(cluster.names):
            cells = ["-" if i == j else f"{cluster.matrix[i][j].gbps:.4g}" for j in range(n)]
            lines.append("         " + name.rjust(width) + " " +
                         " ".join(c.rjust(width) for c in cells))
    i, j = min(pairs, key=lambda p: (cluster.matrix[p[0]][p[1]].gbps,
                                     -cluster.matrix[p[0]][p[1]].latency_ms))
    lines.append(f"  slowest: {cluster.names[i]} -> {cluster.names[j]}: "
                 f"{_link(cluster.matrix[i][j])}")
    return "\n".join(lines)

