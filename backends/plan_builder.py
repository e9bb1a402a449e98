"""Turn the facts the passes left on a graph into a :class:`ccfx.plan.GraphPlan`."""

from __future__ import annotations

import sympy
import torch
import torch.fx

from ccfx import codecs, cost
from ccfx.passes.facts import EdgeFacts, NodeFacts, PartitionFacts, StageFacts, fact, need
from ccfx.passes.graph_utils import val
from ccfx.plan import CutEdge, GraphPlan, SharedParam, Stage


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
