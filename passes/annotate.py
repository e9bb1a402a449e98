"""annotate: shapes, dtypes, the role of every placeholder, and per-node cost.

Facts written to ``node.meta["ccfx"]``:
  kind      placeholders: "param", "buffer", "input" or "symint"; other nodes: "op"
  name      for params and buffers: the qualified name in the user's module ("blocks.0.weight")
  shape     list of ints or symbolic strings; dtype: "torch.float32"
  flops, bytes        sympy expressions (symbolic under dynamic shapes)
  flops_hint, bytes_hint   their values at the example shapes
and ``gm.meta["ccfx"]["hints"]``: symbol → example value, for evaluating symbolic costs.

Every node gets ``meta["val"]`` (Dynamo's graphs carry ``example_value``; if a node has
neither, the graph is run through FakeTensorProp).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.fx

from ccfx import cost

from .graph_utils import facts, is_stage_marker, val


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
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


def _describe(value) -> tuple[list, str]:
    if isinstance(value, torch.Tensor):
        return [d if isinstance(d, int) else str(d) for d in value.shape], str(value.dtype)
    return [], type(value).__name__


def annotate(gm: torch.fx.GraphModule, example_inputs: Sequence | None = None) -> torch.fx.GraphModule:
    if example_inputs is not None:
        _ensure_vals(gm, list(example_inputs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    examples = list(example_inputs) if example_inputs is not None else [None] * len(placeholders)
    for node, example in zip(placeholders, examples):
        kind, name = _placeholder_kind(node, example)
        facts(node).update(kind=kind)
        if name:
            facts(node)["name"] = name
    hints = cost.hints_of(gm)
    gm.meta.setdefault("ccfx", {})["hints"] = hints
    for node in gm.graph.nodes:
        value = val(node)
        if node.op != "output" and value is not None and "val" not in node.meta:
            node.meta["val"] = value
        f = facts(node)
        f.setdefault("kind", "op" if node.op not in ("placeholder", "output") else node.op)
        if node.op == "get_attr":
            f["kind"] = "param" if isinstance(getattr(gm, str(node.target), None),
                                               torch.nn.Parameter) else "buffer"
            f["name"] = str(node.target)
        f["shape"], f["dtype"] = _describe(value)
        flops, nbytes = cost.node_flops(node), cost.node_bytes(node)
        f.update(flops=flops, bytes=nbytes,
                 flops_hint=cost.evaluate(flops, hints), bytes_hint=cost.evaluate(nbytes, hints))
    return gm
