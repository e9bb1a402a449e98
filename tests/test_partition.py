"""The partitioner on the shapes of graph it must handle, checked on the graph and the plan."""

import warnings

import pytest
import torch

import ccfx
from ccfx.passes.facts import CutFacts, fact, kind_of, stage_of

from . import toy_models as models
from .util import assert_same, compile_ccfx, run_both


def _stages_in_order(gm):
    order = [stage_of(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return order


def test_stages_are_contiguous_and_balanced():
    compiled, be = compile_ccfx(models.MLP(depth=8), stages=4)
    compiled(torch.randn(4, 32))
    order = _stages_in_order(be.graphs[0].partitioned)
    assert order == sorted(order) and set(order) == {0, 1, 2, 3}
    plan = be.plan.graphs[0]
    assert plan.num_stages == 4 and plan.imbalance <= 1.10
    # Eight identical layers in four stages: two per stage, cut on the layer boundary.
    assert [sum(1 for n in s.nodes if n.startswith("linear") or n == "linear") for s in plan.stages] == [2, 2, 2, 2]
    assert all(len(e.hops) == 1 for e in plan.edges)


def test_cuts_prefer_few_crossing_bytes():
    """Inside a residual block two tensors are live, at its boundary one: cuts land there.
    (Six layers plus a head worth two: the ideal cut is after layer four.)"""
    compiled, be = compile_ccfx(models.TiedLM(depth=6), stages=2)
    compiled(torch.randint(0, 64, (2, 8)))
    part = be.graphs[0].partitioned.meta["ccfx"]["partition"]
    assert all(b == 2 * 8 * 32 * 4 for b in part.crossing_bytes), part.crossing_bytes


def test_skip_connection_crossing_two_cuts_is_sent_per_hop():
    compiled, be = compile_ccfx(models.LongSkip(depth=8), stages=4, activation_codec="int8")
    compiled(torch.randn(4, 32))
    plan = be.plan
    skip = [e for e in plan.edges if e.dest_stages == [3] and e.source_stage == 0]
    assert len(skip) == 1
    assert skip[0].hops == [(0, 1), (1, 2), (2, 3)]
    gm = be.graphs[0].partitioned
    cuts = [n for n in gm.graph.nodes if kind_of(n) == "cut"]
    assert len(cuts) == sum(len(e.hops) for e in plan.edges)
    # Every link of the chain reads the one before, and sits in its destination stage.
    chain = [n for n in cuts if fact(n, CutFacts).source == skip[0].source]
    assert [stage_of(n) for n in chain] == [1, 2, 3]
    assert chain[1].args[0] is chain[0] and chain[2].args[0] is chain[1]


def test_skip_connection_numerics_identity_exact():
    eager, mine, _ = run_both(models.LongSkip(depth=8), torch.randn(4, 32), stages=4)
    assert_same(eager, mine)


def test_tied_parameters_are_listed_as_shared():
    compiled, be = compile_ccfx(models.TiedLM(depth=6), stages=3)
    compiled(torch.randint(0, 64, (2, 8)))
    shared = be.plan.shared
    assert [p.name for p in shared] == ["emb.weight"]
    assert shared[0].stages == [0, 2]
    assert shared[0].nbytes == 64 * 32 * 4


def test_tied_parameters_gradients_match_eager():
    eager, mine, _ = run_both(models.TiedLM(depth=6), torch.randint(0, 64, (2, 8)), stages=3)
    assert_same(eager, mine)


def test_multi_output_ops_stay_with_their_getitems():
    compiled, be = compile_ccfx(models.MultiOut(depth=6), stages=4)
    compiled(torch.randn(4, 32))
    gm = be.graphs[0].partitioned
    for n in gm.graph.nodes:
        if n.target is __import__("operator").getitem:
            assert stage_of(n) == stage_of(n.args[0]), n.name
    eager, mine, _ = run_both(models.MultiOut(depth=6), torch.randn(4, 32), stages=4)
    assert_same(eager, mine)


def test_in_place_ops_keep_eager_numerics():
    eager, mine, be = run_both(models.InPlace(depth=6), torch.randn(4, 32), stages=3)
    assert be.plan.num_stages == 3
    assert_same(eager, mine)


def test_batchnorm_buffers_update_like_eager():
    eager, mine, be = run_both(models.ConvBN(depth=4), torch.randn(2, 3, 8, 8), stages=3)
    assert be.plan.num_stages == 3
    assert_same(eager, mine, atol=1e-5, rtol=1e-5)  # conv reductions reorder under aot


def test_fewer_nodes_than_stages_warns_and_uses_fewer():
    compiled, be = compile_ccfx(models.Tiny(), stages=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(2, 8))
    assert any(issubclass(w.category, ccfx.CcfxWarning) for w in caught)
    plan = be.plan.graphs[0]
    assert plan.num_stages == 1 and plan.requested_stages == 4
    assert "instead of 4" in plan.notes[0]


def test_split_points_are_honoured():
    compiled, be = compile_ccfx(models.MLP(depth=8), split_points=["layers.3", "layers.6"])
    compiled(torch.randn(4, 32))
    gm = be.graphs[0].partitioned
    from ccfx.passes.graph_utils import module_path

    first = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and kind_of(n) == "op":
            first.setdefault(stage_of(n), module_path(n))
    assert first == {0: "layers.0", 1: "layers.3", 2: "layers.6"}


def test_unknown_split_point_lists_the_modules():
    compiled, _ = compile_ccfx(models.MLP(depth=4), split_points=["layer.2"])
    with pytest.raises(ccfx.PartitionError, match="layers.2"):
        compiled(torch.randn(4, 32))


class Marked(torch.nn.Module):
    """Three linear layers with ``ccfx.stage_boundary()`` where the caller asks."""

    def __init__(self, after=(0, 1)):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.after = after

    def forward(self, x):
        if -1 in self.after:
            ccfx.stage_boundary()
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            for _ in range(self.after.count(i)):
                ccfx.stage_boundary()
        return x


def test_stage_boundary_markers_are_the_cuts_and_leave_the_graph():
    model = Marked(after=(0, 1))
    eager, mine, be = run_both(model, torch.randn(4, 16), activation_codec="none")
    assert_same(eager, mine, atol=0, rtol=0)
    plan = be.plan.graphs[0]
    assert plan.num_stages == 3 and plan.requested_stages == 3
    gm = be.graphs[0].partitioned
    assert not any("pipe_split" in str(n.target) for n in gm.graph.nodes)
    from ccfx.passes.graph_utils import module_path

    first = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and kind_of(n) == "op":
            first.setdefault(stage_of(n), module_path(n))
    assert first == {0: "layers.0", 1: "layers.1", 2: "layers.2"}
    # The backward is compressed too: the markers do not lose the activations' requires_grad.
    assert all(e.wire_bytes_bwd > 0 for e in plan.edges)


def test_stage_boundary_is_torch_pipelinings_pipe_split():
    """The same marked model splits with torch's own pipeline tracer (the real multi-rank
    pipeline builds on it), at the same places."""
    from torch.distributed.pipelining import pipeline

    model = Marked(after=(0, 1))
    pipe = pipeline(model, mb_args=(torch.randn(2, 16),))
    assert pipe.num_stages == 3


@pytest.mark.parametrize("after, stages, message", [
    ((0, 1), 4, "2 stage_boundary.. marker.s., making 3 stages, but stages=4"),
    ((-1,), 1, "leaves a stage with no computation"),
    ((2,), 1, "leaves a stage with no computation"),
    ((0, 0), 1, "leaves a stage with no computation"),
])
def test_bad_stage_boundary_markers_are_named(after, stages, message):
    compiled, _ = compile_ccfx(Marked(after=after), stages=stages)
    with pytest.raises(ccfx.PartitionError, match=message):
        compiled(torch.randn(4, 16))


def test_stage_boundary_markers_and_split_points_do_not_mix():
    compiled, _ = compile_ccfx(Marked(), split_points=["layers.2"])
    with pytest.raises(ccfx.PartitionError, match="one or the other"):
        compiled(torch.randn(4, 16))


@pytest.mark.parametrize("balance", ["flops", "params", "memory"])
def test_every_balance_metric_partitions(balance):
    compiled, be = compile_ccfx(models.MLP(depth=8), stages=4, balance=balance)
    compiled(torch.randn(4, 32))
    assert be.plan.graphs[0].num_stages == 4
    assert be.plan.graphs[0].balance == balance
    assert be.plan.graphs[0].imbalance <= 1.10


def test_dynamic_shapes_keep_symbolic_costs():
    compiled, be = compile_ccfx(models.MLP(depth=4), stages=2, dynamic=True,
                                activation_codec="int8")
    compiled(torch.randn(5, 32))
    g = be.plan.graphs[0]
    assert g.symbolic
    edge = g.edges[0]
    assert edge.raw_bytes == 5 * 32 * 4
    assert "s" in edge.raw_bytes_expr  # e.g. "128*s77"
    assert edge.wire_bytes_fwd == 5 * 32 + 4 * 1
    assert "ceiling" in edge.wire_bytes_fwd_expr
    assert any(ch.isalpha() for ch in g.stages[0].cost_expr)
    # Another batch size reuses the graph; the ledger counts the real bytes.
    compiled(torch.randn(9, 32))
    entries = ccfx.ledger_of(compiled).entries()
    assert sum(e.raw_bytes for e in entries if e.direction == "fwd") == (5 + 9) * 32 * 4
