"""DOT for a plan (stages and what crosses between them) and for a backend's graphs (modules or
nodes in one cluster per stage, codec ops between the clusters).

Conventions shared by every drawing:

* a stage is a colour (:data:`STAGE_COLOURS`, fixed, cycling after eight stages); a cluster per
  stage says its cost and share of the total;
* codec ops are orange ``cds`` shapes outside the clusters. At module level the hops of one
  stage boundary are drawn as one codec node (one pipeline message) whose table lists every edge
  crossing it: source, shape, dtype, codec, raw → wire bytes per hop;
* a parameter used in several stages (tied embedding and LM head) is a gold cylinder with dashed
  "tied" arrows to every place that reads it;
* at module level, operations are grouped by module path to ``depth`` levels, a ModuleList
  index counting with its container (``transformer.h.3`` is two levels). A group is split into
  its contiguous runs only where keeping it whole would draw a cycle.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ccfx.plan import CutEdge, GraphPlan, Plan, human_bytes

from . import collectives as coll
from .dot import Digraph, Html, html_text
from .palette import (  # noqa: F401  (STAGE_*: the drawings' colours, named here as before)
    CODEC_BORDER,
    CODEC_FILL,
    STAGE_BORDERS,
    STAGE_COLOURS,
    TIED_BORDER,
    TIED_FILL,
    stage_border,
    stage_colour,
)
from .view import GraphView, VNode

MAX_TABLE_ROWS = 40
FONT = "Helvetica"


def _lighten(colour: str, amount: float = 0.6) -> str:
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def fmt_shape(shape) -> str:
    return "×".join(str(d) for d in shape) if shape else "scalar"


def fmt_flops(x: float) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{_three_digits(x / scale)} {prefix}FLOP"
    return f"{x:.0f} FLOP"


def _three_digits(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def fmt_cost(cost: float, balance: str) -> str:
    return fmt_flops(cost) if balance == "flops" else human_bytes(cost)


def _dtype(dtype: str) -> str:
    return dtype.replace("torch.", "")


def _new_graph(title: str) -> Digraph:
    g = Digraph("ccfx", rankdir="TB", newrank=True, compound=True, labelloc="t", fontname=FONT,
                fontsize=14, label=title, ranksep=0.3, nodesep=0.25)
    g.attrs("node", fontname=FONT, fontsize=10, shape="box", style="rounded,filled",
            fillcolor="white", margin="0.12,0.04")
    g.attrs("edge", fontname=FONT, fontsize=9, color="#555555", arrowsize=0.7)
    return g


# -- codec tables (plan view and module view) ----------------------------------------------


#: The columns of a boundary's table: (heading, alignment).
TABLE_HEADER = [("edge", "LEFT"), ("tensor", "LEFT"), ("shape", "LEFT"), ("dtype", "LEFT"),
                ("codec", "LEFT"), ("raw → wire", "RIGHT")]
TABLE_COLUMNS = len(TABLE_HEADER)


def codec_table(hop: tuple[int, int], direction: str, edges: list[CutEdge]) -> Html:
    """An HTML table: one row per edge crossing ``hop`` in ``direction``, and the total."""
    src, dst = (hop[1], hop[0]) if direction == "bwd" else hop
    what = "gradients" if direction == "bwd" else "activations"
    n = len(edges)
    rows = [f'<TR><TD COLSPAN="{TABLE_COLUMNS}"><B>stage {src} → {dst}</B> · {n} {what}</TD></TR>',
            # a header row: shape, dtype and codec are columns of their own, never read as one
            # word ("float32int8")
            "<TR>" + "".join(f'<TD ALIGN="{a}"><I>{h}</I></TD>' for h, a in TABLE_HEADER) + "</TR>"]
    raw_total = wire_total = 0
    for i, e in enumerate(edges):
        codec = e.grad_codec if direction == "bwd" else e.codec
        wire = e.wire_bytes_bwd if direction == "bwd" else e.wire_bytes_fwd
        raw_total += e.raw_bytes
        wire_total += wire
        if i >= MAX_TABLE_ROWS:
            continue
        cells = [f"e{e.index}", e.source, fmt_shape(e.shape), _dtype(e.dtype),
                 codec or "none", f"{human_bytes(e.raw_bytes)} → {human_bytes(wire)}"]
        rows.append("<TR>" + "".join(
            f'<TD ALIGN="{a}">' + (f"<B>{html_text(c)}</B>" if h == "codec" else html_text(c))
            + "</TD>" for (h, a), c in zip(TABLE_HEADER, cells)) + "</TR>")
    if n > MAX_TABLE_ROWS:
        rows.append(f'<TR><TD COLSPAN="{TABLE_COLUMNS}">… {n - MAX_TABLE_ROWS} more (see the '
                    "report)</TD></TR>")
    if n > 1:
        ratio = wire_total / raw_total if raw_total else 1.0
        rows.append(f'<TR><TD COLSPAN="{TABLE_COLUMNS}" ALIGN="RIGHT">total '
                    f"{html_text(human_bytes(raw_total))} → {html_text(human_bytes(wire_total))}"
                    f" (×{ratio:.3f})</TD></TR>")
    return Html('<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2" CELLPADDING="2">'
                + "".join(rows) + "</TABLE>")


def _codec_node(g: Digraph, node_id: str, label) -> None:
    g.node(node_id, label=label, shape="cds", style="filled", fillcolor=CODEC_FILL,
           color=CODEC_BORDER, penwidth=1.5, margin="0.15,0.05")


def _tied_node(g: Digraph, node_id: str, name: str, stages, nbytes: int) -> None:
    g.node(node_id, label=f"tied: {name}\nstages {', '.join(map(str, stages))} · "
           f"{human_bytes(nbytes)}", shape="cylinder", style="filled", fillcolor=TIED_FILL,
           color=TIED_BORDER)


def _tied_edge(g: Digraph, tail: str, head: str) -> None:
    g.edge(tail, head, style="dashed", color=TIED_BORDER, fontcolor=TIED_BORDER, label="tied")


def _hops_by_boundary(gp: GraphPlan) -> dict[tuple[int, int], list[CutEdge]]:
    out: dict[tuple[int, int], list[CutEdge]] = defaultdict(list)
    for e in gp.edges:
        for hop in e.hops:
            out[tuple(hop)].append(e)
    return out


# -- plan view -----------------------------------------------------------------------------


def plan_dot(plan: Plan, title: str | None = None) -> str:
    """Stages as boxes, one codec node per stage boundary listing the edges that cross it."""
    codec = plan.config.get("activation_codec", "?")
    default = f"ccfx plan · {plan.num_stages} stages · activations {codec}"
    if plan.collectives:
        default += f" · collectives {coll.codec_text(plan.config)}"
    g = _new_graph(title or default)
    many = len(plan.graphs) > 1
    for gp in plan.graphs:
        prefix = f"g{gp.index}_"
        if many:
            with g.cluster(f"graph{gp.index}", label=f"graph {gp.index}", style="dashed",
                           color="#999999"):
                _plan_graph(g, gp, prefix)
        else:
            _plan_graph(g, gp, prefix)
    return g.source()


def _plan_graph(g: Digraph, gp: GraphPlan, prefix: str) -> None:
    total = sum(s.cost for s in gp.stages) or 1.0
    for s in gp.stages:
        span = f"{s.nodes[0]} … {s.nodes[-1]}" if s.nodes else "(empty)"
        g.node(f"{prefix}stage{s.index}",
               label=f"stage {s.index}\ncost {fmt_cost(s.cost, gp.balance)} "
                     f"({100 * s.cost / total:.1f}%)\n{len(s.nodes)} nodes · params "
                     f"{human_bytes(s.param_bytes)}\n{span}",
               fillcolor=stage_colour(s.index), color=stage_border(s.index), penwidth=1.5)
    boundaries = _hops_by_boundary(gp)
    for a in range(gp.num_stages - 1):
        edges = boundaries.get((a, a + 1), [])
        if not edges:
            g.edge(f"{prefix}stage{a}", f"{prefix}stage{a + 1}", label="nothing crosses",
                   style="dotted")
            continue
        node = f"{prefix}cut_{a}_{a + 1}"
        _codec_node(g, node, codec_table((a, a + 1), "fwd", edges))
        g.edge(f"{prefix}stage{a}", node)
        g.edge(node, f"{prefix}stage{a + 1}")
    for p in gp.shared:
        node = f"{prefix}tied_{p.name}"
        _tied_node(g, node, p.name, p.stages, p.nbytes)
        for s in p.stages:
            _tied_edge(g, node, f"{prefix}stage{s}")
    last = gp.stages[-1].index if gp.stages else None
    coll.draw_tables(g, gp, prefix, f"{prefix}stage{last}" if last is not None else None)


# -- graph views ---------------------------------------------------------------------------


def _levels(path: str) -> list[str]:
    """Path components, a ModuleList index joined to its container: h.3 is one level."""
    out: list[str] = []
    for part in path.split(".") if path else []:
        if part.isdigit() and out:
            out[-1] += "." + part
        else:
            out.append(part)
    return out


def truncate_path(path: str, depth: int) -> str:
    return ".".join(_levels(path)[:depth])


@dataclass
class _Box:
    id: str
    stage: int
    path: str
    members: list[VNode] = field(default_factory=list)
    label_suffix: str = ""


def _sccs(nodes: list, succ: dict) -> list[list]:
    """Strongly connected components (iterative Tarjan), in a deterministic order."""
    index: dict = {}
    low: dict = {}
    on_stack: set = set()
    stack: list = []
    out: list[list] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(succ.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ.get(w, ()))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def _group_ops(view: GraphView, depth: int) -> dict[str, tuple]:
    """op node name → group key (stage, path, run); runs split only groups on a cycle.

    A collective's nodes are one node of their own (never split): a box that feeds a
    collective and reads its result is split at it, as any group on a cycle is."""
    ops = [v for v in view.nodes if v.kind in ("op", "collective")]
    key = {v.name: ((-1, f"collective {v.collective}", 0) if v.kind == "collective" else
                    (v.stage, truncate_path(v.paths[-1] if v.paths else "", depth), 0))
           for v in ops}
    for _ in range(4):
        succ: dict[tuple, set] = defaultdict(set)
        for v in ops:
            for a in v.inputs:
                if a in key and key[a] != key[v.name]:
                    succ[key[a]].add(key[v.name])
        order = list(dict.fromkeys(key[v.name] for v in ops))
        rank = {k: i for i, k in enumerate(order)}
        succ_sorted = {k: sorted(s, key=rank.__getitem__) for k, s in succ.items()}
        cyclic = {k for comp in _sccs(order, succ_sorted) if len(comp) > 1 for k in comp}
        if not cyclic:
            break
        runs: dict[tuple, int] = {}
        previous: tuple | None = None
        for v in ops:
            k = key[v.name]
            if k in cyclic and v.kind == "op":
                base = k[:2]
                if previous is None or previous[:2] != base:
                    runs[base] = runs.get(base, -1) + 1
                key[v.name] = (*base, runs[base])
            previous = k
    return key


def _collapse(view: GraphView, depth: int, prefix: str) -> tuple[list[_Box], dict[str, str]]:
    key = _group_ops(view, depth)
    boxes: dict[tuple, _Box] = {}
    rep: dict[str, str] = {}
    for v in view.nodes:
        if v.kind != "op":
            continue
        k = key[v.name]
        box = boxes.get(k)
        if box is None:
            safe = k[1] or "top"
            box = boxes[k] = _Box(f"{prefix}s{k[0]}_{safe}_{k[2]}", k[0], k[1])
        box.members.append(v)
        rep[v.name] = box.id
    seen: dict[tuple[int, str], int] = defaultdict(int)
    for box in boxes.values():
        seen[(box.stage, box.path)] += 1
    count: dict[tuple[int, str], int] = defaultdict(int)
    for box in boxes.values():
        if seen[(box.stage, box.path)] > 1:
            count[(box.stage, box.path)] += 1
            box.label_suffix = f" ({count[(box.stage, box.path)]})"
    return list(boxes.values()), rep


def _stage_label(view: GraphView, stage: int, totals: dict[int, float]) -> str:
    total = sum(totals.values()) or 1.0
    if view.which == "partitioned" and stage < len(view.plan.stages):
        s = view.plan.stages[stage]
        all_cost = sum(x.cost for x in view.plan.stages) or 1.0
        return (f"stage {stage} · cost {fmt_cost(s.cost, view.balance)} "
                f"({100 * s.cost / all_cost:.1f}%) · params {human_bytes(s.param_bytes)}")
    c = totals.get(stage, 0.0)
    return f"stage {stage} · {view.which} {fmt_flops(c)} ({100 * c / total:.1f}%)"


def _edge_index(view: GraphView) -> dict[int, CutEdge]:
    return {e.index: e for e in view.plan.edges}


def _full_label(v: VNode, edges: dict[int, CutEdge]) -> str:
    tensor = f"{fmt_shape(v.shape)} {v.dtype}".strip() if v.dtype else ""
    if v.kind == "cut":
        e = edges.get(v.edge)
        if e is None:
            return f"codec\n{tensor}"
        a, b = (v.hop[1], v.hop[0]) if v.direction == "bwd" else v.hop
        codec = e.grad_codec if v.direction == "bwd" else e.codec
        wire = e.wire_bytes_bwd if v.direction == "bwd" else e.wire_bytes_fwd
        return (f"e{e.index} · stage {a} → {b} · {codec}\n{tensor}\n"
                f"{human_bytes(e.raw_bytes)} → {human_bytes(wire)}")
    if v.kind in ("param", "buffer"):
        return f"{v.kind} {v.qualname or v.name}\n{tensor}"
    if v.kind in ("input", "tangent", "saved", "symint"):
        return f"{v.kind} {v.name}\n{tensor}".strip()
    if v.kind == "output":
        return "output"
    return f"{v.name}\n{v.op}\n{tensor}".strip()


def graph_dot(views: list[GraphView], depth: int | None = 2, title: str | None = None,
              codec: str | None = None, collectives: str | None = None) -> str:
    """One drawing of ``views`` (one per graph): modules to ``depth`` levels, or every node
    when ``depth`` is None. ``collectives``: the collective options, named in the title when
    a graph has collectives."""
    which = views[0].which if views else "partitioned"
    stages = max((v.num_stages for v in views), default=0)
    level = "every node" if depth is None else f"modules to depth {depth}"
    named = (f"collectives {collectives} · "
             if collectives and any(v.plan.collectives for v in views) else "")
    g = _new_graph(title or f"ccfx · {which} graph · {stages} stages · "
                   f"activations {codec or '?'} · {named}{level}")
    many = len(views) > 1
    for view in views:
        prefix = f"g{view.index}_"
        if many:
            with g.cluster(f"graph{view.index}", label=f"graph {view.index}", style="dashed",
                           color="#999999"):
                _draw_view(g, view, depth, prefix)
        else:
            _draw_view(g, view, depth, prefix)
    return g.source()


def _draw_view(g: Digraph, view: GraphView, depth: int | None, prefix: str) -> None:
    """One graph view drawn into ``g``: its nodes (every node, or module boxes at ``depth``)
    in stage clusters, the codec ops, collectives, tied parameters and the arrows."""
    edges = _edge_index(view)
    shared = {v.name for v in view.nodes
              if v.kind in ("param", "buffer") and len(v.stages) > 1}
    totals: dict[int, float] = defaultdict(float)
    for v in view.nodes:
        if v.kind == "op" and v.stage is not None:
            totals[v.stage] += v.flops
    stage_ids = sorted({v.stage for v in view.nodes if v.stage is not None and v.kind == "op"}
                       | set(range(view.num_stages)))
    if depth is None:
        rep, in_stage, outside = _node_items(view, edges, shared, prefix)
    else:
        rep, in_stage, outside = _box_items(view, depth, edges, shared, prefix)

    # stage clusters
    for s in stage_ids:
        with g.cluster(f"{prefix}stage{s}", label=_stage_label(view, s, totals),
                       style="rounded,filled", fillcolor=_lighten(stage_colour(s), 0.7),
                       color=stage_border(s), penwidth=1.5, fontsize=12, labeljust="l"):
            for nid, attrs in in_stage.get(s, []):
                g.node(nid, **attrs)
    for nid, attrs in outside:
        g.node(nid, **attrs)
    _draw_codec_ops(g, view, depth, edges, rep, prefix)

    # collectives: one node per collective where it runs (forward / backward graphs), a table
    # per part beside the partitioned graph (its collectives are not nodes of that graph)
    rows = {c.index: c for c in view.plan.collectives}
    for index in sorted({v.collective for v in view.nodes if v.kind == "collective"}):
        c = rows.get(index)
        coll.node(g, f"{prefix}collective{index}", coll.label(c, index),
                  c is not None and c.codec != "none")
    if view.which == "partitioned":
        coll.draw_tables(g, view.plan, prefix)

    # tied parameters
    for v in view.nodes:
        if v.name in shared:
            _tied_node(g, prefix + v.name, v.qualname or v.name, v.stages, v.nbytes)
    _draw_arrows(g, view, rep, in_stage, shared, rows, prefix)


def _node_items(view: GraphView, edges: dict[int, CutEdge], shared: set[str], prefix: str
                ) -> tuple[dict[str, str], dict[int, list[tuple[str, dict]]],
                           list[tuple[str, dict]]]:
    """Every node drawn: which drawn node stands for each node (``rep``), the nodes of each
    stage cluster and those outside any (inputs, outputs) with their attributes."""
    rep: dict[str, str] = {}
    in_stage: dict[int, list[tuple[str, dict]]] = defaultdict(list)
    outside: list[tuple[str, dict]] = []
    for v in view.nodes:
        nid = prefix + v.name
        label = _full_label(v, edges)
        if v.kind == "collective":
            rep[v.name] = f"{prefix}collective{v.collective}"
            continue  # one node per collective, drawn below
        if v.kind == "object":
            continue  # a process group handle: not drawn
        if v.kind == "cut":
            rep[v.name] = nid
            continue  # drawn below with the codec style
        if v.name in shared:
            rep[v.name] = nid
            continue
        rep[v.name] = nid
        if v.kind == "op":
            in_stage[v.stage].append((nid, {"label": label, "fillcolor": stage_colour(v.stage),
                                                "color": stage_border(v.stage)}))
        elif v.kind in ("param", "buffer", "saved"):
            in_stage[v.stage].append((nid, {
                "label": label, "fontsize": 8, "style": "filled,dashed",
                "fillcolor": _lighten(stage_colour(v.stage)), "color": stage_border(v.stage)}))
        else:
            outside.append((nid, _io_attrs(v, label)))
    return rep, in_stage, outside


def _box_items(view: GraphView, depth: int, edges: dict[int, CutEdge], shared: set[str],
               prefix: str) -> tuple[dict[str, str], dict[int, list[tuple[str, dict]]],
                                     list[tuple[str, dict]]]:
    """Modules down to ``depth`` drawn as boxes: which drawn node stands for each node
    (``rep``), the boxes of each stage cluster and the inputs drawn outside any."""
    boxes, rep = _collapse(view, depth, prefix)
    for v in view.nodes:
        if v.kind == "collective":
            rep[v.name] = f"{prefix}collective{v.collective}"
    by_name = {v.name: v for v in view.nodes}
    box_params = _box_param_bytes(boxes, by_name, shared)
    leaving: dict[str, set] = defaultdict(set)
    for v in view.nodes:
        for a in v.inputs:
            if a in rep and rep[a] != rep.get(v.name, prefix + v.name):
                leaving[rep[a]].add(a)
    in_stage: dict[int, list[tuple[str, dict]]] = defaultdict(list)
    for box in boxes:
        in_stage[box.stage].append((box.id, {
            "label": _box_label(box, box_params[box.id], sorted(leaving.get(box.id, ())),
                                by_name),
            "fillcolor": stage_colour(box.stage), "color": stage_border(box.stage)}))
    # aot graphs output saved activations (forward) or every gradient (backward): the
    # "out" line of each box says what leaves it, arrows to one output node would not help
    io_kinds = ("input", "tangent", "output") if view.which == "partitioned" else (
        "input", "tangent")
    outside: list[tuple[str, dict]] = []
    for v in view.nodes:
        if v.kind in io_kinds:
            rep[v.name] = prefix + v.name
            outside.append((prefix + v.name, _io_attrs(v, _full_label(v, edges))))
        elif v.name in shared:
            rep[v.name] = prefix + v.name
    return rep, in_stage, outside


def _box_param_bytes(boxes: list[_Box], by_name: dict[str, VNode], shared: set[str]
                     ) -> dict[str, int]:
    """The bytes of the (untied) parameters each box reads, each counted in the first box
    that reads it."""
    param_owner: dict[str, str] = {}
    box_params: dict[str, int] = defaultdict(int)
    for box in boxes:
        for m in box.members:
            for a in m.inputs:
                p = by_name.get(a)
                if p is not None and p.kind in ("param", "buffer") and a not in shared \
                        and a not in param_owner:
                    param_owner[a] = box.id
                    box_params[box.id] += p.nbytes
    return box_params


def _box_label(box: _Box, param_bytes: int, out: list[str], by_name: dict[str, VNode]) -> str:
    """A box's label: its module (or ops), ops and FLOPs, parameters, and what leaves it."""
    flops = sum(m.flops for m in box.members)
    n_ops = len(box.members)
    title = box.path or _op_names(box.members)
    if box.path and box.label_suffix:  # a module drawn in pieces: say which piece
        names = {m.op for m in box.members}
        title += f": {_op_names(box.members)}" if len(names) <= 3 else box.label_suffix
    lines = [title,
             f"{n_ops} op{'s' if n_ops != 1 else ''} · {fmt_flops(flops)}"]
    if param_bytes:
        lines.append(f"params {human_bytes(param_bytes)}")
    if len(out) == 1:
        v = by_name[out[0]]
        lines.append(f"out {fmt_shape(v.shape)} {v.dtype}")
    elif out:
        lines.append(f"out {len(out)} tensors")
    return "\n".join(lines)


def _draw_codec_ops(g: Digraph, view: GraphView, depth: int | None,
                    edges: dict[int, CutEdge], rep: dict[str, str], prefix: str) -> None:
    """The codec ops: one node per op (every node), or one per stage boundary and direction
    (modules; ``rep`` then points each cut at its boundary's node)."""
    cuts = [v for v in view.nodes if v.kind == "cut"]
    if depth is None:
        for v in cuts:
            _codec_node(g, prefix + v.name, _full_label(v, edges))
        return
    bundles: dict[tuple, list[CutEdge]] = {}
    for v in cuts:
        k = (v.hop, v.direction) if v.hop is not None else ((v.stage, v.stage), v.direction)
        bundles.setdefault(k, [])
        if v.edge in edges and edges[v.edge] not in bundles[k]:
            bundles[k].append(edges[v.edge])
        rep[v.name] = f"{prefix}cut_{k[0][0]}_{k[0][1]}_{k[1]}"
    for (hop, direction), es in sorted(bundles.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        es = sorted(es, key=lambda e: e.index)
        _codec_node(g, f"{prefix}cut_{hop[0]}_{hop[1]}_{direction}",
                    codec_table(hop, direction, es))


def _arrow_tags(view: GraphView, rep: dict[str, str]) -> dict[tuple[str, str], list[str]]:
    """Each arrow between drawn nodes, with the collectives (``c<i>``) and cut edges
    (``e<i>``) it carries."""
    by_name = {v.name: v for v in view.nodes}
    drawn: dict[tuple[str, str], list[str]] = {}
    for v in view.nodes:
        head = rep.get(v.name)
        if head is None:
            continue
        for a in v.inputs:
            tail = rep.get(a)
            if tail is None or tail == head:
                continue
            drawn.setdefault((tail, head), [])
            src = by_name[a]
            if src.kind == "collective" or v.kind == "collective":
                c = v if v.kind == "collective" else src
                tag = f"c{c.collective}"
                if tag not in drawn[(tail, head)]:
                    drawn[(tail, head)].append(tag)
            elif src.kind == "cut" or v.kind == "cut":
                cut = v if v.kind == "cut" else src
                tag = f"e{cut.edge}" if cut.edge is not None else ""
                if tag and tag not in drawn[(tail, head)]:
                    drawn[(tail, head)].append(tag)
    return drawn


def _draw_arrows(g: Digraph, view: GraphView, rep: dict[str, str],
                 in_stage: dict[int, list[tuple[str, dict]]], shared: set[str],
                 rows: dict, prefix: str) -> None:
    """The arrows: tied parameters', to outputs (grey), through codecs or collectives
    (labelled), between stages without a codec (dashed), and plain ones."""
    tied_ids = {prefix + v.name for v in view.nodes if v.name in shared}
    output_ids = {prefix + v.name for v in view.nodes if v.kind == "output"}
    kept = {f"c{i}" for i, c in rows.items() if c.codec == "none"}
    box_stage = {nid: s for s, items in in_stage.items() for nid, _ in items}
    constant = _constant_arrows(view, rep)
    for (tail, head), tags in _arrow_tags(view, rep).items():
        tags.sort(key=lambda t: int(t[1:]))
        if tail in tied_ids:
            _tied_edge(g, tail, head)
        elif head in output_ids:
            g.edge(tail, head, color="#aaaaaa")
        elif tags:
            if all(t in kept for t in tags):  # only collectives left alone: grey, not orange
                g.edge(tail, head, label=_short_tags(tags), color=coll.KEPT_BORDER,
                       fontcolor="#666666")
            else:
                g.edge(tail, head, label=_short_tags(tags), color=CODEC_BORDER,
                       fontcolor="#b45f06")
        elif box_stage.get(tail, -1) != box_stage.get(head, -1) and tail in box_stage \
                and head in box_stage and (tail, head) not in constant:
            # no codec between two stages: in a backward with tied parameters, their
            # gradients being summed; else a value that crosses uncompressed
            tied = view.which == "backward" and view.plan.shared
            g.edge(tail, head, style="dashed", color=TIED_BORDER, fontcolor=TIED_BORDER,
                   label="tied grad" if tied else "no codec")
        else:
            g.edge(tail, head)


def _constant_arrows(view: GraphView, rep: dict[str, str]) -> set[tuple[str, str]]:
    """The arrows between drawn nodes that carry only constants (an op of no inputs, such as
    the zero inductor's passes share between the stages' ReLU backwards): each stage makes
    its own, nothing crosses between stages."""
    by_name = {v.name: v for v in view.nodes}
    carried: dict[tuple[str, str], bool] = {}
    for v in view.nodes:
        head = rep.get(v.name)
        for a in v.inputs if head is not None else ():
            tail = rep.get(a)
            if tail is not None and tail != head:
                src = by_name[a]
                only = src.kind == "op" and not src.inputs
                carried[(tail, head)] = carried.get((tail, head), True) and only
    return {arrow for arrow, only in carried.items() if only}


def _op_names(members: list[VNode]) -> str:
    """A box of top-level operations (no module): named after them."""
    names = list(dict.fromkeys(m.op for m in members))
    return ", ".join(names[:3]) + (", …" if len(names) > 3 else "")


def _short_tags(tags: list[str]) -> str:
    if len(tags) <= 4:
        return ",".join(tags)
    return ",".join(tags[:3]) + f",… ({len(tags)})"


def _io_attrs(v: VNode, label: str) -> dict:
    if v.kind == "output":
        return {"label": label, "shape": "house", "style": "filled", "fillcolor": "#eeeeee"}
    if v.kind == "symint":
        return {"label": label, "shape": "plaintext", "style": ""}
    return {"label": label, "shape": "invhouse", "style": "filled", "fillcolor": "#eeeeee"}
