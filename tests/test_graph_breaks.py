"""`stages` across graph breaks: one set of stages for the model, small graphs left whole.

Dynamo hands ccfx a model with graph breaks one graph at a time, in execution order. Two
graphs are left whole (one stage, no cut, no codec, a note in the plan and one CcfxWarning
naming it): a graph that uses no parameters (pipeline stages exist to hold parameters: a
loss function, mask creation or input scaling before the model, wherever it comes, even
first), and a graph below ``partition.WHOLE_BELOW`` (1 %) of the model's FLOPs seen so far
(the distinct graphs compiled before it, plus its own). GPT-2's loss function (a graph of its
own: transformers logs a warning in it, which breaks the graph) and a mask built before the
model are the cases this is for.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn

import ccfx

from . import toy_models as models
from .util import compile_ccfx

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 128, 16, 2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    return model


def ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def ccfx_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ccfx.CcfxWarning)]


def test_gpt2_loss_graph_is_left_whole():
    compiled, backend = compile_ccfx(gpt2(), stages=2, activation_codec="int8")
    x = ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second call compiles nothing: no second warning
            compiled(input_ids=x, labels=x).loss.backward()
    plan = ccfx.plan_of(compiled)
    assert len(plan.graphs) == 2, str(plan)
    body, loss = plan.graphs
    # the model's main graph gets the stages asked for, with int8 on its cut edges
    assert body.num_stages == 2 and body.requested_stages == 2 and not body.left_whole
    assert body.edges and all(e.graph == 0 for e in plan.edges)
    assert {e.codec for e in body.edges if e.dtype == "torch.float32"} == {"int8"}
    # the loss graph: one stage, no cut edge, no codec op, and the plan says why
    assert loss.num_stages == 1 and loss.requested_stages == 2
    assert loss.edges == [] and len(loss.stages) == 1
    assert loss.left_whole.startswith("left whole")
    assert "uses no parameters" in loss.left_whole and "FLOP" in loss.left_whole
    assert loss.left_whole in loss.notes
    cut_ops = [n for n in backend.graphs[1].partitioned.graph.nodes
               if n.target is torch.ops.ccfx.cut.default]
    assert cut_ops == []
    text = str(plan)
    assert "graph 1: 1 stage(s) (asked 2)" in text
    assert "note: left whole (one stage, no cut, no codec)" in text
    # one CcfxWarning, naming the graph
    said = [m for m in ccfx_warnings(caught) if "left whole" in m]
    assert len(said) == 1 and said[0].startswith("ccfx: graph 1: left whole"), said
    # the ledger counts the main graph's edges only
    assert {c.graph for c in ccfx.ledger_of(compiled).entries()} == {0}
    # the reason survives JSON; a plan written before the field existed still reads
    again = ccfx.Plan.from_json(plan.to_json())
    assert again == plan and again.graphs[1].left_whole == loss.left_whole
    data = json.loads(plan.to_json())
    for g in data["graphs"]:
        del g["left_whole"]
    assert ccfx.Plan.from_json(json.dumps(data)).graphs[1].left_whole == ""


def test_gpt2_identity_codec_equals_eager_across_the_break():
    model = gpt2()
    ref = copy.deepcopy(model)
    compiled, _ = compile_ccfx(model, stages=2, activation_codec="none")
    x = ids()
    out, ref_out = compiled(input_ids=x, labels=x), ref(input_ids=x, labels=x)
    assert torch.equal(out.loss, ref_out.loss)
    assert torch.equal(out.logits, ref_out.logits)
    out.loss.backward()
    ref_out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    plan = ccfx.plan_of(compiled)
    assert [g.num_stages for g in plan.graphs] == [2, 1]


class TinyTail(nn.Module):
    """An MLP, a graph break, then a tail of a few FLOPs."""

    def __init__(self):
        super().__init__()
        self.body = models.MLP(32, 4)

    def forward(self, x):
        h = self.body(x)
        torch._dynamo.graph_break()
        return (h * 2 + 1).sum()


def test_a_few_flop_tail_is_never_a_stage():
    compiled, _ = compile_ccfx(TinyTail(), stages=2, activation_codec="int8")
    with pytest.warns(ccfx.CcfxWarning, match="graph 1: left whole"):
        compiled(torch.randn(4, 32)).backward()
    plan = ccfx.plan_of(compiled)
    assert [g.num_stages for g in plan.graphs] == [2, 1]
    assert plan.graphs[1].edges == [] and plan.graphs[1].left_whole


def test_equal_graphs_each_get_their_stages():
    # the graph_break golden's model: two halves of equal cost, neither is small
    compiled, _ = compile_ccfx(models.GraphBreak(width=16, depth=4), stages=2,
                               activation_codec="int8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(4, 16))
    plan = ccfx.plan_of(compiled)
    assert [g.num_stages for g in plan.graphs] == [2, 2]
    assert not any(g.left_whole for g in plan.graphs)
    assert not [m for m in ccfx_warnings(caught) if "left whole" in m]


def test_two_large_graphs_have_no_pipeline_on_real_ranks():
    """Simulated, each large graph keeps the stages asked (above); a pipeline on real ranks
    runs one graph's stages, so ``build_stages`` refuses several graphs, naming each graph's
    stages and the ways out (no process group needed: it refuses before any)."""
    compiled, _ = compile_ccfx(models.GraphBreak(width=16, depth=4), stages=2,
                               activation_codec="int8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(torch.randn(4, 16))
    with pytest.raises(ccfx.ConfigError) as e:
        ccfx.build_stages(compiled, 0, "cpu")
    text = str(e.value)
    assert "compiled to 2 graphs (graph breaks: graph 0: 2 stage(s); graph 1: 2 stage(s))" \
        in text, text
    assert "fullgraph=True" in text and "outside the compiled module" in text


def test_gpt2_with_its_loss_break_names_the_graph_left_whole_when_pipelined():
    compiled, _ = compile_ccfx(gpt2(), stages=2, activation_codec="int8")
    x = ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(input_ids=x, labels=x)
    with pytest.raises(ccfx.ConfigError, match=r"graph 1: 1 stage\(s\) \(left whole\)"):
        ccfx.build_stages(compiled, 0, "cpu")


def test_a_parameterless_prologue_is_left_whole():
    """The first graph cannot know what follows it (nothing bigger has been seen), but it holds
    no parameters: left whole, and the model's main graph after the break gets the stages."""
    compiled, backend = compile_ccfx(models.BreakThenMLP(depth=4), stages=2,
                                     activation_codec="int8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(4, 32)).sum().backward()
    plan = ccfx.plan_of(compiled)
    head, body = plan.graphs
    assert head.num_stages == 1 and head.requested_stages == 2 and head.edges == []
    assert "uses no parameters" in head.left_whole and head.left_whole in head.notes
    assert body.num_stages == 2 and not body.left_whole and body.edges
    said = [m for m in ccfx_warnings(caught) if "left whole" in m]
    assert len(said) == 1 and said[0].startswith("ccfx: graph 0: left whole"), said
    assert not [n for n in backend.graphs[0].partitioned.graph.nodes
                if n.target is torch.ops.ccfx.cut.default]


class MaskedGPT2(nn.Module):
    """GPT-2 behind a prologue of the kind that breaks a graph before the model: the padding
    mask built from the token ids, then a graph break (a data-dependent check, a log line)."""

    PAD = 0

    def __init__(self):
        super().__init__()
        self.gpt2 = gpt2()

    def forward(self, input_ids, labels):
        mask = (input_ids != self.PAD).long()
        torch._dynamo.graph_break()
        return self.gpt2(input_ids=input_ids, attention_mask=mask, labels=labels)


def test_hugging_face_model_behind_a_mask_prologue():
    """Three graphs: the mask (no parameters), GPT-2 (its stages), the loss (no parameters).
    Only the middle one is cut; with the identity codec the whole equals eager bit for bit."""
    model = MaskedGPT2()
    ref = copy.deepcopy(model)
    compiled, _ = compile_ccfx(model, stages=2, activation_codec="none")
    x = ids()
    x[0, -3:] = MaskedGPT2.PAD  # padded: the mask matters
    out, ref_out = compiled(x, x), ref(x, x)
    out.loss.backward()
    ref_out.loss.backward()
    plan = ccfx.plan_of(compiled)
    assert [g.num_stages for g in plan.graphs] == [1, 2, 1], str(plan)
    assert ["uses no parameters" in g.left_whole for g in plan.graphs] == [True, False, True]
    assert {e.graph for e in plan.edges} == {1}
    assert torch.equal(out.loss, ref_out.loss) and torch.equal(out.logits, ref_out.logits)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def test_partition_leaves_a_parameterless_graph_whole_whatever_its_flops():
    """In isolation: a graph with no parameters (a matmul of two inputs: FLOPs, no weights) is
    one stage even when it is the first graph and costs more than anything seen; explicit
    split points are obeyed."""
    from ccfx.passes.partition import partition, uses_parameters

    def f(a, b):
        return torch.relu(a @ b) @ b

    gm = _annotated(f, torch.randn(16, 16), torch.randn(16, 16))
    assert not uses_parameters(gm)
    facts = partition(gm, stages=2, flops_before=0).meta["ccfx"]["partition"]
    assert facts.num_stages == 1 and facts.cuts == ()
    assert "uses no parameters" in facts.left_whole and facts.left_whole in facts.notes
    with_params = _annotated(models.MLP(8, 4), torch.randn(2, 8))
    assert uses_parameters(with_params)
    assert partition(with_params, stages=2).meta["ccfx"]["partition"].num_stages == 2


def _annotated(model, *inputs):
    """Dynamo's graph of ``model`` (one, no break) with annotate's facts, not partitioned."""
    from ccfx.passes import annotate

    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    gm, example_inputs = captured[0]
    return annotate(gm, example_inputs=example_inputs)


def test_partition_rule_in_isolation():
    """``flops_before`` decides: below 1 % of the FLOPs seen so far, one stage; at or above,
    the stages asked; split points are always obeyed; with no FLOPs anywhere, nothing is
    left whole."""
    from ccfx.passes.graph_utils import module_paths
    from ccfx.passes.partition import WHOLE_BELOW, graph_flops, partition

    gm = _annotated(models.MLP(8, 4), torch.randn(2, 8))
    mine = graph_flops(gm)
    assert mine > 0 and WHOLE_BELOW == 0.01
    # 99 x its FLOPs before it: exactly 1 % of the model seen so far, worth its stages
    for before, stages in ((None, 2), (0, 2), (99 * mine, 2), (100 * mine, 1)):
        gm = _annotated(models.MLP(8, 4), torch.randn(2, 8))
        facts = partition(gm, stages=2, flops_before=before).meta["ccfx"]["partition"]
        assert facts.num_stages == stages and facts.requested == 2, (before, facts)
        assert bool(facts.left_whole) == (stages == 1)
        if stages == 1:
            assert facts.cuts == () and facts.left_whole in facts.notes
            assert f"{mine} FLOP" in facts.left_whole
    # stages=1 asked: nothing to leave whole, no note
    gm = _annotated(models.MLP(8, 4), torch.randn(2, 8))
    facts = partition(gm, stages=1, flops_before=10**9).meta["ccfx"]["partition"]
    assert facts.left_whole == "" and facts.notes == ()
    # explicit split points are obeyed whatever the share
    gm = _annotated(models.MLP(8, 4), torch.randn(2, 8))
    names = sorted({p for n in gm.graph.nodes for p in module_paths(n)})
    layer = next(p for p in names if p.endswith("layers.2"))
    facts = partition(gm, stages=2, split_points=[layer],
                      flops_before=10**9).meta["ccfx"]["partition"]
    assert facts.num_stages == 2 and not facts.left_whole
