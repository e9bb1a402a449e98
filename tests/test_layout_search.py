"""The layout search at scale (issue 38): pruning by the step's lower bound never changes the
answer, the event-skipping simulator runs the plain loop's timeline, the refinement's
shortcut takes the descent's own answer, activation recomputation (the attention core, or
every block) fits what does not fit without it, and tensor parallelism without sequence
parallelism keeps the norms' activations whole. Single process, small models traced on fake
tensors, codec work at a fixed rate (the same answer on any machine at any load)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import ccfx
from ccfx.backends.plan_parallel import model_facts
from ccfx.cluster_spec import Link
from ccfx.errors import ConfigError
from ccfx.models.tiny_gpt import GPTConfig, TinyGPT
from ccfx.planner import schedule
from ccfx.planner.codec_cost import CodecTimer
from ccfx.planner.layout import Layout, predict_layout, step_lower_bound
from ccfx.planner.layout_search import make_layout, search
from ccfx.planner.memory_model import recompute_bytes
from ccfx.wire.schedules import PROGRAMS, StageCost

from .toy_models import tiny_gpt

TIMER = CodecTimer(throughput=1e10)


def gpt(n_embd: int = 128, batch: int = 32, n_layer: int = 6):
    """The facts of toy_models' GPT, larger by default than test_layout_planner's."""
    return model_facts(*tiny_gpt(n_embd, batch, n_layer))


def math_gpt(seq: int = 128, batch: int = 32, n_layer: int = 4):
    """The facts of a GPT (width 64, 4 heads) whose attention runs torch's math path: the
    (T, T) softmax saved per layer, as a model without a fused kernel keeps it."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=96, block_size=seq, n_layer=n_layer, n_head=4,
                              n_embd=64))
    idx = torch.randint(0, 96, (batch, seq))
    with sdpa_kernel(SDPBackend.MATH):
        return model_facts(model, (idx, idx))


def nodes(n: int, per: int, inter_gbps: float, memory="16GiB"):
    return ccfx.Cluster.nodes(n, per, intra=(100, 0.01), inter=(inter_gbps, 1), memory=memory,
                              flops=1e12)


def summary(plan):
    """What a user sees: the chosen layout, the listed runners-up and refused, their steps."""
    return ([(p.layout, p.step_s) for p in plan.ranked[:plan.top]],
            [(p.layout, p.step_s) for p in plan.refused[:3]])


@pytest.mark.parametrize("facts_args", [(128, 32, 6), (64, 512, 4)])
@pytest.mark.parametrize("shape", [(2, 2, 0.1), (2, 4, 1.0), (4, 2, 0.05)])
def test_pruning_never_changes_the_answer(facts_args, shape):
    facts = gpt(*facts_args)
    cluster = nodes(*shape)
    for top in (1, 3):
        full = search(facts, cluster, timer=TIMER, top=top, prune=False)
        fast = search(facts, cluster, timer=TIMER, top=top)
        assert summary(fast) == summary(full)
        assert not full.pruned
        assert len(fast.ranked) + len(fast.refused) + len(fast.pruned) == \
            len(full.ranked) + len(full.refused)
        # what was pruned could not have been listed: its bound is above the last listed
        listed = full.ranked[:top]
        for p in fast.pruned:
            if p.fits and len(listed) == top:
                assert p.lower_bound_s > listed[-1].step_s


def test_the_step_is_never_below_its_lower_bound():
    facts = gpt(128, 32, 6)
    plan = search(facts, nodes(2, 4, 0.1), timer=TIMER, prune=False, local_steps=False)
    for p in plan.ranked + plan.refused:
        assert p.lower_bound_s <= p.step_s * (1 + 1e-12), p.layout.describe()
    # alike stages, instant links: the bound is 1F1B's (m + pp - 1) (f + b)
    assert step_lower_bound([1.0] * 4, [2.0] * 4, [0.0] * 4, 8) == pytest.approx(11 * 3.0)


def _plain_loop(programs, nbytes, links):
    """The simulator's loop before issue 38 (every runnable rank asked in clock order each
    step): the oracle the event-skipping loop must match to the last bit."""
    sim = schedule._Simulation(programs, nbytes, links)
    n = len(programs)
    while True:
        runnable = [r for r in range(n) if sim.pc[r] < len(programs[r])]
        if not runnable:
            break
        if not any(sim.advance(r) for r in sorted(runnable, key=lambda r: sim.clock[r])):
            sim.schedule_ready(sim.pending[0][0])
    return schedule.Timeline(max(sim.clock), sim.compute, sim.waited,
                             sorted(sim.times.values(), key=lambda t: t.start_s),
                             list(sim.clock))


def test_the_simulator_runs_the_plain_loops_timeline():
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(2, 8)
        m = rng.randint(n, 3 * n)
        sched = rng.choice(["1F1B", "GPipe"])
        stages = [StageCost(*(rng.uniform(0.001, 0.03) for _ in range(2)),
                            *(rng.uniform(0, 0.003) for _ in range(4))) for _ in range(n)]
        kinds = [Link(rng.choice([0.05, 1, 100]), rng.choice([0, 0.02, 1]),
                      shared=rng.random() < 0.3, rendezvous=rng.random() < 0.3,
                      buffered_sends=rng.random() < 0.6) for _ in range(3)]
        links = [rng.choice(kinds) for _ in range(n - 1)]
        size = {h: rng.choice([1 << 10, 1 << 20, 1 << 24]) for h in range(n)}

        def nbytes(msg, size=size):
            return size[msg.hop] // (2 if msg.kind == "bwd" else 1)

        programs = [PROGRAMS[sched](s, n, m, stages[s]) for s in range(n)]
        want = _plain_loop(programs, nbytes, links)
        got = schedule._run(programs, nbytes, links)
        assert (got.step_s, got.end_s, got.wait_s) == (want.step_s, want.end_s, want.wait_s)
        assert [(t.message, t.start_s, t.done_s, t.waited_s) for t in got.messages] == \
            [(t.message, t.start_s, t.done_s, t.waited_s) for t in want.messages]


def test_refinement_shortcut_is_the_descents_answer():
    from ccfx.planner.layout import Links
    from ccfx.planner.layout_search import _descend
    from ccfx.planner.pipeline_model import PipelineModel

    facts = gpt(128, 32, 6)
    # slow devices on fast links: the uncompressed step is at its bound
    cluster = ccfx.Cluster.nodes(2, 2, intra=(100, 0.01), inter=(100, 0.01), memory="16GiB",
                                 flops=1e10)
    layout = make_layout(facts, cluster, 4, 1, microbatches=8)
    pred = predict_layout(facts, cluster, layout, timer=TIMER, links=Links(cluster))
    compute, edges, hop_links = pred.pipeline
    model = PipelineModel(compute, edges, list(hop_links), microbatches=8, timer=TIMER)
    bound = step_lower_bound([c.forward_s for c in compute], [c.backward_s for c in compute],
                             [0.0] * 4, 8)
    assert model.predict({}).step_s * 0.9 <= bound  # where the shortcut applies
    assert _descend(model, edges, layout, ccfx.Config(), False) == (("none", "none"),) * 3


def test_recompute_costs_one_more_forward_and_keeps_the_block_inputs():
    facts = gpt(128, 32, 6)
    cluster = nodes(2, 2, 100)
    layout = make_layout(facts, cluster, 2, 2, microbatches=4)
    plain = predict_layout(facts, cluster, layout, timer=TIMER)
    again = predict_layout(facts, cluster, replace(layout, recompute="block"), timer=TIMER)
    # the backward runs the forward again: compute goes from f + 2f to f + 3f (FLOP-priced)
    assert again.compute_s == pytest.approx(plain.compute_s * 4 / 3)
    assert again.step_s > plain.step_s
    for s, (lo, hi) in enumerate(layout.stage_layers(facts.num_layers)):
        kept, block, block_tp = recompute_bytes(facts, lo, hi)
        assert kept < facts.stage(lo, hi).saved_bytes and 0 < block_tp < block
        assert again.memory[s].activations < plain.memory[s].activations
    assert "recompute=block" in replace(layout, recompute="block").describe()


def test_recompute_fits_what_does_not_fit_without():
    facts = gpt(128, 256, 6)
    roomy = search(facts, nodes(2, 2, 100), timer=TIMER)
    assert roomy.layout.recompute == "none"  # never where the plain layout fits: slower
    assert all(p.layout.recompute == "none" for p in roomy.ranked)
    # a device too small for any layout's activations, big enough for the blocks' inputs
    cap = int(0.9 * min(p.peak_memory_bytes for p in roomy.ranked + roomy.refused) / 0.8)
    small = search(facts, nodes(2, 2, 100, memory=cap), timer=TIMER)
    assert small.layout.recompute == "block", small.explain()
    assert all(p.layout.recompute == "none" for p in small.refused)
    text = small.explain()
    assert "recompute=block" in text and "torch.utils.checkpoint" in text
    assert "refused (" in text and "above 80% of its" in text
    with pytest.raises(ConfigError, match="no layout fits"):
        search(facts, nodes(2, 2, 100, memory=int(0.01 * 2 ** 30)), timer=TIMER)


def test_a_recompute_policy_the_search_does_not_know_is_refused():
    with pytest.raises(ConfigError, match="recompute 'full': use one of "
                                          r"\('none', 'selective', 'block'\)"):
        Layout(1, 4, recompute="full")


def test_selective_recompute_drops_the_attention_core_and_runs_its_flops_again():
    facts = math_gpt()
    cluster = nodes(2, 2, 100)
    layout = make_layout(facts, cluster, 1, 4)  # a quarter of the batch per device
    plain, selective, block = (predict_layout(facts, cluster, replace(layout, recompute=r),
                                              timer=TIMER)
                               for r in ("none", "selective", "block"))
    core = sum(x.attn_core_saved_bytes for x in facts.layers)
    # per layer the (T, T) softmax, B x heads x T x T float32: a third of what it saves
    assert core == 4 * 32 * 4 * 128 * 128 * 4
    assert plain.memory[0].activations - selective.memory[0].activations == core // 4
    assert block.memory[0].activations < selective.memory[0].activations
    # rebuilt one layer at a time in the backward
    assert selective.memory[0].transient - plain.memory[0].transient == core // 4 // 4
    # the backward runs the core's FLOPs again (at 1e12 FLOP/s): between none and block
    flops = sum(x.attn_core_flops for x in facts.layers) / 4
    assert selective.compute_s == pytest.approx(plain.compute_s + flops / 1e12)
    assert plain.compute_s < selective.compute_s < block.compute_s
    assert "recompute=selective" in selective.layout.describe()


def test_the_search_recomputes_the_attention_core_before_every_block():
    facts = math_gpt()
    roomy = search(facts, nodes(2, 2, 100), timer=TIMER)
    assert roomy.layout.recompute == "none"
    # too small for any layout's plain activations, big enough without the softmax
    cap = int(0.95 * min(p.peak_memory_bytes for p in roomy.ranked + roomy.refused) / 0.8)
    small = search(facts, nodes(2, 2, 100, memory=cap), timer=TIMER)
    assert small.layout.recompute == "selective", small.explain()
    # where the core is enough, every block is not priced: it would only be slower

    def degrees(p):
        lay = p.layout
        return lay.pp, lay.dp, lay.tp, lay.microbatches, lay.sharded, lay.order

    priced = small.ranked + small.pruned
    core_fits = {degrees(p) for p in priced if p.layout.recompute == "selective"}
    blocks = {degrees(p) for p in priced if p.layout.recompute == "block"}
    assert core_fits and not core_fits & blocks
    text = small.explain()
    assert "recompute the attention core" in text
    assert "create_selective_checkpoint_contexts" in text
    # weighing every policy everywhere: the core still beats every block where both fit
    both = search(facts, nodes(2, 2, 100, memory=cap), timer=TIMER, recompute=True)
    assert both.layout == small.layout
    assert any(p.layout.recompute == "block" for p in both.ranked + both.pruned)


def test_tensor_parallel_without_sequence_parallel_keeps_the_norms_inputs_whole():
    facts = gpt(128, 32, 6)
    cluster = nodes(2, 2, 100)
    sp = make_layout(facts, cluster, 1, 2, tp=2)
    no_sp = replace(sp, sequence_parallel=False)
    with_sp, without = (predict_layout(facts, cluster, x, timer=TIMER) for x in (sp, no_sp))
    # the share outside Megatron's TP span (norms' inputs, residual stream, embeddings, the
    # head's logits) is whole on each TP rank: (saved - tp_saved) x (1 - 1/tp) x held x the
    # microbatch's share of the traced batch (one microbatch of 16 of the 32 samples)
    outside = sum(x.saved_bytes - x.tp_saved_bytes for x in facts.layers)
    assert without.memory[0].activations - with_sp.memory[0].activations == \
        outside * (1 - 1 / 2) * 1 * 16 // 32
    assert without.peak_memory_bytes > with_sp.peak_memory_bytes
    # the collectives move the same bytes: the step is the same
    assert without.step_s == with_sp.step_s
    assert "tp=2 sp=off" in no_sp.describe() and "sp=" not in sp.describe()
    assert "sp=" not in Layout(1, 4, sequence_parallel=False).describe()  # no TP: ignored
    with pytest.raises(ConfigError, match="sequence_parallel is 'no'"):
        Layout(1, 2, tp=2, sequence_parallel="no")


def test_recomputed_blocks_keep_their_inputs_split_only_with_sequence_parallel():
    facts = gpt(128, 32, 6)
    cluster = nodes(2, 2, 100)
    sp = make_layout(facts, cluster, 1, 2, tp=2)
    sp = replace(sp, recompute="block")
    with_sp, without = (predict_layout(facts, cluster, x, timer=TIMER)
                        for x in (sp, replace(sp, sequence_parallel=False)))
    kept, block, block_tp = recompute_bytes(facts, 0, facts.num_layers)
    assert with_sp.memory[0].activations == kept // 2 // 2  # half the batch, half per rank
    assert without.memory[0].activations == kept // 2
    # the block rebuilt in the backward: its TP span split, the rest whole
    assert without.memory[0].transient - with_sp.memory[0].transient == \
        (block - block_tp) // 2 - (block - block_tp) // 2 // 2


def test_a_long_search_reports_progress():
    lines: list[str] = []
    search(gpt(128, 32, 6), nodes(2, 2, 0.1), timer=TIMER, progress=lines.append)
    assert lines and all(x.startswith("plan_parallel: ") for x in lines)
    assert any("refining the codecs" in x for x in lines)
