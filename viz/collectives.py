"""The collectives of a plan in a drawing: tables like the boundary tables, and one node per
collective in the forward and backward graphs.

A collective (tensor or sequence parallel, sharded parameters, the user's funcol code) belongs
to a graph's forward, backward or inference part, not to a stage boundary, so the plan and the
partitioned graph show one table per part beside the stages: one row per collective (its
index, kind, group, shape, dtype, codec, raw -> wire bytes this rank sends per call), and
under a collective ccfx left alone, the reason. The forward and backward graphs draw each
collective as one node where it runs: the nodes spliced in for its compressed form (and its
codec-state inputs) are folded into it.

Compressed collectives wear the codec's orange ``cds`` shape, as the codec ops between stages
do; a table or node with nothing compressed is grey.
"""

from __future__ import annotations

from ccfx.plan import Collective, GraphPlan, human_bytes

from .dot import Digraph, Html, html_text
from .palette import CODEC_BORDER, CODEC_FILL, KEPT_BORDER, KEPT_FILL

PARTS = ("forward", "backward", "inference")

#: The columns of a collectives table: (heading, alignment).
HEADER = [("#", "LEFT"), ("kind", "LEFT"), ("group", "LEFT"), ("shape", "LEFT"),
          ("dtype", "LEFT"), ("codec", "LEFT"), ("raw → wire", "RIGHT")]
COLUMNS = len(HEADER)
MAX_ROWS = 40


def _shape(shape) -> str:
    return "×".join(str(d) for d in shape) if shape else "scalar"


def kind_text(c: Collective) -> str:
    """``all_reduce (sum)``: the kind, and the reduction where there is one."""
    return f"{c.kind} ({c.reduce_op})" if c.reduce_op else c.kind


def group_text(c: Collective) -> str:
    """``2 ranks, group 0``: the group's size, and its name (torch's process-group name)."""
    return f"{c.group_size} ranks, group {c.group}" if c.group else f"{c.group_size} ranks"


def bytes_text(c: Collective) -> str:
    per = " per row" if c.per_row else ""
    return f"{human_bytes(c.raw_bytes)} → {human_bytes(c.wire_bytes)}{per}"


def codec_text(config: dict) -> str:
    """The collective options as the user wrote them: ``none (all_gather: int8,
    reduce_scatter: int4:ef)``."""
    from ccfx.codecs import spelled

    text = spelled(config.get("collective_codec", "none"))
    table = config.get("collective_overrides")
    if table:
        text += " (" + ", ".join(f"{k}: {spelled(v)}" for k, v in sorted(table.items())) + ")"
    return text


def by_part(gp: GraphPlan) -> list[tuple[str, list[Collective]]]:
    """The graph's collectives grouped by part, forward first, each in index order."""
    out = []
    for part in [*PARTS, *sorted({c.part for c in gp.collectives} - set(PARTS))]:
        rows = sorted((c for c in gp.collectives if c.part == part), key=lambda c: c.index)
        if rows:
            out.append((part, rows))
    return out


def table(title: str, rows: list[Collective]) -> Html:
    """An HTML table: a title, a header row, one row per collective (a collective left alone
    gets a second row with its reason) and, for several, the total per call."""
    compressed = sum(c.codec != "none" for c in rows)
    lines = [(f'<TR><TD COLSPAN="{COLUMNS}"><B>{html_text(title)}</B> · {len(rows)} '
             f"collective{'s' if len(rows) != 1 else ''}, {compressed} compressed</TD></TR>"),
             "<TR>" + "".join(f'<TD ALIGN="{a}"><I>{h}</I></TD>' for h, a in HEADER) + "</TR>"]
    for c in rows[:MAX_ROWS]:
        cells = [f"c{c.index}", kind_text(c), group_text(c), _shape(c.shape),
                 c.dtype.replace("torch.", ""), c.codec, bytes_text(c)]
        lines.append("<TR>" + "".join(
            f'<TD ALIGN="{a}">' + (f"<B>{html_text(v)}</B>" if h == "codec" else html_text(v))
            + "</TD>" for (h, a), v in zip(HEADER, cells)) + "</TR>")
        if c.codec == "none" and c.reason:
            lines.append(f'<TR><TD></TD><TD COLSPAN="{COLUMNS - 1}" ALIGN="LEFT"><I>left alone: '
                         f"{html_text(c.reason)}</I></TD></TR>")
    if len(rows) > MAX_ROWS:
        lines.append(f'<TR><TD COLSPAN="{COLUMNS}">… {len(rows) - MAX_ROWS} more (see the '
                     "report)</TD></TR>")
    if len(rows) > 1:
        raw = sum(c.raw_bytes for c in rows if not c.per_row)
        wire = sum(c.wire_bytes for c in rows if not c.per_row)
        ratio = wire / raw if raw else 1.0
        lines.append(f'<TR><TD COLSPAN="{COLUMNS}" ALIGN="RIGHT">per call '
                     f"{html_text(human_bytes(raw))} → {html_text(human_bytes(wire))}"
                     f" (×{ratio:.3f})</TD></TR>")
    return Html('<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2" CELLPADDING="2">'
                + "".join(lines) + "</TABLE>")


def label(c: Collective | None, index: int) -> str:
    """One collective's node label: what it is, its codec and bytes, or why it was left
    alone."""
    if c is None:
        return f"collective c{index}"
    head = f"c{c.index} · {kind_text(c)} · {c.codec}"
    tensor = f"{_shape(c.shape)} {c.dtype.replace('torch.', '')} · {group_text(c)}"
    if c.codec == "none":
        return f"{head}\n{tensor}\nleft alone: {c.reason or 'not compressed'}"
    return f"{head}\n{tensor}\n{bytes_text(c)} per call"


def node(g: Digraph, node_id: str, text, compressed: bool) -> None:
    """A collective (or a table of them): the codec's orange where one is compressed, grey
    where none is."""
    fill, border = (CODEC_FILL, CODEC_BORDER) if compressed else (KEPT_FILL, KEPT_BORDER)
    g.node(node_id, label=text, shape="cds", style="filled", fillcolor=fill, color=border,
           penwidth=1.5, margin="0.15,0.05")


def draw_tables(g: Digraph, gp: GraphPlan, prefix: str, anchor: str | None = None) -> None:
    """One table node per part of ``gp`` that has collectives, below ``anchor`` (a node id;
    an invisible arrow keeps the table under it)."""
    for part, rows in by_part(gp):
        nid = f"{prefix}collectives_{part}"
        node(g, nid, table(f"{part} collectives", rows), any(c.codec != "none" for c in rows))
        if anchor is not None:
            g.edge(anchor, nid, style="invis")
