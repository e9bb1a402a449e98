"""passes/shard_buckets.py: ccfx.shard's per-parameter all-gathers and reduce-scatters merged
per block (``shard_bucket="block"``, the default), on graphs made here and on 2 gloo ranks.

Here: a graph traced in fake mode as ccfx.shard's look (a gather per parameter, a reduce-scatter
per gradient, each tagged with its module by hand as Dynamo does), checked by counting nodes,
and run on a group of one rank before and after. On 2 ranks (tests/shard_workers.py's
``bucketing``): the tiny GPT compiled with ``none`` bucketed and not, bit for bit the same,
one gather per block in the lowered graphs; with int8 the ledger's wire bytes per call equal
the codec's formula for each bucket's payload.
"""

from __future__ import annotations

import math

import pytest
import torch

from ccfx.config import Config
from ccfx.errors import ConfigError
from ccfx.passes.facts import fact
from ccfx.passes.shard_buckets import ShardBucketFacts, bucket_shard_collectives

from . import shard_workers as w
from .ranks import Shared, scenario

#: (module path, shard shape) of each parameter the graph gathers, in order: three in block 0,
#: two in block 1, one outside any block (a final norm)
PARAMS = [("blocks.0.attn.qkv", (6, 4)), ("blocks.0.attn.qkv", (6,)), ("blocks.0.ln", (2,)),
          ("blocks.1.fc", (4, 4)), ("blocks.1.fc", (4,)), ("ln_f", (2,))]


def _graph(group: str, world: int) -> torch.fx.GraphModule:
    """One gather per parameter, its use, and one reduce-scatter per (made-up) gradient returned
    as the graph's output, as ccfx.shard's forward + backward look; modules set by hand."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ccfx.wire.comm import FunctionalComm

    comm = FunctionalComm(group, world)

    def step(*shards):
        total = 0
        for s in shards:
            total = total + comm.wait(comm.all_gather(s)).sum()
        grads = [comm.wait(comm.reduce_scatter(total * torch.ones(world * s.shape[0],
                                                                  *s.shape[1:])))
                 for s in shards]
        return total, *grads

    gm = make_fx(step, tracing_mode="fake")(*[torch.randn(s) for _, s in PARAMS])
    collectives = [n for n in gm.graph.nodes if "all_gather" in str(n.target)
                   or "reduce_scatter" in str(n.target)]
    for n, (path, _) in zip(collectives, PARAMS + PARAMS):
        n.meta["nn_module_stack"] = {path: (f"L['self'].{path}", object)}
    return gm


def _count(gm, op: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and op in str(n.target))


def test_one_gather_and_one_reduce_scatter_per_block(one_rank_group):
    import torch.distributed as dist

    gm = _graph(dist.group.WORLD.group_name, 1)
    assert _count(gm, "all_gather_into_tensor") == _count(gm, "reduce_scatter_tensor") == 6
    bucket_shard_collectives(gm)
    # blocks.0 (3 parameters), blocks.1 (2): one each; ln_f alone stays as it was
    assert _count(gm, "all_gather_into_tensor") == 3
    assert _count(gm, "reduce_scatter_tensor") == 3
    buckets = gm.meta["ccfx"]["shard_buckets"]
    assert [(b.kind, b.block, len(b.members)) for b in buckets] == [
        ("all_gather", "blocks.0", 3), ("all_gather", "blocks.1", 2),
        ("reduce_scatter", "blocks.0", 3), ("reduce_scatter", "blocks.1", 2)]
    assert buckets[0].numels == (24, 6, 2)
    spliced = [n for n in gm.graph.nodes if fact(n, ShardBucketFacts) is not None]
    assert {fact(n, ShardBucketFacts).bucket for n in spliced} == {0, 1, 2, 3}


def test_bucketed_graph_computes_the_same_values(one_rank_group):
    import torch.distributed as dist

    shards = [torch.randn(s, generator=torch.Generator().manual_seed(i))
              for i, (_, s) in enumerate(PARAMS)]
    gm = _graph(dist.group.WORLD.group_name, 1)
    before = gm(*shards)
    after = bucket_shard_collectives(gm)(*shards)
    assert len(before) == len(after) == 7
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_none_leaves_the_graph_alone(one_rank_group):
    import torch.distributed as dist

    gm = _graph(dist.group.WORLD.group_name, 1)
    code = gm.code
    assert bucket_shard_collectives(gm, "none").code == code
    assert gm.meta["ccfx"]["shard_buckets"] == []


def test_shard_bucket_option_is_checked():
    assert Config().shard_bucket == "block"
    assert Config(shard_bucket="none").shard_bucket == "none"
    with pytest.raises(ConfigError, match="shard_bucket='layer' is not valid; choose one of "
                                          "'block', 'none'"):
        Config(shard_bucket="layer")


# -- 2 gloo ranks ---------------------------------------------------------------------------------

TWO = Shared(2, [
    scenario("eager", w.bucketing, "eager"),
    scenario("uneven", w.bucketing, "eager", "odd"),
    scenario("int8", w.bucketed_ledger),
], timeout_s=600)


@pytest.fixture(scope="module")
def two(shared_ranks):
    return shared_ranks[TWO]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["eager", "uneven"])
def test_bucketed_training_is_bit_equal_with_codec_none(two, case):
    """Three SGD steps, codec none: bucketed and per parameter give the same losses and
    parameters, bit for bit, on every rank. The tiny GPT (2 blocks); and tests/shard_workers.py's
    ``Odd`` (rows not divisible by W, an empty shard on rank 1), whose ranks pad and narrow in
    their own graphs around the same collectives: one bucket of its five parameters each way
    (it has no numbered blocks), the same on both ranks. (Inductor lowers the bucketed graphs
    in tests/test_shard.py, ``mlp_inductor``: bucketing is the default.)"""
    if case == "uneven":
        for got in two[case]:
            assert got["block"]["buckets"]["forward"] == [("all_gather", "", 5)]
            assert ("reduce_scatter", "", 5) in got["block"]["buckets"]["backward"]
    for got in two[case]:
        assert got["block"]["losses"] == got["none"]["losses"]
        assert got["block"]["digest"] == got["none"]["digest"]


@pytest.mark.slow
def test_lowered_graphs_hold_one_gather_per_block(two):
    """Per parameter: the forward gathers each of the 28 parameters. Bucketed: one gather for
    the embeddings, one per block, one for the final norm; the backward one reduce-scatter per
    block's gradients (the tied embedding's two gradients are summed: left alone)."""
    got = two["eager"][0]
    assert got["none"]["forward"]["all_gather_into_tensor"] == got["params"] == 28
    assert got["block"]["forward"]["all_gather_into_tensor"] == 2 + 2
    assert got["block"]["buckets"]["forward"] == [
        ("all_gather", "", 2), ("all_gather", "blocks.0", 12), ("all_gather", "blocks.1", 12),
        ("all_gather", "", 2)]
    backward = got["block"]["buckets"]["backward"]
    scatters = [b for b in backward if b[0] == "reduce_scatter"]
    assert scatters == [("reduce_scatter", "", 2), ("reduce_scatter", "blocks.1", 12),
                        ("reduce_scatter", "blocks.0", 12)]
    assert got["block"]["backward"]["reduce_scatter_tensor"] == 3 + 3  # + pos_emb, tied pair


@pytest.mark.slow
def test_int8_ledger_counts_the_formula_of_each_bucket(two):
    """With int8 gathers and reduce-scatters each bucket is one compressed collective: per call
    ``(W - 1) (n + 4 ceil(n / 256))`` bytes for a payload of n elements per rank (int8's wire
    bytes, module docstring; W = 2), n the bucket's elements (gather: this rank's shards;
    reduce-scatter: one rank's chunk), and the ledger counts exactly that per call."""
    for got in two["int8"]:
        assert got["buckets"]  # bucketed collectives were compressed
        for index, numel in got["buckets"]:
            row = got["rows"][index]
            assert row["codec"] == "int8"
            assert row["wire"] == (2 - 1) * (numel + 4 * math.ceil(numel / 256))
            assert got["ledger"][index] == (got["calls"], got["calls"] * row["wire"])


# -- the planner ----------------------------------------------------------------------------------


def test_planner_prices_a_message_per_block_not_per_parameter():
    """Sharded data parallel on 2 devices over a 10 Mbit/s, 20 ms link (every collective
    exposed: the compute is far shorter): per parameter, the forward gathers each parameter,
    the backward each matrix again and reduce-scatters each gradient; per block, one of each
    per block plus one before and one after the blocks. The predictions differ by exactly the
    latency of the messages saved."""
    import ccfx
    from ccfx.backends.plan_parallel import model_facts
    from ccfx.planner.codec_cost import CodecTimer
    from ccfx.planner.layout import Layout, predict_layout, shard_messages

    from .toy_models import tiny_gpt

    facts = model_facts(*tiny_gpt())
    cluster = ccfx.Cluster.nodes(1, 2, intra=(0.01, 20.0), inter=(0.01, 20.0), memory="16GiB",
                                 flops=1e15)
    stage = facts.stage(0, facts.num_layers)
    per_param, per_block = shard_messages(stage, "none"), shard_messages(stage, "block")
    params = len(stage.param_shapes)
    matrices = sum(len(s) >= 2 for s in stage.param_shapes)
    assert per_param == (params, matrices, params)
    assert per_block == (facts.num_layers + 2,) * 3
    timer = CodecTimer(throughput=1e10)
    pred = {b: predict_layout(facts, cluster, Layout(1, 2, sharded=True, shard_bucket=b),
                              timer=timer) for b in ("none", "block")}
    saved = sum(per_param) - sum(per_block)
    assert saved > 0
    assert pred["none"].buckets_s - pred["block"].buckets_s == pytest.approx(saved * 0.020,
                                                                            rel=1e-6)


def test_an_unknown_policy_is_a_config_error(one_rank_group):
    import torch.distributed as dist

    with pytest.raises(ConfigError, match="shard_bucket='layer' is not valid"):
        bucket_shard_collectives(_graph(dist.group.WORLD.group_name, 1), "layer")
