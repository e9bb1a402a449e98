"""annotate: shapes, dtypes, the role of every placeholder, and per-node cost.

Facts: a :class:`~ccfx.passes.facts.NodeFacts` on every node (kind: placeholders "param",
"buffer", "input" or "symint", other nodes "op"; a parameter's or buffer's qualified name in
the user's module; shape and dtype; FLOPs and bytes as sympy expressions, symbolic under
dynamic shapes, and their values at the example shapes), and ``gm.meta["ccfx"]["hints"]``:
symbol → example value, for evaluating symbolic costs.

Every node gets ``meta["val"]`` (Dynamo's graphs carry ``example_value``; if a node has
neither, the graph is run through FakeTensorProp).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.fx

from ccfx import _torch_compat as tc
from ccfx import cost

from .facts import NodeFacts, fact, put
from .graph_utils import is_stage_marker, val


def _state_name(source_name: str) -> str:
    keys = re.findall(r"\['([^']*)'\]", source_name)
    if len(keys) >= 2:
        return ".".join(keys[1:])
    from .graph_utils import normalize_fqn

    return normalize_fqn(source_name)


def _placeholder_kind(node: torch.fx.Node, example) -> tuple[str, str | None]:
    value = val(node)
    if isinstance(value, (torch.SymInt, int, float, bool)) or isinstance(example, (int, torch.SymInt)):
        return "symint", None
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    source_name = getattr(source, "name", "") if source is not None else ""
    source_name = source_name() if callable(source_name) else str(source_name)
    if isinstance(example, torch.nn.Parameter):
        return "param", _state_name(source_name) if source_name else node.name
    if "_buffers" in source_name:
        return "buffer", _state_name(source_name)
    return "input", None


def _ensure_vals(gm: torch.fx.GraphModule, example_inputs) -> None:
    missing = [n for n in gm.graph.nodes
               if n.op != "output" and val(n) is None and not is_stage_marker(n)]
    if not missing:
        return
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = tc.detect_fake_mode(example_inputs) or tc.FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


def _describe(value) -> tuple[tuple, str]:
    if isinstance(value, torch.Tensor):
        return tuple(d if isinstance(d, int) else str(d) for d in value.shape), str(value.dtype)
    return (), type(value).__name__


def annotate(gm: torch.fx.GraphModule, example_inputs: Sequence | None = None) -> torch.fx.GraphModule:
    if example_inputs is not None:
        _ensure_vals(gm, list(example_inputs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = list(example_inputs) if example_inputs is not None else [None] * len(placeholders)
    roles = {node: _placeholder_kind(node, example) for node, example in zip(placeholders, examples)}
    hints = cost.hints_of(gm)
    gm.meta.setdefault("ccfx", {})["hints"] = hints
    for node in gm.graph.nodes:
        value = val(node)
        if node.op != "output" and value is not None and "val" not in node.meta:
            node.meta["val"] = value
        before = fact(node, NodeFacts)  # a node annotated before keeps its role
        if node in roles:
            kind, name = roles[node]
        elif node.op == "get_attr":
            kind = "param" if isinstance(getattr(gm, str(node.target), None),
                                         torch.nn.Parameter) else "buffer"
            name = str(node.target)
        elif before is not None:
            kind, name = before.kind, before.name
        else:
            kind, name = ("op" if node.op not in ("placeholder", "output") else node.op), None
        shape, dtype = _describe(value)
        flops, nbytes = cost.node_flops(node), cost.node_bytes(node)
        put(node, NodeFacts(kind, name or None, shape, dtype, flops, nbytes,
                            cost.evaluate(flops, hints), cost.evaluate(nbytes, hints)))
    return gm
