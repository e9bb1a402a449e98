"""What a drawing shows, taken from a backend's graphs: one :class:`VNode` per FX node with its
stage, module path, shape and, for codec ops, its cut edge and hop.

The partitioned graph carries ccfx's facts in ``node.meta["ccfx"]``. aot_autograd's forward and
backward graphs do not, so their stages are recovered:

* forward: ``meta["from_node"]`` names the partitioned node each aten node was traced from;
* backward: ``meta["seq_nr"]`` pairs a node with the forward nodes of the same autograd step;
  saved activations are placeholders named like the forward node that produced them;
* codec ops (``ccfx::cut``) carry their hop's uid, which the partitioned graph's cut nodes map
  to (edge, hop); a backward cut sends the gradient from ``hop[1]`` to ``hop[0]``;
* the nodes of a functional collective (``CollectiveFacts``: the collective left alone, the
  nodes spliced for its compressed form, its codec-state placeholders) are kind "collective"
  with the plan's index, drawn as one node;
* anything left takes the stage of its inputs (latest in forward, earliest in backward), then of
  its users.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ccfx import cost
from ccfx.errors import ConfigError
from ccfx.passes.facts import (
    BucketFacts,
    CollectiveFacts,
    CutFacts,
    NodeFacts,
    StageFacts,
    fact,
    kind_of,
    stage_of,
)
from ccfx.passes.graph_utils import module_paths, normalize_fqn
from ccfx.plan import GraphPlan

WHICH = ("partitioned", "forward", "backward")


@dataclass
class VNode:
    name: str
    kind: str  # op, cut, collective, param, buffer, input, symint, object, saved, tangent, output
    stage: int | None
    paths: tuple[str, ...]  # enclosing modules, outermost first
    op: str
    shape: tuple = ()
    dtype: str = ""
    flops: int = 0
    nbytes: int = 0
    inputs: list[str] = field(default_factory=list)
    qualname: str | None = None  # params and buffers: name in the user's module
    stages: tuple[int, ...] = ()  # params and buffers: every stage that uses them
    edge: int | None = None  # cut ops
    hop: tuple[int, int] | None = None
    direction: str = "fwd"
    collective: int | None = None  # kind "collective": the plan's index


@dataclass
class GraphView:
    """One graph of a backend, ready to draw."""

    index: int
    which: str
    nodes: list[VNode]
    plan: GraphPlan
    balance: str

    @property
    def num_stages(self) -> int:
        return self.plan.num_stages


def _shape_dtype(value) -> tuple[tuple, str]:
    if isinstance(value, torch.Tensor):
        return tuple(d if isinstance(d, int) else str(d) for d in value.shape), \
            str(value.dtype).replace("torch.", "")
    if isinstance(value, (tuple, list)):
        return (), f"{type(value).__name__}[{len(value)}]"
    if value is None:
        return (), ""
    return (), type(value).__name__


def _int(x) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return 0


def _is_cut(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.ccfx.cut.default


def _stack_paths(stack) -> tuple[str, ...]:
    return tuple(normalize_fqn(v[0]) for v in (stack or {}).values())


def partitioned_view(gm: torch.fx.GraphModule, plan: GraphPlan, index: int) -> GraphView:
    nodes = []
    for n in gm.graph.nodes:
        f = fact(n, NodeFacts) or NodeFacts("op")  # cut nodes have none: no shape, no cost
        where, cut = fact(n, StageFacts), fact(n, CutFacts)
        kind = "output" if n.op == "output" else kind_of(n) or "op"
        shape = tuple(f.shape)
        dtype = f.dtype.replace("torch.", "")
        nodes.append(VNode(
            name=n.name, kind=kind, stage=stage_of(n), paths=tuple(module_paths(n)),
            op=n.op if n.op in ("placeholder", "output") else cost.op_name(n),
            shape=shape, dtype=dtype if shape or kind != "output" else "",
            flops=_int(f.flops_hint), nbytes=_int(f.bytes_hint),
            inputs=[a.name for a in n.all_input_nodes], qualname=f.name,
            stages=where.stages if where is not None else (),
            edge=cut.edge if cut is not None else None,
            hop=tuple(cut.hop) if cut is not None else None,
        ))
    return GraphView(index, "partitioned", nodes, plan, plan.balance)


def _uid_map(gm: torch.fx.GraphModule) -> dict[int, tuple[int, tuple[int, int]]]:
    """hop uid → (edge, hop), from the partitioned graph's codec ops."""
    out = {}
    for n in gm.graph.nodes:
        cut = fact(n, CutFacts)
        if _is_cut(n) and cut is not None:
            out[int(n.args[3])] = (cut.edge, tuple(cut.hop))
    return out


def _sources(meta_from_node) -> list:
    """Every NodeSource in a ``from_node`` tree, nearest first."""
    out, todo = [], list(meta_from_node or [])
    while todo:
        s = todo.pop(0)
        out.append(s)
        todo.extend(getattr(s, "from_node", []) or [])
    return out


def _is_object(value) -> bool:
    """A TorchScript object input (a ProcessGroup handle, fake while tracing)."""
    return isinstance(value, torch.ScriptObject) or type(value).__name__ == "FakeScriptObject"


def _placeholder_index(node: torch.fx.Node) -> int | None:
    desc = node.meta.get("desc")
    idx = getattr(desc, "idx", None)
    if type(desc).__name__ in ("PlainAOTInput", "ParamAOTInput", "BufferAOTInput") and \
            isinstance(idx, int):
        return idx
    return None


@dataclass
class _AotSource:
    """What places an AOT forward/backward graph's nodes: the partitioned graph it came
    from (its nodes, placeholders, cut uids, symbolic hints), the forward's stages by
    ``seq_nr`` and by name, and the nodes already built."""

    part: torch.fx.GraphModule
    backward: bool
    last_stage: int
    forward_stage_by_seq: dict[int, int]
    forward_stage_by_name: dict[str, int]
    part_nodes: dict[str, torch.fx.Node] = field(default_factory=dict)
    part_placeholders: list[torch.fx.Node] = field(default_factory=list)
    uids: dict = field(default_factory=dict)
    hints: dict = field(default_factory=dict)
    built: dict[str, VNode] = field(default_factory=dict)


def _aot_view(gm: torch.fx.GraphModule, part: torch.fx.GraphModule, plan: GraphPlan, index: int,
              which: str, forward_stage_by_seq: dict[int, int], forward_stage_by_name: dict[str, int],
              ) -> GraphView:
    """The view of an AOT forward or backward graph ``gm``, each node placed in a stage from
    the partitioned graph ``part`` it came from."""
    src = _AotSource(part, which == "backward", max(plan.num_stages - 1, 0),
                     forward_stage_by_seq, forward_stage_by_name,
                     {n.name: n for n in part.graph.nodes},
                     [n for n in part.graph.nodes if n.op == "placeholder"], _uid_map(part),
                     part.meta.get("ccfx", {}).get("hints", {}))
    nodes: list[VNode] = []
    for n in gm.graph.nodes:
        v = _aot_node(n, src)
        nodes.append(v)
        src.built[v.name] = v
    _fill_stages(nodes, src.backward, src.last_stage)
    return GraphView(index, which, nodes, plan, "flops")


def _aot_node(n: torch.fx.Node, src: _AotSource) -> VNode:
    """One AOT graph node as a view node: its modules, shape and bytes, and its kind and
    stage (collective, process group, placeholder, output, codec cut or op)."""
    backward, hints = src.backward, src.hints
    value = n.meta.get("val")
    shape, dtype = _shape_dtype(value)
    stack = n.meta.get("fwd_nn_module_stack" if backward else "nn_module_stack") or \
        n.meta.get("nn_module_stack")
    bucket = fact(n, BucketFacts)  # spliced by passes.grad_buckets
    paths = ((f"gradient bucket {bucket.bucket}",) if bucket is not None
             else _stack_paths(stack))
    v = VNode(name=n.name, kind="op", stage=None, paths=paths,
              op=n.op if n.op in ("placeholder", "output") else cost.op_name(n),
              shape=shape, dtype=dtype, inputs=[a.name for a in n.all_input_nodes])
    if isinstance(value, torch.Tensor):
        v.nbytes = cost.evaluate(cost.nbytes(value), hints) if hints else _int(
            value.numel() * value.element_size())
    collective = fact(n, CollectiveFacts)  # spliced by passes.compress_collectives
    if collective is not None:
        # the collective left alone, a node of its compressed form, or its codec state:
        # all drawn as one node per collective; its stage comes from its inputs
        v.kind, v.collective = "collective", collective.collective
    elif n.op == "placeholder" and _is_object(value):
        v.kind = "object"  # a process group handle (ccfx.shard's gathers): not data
    elif n.op == "placeholder":
        _place_placeholder(v, n, value, src)
    elif n.op == "output":
        v.kind = "output"
    elif _is_cut(n):
        edge, hop = src.uids.get(int(n.args[3]), (None, None))
        v.kind, v.edge, v.hop = "cut", edge, hop
        v.direction = "bwd" if backward else "fwd"
        if hop is not None:
            v.stage = hop[0] if backward else hop[1]
    else:
        _place_op(v, n, src)
        try:
            v.flops = cost.evaluate(cost.node_flops(n), hints)
        except Exception:  # noqa: BLE001  (cost is a hint; an odd op costs nothing)
            v.flops = 0
    return v


def _place_placeholder(v: VNode, n: torch.fx.Node, value, src: _AotSource) -> None:
    """A placeholder's kind and stage: the partitioned graph's input it stands for, a
    tangent (the last stage), a saved activation (its forward stage), a symbolic size or
    an input."""
    k = _placeholder_index(n)
    desc = type(n.meta.get("desc")).__name__
    if k is not None and k < len(src.part_placeholders):
        ph = src.part_placeholders[k]
        f, where = fact(ph, NodeFacts), fact(ph, StageFacts)
        v.kind, v.stage = (f.kind if f is not None else "input"), stage_of(ph)
        v.qualname = f.name if f is not None else None
        v.stages = where.stages if where is not None else ()
        v.paths = tuple(module_paths(ph))
    elif desc == "TangentAOTInput":
        v.kind, v.stage = "tangent", src.last_stage
    elif src.backward and n.name in src.forward_stage_by_name:
        v.kind, v.stage = "saved", src.forward_stage_by_name[n.name]
    elif isinstance(value, (int, torch.SymInt)):
        v.kind = "symint"
    else:
        v.kind = "input"


def _place_op(v: VNode, n: torch.fx.Node, src: _AotSource) -> None:
    """An op's stage: in the backward its forward op's (by ``seq_nr``), in the forward the
    partitioned graph's node it came from."""
    if src.backward:
        # a gradient accumulation sums contributions from several places: it is placed
        # by its inputs (below), not by the forward op whose seq_nr it carries, and it
        # belongs to the innermost module that encloses all of them
        built = src.built
        if not n.meta.get("is_gradient_acc"):
            v.stage = src.forward_stage_by_seq.get(n.meta.get("seq_nr"))
        elif not v.paths:
            v.paths = _common_paths([built[a].paths for a in v.inputs
                                     if a in built and built[a].paths])
        return
    part_nodes = src.part_nodes
    for s in _sources(n.meta.get("from_node")):
        node = part_nodes.get(s.name)
        if node is not None and s.graph_id in (id(src.part.graph), -1):
            v.stage = stage_of(node)
            return
    for s in _sources(n.meta.get("from_node")):
        if s.name in part_nodes:
            v.stage = stage_of(part_nodes[s.name])
            return


def _common_paths(paths: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The enclosing modules every one of ``paths`` shares (outermost first)."""
    if not paths:
        return ()
    out = []
    for level in zip(*paths):
        if any(p != level[0] for p in level):
            break
        out.append(level[0])
    return tuple(out)


def _fill_stages(nodes: list[VNode], backward: bool, last_stage: int) -> None:
    by_name = {v.name: v for v in nodes}
    pick = min if backward else max
    for v in nodes:  # topological order: inputs first
        if v.stage is None and v.kind not in ("output",):
            known = [by_name[a].stage for a in v.inputs
                     if a in by_name and by_name[a].stage is not None
                     and by_name[a].kind not in ("param", "buffer", "symint", "object")]
            if known:
                v.stage = pick(known)
    users: dict[str, list[VNode]] = {}
    for v in nodes:
        for a in v.inputs:
            users.setdefault(a, []).append(v)
    for v in reversed(nodes):
        if v.stage is None and v.kind != "output":
            known = [u.stage for u in users.get(v.name, []) if u.stage is not None]
            v.stage = (max if backward else min)(known) if known else 0
    for v in nodes:
        if v.kind == "output":
            v.stage = 0 if backward else last_stage


def graph_views(backend, which: str = "partitioned", graph: int | None = None) -> list[GraphView]:
    """One view per graph of ``backend`` (or only graph ``graph``)."""
    if which not in WHICH:
        raise ConfigError(f"which={which!r}: choose one of {', '.join(WHICH)} (or 'plan')")
    graphs = backend.graphs
    if not graphs:
        raise ConfigError("the backend has compiled no graph yet: run the compiled model once")
    if graph is not None:
        if not 0 <= graph < len(graphs):
            raise ConfigError(f"graph={graph}: the backend has graphs 0..{len(graphs) - 1}")
        graphs = [graphs[graph]]
    views = []
    for g in graphs:
        if which == "partitioned":
            views.append(partitioned_view(g.partitioned, g.plan, g.index))
            continue
        forward = g.lowered.forward or g.lowered.inference
        if not forward:
            raise ConfigError(f"graph {g.index} has no forward graph recorded")
        fw = forward[-1]
        fw_view = _aot_view(fw, g.partitioned, g.plan, g.index, "forward", {}, {})
        if which == "forward":
            views.append(fw_view)
            continue
        if not g.lowered.backward:
            raise ConfigError(
                f"graph {g.index} has no backward graph yet: aot_autograd compiles it at the "
                "first .backward(); run one training step before drawing it"
            )
        by_seq: dict[int, int] = {}
        fw_nodes = {n.name: n for n in fw.graph.nodes}
        for v in fw_view.nodes:
            node = fw_nodes[v.name]
            seq = node.meta.get("seq_nr")
            if seq is not None and v.stage is not None and v.kind in ("op", "cut"):
                by_seq.setdefault(seq, v.stage)
        by_name = {v.name: v.stage for v in fw_view.nodes if v.stage is not None}
        views.append(_aot_view(g.lowered.backward[-1], g.partitioned, g.plan, g.index,
                               "backward", by_seq, by_name))
    return views
