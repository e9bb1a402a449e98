"""``collective_codec="auto"``: the planner prices each collective on the link and compresses it
only where that is predicted faster (ccfx.planner.collective_model, plan_collectives).

Codec time here is modelled at a fixed throughput (``CodecTimer(throughput=...)``), so every
figure below is arithmetic on the link and the bytes, the same on any machine; the measured
path (the compressed collective's phases timed over a loopback comm) is what compile time
uses, exercised by the 2-rank tests in test_collectives_pass.py."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ccfx
from ccfx import Config
from ccfx.errors import ConfigError
from ccfx.planner.codec_cost import CodecTimer
from ccfx.planner.collective_model import (
    CollectiveTraffic,
    choose_collective_codecs,
    codec_seconds,
    link_seconds,
)
from ccfx.planner.plan_collectives import GraphCollective, plan_collective_codecs
from ccfx.wire.collectives import CollectiveCall, CompressedCollective
from ccfx.wire.link import Link

SLOW = Link(0.1, 0.05, shared=True)  # the shaped harness's 100 Mbit/s loopback
FAST_CODEC = CodecTimer(throughput=1e9)  # 1 GB/s encode and decode
POOL = ["none", "int8", "bf16"]


def all_reduce(*shape, world=2):
    return CollectiveCall("all_reduce", shape, torch.float32, world, "sum")


def traffic(call, overlap_s=0.0, part="forward", index=0):
    return CollectiveTraffic(index, call, part, overlap_s)


def test_link_seconds_count_latency_per_step_and_every_ranks_bytes_on_a_shared_link():
    call = all_reduce(8, 64, 512)  # 1 MiB
    payload = 8 * 64 * 512 * 4
    # a ring all-reduce on 2 ranks: 2 steps; each rank sends 2 (W-1)/W of it, the payload
    assert link_seconds(call, "none", SLOW) == pytest.approx(
        2 * 0.05e-3 + payload * 2 * 8 / 0.1e9)
    per_pair = Link(0.1, 0.05, shared=False)
    assert link_seconds(call, "none", per_pair) == pytest.approx(
        2 * 0.05e-3 + payload * 8 / 0.1e9)
    # compressed: an all-to-all and an all-gather of the messages the wire layer sends
    cc = CompressedCollective(call, "int8")
    sent = sum(b if k == "all_gather" else b / 2 for k, b in cc.messages())
    assert sent == cc.wire_bytes()
    assert link_seconds(call, "int8", SLOW) == pytest.approx(
        2 * 0.05e-3 + cc.wire_bytes() * 2 * 8 / 0.1e9)


def test_a_large_exposed_all_reduce_on_a_slow_link_is_compressed():
    t = traffic(all_reduce(8, 64, 512))
    got = choose_collective_codecs([t], 0.5, {0: POOL}, SLOW, timer=FAST_CODEC)
    assert got.codecs == {0: "int8"}
    (d,) = got.decisions
    assert d.what == "collective 0" and d.chosen == "int8"
    assert d.candidates[0][0] == "int8"  # fastest first
    assert "exposed uncompressed" in d.reason and "less)" in d.reason
    assert got.chosen_s < got.uncompressed_s
    # the prediction is the compute plus the exposed collective
    assert got.uncompressed_s == pytest.approx(0.5 + link_seconds(t.call, "none", SLOW))


def test_codec_time_that_outweighs_the_bytes_keeps_a_small_all_reduce_raw():
    # a decode step's all-reduce: one token of a 512-wide model; a slow codec (1 MB/s)
    t = traffic(all_reduce(1, 512))
    slow_codec = CodecTimer(throughput=1e6)
    got = choose_collective_codecs([t], 0.01, {0: POOL}, SLOW, timer=slow_codec)
    assert got.codecs == {0: "none"}
    assert "compression does not pay" in got.decisions[0].reason
    assert got.chosen_s == got.uncompressed_s


def test_a_collective_hidden_behind_compute_stays_raw():
    t = traffic(all_reduce(8, 64, 512), overlap_s=10.0)
    got = choose_collective_codecs([t], 11.0, {0: POOL}, SLOW, timer=FAST_CODEC)
    assert got.codecs == {0: "none"}
    assert "hidden behind the compute" in got.decisions[0].reason


def test_choices_that_save_less_than_min_gain_of_the_step_are_all_dropped():
    # 1000 s of compute: the all-reduces' 0.3 s are noise; int8 would save on each one
    ts = [traffic(all_reduce(8, 64, 512), index=i) for i in range(2)]
    got = choose_collective_codecs(ts, 1000.0, {0: POOL, 1: POOL}, SLOW, timer=FAST_CODEC,
                                   min_gain=0.1)
    assert got.codecs == {0: "none", 1: "none"}
    assert all("less than auto_min_gain" in d.reason for d in got.decisions)


def test_only_none_within_the_loss_budget_says_so():
    t = traffic(all_reduce(8, 64, 512))
    got = choose_collective_codecs([t], 0.1, {0: ["none"]}, SLOW, timer=FAST_CODEC)
    assert got.codecs == {0: "none"} and "loss budget" in got.decisions[0].reason


def test_roles_follow_the_loss_budget_of_what_the_collective_carries():
    assert traffic(all_reduce(4, 4)).roles == ("activation",)
    assert traffic(all_reduce(4, 4), part="backward").roles == ("activation_grad",)
    rs = CollectiveCall("reduce_scatter", (8, 4), torch.float32, 2, "avg")
    ag = CollectiveCall("all_gather", (8, 4), torch.float32, 2)
    assert traffic(rs).roles == ("activation",)  # sequence parallel's forward
    # backward: weights gathered again or gradients (sequence parallel): both budgets
    assert traffic(ag, part="backward").roles == ("activation", "activation_grad")
    assert traffic(rs, part="backward").roles == ("gradient", "activation_grad")


def test_a_backward_all_gather_takes_only_codecs_within_both_budgets():
    from ccfx.planner.plan_collectives import _within_all

    cfg = Config(collective_codec="auto", link_gbps=0.1)
    both = _within_all(("activation", "activation_grad"), cfg)
    assert "int8" in both and "int4:ef" not in both  # int4:ef: activation_grad only
    assert _within_all(("gradient", "activation_grad"), cfg) == ["none", "bf16"]


def test_gloos_raw_reduce_scatter_is_priced_as_an_all_reduce():
    rs = CollectiveCall("reduce_scatter", (64, 512), torch.float32, 2, "avg")
    ar = all_reduce(64, 512)
    assert link_seconds(rs, "none", SLOW, "gloo") == pytest.approx(
        link_seconds(ar, "none", SLOW))
    assert link_seconds(rs, "none", SLOW, "nccl") < link_seconds(rs, "none", SLOW, "gloo")
    # compressed, it is an all-to-all on any backend
    assert link_seconds(rs, "int8", SLOW, "gloo") == link_seconds(rs, "int8", SLOW)


def test_modelled_codec_time_counts_the_all_reduce_owners_second_round():
    ar, ag = all_reduce(256, 256), CollectiveCall("all_gather", (256, 256), torch.float32, 4)
    one = 256 * 256 * 4 / 1e9
    assert codec_seconds(ar, "int8", FAST_CODEC) == pytest.approx(4 * one)  # 2 enc, 2 dec
    assert codec_seconds(ag, "int8", FAST_CODEC) == pytest.approx(5 * one)  # 1 enc, W dec
    assert codec_seconds(ar, "none", FAST_CODEC) == 0.0


def test_measured_codec_time_runs_the_phases_once_per_shape(tmp_path):
    timer = CodecTimer(path=tmp_path / "t.json", repeats=2)
    first = codec_seconds(all_reduce(4, 256), "int8", timer)
    assert first > 0
    assert codec_seconds(all_reduce(4, 256), "int8", timer) == first  # cached
    assert (tmp_path / "t.json").exists()


def test_the_compute_between_issue_and_wait_is_the_overlap():
    F = torch.ops._c10d_functional

    def fn(x, w):
        s = F.all_reduce(x, "sum", "fake")
        y = (x @ w) @ w  # runs while the all-reduce is in flight
        return F.wait_tensor(s) + y

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(64, 512), torch.randn(512, 512))
    nodes = {n.name: n for n in gm.graph.nodes}
    issue = next(n for n in nodes if "all_reduce" in n)
    wait = next(n for n in nodes if "wait" in n)
    c = GraphCollective(0, all_reduce(64, 512), issue, wait)
    cfg = Config(collective_codec="auto", link_gbps=0.1, link_shared=True)
    rate = (1e9, 0.0)  # 1 GFLOP/s, no per-op time
    codecs_, decisions, predicted = plan_collective_codecs(
        gm, "forward", [c], cfg, timer=FAST_CODEC, rate=rate)
    flops_between = 2 * (2 * 64 * 512 * 512)
    raw_link = link_seconds(c.call, "none", SLOW)
    assert flops_between / 1e9 > raw_link  # the matmuls hide it completely
    assert codecs_ == {0: "none"} and "hidden" in decisions[0].reason
    assert predicted.uncompressed_s == pytest.approx(predicted.chosen_s)
    assert predicted.uncompressed_s >= flops_between / 1e9


def test_with_a_cluster_each_group_is_priced_on_the_slowest_link_among_its_devices():
    # two nodes of two devices: 100 Gbit/s inside a node, 100 kbit/s between them
    cluster = ccfx.Cluster.nodes(2, 2, intra=(100.0, 0.01), inter=(0.0001, 1.0),
                                 memory="16GiB")
    cfg = Config(collective_codec="auto", cluster=cluster.to_dict())
    F = torch.ops._c10d_functional

    def fn(x):
        return F.wait_tensor(F.all_reduce(x, "sum", "fake")) * 2

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(64, 512))
    names = [n.name for n in gm.graph.nodes]
    c = GraphCollective(0, all_reduce(64, 512), next(n for n in names if "all_reduce" in n),
                        next(n for n in names if "wait" in n))
    plan = functools.partial(plan_collective_codecs, gm, "forward", [c], cfg,
                             timer=FAST_CODEC, rate=(1e12, 0.0))
    inside, _, p_in = plan(ranks=(0, 1))  # one node: NVLink-like, raw pays
    across, _, p_across = plan(ranks=(0, 2))  # two nodes: the slow link, compress
    assert inside == {0: "none"} and across == {0: "int8"}
    assert "100 Gbit/s" in p_in.link and "0.0001 Gbit/s" in p_across.link
    with pytest.raises(ConfigError, match="describes 4 devices"):
        plan(ranks=(0, 4))
    # the placement option moves ranks: rank 1 on node 1's first device, rank 2 on node 0's
    placed = Config(collective_codec="auto", cluster=cluster.to_dict(), placement=[0, 2, 1, 3])
    moved = functools.partial(plan_collective_codecs, gm, "forward", [c], placed,
                              timer=FAST_CODEC, rate=(1e12, 0.0))
    assert moved(ranks=(0, 1))[0] == {0: "int8"} and moved(ranks=(0, 2))[0] == {0: "none"}


def test_the_cluster_option_reads_a_file_and_keeps_the_description():
    example = Path(__file__).parents[1] / "examples" / "cluster.toml"
    cfg = Config(collective_codec="auto", cluster=str(example))  # no link_gbps
    assert cfg.cluster_description().world == 10
    assert Config.from_options(cfg.to_dict()) == cfg  # the description, not the path
    with pytest.raises(ConfigError, match="cannot read"):
        Config(cluster="no/such/cluster.toml")
    with pytest.raises(ConfigError, match="give the path"):
        Config(cluster=3)
