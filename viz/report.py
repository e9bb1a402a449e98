"""One self-contained HTML file about a plan: the drawing, the plan tables, charts.

    ccfx.viz.write_report("report.html", compiled,
                          losses={"int8": losses_int8, "none": losses_baseline},
                          wire_per_step={"int8": wire_int8, "none": wire_baseline})

Everything is inline: CSS, the graphviz drawing as SVG, the charts as SVG drawn here
(:mod:`ccfx.viz.svgplot`). No JavaScript, no web fonts, nothing fetched: the file opens offline
and can be attached to an issue or a pull request.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

from ccfx.errors import CcfxWarning
from ccfx.plan import Plan, human_bytes
from ccfx.version import __version__

from . import svgplot
from .drawing import CODEC_BORDER, fmt_cost, fmt_shape, stage_border, stage_colour
from .render import INSTALL_HINT, GraphvizNotFoundError, svg_text

CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1200px;
       color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 32px;
       border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 15px; } .muted { color: #777; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0 16px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 12px 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 150px; }
.card b { display: block; font-size: 18px; } .card span { color: #666; font-size: 12px; }
.drawing { overflow: auto; max-height: 92vh; border: 1px solid #ddd; border-radius: 6px;
           padding: 8px; background: #fff; }
.chart { margin: 8px 0 20px; } .note { background: #fff8e1; border: 1px solid #f0d98c;
         padding: 8px 12px; border-radius: 6px; font-size: 13px; }
pre { background: #f7f7f7; padding: 10px; overflow: auto; font-size: 12px; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
          margin-right: 6px; vertical-align: middle; }
"""


#: One colour per meaning in every chart of the report (and the drawing's codec orange):
#: uncompressed / raw bytes grey, bytes on the wire and compressed runs the codec's orange,
#: gradients (backward) a darker orange, a stage's cost slate.
UNCOMPRESSED_COLOUR = "#999999"
WIRE_COLOUR = CODEC_BORDER
BACKWARD_COLOUR = "#b45f06"
COST_COLOUR = "#5b6770"
#: compressed runs after the first
RUN_COLOURS = [CODEC_BORDER, "#674ea7", "#45818e", "#a64d79", "#cc0000", "#6aa84f"]


def is_uncompressed(name: str) -> bool:
    """Whether a run or series name means "without compression" (a baseline, raw bytes)."""
    low = name.lower()
    return (any(w in low for w in ("uncompressed", "baseline", "no codec", "raw"))
            or low.startswith("none") or "(none)" in low)


def run_colours(names) -> dict[str, str]:
    """The colour of each run in one chart: uncompressed grey, the first compressed run the
    codec's orange (as in the drawing), further ones the rest of :data:`RUN_COLOURS`; so grey
    and orange mean the same in the loss chart, the wire chart and the edge chart."""
    out, i = {}, 0
    for name in names:
        if name in out:
            continue
        if is_uncompressed(name):
            out[name] = UNCOMPRESSED_COLOUR
        else:
            out[name] = RUN_COLOURS[i % len(RUN_COLOURS)]
            i += 1
    return out


def _series(values, default_name: str) -> dict[str, list[float]]:
    """A mapping name → floats from a mapping, a single sequence, or None."""
    if values is None:
        return {}
    if isinstance(values, Mapping):
        return {str(k): [_float(x) for x in v] for k, v in values.items()}
    return {default_name: [_float(x) for x in values]}


def _float(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _table(header: Sequence[str], rows: Sequence[Sequence], numeric: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = []
    for r in rows:
        cells = []
        for i, c in enumerate(r):
            cls = ' class="num"' if i in numeric else ""
            cells.append(f"<td{cls}>{c if isinstance(c, _Raw) else escape(str(c))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


class _Raw(str):
    """Table cell content that is already HTML."""


_svg_counter = 0


def _inline_svg(svg: str) -> str:
    """graphviz SVG made fit for inlining: no XML prolog or doctype, ids made unique."""
    global _svg_counter
    _svg_counter += 1
    svg = re.sub(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>|<!--.*?-->", "", svg, flags=re.DOTALL).strip()
    prefix = f"d{_svg_counter}-"
    svg = re.sub(r'\bid="([^"]*)"', lambda m: f'id="{prefix}{m.group(1)}"', svg)
    svg = re.sub(r"url\(#([^)]*)\)", lambda m: f"url(#{prefix}{m.group(1)})", svg)
    svg = re.sub(r'xlink:href="#([^"]*)"', lambda m: f'xlink:href="#{prefix}{m.group(1)}"', svg)
    return svg


def _drawing_html(dot_text: str, caption: str) -> str:
    try:
        svg = svg_text(dot_text)
    except GraphvizNotFoundError:
        svg = None
    if svg is None:
        warnings.warn(f"the report has no drawing: {INSTALL_HINT}", CcfxWarning, stacklevel=3)
        return (f'<p class="note">No drawing: graphviz\'s <code>dot</code> was not found when '
                f"this report was written ({escape(INSTALL_HINT)}). The DOT text is below; "
                f"render it with <code>dot -Tsvg</code>.</p><details><summary>DOT text of "
                f"{escape(caption)}</summary><pre>{escape(dot_text)}</pre></details>")
    return f'<div class="drawing" data-drawing="{escape(caption)}">{_inline_svg(svg)}</div>'


def _cards(items: Sequence[tuple[str, str]]) -> str:
    return '<div class="cards">' + "".join(
        f'<div class="card"><b>{escape(v)}</b><span>{escape(k)}</span></div>' for k, v in items
    ) + "</div>"


def _dp_summary(plan: Plan, wire_series: Mapping[str, list[float]]) -> list[tuple[str, str]]:
    """The headline of a data-parallel plan without stage boundaries: its gradient buckets and
    what they save (the pipeline's cards would all be zeros)."""
    from ccfx.codecs import spelled

    dp, buckets = plan.data_parallel, plan.buckets
    raw = sum(b.raw_bytes for b in buckets)
    wire = sum(b.wire_bytes for b in buckets)
    items = [("ranks", str(dp.world_size) if dp is not None else "1"),
             ("gradient codec", spelled(dp.gradient_codec) if dp is not None else "?"),
             ("gradient buckets (compressed / all)",
              f"{sum(b.codec != 'none' for b in buckets)} / {len(buckets)}"),
             ("gradient bytes per rank per step, raw → wire",
              f"{human_bytes(raw)} → {human_bytes(wire)}"),
             ("gradient saving (raw / wire)", f"{raw / wire:.1f}×" if wire else "–")]
    runs = {k: [x for x in v if math.isfinite(x)] for k, v in wire_series.items()}
    means = {k: sum(v) / len(v) for k, v in runs.items() if v}
    if len(means) > 1:
        (first, base), (last, comp) = next(iter(means.items())), list(means.items())[-1]
        items.append((f"measured per rank per step: {first} → {last}",
                      f"{human_bytes(base)} → {human_bytes(comp)}"
                      + (f" ({base / comp:.0f}× less)" if comp and base / comp > 1.01 else "")))
    return items


def _collective_calls(ledger) -> dict[tuple[int, int], int]:
    """(graph, collective index) → calls the ledger counted (empty without a ledger)."""
    if ledger is None:
        return {}
    return {(c.graph, c.edge): c.calls for c in ledger.entries("collective")}


def _collective_summary(plan: Plan, ledger) -> list[tuple[str, str]]:
    """The headline of a plan's collectives: how many are compressed, the bytes one rank sends
    per step (every graph's forward and backward once) and what that saves; what the ledger
    measured when it ran."""
    from .collectives import codec_text

    rows = plan.collectives
    per_call = [c for c in rows if not c.per_row]  # bytes per row: the row count is a run's
    raw = sum(c.raw_bytes for c in per_call)
    wire = sum(c.wire_bytes for c in per_call)
    items = [("collective codec", codec_text(plan.config)),
             ("collectives (compressed / all)",
              f"{sum(c.codec != 'none' for c in rows)} / {len(rows)}"),
             ("collective bytes per rank per step, raw → wire",
              f"{human_bytes(raw)} → {human_bytes(wire)}"),
             ("collective bytes saved per rank per step", human_bytes(raw - wire)),
             ("collective saving (raw / wire)", f"{raw / wire:.1f}×" if wire else "–")]
    if ledger is not None and ledger.steps and _collective_calls(ledger):
        r, w = ledger.per_step("collective")
        items.append((f"collectives measured per step ({ledger.steps} steps)",
                      f"{human_bytes(r)} → {human_bytes(w)}"))
    return items


def _summary(plan: Plan, ledger, wire_series: Mapping[str, list[float]] | None = None) -> str:
    if plan.collectives and not plan.edges and not plan.buckets:
        return _cards(_collective_summary(plan, ledger))
    extra = _cards(_collective_summary(plan, ledger)) if plan.collectives else ""
    if plan.buckets and not plan.edges:
        return _cards(_dp_summary(plan, wire_series or {})) + extra
    raw = sum(e.total_raw_bytes for e in plan.edges)
    wire_f = sum(e.total_wire_fwd for e in plan.edges)
    wire_b = sum(e.total_wire_bwd for e in plan.edges)
    raw_b = sum(e.total_raw_bytes for e in plan.edges if e.grad_codec is not None)
    worst = max((g.imbalance for g in plan.graphs), default=1.0)
    items = [
        ("graphs", str(len(plan.graphs))),
        ("stages", str(plan.num_stages)),
        ("cut edges", str(len(plan.edges))),
        ("forward bytes per step, raw → wire",
         f"{human_bytes(raw)} → {human_bytes(wire_f)}"),
        ("forward wire / raw", f"{wire_f / raw:.3f}" if raw else "–"),
        ("backward bytes per step, raw → wire",
         f"{human_bytes(raw_b)} → {human_bytes(wire_b)}"),
        ("slowest stage / ideal", f"{worst:.3f}"),
        ("tied parameters", str(len(plan.shared))),
    ]
    if ledger is not None and ledger.steps:
        r, w = ledger.per_step()
        items.append((f"measured per step, both directions ({ledger.steps} steps)",
                      f"{human_bytes(r)} → {human_bytes(w)}"))
    return _cards(items) + extra


def _fmt_cost(v: float, balance: str) -> str:
    return fmt_cost(v, balance)


def _config_table(config: Mapping) -> str:
    rows = [(k, v) for k, v in config.items()]
    return _table(["option", "value"], rows) if rows else ""


def _stage_section(plan: Plan) -> str:
    out = []
    for g in plan.graphs:
        total = sum(s.cost for s in g.stages) or 1.0
        if len(plan.graphs) > 1:
            out.append(f"<h3>graph {g.index}</h3>")
        out.append(f'<p class="muted">balanced by {escape(g.balance)}; {g.num_stages} stage(s) '
                   f"(asked {g.requested_stages}); slowest stage / ideal {g.imbalance:.3f}</p>")
        for note in g.notes:
            out.append(f'<p class="note">{escape(note)}</p>')
        rows = []
        for s in g.stages:
            swatch = _Raw(f'<span class="swatch" style="background:{stage_colour(s.index)};'
                          f'border:1px solid {stage_border(s.index)}"></span>{s.index}')
            rows.append([swatch, len(s.nodes), fmt_cost(s.cost, g.balance),
                         f"{100 * s.cost / total:.1f}%", f"{s.flops:,}",
                         human_bytes(s.param_bytes), s.nodes[0] if s.nodes else "",
                         s.nodes[-1] if s.nodes else ""])
        out.append(_table(["stage", "nodes", "cost", "share", "FLOPs", "params", "first", "last"],
                          rows, numeric=(1, 2, 3, 4, 5)))
        out.append('<div class="chart">' + svgplot.bar_chart(
            [f"stage {s.index}" for s in g.stages], {"cost": [s.cost for s in g.stages]},
            title=f"Stage balance (graph {g.index}): cost by {g.balance}",
            fmt=functools.partial(_fmt_cost, balance=g.balance),
            reference=total / max(len(g.stages), 1), reference_label="ideal",
            colours={"cost": COST_COLOUR}) + "</div>")
    return "".join(out)


def _edge_section(plan: Plan) -> str:
    if not plan.edges:
        return "<p>No edge crosses a stage boundary.</p>"
    out = []
    rows = []
    for e in plan.edges:
        ratio = e.wire_bytes_fwd / e.raw_bytes if e.raw_bytes else 1.0
        rows.append([e.graph, f"e{e.index}", e.source,
                     f"{e.source_stage} → {', '.join(map(str, e.dest_stages))}", len(e.hops),
                     fmt_shape(e.shape), e.dtype.replace("torch.", ""), e.codec,
                     e.grad_codec or "–", human_bytes(e.raw_bytes), human_bytes(e.wire_bytes_fwd),
                     human_bytes(e.wire_bytes_bwd), f"{ratio:.3f}"])
    out.append(_table(["graph", "edge", "source", "stages", "hops", "shape", "dtype", "codec",
                       "grad codec", "raw / hop", "wire fwd / hop", "wire bwd / hop",
                       "wire / raw"], rows, numeric=(4, 9, 10, 11, 12)))
    many = len(plan.graphs) > 1
    cats = [(f"g{e.graph} " if many else "") + f"e{e.index} {e.source} ×{len(e.hops)}"
            for e in plan.edges]
    out.append('<div class="chart">' + svgplot.bar_chart(
        cats, {"raw": [e.total_raw_bytes for e in plan.edges],
               "wire forward": [e.total_wire_fwd for e in plan.edges],
               "wire backward": [e.total_wire_bwd for e in plan.edges]},
        title="Bytes per step per edge (all hops): raw vs on the wire", fmt=human_bytes,
        binary=True, colours={"raw": UNCOMPRESSED_COLOUR, "wire forward": WIRE_COLOUR,
                              "wire backward": BACKWARD_COLOUR}) + "</div>")
    if plan.shared:
        out.append("<h3>Tied parameters</h3>")
        out.append(_table(["graph", "parameter", "stages", "size"],
                          [[p.graph, p.name, ", ".join(map(str, p.stages)), human_bytes(p.nbytes)]
                           for p in plan.shared]))
    return "".join(out)


def _collective_section(plan: Plan, ledger) -> str:
    """Every collective of the plan: what it is, its codec, the bytes this rank sends per call
    raw and on the wire, the calls the ledger counted, and why one was left alone."""
    from . import collectives as coll

    calls = _collective_calls(ledger)
    rows = []
    for c in sorted(plan.collectives, key=lambda c: (c.graph, c.index)):
        codec = _Raw(f"<b>{escape(c.codec)}</b>") if c.codec != "none" else c.codec
        rows.append([c.graph, f"c{c.index}", c.part, coll.kind_text(c), coll.group_text(c),
                     fmt_shape(c.shape), c.dtype.replace("torch.", ""), codec,
                     human_bytes(c.raw_bytes) + ("/row" if c.per_row else ""),
                     human_bytes(c.wire_bytes) + ("/row" if c.per_row else ""), f"{c.ratio:.3f}",
                     calls.get((c.graph, c.index), "–") if ledger is not None else "–",
                     c.reason])
    out = [('<p class="muted">The functional collectives of the compiled forward, backward and '
           "inference graphs (tensor and sequence parallel, sharded parameters, the model's own "
           "funcol code): bytes this rank sends per call, uncompressed (an all-reduce sends "
           "2(W−1)/W of its input) and as it runs; calls as the ledger counted them.</p>"),
           _table(["graph", "collective", "part", "kind", "group", "shape", "dtype", "codec",
                   "raw / call", "wire / call", "wire / raw", "calls", "why"],
                  rows, numeric=(8, 9, 10, 11))]
    many = len(plan.graphs) > 1
    cols = sorted((c for c in plan.collectives if not c.per_row),
                  key=lambda c: (c.graph, c.index))
    if cols:
        out.append('<div class="chart">' + svgplot.bar_chart(
            [(f"g{c.graph} " if many else "") + f"c{c.index} {c.kind}" for c in cols],
            {"raw": [c.raw_bytes for c in cols], "wire": [c.wire_bytes for c in cols]},
            title="Bytes per call per collective: raw vs on the wire", fmt=human_bytes,
            binary=True, colours={"raw": UNCOMPRESSED_COLOUR, "wire": WIRE_COLOUR}) + "</div>")
    return "".join(out)


def _planner_section(plan: Plan) -> str:
    """What ``auto`` chose: per decision the predicted step of every candidate and why."""
    out = []
    for g in plan.graphs:
        p = g.prediction
        if p is not None:
            out.append(f"<p>Graph {g.index}: predicted step {p.uncompressed_s:.4g} s "
                       f"uncompressed, {p.chosen_s:.4g} s with these choices; "
                       f"{escape(p.schedule)}, link {escape(p.link)}; compute from "
                       f"{escape(p.compute)}.</p>")
        rows = [[d.what, _Raw(f"<b>{escape(d.chosen)}</b>"),
                 "  ".join(f"{c} {t:.4g} s" for c, t in d.candidates), d.reason]
                for d in g.decisions]
        if rows:
            out.append(_table(["choice", "codec", "predicted s/step per candidate", "why"], rows))
    return "".join(out)


def _ledger_section(ledger) -> str:
    if ledger is None or not ledger.steps:
        return ""
    rows = []
    directions = ("fwd", "bwd", "collective") if ledger.entries("collective") else ("fwd", "bwd")
    for d in directions:
        r, w = ledger.per_step(d)
        rows.append([d, human_bytes(r), human_bytes(w), f"{w / r:.3f}" if r else "–"])
    return (f"<h3>Measured by the ledger ({ledger.steps} step(s))</h3>"
            + _table(["direction", "raw / step", "wire / step", "wire / raw"], rows,
                     numeric=(1, 2, 3)))


def report_html(backend_or_plan, losses=None, wire_per_step=None, *, title: str | None = None,
                depth=2, notes: Sequence[str] = ()) -> str:
    """The report as one HTML string (see :func:`write_report`)."""
    from .front import _resolve, normalize_depth, to_dot

    backend, plan = _resolve(backend_or_plan)
    ledger = getattr(backend, "ledger", None)
    title = title or _default_title(plan)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    body = [f"<h1>{escape(title)}</h1>",
            f'<p class="muted">ccfx {escape(__version__)} · written {escape(when)}</p>']
    body += [f'<p class="note">{escape(n)}</p>' for n in notes]
    body.append(_summary(plan, ledger, _series(wire_per_step, "wire bytes")))
    body.append("<h2>Drawing</h2>")
    if backend is not None:
        d = normalize_depth(depth)
        level = "every node" if d is None else f"modules to depth {d}"
        body.append(f'<p class="muted">The partitioned graph, {escape(level)}: one cluster per '
                    "stage, codec ops in orange between them (each table lists the edges that "
                    "cross that boundary), tied parameters as gold cylinders."
                    + (" The collectives are tables beside the stages, one per part (forward, "
                       "backward): orange where one is compressed, grey where all were left "
                       "alone, with the reason." if plan.collectives else "") + "</p>")
        body.append(_drawing_html(to_dot(backend, which="partitioned", depth=depth), "graph"))
        body.append("<h3>Stages only</h3>")
    body.append(_drawing_html(to_dot(plan, which="plan"), "plan"))
    body.append("<h2>Stages</h2>")
    body.append(_stage_section(plan))
    body.append("<h2>Cut edges</h2>")
    body.append(_edge_section(plan))
    if plan.collectives:
        body.append("<h2>Collectives</h2>")
        body.append(_collective_section(plan, ledger))
    if any(g.decisions for g in plan.graphs):
        body.append("<h2>Planner</h2>")
        body.append(_planner_section(plan))
    body += _loss_section(_series(losses, "loss"))
    body += _wire_section(_series(wire_per_step, "wire bytes"), ledger)
    body.append(_ledger_section(ledger))
    body.append("<h2>Configuration</h2>")
    body.append(_config_table(plan.config))
    body.append(f"<details><summary>Plan as text</summary><pre>{escape(str(plan))}</pre>"
                "</details>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _default_title(plan: Plan) -> str:
    """The report's title where none is given: data parallel, collectives or stages, with
    the codec that applies."""
    codec = plan.config.get("activation_codec", "?")
    if plan.buckets and not plan.edges and plan.data_parallel is not None:
        from ccfx.codecs import spelled

        return (f"ccfx report · data parallel on {plan.data_parallel.world_size} rank(s) · "
                f"gradients {spelled(plan.data_parallel.gradient_codec)}")
    if plan.collectives and not plan.edges and not plan.buckets:
        from .collectives import codec_text

        return (f"ccfx report · {len(plan.collectives)} collectives · collective codec "
                f"{codec_text(plan.config)}")
    return f"ccfx report · {plan.num_stages} stages · activations {codec}"


def _loss_section(loss_series: Mapping[str, list[float]]) -> list[str]:
    """The loss chart and a table of each run's steps, last and lowest loss (none without
    losses)."""
    if not loss_series:
        return []
    rows = [[k, len(v), svgplot.default_fmt(v[-1]) if v else "–",
             svgplot.default_fmt(min((x for x in v if math.isfinite(x)), default=math.nan))]
            for k, v in loss_series.items()]
    return ["<h2>Loss</h2>",
            '<div class="chart">' + svgplot.line_chart(
                loss_series, title="Training loss, with and without compression"
                if len(loss_series) > 1 else "Training loss", y_label="loss",
                colours=run_colours(loss_series)) + "</div>",
            _table(["run", "steps", "last", "min"], rows, numeric=(1, 2, 3))]


def _wire_section(wire_series: Mapping[str, list[float]], ledger) -> list[str]:
    """The wire bytes per step heading (also where only the ledger has steps), chart and a
    table of each run's total."""
    out = []
    if wire_series or (ledger is not None and ledger.steps):
        out.append("<h2>Wire bytes per step</h2>")
    if wire_series:
        out.append('<div class="chart">' + svgplot.line_chart(
            wire_series, title="Bytes on the wire per step", y_label="bytes",
            fmt=human_bytes, zero=True, binary=True,
            colours=run_colours(wire_series)) + "</div>")
        rows = [[k, len(v), human_bytes(sum(x for x in v if math.isfinite(x)))]
                for k, v in wire_series.items()]
        out.append(_table(["run", "steps", "total"], rows, numeric=(1, 2)))
    return out


def write_report(path: str | os.PathLike, backend_or_plan, losses=None, wire_per_step=None, *,
                 title: str | None = None, depth=2, notes: Sequence[str] = ()) -> Path:
    """Write one self-contained HTML report to ``path``; returns the path.

    backend_or_plan: a model compiled by ccfx (run at least once), its backend, or a Plan.
    losses: loss per step, either a list or ``{"run name": [...]}`` — e.g. ``{"int8": ...,
            "none (baseline)": ...}`` for curves with and without compression.
    wire_per_step: bytes on the wire per step, a list or ``{"run name": [...]}``.
    depth: module depth of the drawing (None/"full": every node).
    notes: short paragraphs shown at the top.
    Without graphviz the report is written with the DOT text instead of the drawing, and a
    CcfxWarning says how to install graphviz."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_html(backend_or_plan, losses, wire_per_step, title=title, depth=depth,
                                notes=notes), encoding="utf-8")
    return path
