"""ccfx.Cluster: the devices and links the layout planner plans for (issue 19, part 1).

Single-process tests of the description (levels and matrix), its files and its errors; the
3-rank spawn the modules share (tests/ranks.py, ``Shared``; ``slow``) for the probe, whose workers are in
tests/cluster_workers.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import ccfx
from ccfx import Cluster, ConfigError
from ccfx.planner.cluster import Device, make_link
from ccfx.wire.link import Link

from . import cluster_workers as w
from .ranks import Shared, scenario

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"
GIB = 1 << 30


def two_by_two() -> Cluster:
    return Cluster.nodes(2, 2, intra=(900, 0.005, "blocking"), inter=(100, 0.02),
                         memory="80GiB", flops=9.9e14)


def three_matrix() -> Cluster:
    devices = [Device("a", GIB, 1e12, node="h0"), Device("b", "2GiB", node="h0"),
               Device("c", 5e9, node="h1")]
    return Cluster.from_matrix(devices, gbps=[[0, 1.5, 2], [3, 0, 4], [5, 6.25, 0]],
                               latency_ms=[[0, 0.1, 0.2], [0.3, 0, 0.4], [0.5, 0.6, 0]])


# -- levels ---------------------------------------------------------------------------------------


def test_two_nodes_give_the_intra_link_inside_a_node_and_the_inter_link_across():
    c = two_by_two()
    intra = Link(900.0, 0.005, False, rendezvous=True, buffered_sends=False)
    inter = Link(100.0, 0.02)
    assert c.world == 4 and c.kind == "levels"
    assert c.names == ("n0.d0", "n0.d1", "n1.d0", "n1.d1")
    assert c.link("n0.d0", "n0.d1") == intra
    assert c.link("n1.d1", "n1.d0") == intra
    assert c.link("n0.d0", "n1.d0") == inter
    assert c.link(1, 2) == inter  # positions work as well as names
    assert c.by_node() == {"n0": ("n0.d0", "n0.d1"), "n1": ("n1.d0", "n1.d1")}
    assert c.memory("n1.d1") == 80 * GIB and c.rate("n0.d0") == 9.9e14


def test_slowest_link_is_what_a_collective_over_the_devices_sees():
    c = two_by_two()
    assert c.slowest_link(["n0.d0", "n0.d1"]) == c.link(0, 1)
    assert c.slowest_link(range(4)) == c.link(0, 2)
    m = three_matrix()
    # the slowest pair is a -> b (1.5 Gbit/s); the group's highest latency is c -> b's 0.6 ms
    assert m.slowest_link("abc") == Link(1.5, 0.6)
    with pytest.raises(ConfigError, match="two devices or more"):
        c.slowest_link(["n0.d0", 0])


def test_select_keeps_the_links_between_the_devices_it_keeps():
    c = two_by_two().select(["n1.d1", "n0.d0"])  # rank 0 on n1.d1, rank 1 on n0.d0
    assert c.names == ("n1.d1", "n0.d0") and c.link(0, 1) == two_by_two().link(0, 3)
    assert two_by_two().select(["n0.d1", "n0.d0"]).link(0, 1) == two_by_two().link(0, 1)
    example = Cluster.from_file(EXAMPLE)
    assert example.select(["c1", "c0"]).link("c0", "c1").gbps == 200  # node c's own link
    m = three_matrix().select("ca")
    assert m.link(0, 1) == three_matrix().link("c", "a") and m.link(1, 0).gbps == 2
    with pytest.raises(ConfigError, match="lists device 'a' twice"):
        three_matrix().select("aa")


def test_the_example_file_reads_with_regions_and_a_node_with_its_own_link():
    c = Cluster.from_file(EXAMPLE)
    assert c.world == 10
    assert c.link("a0", "a3").gbps == 2400 and c.link("a0", "a3").rendezvous
    assert c.link("a0", "b2").gbps == 100
    assert c.link("b0", "c1") == Link(1.0, 40.0)  # between regions: buffered, the default
    assert c.link("c0", "c1").gbps == 200  # node c's own link, not intra_node
    assert c.memory("a0") == 80 * GIB and c.memory("c0") == 24 * GIB
    assert c.device("c1").flops is None and c.device("c0").flops == 1.65e14
    assert {d.region for d in c.devices} == {"eu", "us"}


def test_homogeneous_has_one_link_between_every_pair():
    c = Cluster.homogeneous(3, 25, 0.1, "16GB", transport="blocking")
    links = {c.link(i, j) for i in range(3) for j in range(3) if i != j}
    assert links == {Link(25.0, 0.1, False, True, False)}
    assert c.memory(2) == 16 * 10 ** 9


def test_memory_units_and_measured_rate(monkeypatch):
    assert Device("x", "80GiB").memory == 80 * GIB
    assert Device("x", "80 GB").memory == 80 * 10 ** 9
    assert Device("x", "1.5TiB").memory == 3 << 39
    assert Device("x", 4096.0).memory == 4096
    from ccfx.planner import compute

    monkeypatch.setattr(compute, "machine_rate", lambda *a, **k: (1.25e9, 1e-6))
    assert Cluster.homogeneous(2, 1, 1, 10).rate("d0") == 1.25e9  # None: measured here


def test_describe_says_devices_nodes_and_links():
    text = two_by_two().describe()
    assert "4 devices, 2 nodes; 320 GiB" in text
    assert "node n0: n0.d0, n0.d1 (each 80 GiB, 9.9e+14 FLOP/s)" in text
    assert "inside: 900 Gbit/s, 0.005 ms, blocking" in text
    assert "between nodes: 100 Gbit/s, 0.02 ms, buffered" in text
    text = Cluster.from_file(EXAMPLE).describe()
    assert "between regions: 1 Gbit/s, 40 ms, buffered" in text
    assert "c1 (24 GiB, compute measured here)" in text
    text = three_matrix().describe()
    assert "a link per ordered pair" in text and "slowest: a -> b: 1.5 Gbit/s" in text


def test_fingerprint_follows_the_description():
    assert two_by_two().fingerprint() == two_by_two().fingerprint()
    other = Cluster.nodes(2, 2, intra=(900, 0.005, "blocking"), inter=(10, 0.02),
                          memory="80GiB", flops=9.9e14)
    assert other.fingerprint() != two_by_two().fingerprint()


# -- dicts and files ------------------------------------------------------------------------------


def test_matrix_round_trips_through_to_dict():
    m = three_matrix()
    assert m.kind == "matrix"
    assert m.link("b", "a") == Link(3.0, 0.3) and m.link("a", "b") == Link(1.5, 0.1)
    d = m.to_dict()
    assert d["matrix"]["transport"] == "buffered" and d["nodes"] == {"h0": ["a", "b"],
                                                                     "h1": ["c"]}
    assert Cluster.from_dict(d) == m
    assert Cluster.from_dict(json.loads(json.dumps(d))) == m


@pytest.mark.parametrize("suffix", [".toml", ".json", ".yaml"])
def test_files_round_trip(tmp_path, suffix):
    if suffix == ".yaml":
        pytest.importorskip("yaml")
    for name, c in [("matrix", three_matrix()), ("levels", two_by_two()),
                    ("example", Cluster.from_file(EXAMPLE))]:
        path = tmp_path / f"{name}{suffix}"
        c.to_file(path)
        assert Cluster.from_file(path) == c, name


def test_a_matrix_with_mixed_transports_round_trips(tmp_path):
    blocking = make_link(10, 0.01, "blocking", shared=True)
    m = Cluster([Device("a", 1), Device("b", 1)],
                matrix=[[None, blocking], [Link(1.0, 5.0), None]])
    d = m.to_dict()
    assert d["matrix"]["transport"] == [["buffered", "blocking"], ["buffered", "buffered"]]
    m.to_file(tmp_path / "m.toml")
    assert Cluster.from_file(tmp_path / "m.toml") == m


def test_yaml_without_pyyaml_names_the_fix(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("devices: []\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(ConfigError, match=r"pip install pyyaml`, or write the cluster as \.toml"):
        Cluster.from_file(path)


@pytest.mark.parametrize("name,text,match", [
    ("c.ini", "", "name it .toml, .json"),
    ("c.toml", "devices = [", "is not valid TOML"),
    ("c.json", "{", "is not valid JSON"),
    ("c.toml", '[[devices]]\nname = "a"\nmemory = -1\n', r"c\.toml: cluster: device 'a'\.memory"),
])
def test_file_errors(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        Cluster.from_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        Cluster.from_file(tmp_path / "absent.toml")


# -- errors ---------------------------------------------------------------------------------------


def dev(*names, memory="1GiB"):
    return [{"name": n, "memory": memory} for n in names]


LINK = {"gbps": 10, "latency_ms": 0.1}

BAD = {
    "unknown device in a node": (
        {"devices": dev("a0", "a1"), "nodes": {"a": ["a0", "zz"]}, "links": {"intra_node": LINK}},
        r"nodes\.a lists 'zz', which is no device"),
    "device in two nodes": (
        {"devices": dev("a0", "a1"), "nodes": {"a": ["a0", "a1"], "b": ["a1"]},
         "links": {"intra_node": LINK, "inter_node": LINK}},
        "device 'a1' is in two nodes: 'a' and 'b'"),
    "device's own node disagrees": (
        {"devices": [{"name": "a0", "memory": 1, "node": "b"}], "nodes": {"a": ["a0"]}},
        "device 'a0' is in two nodes"),
    "device in no node": (
        {"devices": dev("a0", "a1"), "nodes": {"a": ["a0"]}, "links": {"intra_node": LINK}},
        "device 'a1' is in no node"),
    "node in two regions": (
        {"devices": dev("a0", "b0"), "nodes": {"a": ["a0"], "b": ["b0"]},
         "regions": {"x": ["a"], "y": ["a", "b"]}, "links": {"inter_region": LINK}},
        "node 'a' is in two regions"),
    "matrix not square": (
        {"devices": dev("a", "b"), "matrix": {"gbps": [[0, 1], [1]], "latency_ms": [[0, 1]]}},
        r"matrix\.gbps must be square, 2 × 2"),
    "matrix misses a pair": (
        {"devices": dev("a", "b", "c"),
         "matrix": {"gbps": [[0, 1, 1], [1, 0, None], [1, 1, 0]],
                    "latency_ms": [[0, 1, 1], [1, 0, 1], [1, 1, 0]]}},
        r"matrix\.gbps\[1\]\[2\] is missing: the link from 'b' to 'c'"),
    "negative bandwidth": (
        {"devices": dev("a", "b"), "links": {"intra_node": {"gbps": -1, "latency_ms": 0.1}}},
        r"links\.intra_node\.gbps is -1: it must be a finite number above 0"),
    "negative latency in a matrix": (
        {"devices": dev("a", "b"), "matrix": {"gbps": [[0, 1], [1, 0]],
                                               "latency_ms": [[0, -2], [1, 0]]}},
        r"matrix\[0\]\[1\]\.latency_ms is -2"),
    "unknown transport": (
        {"devices": dev("a", "b"), "links": {"intra_node": {**LINK, "transport": "rdma"}}},
        r"links\.intra_node\.transport is 'rdma': use one of \['blocking', 'buffered'\]"),
    "a typo in a link": (
        {"devices": dev("a", "b"), "links": {"intra_node": {"gbps": 1, "latency": 1}}},
        r"links\.intra_node has unknown key\(s\) \['latency'\]"),
    "an unknown level": (
        {"devices": dev("a", "b"), "links": {"intra_rack": LINK}},
        r"links has unknown key\(s\) \['intra_rack'\]"),
    "no link inside a node": (
        {"devices": dev("a", "b"), "links": {"inter_node": LINK}},
        "share a node but no link inside it is given: give links.intra_node"),
    "no link between regions": (
        {"devices": dev("a0", "b0"), "nodes": {"a": ["a0"], "b": ["b0"]},
         "regions": {"x": ["a"], "y": ["b"]}, "links": {"inter_node": LINK}},
        "give links.inter_region"),
    "two devices with one name": (
        {"devices": dev("a", "a"), "links": {"intra_node": LINK}},
        r"devices\[0\] and devices\[1\] are both named 'a'"),
    "memory without a unit we know": (
        {"devices": dev("a", memory="80 gigs")},
        r"device 'a'\.memory is '80 gigs': write bytes as a number or with a unit"),
    "flops as a word": (
        {"devices": [{"name": "a", "memory": 1, "flops": "fast"}]},
        r"device 'a'\.flops is 'fast': give FLOP/s as a number"),
    "a device without memory": (
        {"devices": [{"name": "a"}]}, r"devices\[0\] has no memory"),
    "links and a matrix": (
        {"devices": dev("a", "b"), "links": {"intra_node": LINK},
         "matrix": {"gbps": [[0, 1], [1, 0]], "latency_ms": [[0, 1], [1, 0]]}},
        "describe the links one way"),
    "a region listing an unknown node": (
        {"devices": dev("a0"), "nodes": {"a": ["a0"]}, "regions": {"x": ["b"]}},
        r"regions\.x lists 'b', which is no node \(nodes: a\)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_mistake_is_a_config_error_naming_the_field(case):
    data, match = BAD[case]
    with pytest.raises(ConfigError, match=match):
        Cluster.from_dict(data)


def test_mistakes_in_python():
    c = two_by_two()
    with pytest.raises(ConfigError, match="no device named 'gpu9'"):
        c.link("n0.d0", "gpu9")
    with pytest.raises(ConfigError, match="has no link to itself"):
        c.link(0, "n0.d0")
    with pytest.raises(ConfigError, match="out of range: the cluster has 4 devices"):
        c.link(0, 4)
    with pytest.raises(ConfigError, match=r"nodes\.n7\.link is given, but no device is in"):
        Cluster(c.devices, c.intra_node, c.inter_node, node_links={"n7": c.intra_node})
    with pytest.raises(ConfigError, match="is no transport a cluster knows"):
        Cluster((Device("a", 1), Device("b", 1)), intra_node=Link(1.0, rendezvous=True))
    with pytest.raises(ConfigError, match="has a node and 'b' has none"):
        Cluster((Device("a", 1, node="x"), Device("b", 1)), intra_node=Link(1.0))
    with pytest.raises(ConfigError, match="nodes must be a whole number"):
        Cluster.nodes(0, 2, intra=(1, 1), inter=(1, 1), memory=1)
    with pytest.raises(ConfigError, match="needs a process group"):
        Cluster.probe()


def test_what_needs_no_link_needs_none():
    """One device, or one device per node of one region: no link inside a node is needed."""
    assert Cluster.from_dict({"devices": dev("a"), "nodes": {"n": ["a"]}}).world == 1
    c = Cluster.from_dict({"devices": dev("a", "b"), "nodes": {"x": ["a"], "y": ["b"]},
                           "links": {"inter_node": LINK}})
    assert c.link("a", "b") == Link(10.0, 0.1)


def test_cluster_is_exported():
    assert ccfx.Cluster is Cluster and "Cluster" in ccfx.__all__


# -- the probe, on 3 gloo ranks -------------------------------------------------------------------


#: In the 3-rank spawn the modules share (tests/ranks.py, ``Shared``).
THREE = Shared(3, [scenario("world", w.probe_world, 0.02),
                   scenario("subgroup", w.probe_subgroup, [1, 2], 0.02),
                   scenario("probe_link", w.link_between_0_and_1, 0.02)], timeout_s=120)


@pytest.fixture(scope="module")
def three(shared_ranks):
    return shared_ranks[THREE]


@pytest.mark.slow
def test_probe_fills_every_pair_and_every_rank_gets_the_same_matrix(three):
    got = three["world"]
    assert got[0] == got[1] == got[2]
    c = Cluster.from_dict(got[0])
    assert c.kind == "matrix" and c.names == ("rank0", "rank1", "rank2")
    for i in range(3):
        for j in range(3):
            if i != j:
                link = c.link(i, j)
                assert link.gbps > 0 and link.latency_ms > 0, (i, j, link)
                assert not link.rendezvous  # gloo: buffered
    assert len(c.by_node()) == 1  # one host: one node label
    assert all(d.memory > 0 and d.flops is None for d in c.devices)


@pytest.mark.slow
def test_probe_of_a_subgroup_measures_its_members_only(three):
    got = three["subgroup"]
    assert got[0] is None and got[1] == got[2]
    c = Cluster.from_dict(got[1])
    assert c.names == ("g1", "g2") and c.memory("g1") == GIB
    assert c.link("g1", "g2").gbps > 0 and c.link("g2", "g1").gbps > 0


@pytest.mark.slow
def test_probe_link_still_gives_every_rank_rank_0s_link(three):
    got = three["probe_link"]
    assert got[0] == got[1] == got[2]
    assert got[0][0] > 0 and got[0][1] > 0
