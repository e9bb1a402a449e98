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
