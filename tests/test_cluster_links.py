"""Every pipeline hop and every data-parallel group priced on its own link of a cluster
(issue 19: "codecs per hop, bucket and collective priced on *that* link"): the per-hop
PipelineModel and simulator, ccfx.planner.links (placement, replicas, NIC contention), and
``auto`` through the compiler with the ``cluster`` and ``placement`` options. One process."""

import pytest
import torch
from torch import nn

import ccfx
from ccfx.config import Config
from ccfx.errors import ConfigError
from ccfx.planner import CodecTimer, Link, StageCost, simulate
from ccfx.planner.auto import choose_pipeline_codecs
from ccfx.planner.cluster import Cluster, Device
from ccfx.planner.links import (
    data_parallel_link,
    group_links,
    hop_links,
    level_of,
    rank_devices,
    stage_devices,
    stage_group_links,
)
from ccfx.planner.pipeline_model import EdgeTraffic, PipelineModel, StageCompute

from . import toy_models as models

FAST, SLOW = Link(100.0, 0.01), Link(0.05, 1.0)


def two_by_two(inter=(0.05, 1.0), intra=(100.0, 0.01)) -> Cluster:
    """Nodes n0 and n1 of two devices each (n0.d0, n0.d1, n1.d0, n1.d1)."""
    return Cluster.nodes(2, 2, intra=intra, inter=inter, memory="1GiB")


def four_hop_model(links) -> PipelineModel:
    """4 stages, one 64x1024 fp32 edge per hop; codecs priced at a fixed 1 GB/s (comparisons
    hold at any machine load)."""
    edges = [EdgeTraffic(s, f"h{s}", (64, 1024), torch.float32, ((s, s + 1),))
             for s in range(3)]
    return PipelineModel([StageCompute(0.004, 0.008)] * 4, edges, links, microbatches=8,
                         timer=CodecTimer(throughput=1e9))


def pool(edge, direction):
    return ["none", "bf16", "int8"]


# -- the model and the simulator take a link per hop ---------------------------------------------


@pytest.mark.parametrize("link", [FAST, SLOW, Link(0.1, 0.05, shared=True)])
def test_one_link_and_that_link_on_every_hop_predict_the_same_step(link):
    one, per_hop = four_hop_model(link), four_hop_model([link] * 3)
    for choice in ({}, {1: ("int8", "int8")}):
        assert per_hop.predict(choice).step_s == pytest.approx(one.predict(choice).step_s)
    assert per_hop.link == one.link == link


def test_only_the_slow_hops_messages_are_exposed():
    stages = [StageCost(0.004, 0.008)] * 4
    t = simulate("1F1B", stages, 8, lambda m: 262_144, [FAST, SLOW, FAST])
    waited = {h: sum(m.waited_s for m in t.messages if m.message.hop == h) for h in range(3)}
    assert waited[1] > 0.1 * t.step_s  # 256 KiB at 50 Mbit/s: 42 ms a message
    assert waited[0] < 1e-3 * t.step_s and waited[2] < 1e-3 * t.step_s  # 21 us a message
    # the slow hop alone makes the step slower than all-fast, faster than all-slow
    fast = simulate("1F1B", stages, 8, lambda m: 262_144, FAST).step_s
    slow = simulate("1F1B", stages, 8, lambda m: 262_144, SLOW).step_s
    assert fast < t.step_s <= slow


def test_a_wrong_number_of_links_is_a_config_error():
    with pytest.raises(ConfigError, match="4 stages need 3 Links"):
        simulate("1F1B", [StageCost(1.0, 1.0)] * 4, 2, lambda m: 0, [FAST, SLOW])
    with pytest.raises(ConfigError, match="links\\[s\\] joins stages s and s\\+1"):
        four_hop_model([FAST])


def test_auto_compresses_only_the_weak_link():
    # Heterogeneous SparseLoCo's finding: compress the weak links, leave the strong ones raw
    decided = choose_pipeline_codecs(four_hop_model([FAST, SLOW, FAST]), pool)
    assert decided.choice[0] == decided.choice[2] == ("none", "none")
    assert "none" not in decided.choice[1]
    assert decided.chosen.step_s < 0.9 * decided.uncompressed.step_s
    # on one slow link for every hop, every hop is compressed
    every = choose_pipeline_codecs(four_hop_model(SLOW), pool)
    assert all("none" not in every.choice[s] for s in range(3))


def test_a_tied_weight_sum_is_priced_on_the_links_between_its_stages():
    m = four_hop_model([FAST, SLOW, FAST])
    alone = m.predict({}).step_s
    m.shared = [((0, 1), 4_000_000)]  # stages 0 and 1: the fast link
    fast = m.predict({}).step_s
    m.shared = [((0, 3), 4_000_000)]  # 0 and 3: across the slow hop
    slow = m.predict({}).step_s
    assert fast < alone + 0.01 and slow >= alone + 4_000_000 * 8 / 0.05e9 * 0.99
    m.group_link = lambda stages: FAST  # the caller knows better (a cluster's pair link)
    assert m.predict({}).step_s < alone + 0.01


# -- ccfx.planner.links ---------------------------------------------------------------------------


def test_levels_name_where_two_devices_part():
    c = two_by_two()
    assert level_of(c, 0, 1) == "intra_node" and level_of(c, 1, 2) == "inter_node"
    m = Cluster.from_matrix([Device("a", 1), Device("b", 1)], [[0, 1.0], [2.0, 0]],
                            [[0, 0.1], [0.1, 0]])
    assert level_of(m, 0, 1) == "matrix"
    hop = hop_links(m, 2)[0]
    assert hop.link.gbps == 1.0 and hop.devices == ("a", "b")


def test_four_stages_on_two_nodes_cross_between_them_only_in_the_middle():
    hops = hop_links(two_by_two(), 4)
    assert [h.level for h in hops] == ["intra_node", "inter_node", "intra_node"]
    assert [h.describe() for h in hops] == [
        "intra_node 100 Gbit/s, 0.01 ms", "inter_node 0.05 Gbit/s, 1 ms",
        "intra_node 100 Gbit/s, 0.01 ms"]
    # placement moves the stages: alternating nodes, every hop crosses
    across = hop_links(two_by_two(), 4, placement=[0, 2, 1, 3])
    assert [h.level for h in across] == ["inter_node"] * 3
    # hops 0->1 and 2->3 both leave n0: they share its way out
    assert [h.flows for h in across] == [2, 1, 2]
    assert across[0].link.gbps == pytest.approx(0.025)
    assert "shared by 2 flows (0.025 Gbit/s each)" in across[0].describe()


def test_replicas_of_a_pipeline_share_the_inter_node_link():
    c = two_by_two()
    # ("dp", "pp") mesh order: replica d's stage s is rank 2d + s
    assert stage_devices(c, 2, replicas=2) == [[0, 1], [2, 3]]
    inside = hop_links(c, 2, replicas=2)  # each pipeline inside a node
    assert inside[0].level == "intra_node" and inside[0].flows == 1
    across = hop_links(c, 2, replicas=2, placement=[0, 2, 1, 3])  # each pipeline across
    assert across[0].level == "inter_node" and across[0].flows == 2
    assert across[0].link.gbps == pytest.approx(0.025)
    # interleaved: 4 stages on 2 pipeline ranks, stage s on rank s mod 2
    assert stage_devices(c, 4, pipeline_ranks=2, replicas=2) == [[0, 1, 0, 1], [2, 3, 2, 3]]


def test_data_parallel_groups_are_priced_on_their_slowest_link_shared_where_they_leave_a_node():
    c = two_by_two()
    assert data_parallel_link(c, 2).level == "intra_node"  # ranks 0, 1 on n0
    crossing = data_parallel_link(c, 2, placement=[0, 2])
    assert crossing.level == "inter_node" and crossing.devices == ("n0.d0", "n1.d0")
    assert crossing.flows == 1 and crossing.link == c.link(0, 2)
    assert data_parallel_link(c, 4).level == "inter_node"
    # PP x DP: with each pipeline inside a node, each stage's group crosses, two groups leave
    # each node; with each pipeline across the nodes, the groups stay inside them
    across = stage_group_links(c, 2, 2)
    assert [g.devices for g in across] == [("n0.d0", "n1.d0"), ("n0.d1", "n1.d1")]
    assert all(g.level == "inter_node" and g.flows == 2 for g in across)
    inside = stage_group_links(c, 2, 2, placement=[0, 2, 1, 3])
    assert all(g.level == "intra_node" and g.flows == 1 for g in inside)
    # a group of one device has no link to price
    assert group_links(c, [[0]])[0].level == "same device"


def test_ranks_sit_on_their_placed_devices():
    c = two_by_two()
    assert rank_devices(c, [1, 3]) == [1, 3]
    assert rank_devices(c, [0, 1], placement=[0, 2, 1, 3]) == [0, 2]
    assert c.slowest_link(rank_devices(c, [0, 1], placement=[0, 2, 1, 3])) == c.link(0, 2)


def test_a_shared_medium_is_not_divided_again():
    c = two_by_two(inter=(0.05, 1.0, "buffered"))
    shared = Cluster(c.devices, c.intra_node, Link(0.05, 1.0, shared=True))
    assert [h.flows for h in hop_links(shared, 4, placement=[0, 2, 1, 3])] == [1, 1, 1]


def test_too_few_devices_is_a_config_error_that_names_the_fix():
    with pytest.raises(ConfigError, match="the cluster has 4 devices, but the plan needs 6"):
        hop_links(two_by_two(), 3, replicas=2)
    with pytest.raises(ConfigError, match="give a device for every rank in placement"):
        hop_links(two_by_two(), 3, placement=[0, 1])


def test_the_world_says_where_a_compiled_pipelines_stages_sit():
    from ccfx.planner.plan_edges import pipeline_shape, priced_hops

    assert pipeline_shape(4, 1) == (4, 1)  # the single-process simulation
    assert pipeline_shape(2, 2) == (2, 1) and pipeline_shape(2, 4) == (2, 2)  # PP, PP x DP
    assert pipeline_shape(4, 2) == (2, 1)  # 2 stages per rank
    cfg = Config(stages=2, activation_codec="auto", cluster=two_by_two().to_dict(),
                 placement=[0, 2, 1, 3])
    assert [h.flows for h in priced_hops(cfg, 2, world=4)] == [2]  # both replicas leave n0
    assert [h.flows for h in priced_hops(cfg, 2, world=2)] == [1]
    assert priced_hops(Config(stages=2, activation_codec="auto", link_gbps=1.0), 2) is None


# -- the options ----------------------------------------------------------------------------------


def test_placement_is_checked_against_the_cluster():
    c = two_by_two().to_dict()
    assert Config(cluster=c, placement=["n0.d0", 3]).placement == (0, 3)
    assert Config(cluster=c, placement=[1, 0]).to_dict()["placement"] == [1, 0]
    for bad, message in [({"placement": [0, 1]}, "give the cluster option too"),
                         ({"cluster": c, "placement": [0, 0]}, "two ranks on device 'n0.d0'"),
                         ({"cluster": c, "placement": ["n9"]}, "placement\\[0\\]: .*'n9'"),
                         ({"cluster": c, "placement": "n0.d0"}, "a device \\(name or index"),
                         ({"cluster": c, "placement": [7]}, "out of range")]:
        with pytest.raises(ConfigError, match=message):
            Config(**bad)


# -- through the compiler -------------------------------------------------------------------------


def mlp(layers: int = 8, width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return models.relu_stack(layers, width)


def compile_pipeline(options: dict):
    compiled = torch.compile(mlp(), backend="ccfx", fullgraph=True, options={
        "stages": 4, "activation_codec": "auto", "lowering": "eager", **options})
    compiled(torch.randn(32, 256))
    return compiled


def test_four_stages_on_two_nodes_compress_only_the_middle_hop():
    # 32x256 fp32 activations: 0.7 ms a message inside a node's 100 Gbit/s is hidden, 5 ms at
    # 50 Mbit/s between the nodes is not
    compiled = compile_pipeline({"cluster": two_by_two().to_dict()})
    plan = ccfx.plan_of(compiled)
    by_hop = {tuple(e.hops[0]): (e.codec, e.grad_codec) for e in plan.edges}
    assert by_hop[(0, 1)] == by_hop[(2, 3)] == ("none", "none"), by_hop
    assert "none" not in by_hop[(1, 2)], by_hop
    text = ccfx.explain(compiled)
    assert "hop 0→1: intra_node 100 Gbit/s" in text
    assert "hop 1→2: inter_node 0.05 Gbit/s" in text
    assert "[priced on hop 1→2: inter_node 0.05 Gbit/s, 1 ms]" in text
    # the same cluster, the stages placed alternately on the two nodes: every hop crosses,
    # and hops 0->1 and 2->3 both leave n0 (half the link each): those two are compressed now
    compiled = compile_pipeline({"cluster": two_by_two().to_dict(), "placement": [0, 2, 1, 3]})
    across = {tuple(e.hops[0]): (e.codec, e.grad_codec) for e in ccfx.plan_of(compiled).edges}
    assert "none" not in across[(0, 1)] and "none" not in across[(2, 3)], across
    assert "hop 0→1: inter_node 0.05 Gbit/s, 1 ms, shared by 2 flows" in ccfx.explain(compiled)


def test_a_cluster_of_fast_links_leaves_every_hop_raw_without_link_gbps():
    fast = two_by_two(inter=(100.0, 0.01))
    plan = ccfx.plan_of(compile_pipeline({"cluster": fast.to_dict()}))
    assert all((e.codec, e.grad_codec) == ("none", "none") for e in plan.edges)


@pytest.mark.parametrize("placement,compressed", [([0, 1], False), ([0, 2], True)])
def test_buckets_are_priced_on_the_data_parallel_groups_link(placement, compressed):
    # the group inside node n0 (1000 Gbit/s) vs across the nodes (5 Mbit/s)
    c = two_by_two(inter=(0.005, 1.0), intra=(1000.0, 0.01))
    torch.manual_seed(0)
    model = models.two_layer_mlp(256, 1024)
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options={
        "data_parallel": True, "gradient_codec": "auto", "lowering": "eager",
        "cluster": c.to_dict(), "placement": placement})
    compiled(torch.randn(16, 256)).sum().backward()
    g = ccfx.plan_of(compiled).graphs[0]
    decisions = [d for d in g.decisions if d.what.startswith("bucket")]
    assert decisions and (decisions[0].chosen != "none") == compressed
    level = "inter_node 0.005 Gbit/s" if compressed else "intra_node 1000 Gbit/s"
    names = ", ".join(c.names[i] for i in placement)
    assert f"[priced on {names}: {level}" in decisions[0].reason
    assert g.prediction.link.startswith(f"data-parallel group {names}: {level}")


@pytest.mark.parametrize("placement,crossing", [(None, True), ([0, 2, 1, 3], False)])
def test_pp_x_dp_stage_exchanges_are_priced_on_each_stages_group(placement, crossing):
    from ccfx.planner.plan_stages import plan_stage_codecs

    c = two_by_two(inter=(0.005, 1.0), intra=(1000.0, 0.01))
    compiled = torch.compile(mlp(4, 512), backend="ccfx", fullgraph=True, options={
        "stages": 2, "lowering": "eager"})
    compiled(torch.randn(16, 512))
    plan = ccfx.plan_of(compiled)
    cfg = Config(stages=2, gradient_codec="auto", cluster=c.to_dict(), placement=placement,
                 auto_loss_budget=0.05)
    shapes = [[(512, 512), (512, 512)]] * 2
    chosen, decisions = plan_stage_codecs(plan, cfg, 2, shapes, world=4)
    # each pipeline inside a node: each stage's group crosses the nodes, two groups leave each
    level = "inter_node 0.005 Gbit/s, 1 ms, shared by 2 flows" if crossing else \
        "intra_node 1000 Gbit/s"
    assert all(level in d.reason for d in decisions), [d.reason for d in decisions]
    assert (chosen != ["none", "none"]) == crossing, chosen
