"""``ccfx.explain(compiled)``: what ``auto`` chose, the predicted step of every candidate, and
why the winner won, as text (the HTML report draws the same facts)."""

from __future__ import annotations

from .. import codecs
from ..plan import GraphPlan, Plan
from .candidates import MEASURED

#: the role of a codec in the plan -> how the explanation names it
ROLES = {"activation": "activations (forward)", "activation_grad": "activation gradients",
         "gradient": "gradient buckets"}


def explain_plan(plan: Plan) -> str:
    out = []
    for g in plan.graphs:
        out += _graph(g, plan)
    collectives = _collectives(plan)
    if not out and not collectives:
        out = [("ccfx explain: nothing was chosen by the planner (no option is 'auto'); "
               "set activation_codec, activation_grad_codec, gradient_codec or collective_codec "
               "to 'auto'")]
    return "\n".join(out + collectives + measured_loss_costs(plan))


def _collectives(plan: Plan) -> list[str]:
    """The compiled graphs' collectives: the codec each one got (from the options,
    ``collective_codec`` and ``collective_overrides``, or priced by ``auto``: its decision
    follows with the graph's) and why one runs unchanged."""
    rows = plan.collectives
    if not rows:
        return []
    done = [c for c in rows if c.codec != "none"]
    per_call = [c for c in rows if not getattr(c, "per_row", False)]  # per row: not summed
    raw, wire = sum(c.raw_bytes for c in per_call), sum(c.wire_bytes for c in per_call)
    out = [(f"collectives: {len(done)} of {len(rows)} compressed (collective_codec, "
            f"collective_overrides; 'auto' ones are priced below with the graph's decisions), "
            f"{raw} B raw -> {wire} B on the wire per call of each graph")]
    for c in rows:
        what = (f"{codecs.spelled(c.codec)}, {c.raw_bytes} -> {c.wire_bytes} B"
                + (" per row" if getattr(c, "per_row", False) else "")
                if c.codec != "none" else f"unchanged: {c.reason}")
        out.append(f"  graph {c.graph} collective {c.index} ({c.part} {c.kind}, "
                   f"{'x'.join(map(str, c.shape))} on {c.group_size} ranks): {what}")
    return out


def measured_loss_costs(plan: Plan) -> list[str]:
    """What each lossy codec the plan uses was measured to cost in final loss (the table
    ``auto``'s budget reads), so a user who fixed a codec by hand sees it too."""
    used: dict[tuple[str, str], None] = {}
    for g in plan.graphs:
        for e in g.edges:
            used[("activation", e.codec)] = None
            used[("activation_grad", e.grad_codec or e.codec)] = None
        for b in g.buckets:
            used[("gradient", b.codec)] = None
    rows = []
    for role, spec in used:
        spec = codecs.canonical(spec)
        if spec == "none":
            continue
        change = _measured(role, spec)
        what = (f"{change:+.1%} final loss vs uncompressed" if change is not None
                else "not measured by bench/convergence.py")
        better = _with_error_feedback(role, spec, change)
        rows.append(f"  {ROLES[role]}: {codecs.spelled(spec)}: {what}{better}")
    if not rows:
        return []
    return [("loss cost of the codecs in this plan (bench/convergence.py: tiny GPT, 300 steps, "
            "paired mean over 3 seeds):"), *rows]


def _measured(role: str, spec: str) -> float | None:
    return next((v for k, v in MEASURED[role].items() if codecs.canonical(k) == spec), None)


def _with_error_feedback(role: str, spec: str, change: float | None) -> str:
    """A hint where the error-feedback variant of the same codec was measured to cost less."""
    if change is None or ",ef" in spec or spec.endswith(":ef"):
        return ""
    sep = "," if ":" in spec else ":"
    ef = codecs.canonical(spec + sep + "ef")
    ef_change = _measured(role, ef)
    if ef_change is None or ef_change >= change:
        return ""
    return f"; with error feedback ({ef}) {ef_change:+.1%}"


def _graph(g: GraphPlan, plan: Plan) -> list[str]:
    if not g.decisions:
        return []
    out = [f"graph {g.index}: {g.num_stages} stage(s)"]
    p = g.prediction
    if p is not None:
        steps = (f"{p.schedule}, {p.microbatches} microbatches per step"
                 if p.schedule in ("1F1B", "GPipe") else p.schedule)
        if p.link.startswith("hop "):  # a cluster: a link per hop (plan_edges)
            out.append(f"  assumed: {steps}; compute from {p.compute}")
            out.append("  links, per hop (from the cluster option):")
            out += [f"    {hop}" for hop in p.link.split("; ")]
        else:
            out.append(f"  assumed: {steps}; link {p.link}; compute from {p.compute}")
        gain = 1 - p.chosen_s / p.uncompressed_s if p.uncompressed_s else 0.0
        out.append(f"  predicted step: {p.uncompressed_s:.4g} s uncompressed -> "
                   f"{p.chosen_s:.4g} s with these choices ({gain:.0%} faster)")
    edges = {e.index: e for e in g.edges}
    buckets = {b.index: b for b in g.buckets}
    collectives = {c.index: c for c in g.collectives}
    for d in g.decisions:
        kind, _, rest = d.what.partition(" ")
        index = int(rest.split()[0]) if rest else -1
        about = ""
        if kind == "edge" and index in edges:
            e = edges[index]
            about = (f" ({e.source}, {'x'.join(map(str, e.shape))} "
                     f"{e.dtype.replace('torch.', '')}, hops "
                     f"{', '.join(f'{a}->{b}' for a, b in e.hops)})")
        elif kind == "bucket" and index in buckets:
            b = buckets[index]
            about = f" ({len(b.params)} params, {b.numel} elements)"
        elif kind == "collective" and index in collectives:
            c = collectives[index]
            about = (f" ({c.part} {c.kind}, {'x'.join(map(str, c.shape))} "
                     f"{c.dtype.replace('torch.', '')} on {c.group_size} ranks)")
        out.append(f"  {d.what}{about}: {d.chosen}")
        label = ("predicted s of this collective (exposed + codec)" if kind == "collective"
                 else "predicted s/step")
        out.append(f"    {label}: " + "  ".join(
            f"{spec} {secs:.4g}" + (" *" if spec == d.chosen else "")
            for spec, secs in d.candidates))
        out.append(f"    why: {d.reason}")
    return out
