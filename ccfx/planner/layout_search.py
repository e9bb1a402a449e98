"""The layout search: every pipeline × data (× tensor) layout of a cluster, priced by
:func:`~ccfx.planner.layout.predict_layout`, the ones that fit in memory ranked by their step.

What is enumerated (small on purpose: a 64-device cluster is a few hundred layouts):

* degrees ``pp × dp × tp = world``: ``pp`` up to the model's layers; ``tp`` 2, 4 or 8 and
  within a node, for a model that declares a tensor-parallel plan (``ModelFacts.tp_plan``), or
  with ``tensor_parallel=True`` (a plain transformer's Megatron plan is derived from its
  traced data flow, ``ModelFacts.derived_tp_plan``; the explanation says so, and says when
  a derived plan was not searched);
* microbatches ``pp``, ``2 pp``, ``4 pp``, ``8 pp`` (1 without a pipeline), those that split
  the batch evenly over the replicas;
* replicated or sharded data parallel (``ccfx.shard``; without a pipeline);
* where a layout does not fit, recomputation: the attention core (Megatron's selective
  recomputation: its quadratic activations dropped, its FLOPs run again), else every block
  (its whole forward again); tensor parallelism always with sequence parallelism
  (``Layout.sequence_parallel``: less memory for the same collective bytes);
* placement: every nesting of the non-trivial axes over the node-major device list (tensor
  parallel inside a node then pipeline across nodes, or data parallel across nodes, ...): the
  sensible rank orders, so the slow links carry the hops or groups that move the least;
* stage boundaries balanced by each stage's device speed (contiguous blocks, the slowest
  stage's time minimal);
* codecs per hop and direction, and per stage's gradient exchange, each chosen on *its* link
  among the codecs ``auto`` admits (``candidates``: within the measured loss budget), only
  where it saves ``auto_min_gain`` (10 %) of that transfer; for the ``top`` leaders the hop
  codecs are chosen again by ``auto``'s own descent on the simulated step
  (:func:`refine_codecs`), and the leaders re-ranked;
* local steps when exposed communication (hops and buckets) is over half the step of the best
  layout that syncs every step (a slow link dominates): the smallest H of 2 … 128 that brings the sync
  under a tenth of the step (their effect on the loss per step is not priced, so they never
  compete where every-step data parallel is fine).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ..config import Config
from .auto import choose_pipeline_codecs
from .candidates import candidates
from .cluster import Cluster
from .codec_cost import CodecTimer
from .layout import (
    AXES,
    Layout,
    LayoutPrediction,
    Links,
    default_timer,
    exchange_wire_s,
    predict_layout,
    step_lower_bound,
    steps_multiplier,
)
from .layout_result import ParallelPlan
from .model_facts import ModelFacts
from .pipeline_model import PipelineModel

MIN_GAIN = Config().auto_min_gain
LOCAL_H = (2, 4, 8, 16, 32, 64, 128)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def orders(pp: int, dp: int, tp: int) -> list[tuple[str, ...]]:
    """The distinct nestings: permutations of the axes whose degree is above 1 (the others
    change nothing)."""
    degree = {"tp": tp, "pp": pp, "dp": dp}
    live = [a for a in AXES if degree[a] > 1]
    rest = tuple(a for a in AXES if degree[a] == 1)
    return [tuple(p) + rest for p in itertools.permutations(live)] or [AXES]


def balance(flops: Sequence[float], rates: Sequence[float]) -> tuple[int, ...]:
    """First-layer indices of ``len(rates)`` contiguous stages over layers of ``flops``, the
    slowest stage's ``Σ flops / rate`` minimal (dynamic programming)."""
    n, k = len(flops), len(rates)
    prefix = [0.0]
    for f in flops:
        prefix.append(prefix[-1] + f)
    inf = float("inf")
    # best[j][i]: the slowest of the first j stages over the first i layers
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for p in range(j - 1, i):
                t = max(best[j - 1][p], (prefix[i] - prefix[p]) / rates[j - 1])
                if t < best[j][i]:
                    best[j][i], cut[j][i] = t, p
    bounds, i = [], n
    for j in range(k, 0, -1):
        i = cut[j][i]
        bounds.append(i)
    return tuple(reversed(bounds))


def make_layout(facts: ModelFacts, cluster: Cluster, pp: int, dp: int, *, tp: int = 1,
                microbatches: int | None = None, schedule: str = "1F1B",
                order: tuple[str, ...] = AXES, devices: Sequence[str] | None = None,
                activation_codec: str = "none", activation_grad_codec: str | None = None,
                gradient_codec: str = "none", sharded: bool = False,
                sync_every: int | None = None, outer_codec: str = "none") -> Layout:
    """A layout as a user (or a benchmark) fixes it, with the search's stage boundaries
    (balanced by the stages' device speed): ``devices`` each rank's device (default: ``order``
    over the node-major device list), one codec for every hop and one for every stage's
    gradients; then :func:`~ccfx.planner.layout.predict_layout` prices it."""
    m = microbatches or pp
    probe = Layout(pp, dp, tp, m, schedule, sharded, tuple(order), tuple(range(pp)),
                   devices=tuple(devices) if devices is not None else None)
    where = probe.placement(cluster)
    rates = [min(cluster.rate(where[probe.rank(s, d, t)]) for d in range(dp)
                 for t in range(tp)) for s in range(pp)]
    bwd = activation_grad_codec or activation_codec
    return replace(probe, boundaries=balance([x.flops for x in facts.layers], rates),
                   hop_codecs=((activation_codec, bwd),) * (pp - 1),
                   gradient_codecs=(gradient_codec,) * pp, sync_every=sync_every,
                   outer_codec=outer_codec)


def _pick(costs: dict[str, float]) -> str:
    """The cheapest codec if it beats ``none`` by ``MIN_GAIN``, else ``none``."""
    best = min(costs, key=costs.get)
    return best if best != "none" and costs[best] < costs["none"] * (1 - MIN_GAIN) else "none"


def choose_codecs(facts: ModelFacts, layout: Layout, base: LayoutPrediction,
                  timer: CodecTimer, config: Config) -> Layout:
    """Per hop and direction, per stage's gradient exchange: the codec with the least exposed
    time on that hop's or group's link, its codec work included (``base``: the layout priced
    uncompressed, whose links and slowest stage these are)."""
    samples = facts.batch // (layout.dp * layout.microbatches)
    m = layout.microbatches
    # the slowest stage's work per microbatch: what a transfer hides behind
    period = (base.compute_s + base.collectives_s) / m
    hops = []
    for h, link in enumerate(base.hop_links):
        last = layout.boundaries[h + 1] - 1
        shape = facts.cut_shape(last, samples)
        dtype = getattr(torch, facts.layers[last].out_dtype)
        pair = []
        for role in ("activation", "activation_grad"):
            costs = {}
            for spec in candidates(role, config):
                c = timer.cost(spec, shape, dtype)
                wire = link.seconds(c.wire_bytes)
                # exposed once in the fill or drain, and every microbatch where the transfer
                # outlasts the slowest stage; the codec's work on the stages every microbatch
                costs[spec] = (wire + (m - 1) * max(0.0, wire - period)
                               + m * (c.encode_s + c.decode_s))
            pair.append(_pick(costs))
        hops.append(tuple(pair))
    grads = []
    for s, (lo, hi) in enumerate(layout.stage_layers(facts.num_layers)):
        link = base.dp_links[s] if s < len(base.dp_links) else None
        if link is None or layout.sharded:
            grads.append("none")
            continue
        stage = facts.stage(lo, hi)
        numel = max(1, stage.param_numel // layout.tp)
        flows = base.dp_flows[s] if s < len(base.dp_flows) else 1
        costs = {}
        for spec in candidates("gradient", config):
            c = timer.cost(spec, (numel,), getattr(torch, stage.grad_dtype))
            costs[spec] = (exchange_wire_s(spec, c.wire_bytes, layout.dp, link, flows)
                           + c.encode_s + c.decode_s)
        grads.append(_pick(costs))
    return replace(layout, hop_codecs=tuple(hops), gradient_codecs=tuple(grads))


def search(facts: ModelFacts, cluster: Cluster, *, top: int = 5, timer: CodecTimer | None = None,
           microbatches: Sequence[int] | None = None, schedule: str = "1F1B",
           tensor_parallel: bool | None = None, config: Config | None = None,
           target_steps: int | None = None, local_steps: bool | None = None,
           recompute: bool | None = None, prune: bool = True,
           progress: Callable[[str], None] | None = None) -> ParallelPlan:
    """Every layout (the module's docstring), priced; the fitting ones ranked by step.
    ``microbatches``: the counts to try (default ``pp``, ``2 pp``, ``4 pp``, ``8 pp``);
    ``tensor_parallel``: None (only for a model with a TP plan), True or False;
    ``local_steps``: None (local-step variants compete only where exposed communication is
    over half of the best every-step layout's step: their loss per step is not priced),
    True (always) or False (never); ``recompute``: None (only where the layout does not fit
    without: the attention core, Megatron's selective recomputation, else each block where
    that does not fit either), True (every policy everywhere) or False (never); ``prune``:
    skip simulating a layout whose lower bound already loses to the ``top`` fitting (3
    refused) layouts found (the answer and the listed layouts do not change; ``ranked`` then
    holds the simulated ones only); ``progress``: called with a line every few seconds."""
    t0 = time.perf_counter()
    timer = timer or default_timer(cluster, facts)
    config = config or Config()
    links = Links(cluster)
    skipped: list[str] = []
    meter = _Progress(progress, t0)
    quick = _quick_prices(facts, cluster, timer, links, config, schedule, microbatches,
                          tensor_parallel, recompute, skipped, meter)
    priced, variants, pruned = _simulate(facts, cluster, quick, timer, links, local_steps,
                                         top if prune and not target_steps else None, meter)
    notes = _tp_notes(facts, cluster, tensor_parallel) + \
        _admit_local_steps(priced, variants, local_steps)

    # with a target, the score is the time to it: steps × multiplier × step
    def score(p: LayoutPrediction) -> float:
        return p.step_s * (steps_multiplier(p.layout) if target_steps else 1.0)

    # the leaders' hop codecs chosen again by ``auto``'s own descent on the simulated step
    fitting = sorted((p for p in priced if p.fits), key=score)
    meter.say(f"refining the codecs of the {min(top, len(fitting))} fastest", force=True)
    for i, p in enumerate(fitting[:top]):
        better = refine_codecs(facts, cluster, p, timer, links, config, bool(target_steps))
        meter.say(f"refined {i + 1} of {min(top, len(fitting))}")
        if better is not p:
            priced[priced.index(p)] = better
    fitting = sorted((p for p in priced if p.fits), key=score)
    refused = sorted((p for p in priced if not p.fits), key=score)
    return ParallelPlan(fitting, refused, skipped, facts, cluster, top,
                        time.perf_counter() - t0, target_steps, notes, pruned)


class _Progress:
    """Lines for ``progress`` at most every ``every`` seconds: layouts priced and pruned."""

    def __init__(self, out: Callable[[str], None] | None, t0: float, every: float = 3.0):
        self.out, self.t0, self.every, self.last = out, t0, every, t0

    def say(self, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if self.out is not None and (force or now - self.last >= self.every):
            self.last = now
            self.out(f"plan_parallel: {text} ({now - self.t0:.0f} s)")


def _quick_prices(facts, cluster, timer, links, config, schedule, microbatches,
                  tensor_parallel, recompute, skipped, meter) -> list[LayoutPrediction]:
    """Every layout with its codecs chosen, priced without the pipeline simulation (memory
    exact, the step's lower bound exact): the candidates :func:`_simulate` simulates. One
    that does not fit is priced again with recomputation, the cheaper policy first
    (:func:`_recomputed`)."""
    quick: list[LayoutPrediction] = []
    # selective recomputation saves nothing in a model without an attention core
    policies = ("selective", "block") if any(x.attn_core_saved_bytes for x in facts.layers) \
        else ("block",)
    for pp, dp, tp, counts in _degrees(facts, cluster, tensor_parallel, microbatches, skipped):
        for order in orders(pp, dp, tp):
            probe = Layout(pp, dp, tp, counts[0], schedule, order=order,
                           boundaries=tuple(range(pp)))
            bounds = _balanced(facts, cluster, probe)
            for m in counts:
                for sharded in ([False, True] if pp == 1 and dp > 1 else [False]):
                    layout = Layout(pp, dp, tp, m, schedule, sharded, order, bounds)
                    q = _quick(facts, cluster, layout, timer, links, config)
                    quick.append(q)
                    if recompute or (recompute is None and not q.fits):
                        quick += _recomputed(facts, cluster, layout, timer, links, config,
                                             policies, every=bool(recompute))
            meter.say(f"{len(quick)} layouts laid out")
    return quick


def _recomputed(facts, cluster, layout, timer, links, config, policies,
                every: bool) -> list[LayoutPrediction]:
    """``layout`` priced with each recomputation policy in ``policies`` (cheapest first):
    ``every``, all of them; else up to the first that fits, none where none fits (their
    refusal says nothing new). Selective recomputation runs only the attention core again,
    so it is tried before every block."""
    out = []
    for policy in policies:
        again = _quick(facts, cluster, replace(layout, recompute=policy), timer, links,
                       config, fitting=not every)
        if every or again.fits:
            out.append(again)
            if not every:
                break
    return out


def _balanced(facts: ModelFacts, cluster: Cluster, probe: Layout) -> tuple[int, ...]:
    """Stage boundaries of ``probe``'s degrees and order, balanced by each stage's slowest
    device."""
    pp, dp, tp = probe.pp, probe.dp, probe.tp
    where = probe.placement(cluster)
    rates = [min(cluster.rate(where[probe.rank(s, d, t)]) for d in range(dp)
                 for t in range(tp)) for s in range(pp)]
    return balance([x.flops for x in facts.layers], rates)


def _quick(facts, cluster, layout, timer, links, config,
           fitting: bool = False) -> LayoutPrediction:
    """``layout`` with its codecs chosen (:func:`choose_codecs`), priced without a
    simulation; ``fitting``: uncompressed where that does not fit (codecs only add memory,
    their buffers and payloads: with them it does not fit either)."""
    base = predict_layout(facts, cluster, layout, timer=timer, links=links, simulate=False)
    if fitting and not base.fits:
        return base
    layout = choose_codecs(facts, layout, base, timer, config)
    return predict_layout(facts, cluster, layout, timer=timer, links=links, simulate=False)


def _simulate(facts, cluster, quick: list[LayoutPrediction], timer, links, local_steps,
              keep: int | None, meter: _Progress):
    """The candidates simulated, lowest bound first; with ``keep``, one whose bound is above
    the ``keep``-th fastest fitting step found (3rd refused, as the explanation lists them) is
    pruned. (priced in the candidates' order, local-step variants, pruned)."""
    done: dict[int, LayoutPrediction] = {}
    variants: list[LayoutPrediction] = []
    pruned: list[LayoutPrediction] = []
    best: dict[bool, list[float]] = {True: [], False: []}  # fits -> the fastest steps
    for i in sorted(range(len(quick)), key=lambda i: quick[i].lower_bound_s):
        q = quick[i]
        leaders = best[q.fits]
        enough = keep if q.fits else 3
        if keep is not None and len(leaders) >= enough and \
                q.lower_bound_s > leaders[enough - 1]:
            pruned.append(q)
            continue
        pred = predict_layout(facts, cluster, q.layout, timer=timer, links=links)
        done[i] = pred
        bisect.insort(leaders, pred.step_s)
        if local_steps is not False:
            local = _local_steps(facts, cluster, pred, timer, links)
            if local is not None:
                variants.append(local)
        meter.say(f"{len(done) + len(pruned)}/{len(quick)} layouts: {len(done)} simulated, "
                  f"{len(pruned)} pruned")
    return [done[i] for i in sorted(done)], variants, pruned


def _degrees(facts: ModelFacts, cluster: Cluster, tensor_parallel: bool | None,
             microbatches: Sequence[int] | None, skipped: list[str]):
    """Each (pp, dp, tp, microbatch counts) the search prices; why each other pp is skipped
    goes into ``skipped`` (more stages than layers, no count that splits the batch)."""
    world = cluster.world
    per_node = min(len(v) for v in cluster.by_node().values())
    allow_tp = facts.tp_plan is not None if tensor_parallel is None else tensor_parallel
    tps = [1] + [t for t in (2, 4, 8) if allow_tp and world % t == 0 and per_node % t == 0]
    for tp in tps:
        for pp in divisors(world // tp):
            if pp > facts.num_layers:
                skipped.append(f"pp={pp}: more stages than the model's {facts.num_layers} "
                               "layers")
                continue
            dp = world // (tp * pp)
            counts = [1] if pp == 1 else [k * pp for k in (1, 2, 4, 8)]
            if microbatches is not None:
                counts = [c for c in microbatches if c >= pp or pp == 1]
            counts = [c for c in counts if facts.batch % (dp * c) == 0]
            if not counts:
                skipped.append(f"pp={pp} dp={dp} tp={tp}: no microbatch count splits the batch "
                               f"of {facts.batch} over {dp} replicas")
                continue
            yield pp, dp, tp, counts


def _tp_notes(facts: ModelFacts, cluster: Cluster, tensor_parallel: bool | None) -> list[str]:
    """What the search assumed of tensor parallelism, where a node could hold it."""
    per_node = min(len(v) for v in cluster.by_node().values())
    if per_node < 2 or tensor_parallel is False:
        return []
    derived = facts.derived_tp_plan
    plan = ", ".join(f"{k} {v}" for k, v in derived or ())
    if facts.tp_plan is not None:
        return ["tensor parallel searched with the model's declared plan"]
    if tensor_parallel and derived:
        return [(f"tensor parallel searched with the Megatron plan derived from the first "
                f"block's data flow: {plan}")]
    if tensor_parallel:
        return [("tensor parallel priced as if every block split (no Megatron pairing of "
                "column- and row-parallel linears was found in the first block)")]
    if derived:
        note = (f"tensor parallel not searched: the model declares no plan; the Megatron plan "
                f"derived from its first block ({plan}) would apply: pass "
                "tensor_parallel=True to search it")
        return [note]
    return []


def _admit_local_steps(priced: list[LayoutPrediction], variants: list[LayoutPrediction],
                       local_steps: bool | None) -> list[str]:
    """Add the local-step variants to ``priced`` where asked or where communication is over
    half the best every-step layout's step (their loss per step cannot be priced); the
    notes that say which."""
    notes = []
    if not variants:
        return notes
    fitting = sorted((p for p in priced if p.fits), key=lambda p: p.step_s)
    # local steps change the training (a loss per step the planner cannot price): they
    # compete only where the slow link dominates even the best every-step layout
    comm = (fitting[0].hops_s + fitting[0].buckets_s) / fitting[0].step_s if fitting \
        else 1.0
    dominated = comm > 0.5
    if local_steps or dominated:
        priced += variants
        notes.append(f"local steps considered: communication is {comm:.0%} of the best "
                     "every-step layout's step" if dominated else
                     "local steps considered (asked for)")
    else:
        notes.append(f"local steps not considered: communication is {comm:.0%} of the "
                     "best every-step layout's step (under half)")
    return notes


def refine_codecs(facts: ModelFacts, cluster: Cluster, pred: LayoutPrediction,
                  timer: CodecTimer, links: Links, config: Config,
                  to_target: bool = False) -> LayoutPrediction:
    """``pred``'s layout with its hop codecs chosen by ``auto``'s coordinate descent
    (:func:`ccfx.planner.auto.choose_pipeline_codecs`: the best uniform start, then hop by hop
    and direction, on the simulated step, or on steps × step with ``to_target``); ``pred``
    itself where that is not faster. Where the uncompressed step is already within
    ``MIN_GAIN`` of the step's lower bound no codec can win its place, so the descent's
    answer (every hop uncompressed) is taken without running it."""
    if pred.pipeline is None or pred.layout.sync_every:
        return pred
    compute, edges, hop_links = pred.pipeline
    lay = pred.layout
    model = PipelineModel(compute, edges, list(hop_links), schedule=lay.schedule,
                          microbatches=lay.microbatches, timer=timer)
    bound = step_lower_bound([c.forward_s for c in compute], [c.backward_s for c in compute],
                             [0.0] * len(compute), lay.microbatches)
    if model.predict({}).step_s * (1 - MIN_GAIN) <= bound:
        hops = (("none", "none"),) * (lay.pp - 1)
    else:
        hops = _descend(model, edges, lay, config, to_target)
    if hops == tuple(lay.hop_codecs):
        return pred
    again = predict_layout(facts, cluster, replace(lay, hop_codecs=hops), timer=timer,
                           links=links)
    return again if again.step_s < pred.step_s or to_target else pred


def _descend(model: PipelineModel, edges, lay: Layout, config: Config,
             to_target: bool) -> tuple[tuple[str, str], ...]:
    """The hop codecs ``auto``'s coordinate descent chooses on ``model``."""
    roles = {"fwd": candidates("activation", config),
             "bwd": candidates("activation_grad", config)}
    multiplier = None
    if to_target:
        from ..steps_table import DEFAULT
        from .steps_model import StepsModel

        multiplier = StepsModel(DEFAULT, edges)
    chosen = choose_pipeline_codecs(model, lambda e, d: roles[d], min_gain=MIN_GAIN,
                                    steps_multiplier=multiplier).choice
    return tuple(tuple(chosen.get(h, ("none", "none"))) for h in range(lay.pp - 1))


def _local_steps(facts, cluster, pred: LayoutPrediction, timer, links) -> LayoutPrediction | None:
    """Where the data-parallel exchange is over half the step: the layout with local steps
    (the smallest H whose sync costs under a tenth of the step), else None."""
    layout = pred.layout
    if layout.dp == 1 or layout.sharded or pred.buckets_s <= 0.5 * pred.step_s:
        return None
    best = None
    outer = "bf16" if "bf16" in candidates("gradient", Config()) else "none"
    for h in LOCAL_H:
        trial = replace(layout, sync_every=h, outer_codec=outer,
                        gradient_codecs=("none",) * layout.pp)
        best = predict_layout(facts, cluster, trial, timer=timer, links=links)
        if best.syncs_s < 0.1 * best.step_s:
            break
    return best

