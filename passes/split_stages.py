"""split_stages: one GraphModule per pipeline stage, for the ranks that run them.

Input: a graph after ``cut_edges`` (every node has its ``stage``; each hop of each crossing
edge is a ``ccfx::cut`` node at the start of its destination stage). Output: a new
GraphModule (as ``torch.fx.passes.split_module`` returns) whose children ``stage_0``,
``stage_1``, … are the stages and whose graph runs them one after the other with the cut ops
between them, so running it is running the input graph.

What a stage module is, and what a rank gets from it:

* **Inputs**: stage 0 takes the graph's tensor inputs, in order; stage ``s > 0`` takes what
  arrives on the hops ``s-1 → s``, in edge order. **Outputs**: what leaves on the hops
  ``s → s+1``, in edge order, a value forwarded unchanged when a later stage needs it (a skip
  connection over two cuts is sent by each stage it passes); the last stage returns what the
  graph returns (a lone tensor unwrapped). That is the positional contract
  ``torch.distributed.pipelining`` expects between neighbouring stages.
* **State**: the parameters and buffers the stage's nodes read, as ``get_attr`` under their
  qualified names in the user's module (``blocks.0.attn.weight``), registered on the stage
  module itself: ``stage.state_dict()`` has the user's keys, and the tensors are the user's
  own (no copy). Other stages' parameters are not referenced.
* **Facts**: each child's ``meta["ccfx"]["interface"]`` is a :class:`StageInterface` (ports
  with shape, dtype, codecs, and whether a gradient flows back), the parent's
  ``meta["ccfx"]["interfaces"]`` lists them. Nodes are copied with their meta.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from ccfx.errors import PartitionError

from .facts import CutFacts, NodeFacts, StageFacts, fact, kind_of, need, put, stage_of
from .graph_utils import val


@dataclass(frozen=True)
class Port:
    """One tensor crossing a stage boundary (or entering stage 0: ``edge`` is -1)."""

    name: str
    edge: int
    hop: tuple[int, int]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    codec: str
    grad_codec: str


@dataclass(frozen=True)
class StageInterface:
    index: int
    num_stages: int
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]  # empty for the last stage (it returns the graph's outputs)
    params: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    returns: tuple[str, ...] = field(default=())  # the last stage: names of what it returns


def _static_shape(node: torch.fx.Node) -> tuple[int, ...]:
    value = val(node)
    if not all(isinstance(d, int) for d in value.shape):
        raise PartitionError(
            f"{node.name} has the symbolic shape {tuple(value.shape)}: a pipeline needs static "
            "microbatch shapes (every rank allocates its receive buffers from them). Compile "
            "with torch.compile(..., dynamic=False) and one microbatch shape.")
    return tuple(value.shape)


def _requires_grad(node: torch.fx.Node) -> bool:
    """Whether autograd tracks the value: Dynamo's ``example_value`` of the node the cut chain
    starts from says it (a ``val`` FakeTensorProp filled in may have lost it)."""
    while fact(node, CutFacts) is not None:
        node = node.args[0]
    value = node.meta.get("example_value", val(node))
    return bool(getattr(value, "requires_grad", False)) and value.dtype.is_floating_point


def _port(node: torch.fx.Node, name: str, edge: int, hop: tuple[int, int], codec: str,
          grad_codec: str) -> Port:
    value = val(node)
    return Port(name, edge, hop, _static_shape(node), value.dtype, _requires_grad(node), codec,
                grad_codec)


def _cuts_by_hop(gm: torch.fx.GraphModule) -> dict[tuple[int, int], list[torch.fx.Node]]:
    cuts: dict[tuple[int, int], list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        f = fact(n, CutFacts)
        if f is not None:
            cuts.setdefault(tuple(f.hop), []).append(n)
    for nodes in cuts.values():
        nodes.sort(key=lambda n: need(n, CutFacts).edge)
    return cuts


def _copy_meta(new: torch.fx.Node, old: torch.fx.Node) -> torch.fx.Node:
    """``old``'s meta on ``new``, with a box of facts of its own (the facts are shared: they
    are frozen)."""
    new.meta = dict(old.meta)
    if "ccfx" in old.meta:
        new.meta["ccfx"] = dict(old.meta["ccfx"])
    return new


def split_stages(gm: torch.fx.GraphModule, inputs: list[Any]) -> torch.fx.GraphModule:
    """Split ``gm`` (after ``cut_edges``) into stage modules; ``inputs`` are the graph's inputs
    as Dynamo passed them (the parameters and buffers are taken from there)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(placeholders):
        raise PartitionError(f"split_stages: {len(inputs)} inputs for {len(placeholders)} "
                             "placeholders")
    example = dict(zip(placeholders, inputs))
    for n in placeholders:
        if kind_of(n) == "symint":
            raise PartitionError(
                f"{n.name} is a symbolic size: a pipeline needs static microbatch shapes. "
                "Compile with torch.compile(..., dynamic=False) and one microbatch shape.")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    stages = [need(n, StageFacts).stage for n in gm.graph.nodes
              if n.op not in ("placeholder", "output")]
    num_stages = max(stages, default=0) + 1
    cuts = _cuts_by_hop(gm)

    children: dict[str, torch.fx.GraphModule] = {}
    interfaces: list[StageInterface] = []
    for s in range(num_stages):
        b = _StageBuilder(gm, s, example)
        in_ports = _stage_inputs(b, placeholders, cuts)
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output", "get_attr") or stage_of(n) != s:
                continue
            cut = fact(n, CutFacts)
            if cut is not None and tuple(cut.hop) == (s - 1, s):
                continue  # arrives as an input of this stage
            b.env[n] = _copy_meta(b.graph.node_copy(n, b.lookup), n)
        out_ports, returns = _stage_outputs(b, num_stages, cuts, output)
        child = torch.fx.GraphModule(b.root, b.graph, class_name=f"Stage{s}")
        interface = StageInterface(s, num_stages, tuple(in_ports), tuple(out_ports),
                                   tuple(dict.fromkeys(b.params)),
                                   tuple(dict.fromkeys(b.buffers)), tuple(returns))
        child.meta["ccfx"] = {"interface": interface}
        children[f"stage_{s}"] = child
        interfaces.append(interface)

    return _sequence(gm, placeholders, output, children, cuts, num_stages, interfaces)


class _StageBuilder:
    """Stage ``s``'s graph being built from ``gm``: the node map (``env``), the root module
    that holds the stage's parameters and buffers, and their names."""

    def __init__(self, gm: torch.fx.GraphModule, s: int, example: dict):
        self.gm, self.s, self.example = gm, s, example
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.root = torch.nn.Module()
        self.params: list[str] = []
        self.buffers: list[str] = []

    def lookup(self, a: torch.fx.Node) -> torch.fx.Node:
        """``a`` in this stage's graph: copied already, or a parameter, buffer or attribute
        registered on the stage's root; else a PartitionError (no cut where one is needed)."""
        if a in self.env:
            return self.env[a]
        f = fact(a, NodeFacts)
        if a.op == "placeholder" and f is not None and f.kind in ("param", "buffer"):
            qualname = f.name or a.name
            tensor = self.example[a]
            _register(self.root, qualname, tensor, f.kind == "param")
            (self.params if f.kind == "param" else self.buffers).append(qualname)
        elif a.op == "get_attr":
            qualname = str(a.target)
            tensor = _get_attr(self.gm, qualname)
            _register(self.root, qualname, tensor, isinstance(tensor, torch.nn.Parameter))
        else:
            raise PartitionError(
                f"stage {self.s} reads {a.name} (stage {stage_of(a)}) without a cut: the graph "
                "does not satisfy cut_edges' invariant (run cut_edges before split_stages)")
        self.env[a] = _copy_meta(self.graph.get_attr(qualname), a)
        return self.env[a]


def _stage_inputs(b: _StageBuilder, placeholders: list[torch.fx.Node],
                  cuts: dict) -> list[Port]:
    """The stage's placeholders and in ports: the model's inputs for the first stage, the
    cut edges arriving from the previous stage for the others."""
    s, graph, env = b.s, b.graph, b.env
    in_ports: list[Port] = []
    if s == 0:
        for n in placeholders:
            if kind_of(n) == "input":
                env[n] = _copy_meta(graph.placeholder(n.name), n)
                in_ports.append(_port(n, n.name, -1, (-1, 0), "none", "none"))
        return in_ports
    for c in cuts.get((s - 1, s), []):
        f = need(c, CutFacts)
        name = f"{f.source}_from_stage{s - 1}"
        env[c] = _copy_meta(graph.placeholder(name), c)
        env[c].meta["ccfx"] = {}
        put(env[c], NodeFacts("input"), StageFacts(s))  # its port names the edge
        in_ports.append(_port(c, name, f.edge, (s - 1, s), f.codec, f.grad_codec))
    return in_ports


def _stage_outputs(b: _StageBuilder, num_stages: int, cuts: dict,
                   output: torch.fx.Node) -> tuple[list[Port], list[str]]:
    """The stage's output and out ports: the cut edges leaving for the next stage, or the
    model's output (and the names it returns) from the last stage."""
    s = b.s
    out_ports: list[Port] = []
    returns: list[str] = []
    if s < num_stages - 1:
        values = []
        for c in cuts.get((s, s + 1), []):
            f = need(c, CutFacts)
            values.append(b.lookup(c.args[0]))
            out_ports.append(_port(c, f"{f.source}_to_stage{s + 1}", f.edge, (s, s + 1),
                                   f.codec, f.grad_codec))
        b.graph.output(tuple(values))
    else:
        result = torch.fx.map_arg(output.args[0], b.lookup)
        if isinstance(result, (tuple, list)) and len(result) == 1:
            result = result[0]
        returns = _names(result)
        b.graph.output(result)
    return out_ports, returns


def _names(value) -> list[str]:
    names: list[str] = []
    torch.fx.map_arg(value, lambda a: names.append(a.name))
    return names


def _sequence(gm, placeholders, output, children, cuts, num_stages, interfaces):
    """The parent: the stages called in order, the cut ops between them (the simulation)."""
    graph = torch.fx.Graph()
    env = {n: _copy_meta(graph.placeholder(n.name), n) for n in placeholders}
    inputs = [env[n] for n in placeholders if kind_of(n) == "input"]
    for s in range(num_stages):
        call = graph.call_module(f"stage_{s}", tuple(inputs))
        put(call, NodeFacts("stage"), StageFacts(s))
        if s == num_stages - 1:
            graph.output(call if len(output.args[0]) != 1 else (call,))
            break
        inputs = []
        for k, c in enumerate(cuts.get((s, s + 1), [])):
            item = graph.call_function(operator.getitem, (call, k))
            item.meta = {"val": val(c)}
            put(item, NodeFacts("op"), StageFacts(s))
            link = graph.call_function(c.target, (item, *c.args[1:]))
            _copy_meta(link, c)
            inputs.append(link)
    parent = torch.fx.GraphModule(children, graph, class_name="StagedGraph")
    parent.meta["ccfx"] = {"interfaces": interfaces}
    return parent


def _get_attr(module: torch.nn.Module, qualname: str):
    for part in qualname.split("."):
        module = getattr(module, part)
    return module


def _register(root: torch.nn.Module, qualname: str, tensor: torch.Tensor, is_param: bool) -> None:
    *path, name = qualname.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if hasattr(module, name):
        return
    if is_param:
        module.register_parameter(name, tensor if isinstance(tensor, torch.nn.Parameter)
                                  else torch.nn.Parameter(tensor))
    else:
        module.register_buffer(name, tensor)
