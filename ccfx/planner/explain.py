"""``ccfx.explain(compiled)``: what ``auto`` chose, the predicted step of every candidate, and
why the winner won, as text (the HTML report draws the same facts)."""

from __future__ import annotations

from ..plan import GraphPlan, Plan


def explain_plan(plan: Plan) -> str:
    out = []
    for g in plan.graphs:
        out += _graph(g, plan)
    if not out:
        return ("ccfx explain: nothing was chosen by the planner (no option is 'auto'); "
                "set activation_codec, activation_grad_codec or gradient_codec to 'auto'")
    return "\n".join(out)


def _graph(g: GraphPlan, plan: Plan) -> list[str]:
    if not g.decisions:
        return []
    out = [f"graph {g.index}: {g.num_stages} stage(s)"]
    p = g.prediction
    if p is not None:
        steps = (f"{p.schedule}, {p.microbatches} microbatches per step"
                 if p.schedule in ("1F1B", "GPipe") else p.schedule)
        out.append(f"  assumed: {steps}; link {p.link}; compute from {p.compute}")
        gain = 1 - p.chosen_s / p.uncompressed_s if p.uncompressed_s else 0.0
        out.append(f"  predicted step: {p.uncompressed_s:.4g} s uncompressed -> "
                   f"{p.chosen_s:.4g} s with these choices ({gain:.0%} faster)")
    edges = {e.index: e for e in g.edges}
    buckets = {b.index: b for b in g.buckets}
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
        out.append(f"  {d.what}{about}: {d.chosen}")
        out.append("    predicted s/step: " + "  ".join(
            f"{spec} {secs:.4g}" + (" *" if spec == d.chosen else "")
            for spec, secs in d.candidates))
        out.append(f"    why: {d.reason}")
    return out
