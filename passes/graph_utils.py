"""Helpers every pass uses: the one way to insert a node, and the node's fake value.

The typed facts passes leave on nodes (``NodeFacts``, ``StageFacts``, ``CutFacts``,
``BucketFacts``) and their accessors are in :mod:`ccfx.passes.facts`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from .facts import CutFacts, NodeFacts, StageFacts, put


def val(node: torch.fx.Node) -> Any:
    """The node's fake value: ``meta["val"]`` (AOT) or ``meta["example_value"]`` (Dynamo)."""
    return node.meta.get("val", node.meta.get("example_value"))


def insert_call(
    graph: torch.fx.Graph,
    target,
    args: tuple,
    *,
    before: torch.fx.Node,
    like: torch.fx.Node,
    value: Any,
    facts: Sequence[NodeFacts | StageFacts | CutFacts] = (),
    name: str | None = None,
) -> torch.fx.Node:
    """Insert ``target(*args)`` before ``before``; its meta copies ``like``'s (module stack,
    stack trace) with ``val``/``example_value`` set to ``value``, and its ccfx facts are
    ``facts`` (none of ``like``'s)."""
    with graph.inserting_before(before):
        node = graph.create_node("call_function", target, args, {}, name=name)
    node.meta = {k: v for k, v in like.meta.items() if k != "ccfx"}
    node.meta["val"] = value
    if "example_value" in like.meta:
        node.meta["example_value"] = value
    node.meta["ccfx"] = {}
    put(node, *facts)
    return node


def device_of(gm: torch.fx.GraphModule):
    """The device of an AOT graph's first tensor input (None without one): where codec state
    for the graph is made."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            return v.device
    return None


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """An independent copy of an AOT graph, its output descriptors (which outputs are
    parameter gradients) and ccfx facts included: a pass rewrites the copy, and the original
    stays what a recorded graph or another variant (a warm-up backward) starts from."""
    graph = torch.fx.Graph()
    new_out = graph.output(graph.graph_copy(gm.graph, {}))
    old_out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    new_out.meta = dict(old_out.meta)
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta = dict(gm.meta)
    copy.meta["ccfx"] = dict(gm.meta.get("ccfx", {}))
    return copy


def trace_phase(fn, args, decompositions=None) -> torch.fx.GraphModule:
    """``fn`` traced over fake ``args`` with ``make_fx`` and the decomposition table of the
    compiler it is spliced for (without it, inductor finds "both a fallback and a decomp for the
    same op"): how a wire-layer phase (a bucket's exchange, a compressed collective) becomes
    graph nodes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake", decomposition_table=decompositions or {})(*args)


def splice_traced(graph: torch.fx.Graph, traced: torch.fx.GraphModule,
                  inputs: Sequence[torch.fx.Node], before: torch.fx.Node,
                  tag: Any) -> list[torch.fx.Node]:
    """Copy ``traced``'s nodes into ``graph`` before ``before``, its placeholders bound to
    ``inputs`` in order; every new node gets the fact ``tag``. Returns the nodes standing for
    ``traced``'s outputs."""
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    existing = set(graph.nodes)
    with graph.inserting_before(before):
        out = graph.graph_copy(traced.graph, dict(zip(placeholders, inputs)))
    for node in graph.nodes:
        if node not in existing:
            put(node, tag)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def is_stage_marker(node: torch.fx.Node) -> bool:
    """A ``pipe_split()`` call (``ccfx.stage_boundary()``), as Dynamo records it: no inputs,
    no value; partition cuts there and removes it."""
    return node.op == "call_function" and str(node.target).startswith("pippy._pipe_split")


def module_path(node: torch.fx.Node) -> str:
    """The innermost module that produced the node, as a qualified name ("blocks.2.attn")."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    fqn = list(stack.values())[-1][0]
    return normalize_fqn(fqn)


def module_paths(node: torch.fx.Node) -> list[str]:
    """Every enclosing module, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [normalize_fqn(v[0]) for v in stack.values()]


def normalize_fqn(fqn: str) -> str:
    """Dynamo writes ``L['self'].blocks[2].attn`` or ``L['self'].blocks.2``; users write
    ``blocks.2.attn``."""
    import re

    fqn = re.sub(r"^L\['[^']*'\]\.?", "", fqn)
    fqn = re.sub(r"\[(\d+)\]", r".\1", fqn)
    fqn = re.sub(r"\['([^']*)'\]", r".\1", fqn)
    fqn = re.sub(r"^self\.?", "", fqn)
    return fqn.lstrip(".")
