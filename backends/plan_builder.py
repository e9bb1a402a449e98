"""Turn the facts the passes left on a graph into a :class:`ccfx.plan.GraphPlan`."""

from __future__ import annotations

import sympy
import torch
import torch.fx

from ccfx import codecs, cost
from ccfx.passes.facts import EdgeFacts, NodeFacts, PartitionFacts, StageFacts, fact, need
from ccfx.passes.graph_utils import val
from ccfx.plan import CutEdge, GraphPlan, SharedParam, Stage

#: How a channel of the plan is named in an expansion note: ``(what, spec, shape, dtype, raw
#: bytes, wire bytes)``.
Channel = tuple[str, str, list, str, int, int]


def _expr_str(expr) -> str:
    return str(sympy.simplify(sympy.sympify(expr)))


def build_graph_plan(gm: torch.fx.GraphModule, index: int) -> GraphPlan:
    """The plan of graph ``index``: its stages (nodes, cost, parameters), cut edges with
    their codecs and bytes, and its tied parameters, from the facts the passes left."""
    meta = gm.meta["ccfx"]
    part: PartitionFacts = meta["partition"]
    n_stages = part.num_stages
    symbolic = False

    stage_nodes: list[list[str]] = [[] for _ in range(n_stages)]
    stage_flops = [0] * n_stages
    stage_params: list[list[str]] = [[] for _ in range(n_stages)]
    stage_param_bytes = [0] * n_stages
    shared = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            f, where = need(n, NodeFacts), need(n, StageFacts)
            if f.kind in ("param", "buffer"):
                name = f.name or n.name
                for s in where.stages:
                    stage_params[s].append(name)
                    stage_param_bytes[s] += f.bytes_hint
                if f.kind == "param" and len(where.stages) > 1:
                    shared.append(SharedParam(index, name, list(where.stages), f.bytes_hint))
            continue
        if n.op == "output":
            continue
        stage = need(n, StageFacts).stage
        stage_nodes[stage].append(n.name)
        annotated = fact(n, NodeFacts)  # None on cut nodes (cut_edges made them: no cost)
        stage_flops[stage] += annotated.flops_hint if annotated is not None else 0
        if isinstance(val(n), torch.Tensor) and any(not isinstance(d, int) for d in val(n).shape):
            symbolic = True

    stages = [
        Stage(graph=index, index=s, nodes=stage_nodes[s], cost=float(part.stage_cost_values[s]),
              cost_expr=_expr_str(part.stage_costs[s]), flops=stage_flops[s],
              param_bytes=stage_param_bytes[s], params=stage_params[s])
        for s in range(n_stages)
    ]
    return GraphPlan(index=index, requested_stages=part.requested, num_stages=n_stages,
                     balance=part.balance, stages=stages, edges=_cut_edges(gm, index),
                     shared=shared, notes=list(part.notes), symbolic=symbolic,
                     left_whole=part.left_whole)


def _cut_edges(gm: torch.fx.GraphModule, index: int) -> list[CutEdge]:
    """The graph's cut edges: each one's stages, hops, shape and dtype, codecs, and raw and
    wire bytes (as expressions and at the hints)."""
    meta = gm.meta["ccfx"]
    hints = meta.get("hints", {})
    by_name = {n.name: n for n in gm.graph.nodes}
    edges = []
    e: EdgeFacts
    for e in meta.get("edges", []):
        value = val(by_name[e.source])
        shape = cost.shape_of(value)
        raw = cost.nbytes(value)
        fwd = codecs.get(e.codec).wire_bytes(shape, value.dtype)
        bwd = codecs.get(e.grad_codec).wire_bytes(shape, value.dtype) if e.requires_grad else 0
        edges.append(CutEdge(
            graph=index, index=e.index, source=e.source, source_stage=e.source_stage,
            dest_stages=list(e.dest_stages), hops=[tuple(h) for h in e.hops],
            shape=[int(d) if d.is_number else str(d) for d in shape], dtype=str(value.dtype),
            codec=e.codec, grad_codec=e.grad_codec if e.requires_grad else None,
            raw_bytes=cost.evaluate(raw, hints), raw_bytes_expr=_expr_str(raw),
            wire_bytes_fwd=cost.evaluate(fwd, hints), wire_bytes_fwd_expr=_expr_str(fwd),
            wire_bytes_bwd=cost.evaluate(bwd, hints), users=list(e.users),
        ))
    return edges


def _channels(g: GraphPlan) -> list[Channel]:
    """Every channel a codec was chosen for in graph ``g``: its cut edges (forward and
    backward), gradient buckets and collectives, with their raw and wire bytes."""
    out = []
    for e in g.edges:
        where = f"edge {e.index} (stage {e.source_stage} -> {','.join(map(str, e.dest_stages))}"
        out.append((where + ", forward)", e.codec, e.shape, e.dtype, e.raw_bytes,
                    e.wire_bytes_fwd))
        if e.grad_codec is not None:
            out.append((where + ", backward)", e.grad_codec, e.shape, e.dtype, e.raw_bytes,
                        e.wire_bytes_bwd))
    out += [(f"bucket {b.index}", b.codec, [b.numel], b.dtype, b.raw_bytes, b.wire_bytes)
            for b in g.buckets]
    out += [(f"collective {c.index} ({c.kind}, {c.part})", c.codec, c.shape, c.dtype,
             c.raw_bytes, c.wire_bytes) for c in g.collectives if not c.per_row]
    return out


def expansion_notes(g: GraphPlan) -> list[tuple[str, str]]:
    """``(channel and codec, note)`` for each channel of ``g`` whose codec sends more bytes
    than the raw tensor (``int8:block=1``: 1.25x); the note names the channel, the ratio and a
    spelling that shrinks it: what the plan prints and the backend warns once."""
    from ccfx.codecs.expansion import better_spec

    notes = []
    for what, spec, shape, dtype, raw, wire in _channels(g):
        if spec in (None, "none") or not raw or wire <= raw:
            continue
        better, ratio = better_spec(spec, shape, getattr(torch, dtype.split(".")[-1]))
        instead = ("'none' (the raw tensor)" if better == "none"
                   else f"{codecs.spelled(better)!r} ({ratio:.2f}x)")
        note = (f"graph {g.index} {what}: codec {codecs.spelled(spec)!r} sends "
                f"{wire / raw:.2f}x the raw bytes ({wire} B on the wire for {raw} B); write "
                f"{instead} instead")
        notes.append((f"{what} {spec}", note))
    return notes


def capacity_notes(g: GraphPlan) -> list[tuple[str, str]]:
    """``(channel and codec, note)`` for each channel of ``g`` whose codec's payload size
    depends on the data (``tlc``): every channel of a compiled graph sends the capacity
    (:func:`ccfx.codecs.variable.capacity_note`), and the plan says so."""
    from ccfx.codecs.variable import capacity_note

    notes = []
    for what, spec, _shape, _dtype, _raw, wire in _channels(g):
        note = capacity_note(f"graph {g.index} {what}", spec, wire)
        if note is not None:
            notes.append((f"{what} {spec}", note))
    return notes
