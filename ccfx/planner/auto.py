"""``auto``: per edge and direction (and per gradient bucket), the codec with the lowest
predicted step, or ``none`` where compression does not pay.

The search is coordinate descent over the cost model: start from the best uniform choice
(one codec everywhere it is a candidate, or everything uncompressed); for each edge and
direction in turn, predict the step with each candidate while the others stay as they are,
keep the fastest; two passes (a choice on one hop changes what is exposed on the others: on a
shared link, shrinking one tensor frees the link for the rest). A codec other than ``none`` is
taken only when it beats ``none`` by ``min_gain`` of the step, and the whole choice only if it
beats all-uncompressed by as much: a compressed tensor costs fidelity, and a gain inside the
model's error is no gain.

Every choice is a :class:`Decision` that keeps the predicted step of each candidate and a
sentence saying why the winner won; ``ccfx.explain(compiled)`` prints them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import codecs
from ..plan import Decision, Prediction
from .pipeline_model import PipelineModel, PipelinePrediction

DIRECTIONS = {"fwd": "forward", "bwd": "backward"}
#: (edge, "fwd" | "bwd") → candidate codec specs
Pool = Callable[..., Sequence[str]]


@dataclass
class PipelineDecisions:
    choice: dict[int, tuple[str, str]]
    decisions: list[Decision]
    uncompressed: PipelinePrediction
    chosen: PipelinePrediction
    #: The summary the plan keeps (set by whoever knows the link and the compute's source).
    prediction: Prediction | None = None


def choose_pipeline_codecs(model: PipelineModel, pool: Pool, *, min_gain: float = 0.02,
                           passes: int = 2,
                           steps_multiplier: Callable[[dict], float] | None = None,
                           ) -> PipelineDecisions:
    """The codec of every edge and direction of ``model``; ``pool(edge, "fwd" | "bwd")`` lists
    its candidates (one spec: fixed by the options, not searched).

    ``steps_multiplier(choice)``, when given (``objective="time_to_loss"``,
    :mod:`ccfx.planner.steps_model`), is how many more steps than uncompressed a choice needs
    to reach the loss target: candidates are then compared on T = multiplier × step, the time
    to the target, and every table holds T (uncompressed's multiplier is 1)."""
    def score(c) -> float:
        step = model.predict(c).step_s
        return step * steps_multiplier(c) if steps_multiplier is not None else step

    choice = {e.index: (pool(e, "fwd")[0], pool(e, "bwd")[0]) for e in model.edges}
    searched = [(e, d, _usable(pool(e, d), e.dtype)) for e in model.edges for d in ("fwd", "bwd")
                if len(pool(e, d)) > 1 and (d == "fwd" or e.requires_grad)]
    for e, d, _ in searched:
        choice[e.index] = _set(choice[e.index], d, "none")
    base = model.predict(choice)
    base_s = score(choice)
    start, start_s = _best_uniform(choice, searched, score, base_s)
    if start_s < base_s * (1 - min_gain):
        choice = start
    tables: dict[tuple[int, str], list[tuple[str, float]]] = {}
    for _ in range(passes):
        before = dict(choice)
        for e, d, specs in searched:
            table = []
            for spec in specs:
                trial = dict(choice)
                trial[e.index] = _set(trial[e.index], d, spec)
                table.append((spec, score(trial)))
            table.sort(key=lambda t: t[1])
            tables[(e.index, d)] = table
            current = choice[e.index][0 if d == "fwd" else 1]
            choice[e.index] = _set(choice[e.index], d, _winner(table, min_gain, current))
        if choice == before:  # a pass that changed nothing: another would repeat it exactly
            break
    if score(choice) >= base_s * (1 - min_gain):
        # all together the lossy codecs do not buy min_gain: send everything raw
        for e, d, _ in searched:
            choice[e.index] = _set(choice[e.index], d, "none")
    decisions = _edge_decisions(model, base, choice, tables, min_gain,
                                steps_multiplier is not None)
    return PipelineDecisions(choice, decisions, base, model.predict(choice))


def _best_uniform(choice: dict, searched: list, score: Callable[[dict], float],
                  base_s: float) -> tuple[dict, float]:
    """The best uniform choice (one codec wherever it is a candidate) and its score: on a
    link per direction the step waits for the slower one, so compressing one direction alone
    can look worthless when compressing both is not; the descent then refines edge by edge."""
    start, start_s = dict(choice), base_s
    for spec in {s for _, _, specs in searched for s in specs} - {"none"}:
        trial = dict(choice)
        for e, d, specs in searched:
            if spec in specs:
                trial[e.index] = _set(trial[e.index], d, spec)
        t = score(trial)
        if t < start_s:
            start, start_s = trial, t
    return start, start_s


def _edge_decisions(model: PipelineModel, base: PipelinePrediction, choice: dict, tables: dict,
                    min_gain: float, time_to_loss: bool) -> list[Decision]:
    """A decision per searched edge and direction: the chosen codec, its table, and why."""
    decisions = []
    for e in model.edges:
        for d in ("fwd", "bwd"):
            table = tables.get((e.index, d))
            if table is None:
                continue
            spec = choice[e.index][0 if d == "fwd" else 1]
            reason = _reason(model, base, e, d, spec, table, min_gain)
            if time_to_loss:
                reason += (" [time to loss: each figure is the steps multiplier x the "
                           "predicted step]")
            decisions.append(Decision(f"edge {e.index} {DIRECTIONS[d]}", spec, table, reason))
    return decisions


def _usable(specs: Sequence[str], dtype) -> list[str]:
    """``none`` first, then the candidates that apply to the tensor's dtype."""
    out = ["none"]
    for spec in specs:
        if spec not in out and codecs.get(spec).applies_to(dtype):
            out.append(spec)
    return out


def _set(pair: tuple[str, str], direction: str, spec: str) -> tuple[str, str]:
    return (spec, pair[1]) if direction == "fwd" else (pair[0], spec)


def _winner(table: list[tuple[str, float]], min_gain: float, current: str = "none") -> str:
    """The edge's codec: the best if it beats ``none`` on this edge by ``min_gain``; else the
    lossy codec the edge already has while it still beats ``none`` (one hop of many saves less
    than ``min_gain`` alone: the whole choice is held to ``min_gain`` at the end); else none."""
    times = dict(table)
    none_s = times["none"]
    best, best_s = table[0]
    if best != "none" and best_s < none_s * (1 - min_gain):
        return best
    if current != "none" and times.get(current, none_s) < none_s:
        return current
    return "none"


def _reason(model: PipelineModel, base: PipelinePrediction, edge, direction: str, spec: str,
            table: list[tuple[str, float]], min_gain: float) -> str:
    times = dict(table)
    none_s = times["none"]
    if spec != "none":
        gain = 1 - times[spec] / none_s
        others = [c for c, _ in table if c not in (spec, "none")]
        nxt = f"; next best {others[0]} ({times[others[0]]:.4g} s)" if others else ""
        return (f"{spec}: {none_s:.4g} s -> {times[spec]:.4g} s per step predicted "
                f"({gain:.0%} faster){nxt}")
    if len(table) == 1:
        return "no candidate codec applies to this tensor's dtype"
    hops = {a for a, _ in edge.hops}
    waited = sum(m.waited_s for m in base.timeline.messages
                 if m.message.kind == direction and m.message.hop in hops)
    best, best_s = next((c, s) for c, s in table if c != "none")
    if waited <= 0.01 * none_s:
        return (f"hidden behind compute: uncompressed, no rank ever waits for these messages, "
                f"so a codec only adds its encode and decode ({best}: {best_s:.4g} s vs "
                f"{none_s:.4g} s)")
    gain = 1 - best_s / none_s
    if gain <= 0:
        return (f"compression does not pay here: the best codec, {best}, predicts "
                f"{best_s:.4g} s against {none_s:.4g} s uncompressed (its encode and decode "
                "cost more than the wire time it saves)")
    return (f"the best codec, {best}, saves {gain:.1%} of the step ({best_s:.4g} s vs "
            f"{none_s:.4g} s), less than the {min_gain:.0%} a lossy codec must save")
