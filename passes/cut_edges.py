"""cut_edges: a ``ccfx::cut`` codec op on every hop of every edge that crosses a stage boundary.

Edges are counted per hop: a value made in stage 0 and read in stages 1 and 3 becomes the chain
``x → cut(0→1) → cut(1→2) → cut(2→3)``; readers in stage 1 take the first link, readers in
stage 3 the last. That is what a linear pipeline sends (each stage forwards what later stages
need), so the numerics and the bytes are the deployment's. Each link is inserted at the start of
its destination stage, after every node of the stage before, so in-place updates made upstream
are seen exactly as in the original graph.

Tensors the codec does not apply to (integer ids, masks) cross with codec "none" and are
counted raw. Parameters, buffers, SymInts and pinned (mutated) inputs never cross: they are
where they are used.

Facts: each cut node gets a :class:`~ccfx.passes.facts.CutFacts` (edge, hop, codecs, source)
and a :class:`~ccfx.passes.facts.StageFacts` (its destination stage);
``gm.meta["ccfx"]["edges"]`` lists the edges as :class:`~ccfx.passes.facts.EdgeFacts`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

from ccfx import codecs
from ccfx.runtime import cut_op  # noqa: F401  (registers torch.ops.ccfx.cut)

from .facts import CutFacts, EdgeFacts, StageFacts, kind_of, need
from .graph_utils import insert_call, val

#: (edge index, hop, codec spec, gradient codec spec) → the uid the op reports under.
UidFor = Callable[[int, tuple[int, int], str, str], int]


@dataclass(frozen=True)
class Crossing:
    """A value read in stages after its own: the plan's edge number ``index``, before any
    cut op is inserted (what the planner prices)."""

    index: int
    node: torch.fx.Node
    source_stage: int
    readers: dict[int, list[torch.fx.Node]]  # later stage → its nodes that read the value

    @property
    def dest_stages(self) -> list[int]:
        return sorted(self.readers)

    @property
    def hops(self) -> list[tuple[int, int]]:
        return [(s - 1, s) for s in range(self.source_stage + 1, self.dest_stages[-1] + 1)]


def crossings(gm: torch.fx.GraphModule) -> list[Crossing]:
    """Every tensor that crosses a stage boundary, in graph order (the edges' order)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "output" or kind_of(node) in ("cut", "param", "buffer", "symint"):
            continue
        where = need(node, StageFacts)
        if where.pinned or not isinstance(val(node), torch.Tensor):
            continue
        by_stage: dict[int, list[torch.fx.Node]] = defaultdict(list)
        for u in node.users:
            s = need(u, StageFacts).stage
            if s > where.stage:
                by_stage[s].append(u)
        if by_stage:
            out.append(Crossing(len(out), node, where.stage, dict(by_stage)))
    return out


def cut_edges(
    gm: torch.fx.GraphModule,
    codec: str = "none",
    grad_codec: str | None = None,
    uid_for: UidFor | None = None,
    codecs_for: Callable[[int, int], tuple[str, str]] | None = None,
) -> torch.fx.GraphModule:
    """``codecs_for(edge, source_stage) -> (forward, backward)`` overrides ``codec`` and
    ``grad_codec`` per edge (``Config.codecs_for``)."""
    codec = codecs.canonical(codec)
    grad_codec = codecs.canonical(grad_codec) if grad_codec else codec
    if uid_for is None:
        counter = itertools.count(1)
        uid_for = lambda edge, hop, spec, gspec: next(counter)

    graph = gm.graph
    first_of_stage: dict[int, torch.fx.Node] = {}
    for n in graph.nodes:
        if n.op not in ("placeholder", "output"):
            first_of_stage.setdefault(need(n, StageFacts).stage, n)
    output = next(n for n in graph.nodes if n.op == "output")

    edges = []
    for crossing in crossings(gm):
        node, value, src_stage = crossing.node, val(crossing.node), crossing.source_stage
        by_stage, far = crossing.readers, crossing.dest_stages
        edge = len(edges)
        fwd, bwd = (codec, grad_codec) if codecs_for is None else codecs_for(edge, src_stage)
        fwd, bwd = codecs.canonical(fwd), codecs.canonical(bwd)
        spec = fwd if codecs.get(fwd).applies_to(value.dtype) else "none"
        gspec = bwd if codecs.get(bwd).applies_to(value.dtype) else "none"
        prev, uids, hops = node, [], []
        for s in range(src_stage + 1, far[-1] + 1):
            hop = (s - 1, s)
            uid = uid_for(edge, hop, spec, gspec)
            link = insert_call(
                graph, torch.ops.ccfx.cut.default, (prev, spec, gspec, uid, False),
                before=first_of_stage.get(s, output), like=node, value=value,
                facts=(CutFacts(edge, hop, spec, gspec, node.name), StageFacts(s)),
                name=f"{node.name}_to_stage{s}",
            )
            for user in by_stage.get(s, []):
                user.replace_input_with(node, link)
            prev = link
            uids.append(uid)
            hops.append(hop)
        edges.append(EdgeFacts(
            index=edge, source=node.name, source_stage=src_stage, dest_stages=tuple(far),
            hops=tuple(hops), uids=tuple(uids), codec=spec, grad_codec=gspec,
            requires_grad=bool(value.requires_grad),
            users=tuple(u.name for s in far for u in by_stage[s]),
        ))
    gm.meta.setdefault("ccfx", {})["edges"] = edges
    return gm
