"""Pricing a data-parallel exchange on the link it crosses, and the runtime's
``gradient_collective="auto"`` resolved on the cluster's link for the group (issue 19).

1. A 2-rank all-gather on gloo's TCP loses time to its two directions taking turns on the
   pair's one connection (:func:`ccfx.wire.link.pair_gather_wait_s`, measured on
   ``bench.shaped.two_nodes``): the layout planner, the compiled data-parallel model and the
   per-stage exchange model add it; an all-reduce and a ring of 3+ ranks do not pay it.
2. ``gradient_collective="auto"`` with ``cluster`` and ``placement``: the backend prices the
   choice on the group's slowest link (:mod:`ccfx.planner.links`), hands it to the runtime
   and writes it into the plan. Single process: the runtime is given the world it would run in.
"""

from __future__ import annotations

import pytest
import torch

import ccfx
import ccfx.wire.link as wire_link
from ccfx.backends.plan_parallel import model_facts
from ccfx.models.tiny_gpt import GPTConfig, TinyGPT
from ccfx.planner.codec_cost import CodecTimer
from ccfx.planner.dp_model import BucketTraffic, DataParallelModel
from ccfx.planner.layout import exchange_wire_s, predict_layout
from ccfx.planner.layout_search import make_layout
from ccfx.wire.link import PAIR_GATHER_WAIT, Link, pair_gather_wait_s

from . import links_runtime_workers as w
from .ranks import Shared, scenario

#: codec work priced at a fixed rate: the same answer on any machine at any load
TIMER = CodecTimer(throughput=1e10)
SLOW = Link(0.0481, 0.05)  # bench.layouts' link between its two "nodes"


def payload_s(nbytes: float, gbps: float) -> float:
    return nbytes * 8 / (gbps * 1e9)


# -- 1. the 2-rank all-gather's wait ----------------------------------------------------------


def test_a_pair_gather_waits_part_of_a_payload_at_the_links_whole_rate():
    mb = 5.4e6
    assert pair_gather_wait_s(SLOW, mb, 2) == pytest.approx(PAIR_GATHER_WAIT * payload_s(mb, 0.0481))
    # a link already divided among two groups: the wait is at the whole link's rate
    half = Link(0.0481 / 2, 0.05)
    assert pair_gather_wait_s(half, mb, 2, flows=2) == pytest.approx(pair_gather_wait_s(SLOW, mb, 2))
    # a ring of 3+ ranks sends and receives on different pairs; a shared medium already
    # carries every byte in turn; NCCL's blocking transport was not measured
    assert pair_gather_wait_s(SLOW, mb, 3) == 0.0
    assert pair_gather_wait_s(Link(0.0481, 0.05, shared=True), mb, 2) == 0.0
    assert pair_gather_wait_s(Link(0.0481, 0.05, rendezvous=True, buffered_sends=False), mb,
                              2) == 0.0


def test_the_layout_planner_prices_a_gather_codec_with_its_wait_and_an_all_reduce_without():
    wire = 5.4e6
    half = Link(0.0481 / 2, 0.05)  # two stage groups leave each node (pp2-dp2, replicas across)
    # int8 over 2 replicas: one payload in per rank at the shared rate, plus the wait
    assert exchange_wire_s("int8", wire, 2, half, flows=2) == pytest.approx(
        payload_s(wire, 0.0481 / 2) + PAIR_GATHER_WAIT * payload_s(wire, 0.0481))
    # the all-reduce (none, and summable codecs): 2 (W-1)/W of the payload, no wait
    assert exchange_wire_s("none", wire, 2, half, flows=2) == pytest.approx(
        payload_s(wire, 0.0481 / 2))
    assert exchange_wire_s("bf16", wire, 2, half, flows=2) == pytest.approx(
        payload_s(wire, 0.0481 / 2))
    # 4 replicas gather W-1 = 3 payloads, no wait
    assert exchange_wire_s("int8", wire, 4, SLOW) == pytest.approx(3 * payload_s(wire, 0.0481))


def harness():
    """bench.layouts' cluster (2 nodes x 2 devices, 48.1 Mbit/s between), devices described."""
    return ccfx.Cluster.nodes(2, 2, intra=(34.0, 0.05), inter=(0.0481, 0.05), memory="24GiB",
                              flops=1e11)


@pytest.fixture(scope="module")
def facts():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=256))
    idx = torch.randint(0, 96, (32, 64))
    return model_facts(model, (idx, idx))


#: rank -> device, ranks counted as a (dp, pp) mesh (rank = replica x pp + stage)
ACROSS = ("n0.d0", "n0.d1", "n1.d0", "n1.d1")  # each pipeline inside a node, replicas across
INSIDE = ("n0.d0", "n1.d0", "n0.d1", "n1.d1")  # each pipeline across, replicas inside a node


def predict(facts, pp, dp, devices, codec):
    layout = make_layout(facts, harness(), pp, dp, microbatches=4, devices=devices,
                         activation_codec="none", gradient_codec=codec)
    return predict_layout(facts, harness(), layout, timer=TIMER)


def test_pp2_dp2_with_int8_buckets_across_the_slow_link_pays_the_pairs_wait(facts, monkeypatch):
    with_wait = predict(facts, 2, 2, ACROSS, "int8")
    assert with_wait.dp_flows == (2, 2)  # both stage groups leave each node
    assert all("shared by 2 flows" in t for t in with_wait.dp_text)
    monkeypatch.setattr(wire_link, "PAIR_GATHER_WAIT", 0.0)
    without = predict(facts, 2, 2, ACROSS, "int8")
    # the step grows by the wait of the stage whose exchange ends last: PAIR_GATHER_WAIT of
    # one of the stages' int8 payloads at the link's whole rate
    waits = [PAIR_GATHER_WAIT * payload_s(TIMER.cost("int8", (facts.stage(lo, hi).param_numel,),
                                                     torch.float32).wire_bytes, 0.0481)
             for lo, hi in with_wait.layout.stage_layers(facts.num_layers)]
    grown = with_wait.step_s - without.step_s
    assert min(waits) * 0.999 <= grown <= max(waits) * 1.001, (grown, waits)
    assert grown > 0.1 * without.step_s  # a large part of the step: it was 27 % short


def test_an_all_reduce_a_gather_inside_a_node_and_a_ring_of_four_do_not_change(facts,
                                                                                monkeypatch):
    before = [predict(facts, 2, 2, ACROSS, "none").step_s,
              predict(facts, 2, 2, INSIDE, "int8").step_s,
              predict(facts, 1, 4, ACROSS, "int8").step_s]
    monkeypatch.setattr(wire_link, "PAIR_GATHER_WAIT", 0.0)
    after = [predict(facts, 2, 2, ACROSS, "none").step_s,
             predict(facts, 2, 2, INSIDE, "int8").step_s,
             predict(facts, 1, 4, ACROSS, "int8").step_s]
    assert before[0] == after[0] and before[2] == after[2]
    assert before[1] == pytest.approx(after[1], rel=1e-3)  # 34 Gbit/s: a wait of microseconds


def test_the_data_parallel_model_adds_the_wait_to_a_two_rank_gather_bucket():
    bucket = [BucketTraffic(0, ((1024, 1024),), torch.float32, 0.0)]
    two = DataParallelModel(0.0, 0.0, bucket, 2, SLOW, TIMER, collective="all_gather")
    cost = two.cost(bucket[0], "int8")
    assert cost.collective == "all_gather"
    assert cost.wait_s == pytest.approx(PAIR_GATHER_WAIT * payload_s(cost.wire_bytes, 0.0481))
    base = cost.codec_s + SLOW.seconds(cost.link_bytes)
    assert two.predict({0: "int8"}).step_s == pytest.approx(base + cost.wait_s)
    # shared by two groups: the bytes at half the rate, the wait at the whole link's
    shared = DataParallelModel(0.0, 0.0, bucket, 2, Link(0.0481 / 2, 0.05), TIMER, flows=2)
    assert shared.cost(bucket[0], "int8").wait_s == pytest.approx(cost.wait_s)
    # an all-reduce (bf16) and a gather over four ranks: none
    assert two.cost(bucket[0], "bf16").wait_s == 0.0
    four = DataParallelModel(0.0, 0.0, bucket, 4, SLOW, TIMER)
    assert four.cost(bucket[0], "int8").wait_s == 0.0


# -- 2. gradient_collective="auto" on the cluster's link for the group ------------------------


def eight():
    """2 nodes x 4 devices: 100 Gbit/s and 0.05 ms inside a node, 50 Mbit/s and 1 ms between."""
    return ccfx.Cluster.nodes(2, 4, intra=(100.0, 0.05), inter=(0.05, 1.0), memory="16GiB",
                              flops=1e12)


INSIDE4 = (0, 1, 2, 3)  # a 4-rank group on node n0
ACROSS4 = (0, 1, 4, 5)  # two ranks on each node
NUMEL = 1 << 20  # an int8 bucket of 1 Mi elements (about 1 MB on the wire)


def dp_config(placement, **extra):
    return ccfx.Config(data_parallel=True, gradient_codec="int8", gradient_collective="auto",
                       cluster=eight().to_dict(), placement=placement, **extra)


@pytest.mark.parametrize("placement,level,collective", [
    (INSIDE4, "intra_node 100 Gbit/s", "all_gather"),  # latency-bound: one collective
    (ACROSS4, "inter_node 0.05 Gbit/s", "ring"),  # bandwidth-bound: half the bytes
])
def test_the_backend_prices_auto_on_the_groups_slowest_link(placement, level, collective):
    from ccfx.backends.dp_link import group_link
    from ccfx.wire.link import resolve_collective

    group = group_link(dp_config(placement), range(4))
    assert group.text.startswith(", ".join(eight().names[i] for i in placement) + f": {level}")
    assert "the group's slowest link" in group.text
    assert resolve_collective("auto", "int8", NUMEL, torch.float32, 4, group.link) == collective
    # the options' one link (what the runtime used before) prices both groups alike
    assert resolve_collective("auto", "int8", NUMEL, torch.float32, 4,
                              wire_link.configured_link(dp_config(placement))) == "ring"


def test_nothing_is_priced_without_auto_or_for_one_rank_and_link_gbps_without_a_cluster():
    from ccfx.backends.dp_link import group_link

    assert group_link(ccfx.Config(gradient_collective="all_gather", cluster=eight().to_dict()),
                      range(4)) is None
    assert group_link(dp_config(INSIDE4), [0]) is None
    plain = group_link(ccfx.Config(gradient_collective="auto", link_gbps=0.1), range(4))
    assert plain.link == Link(0.1, 0.05) and plain.text.startswith("the link_gbps link")
    bare = group_link(ccfx.Config(gradient_collective="auto"), range(4))
    assert bare.link is None and "decided by bytes" in bare.text


def test_a_group_beyond_the_clusters_devices_is_a_config_error():
    from ccfx.backends.dp_link import group_link
    from ccfx.errors import ConfigError

    cfg = ccfx.Config(gradient_collective="auto", cluster=eight().to_dict())
    with pytest.raises(ConfigError, match="placement"):
        group_link(cfg, range(12))


@pytest.mark.parametrize("placement,collective", [(INSIDE4, "all_gather"), (ACROSS4, "ring")])
def test_the_runtime_resolves_auto_on_the_link_the_backend_gave(placement, collective):
    from ccfx.backends.dp_link import group_link
    from ccfx.runtime.data_parallel import DataParallel
    from ccfx.runtime.ledger import Ledger
    from ccfx.wire.policy import GradSlot, assign_buckets

    cfg = dp_config(placement)
    group = group_link(cfg, range(4))
    dp = DataParallel(cfg, Ledger(), link=group.link)
    dp.world = 4  # as on 4 ranks (one process here: no group is made)
    buckets = assign_buckets([GradSlot(0, 0, "w", (1024, 1024), torch.float32, 0)], "int8",
                             cfg.bucket_mb, cfg.compress_min_numel, cfg.min_compression_rate)
    assert [b.collective for b in dp._collectives(buckets)] == [collective]
    # without the backend's link (before): the options' (none here), so by bytes: the ring
    # wherever the group sits
    before = DataParallel(cfg, Ledger())
    before.world = 4
    assert [b.collective for b in before._collectives(buckets)] == ["ring"]


def test_the_plan_names_the_link_each_collective_was_priced_on():
    from ccfx.backends.dp_link import collective_decisions, group_link
    from ccfx.plan import GraphPlan, Plan
    from ccfx.planner.explain import explain_plan

    rows = [(0, "int8", "ring", NUMEL, torch.float32), (1, "none", "all_reduce", 10, torch.float32),
            (2, "bf16", "all_reduce", NUMEL, torch.float32)]
    group = group_link(dp_config(ACROSS4), range(4))
    decisions = collective_decisions("bucket", rows, 4, group)
    assert [d.what for d in decisions] == ["bucket 0 collective"]  # summable ones: no choice
    d = decisions[0]
    assert d.chosen == "ring" and [c for c, _ in d.candidates] == ["ring", "all_gather"]
    assert "n0.d0, n0.d1, n1.d0, n1.d1: inter_node 0.05 Gbit/s" in d.reason
    g = GraphPlan(0, 1, 1, "", [], [], [], decisions=decisions)
    text = explain_plan(Plan({}, [g]))
    assert "bucket 0 collective: ring" in text and "inter_node 0.05 Gbit/s" in text


# -- on 4 real ranks (one spawn for the module) ------------------------------------------------


#: In the 4-rank spawn the modules share (tests/ranks.py, ``Shared``).
FOUR = Shared(4, [scenario("dp_inside", w.dp_on_cluster, list(INSIDE4)),
                  scenario("dp_across", w.dp_on_cluster, list(ACROSS4)),
                  scenario("ppdp_across", w.pp_dp_on_cluster, None)], timeout_s=300)


@pytest.fixture(scope="module")
def ranks4(shared_ranks):
    return shared_ranks[FOUR]


@pytest.mark.slow
@pytest.mark.parametrize("name,collective,level", [
    ("dp_inside", "all_gather", "n0.d0, n0.d1, n0.d2, n0.d3: intra_node 100 Gbit/s"),
    ("dp_across", "ring", "n0.d0, n0.d1, n1.d0, n1.d1: inter_node 0.05 Gbit/s")])
def test_compiled_data_parallel_resolves_auto_on_its_groups_link(ranks4, name, collective,
                                                                 level):
    rows = ranks4[name]
    assert len({r["grads"] for r in rows}) == 1  # every rank averaged to the same bits
    for r in rows:
        # the int8 bucket (the biases travel apart, uncompressed: all-reduced)
        assert [(c, k) for c, k, _ in r["buckets"] if c != "none"] == [("int8", collective)], \
            r["buckets"]
        said = [d for d in r["decisions"] if d[0].startswith("bucket ")
                and d[0].endswith(" collective")]
        assert said and said[0][1] == collective and level in said[0][2], r["decisions"]


@pytest.mark.slow
def test_pp_x_dp_sync_grads_names_the_link_of_each_stages_group(ranks4):
    # each pipeline inside a node (ranks 0, 1 on n0): each stage's replicas across
    rows, level = ranks4["ppdp_across"], "inter_node 0.05 Gbit/s"
    for s in (0, 1):  # a stage's replicas average to the same bits
        assert len({r["grads"] for r in rows if r["stage"] == s}) == 1
    for r in rows:
        # two replicas: the all-gather, priced on the group's own link
        assert r["collectives"] and set(r["collectives"]) <= {"all_gather", "all_reduce"}
        said = [d for d in r["decisions"] if d[0].startswith(f"stage {r['stage']} bucket")
                and d[0].endswith("collective")]
        assert said and all(level in d[2] for d in said), r["decisions"]
