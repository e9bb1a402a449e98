"""compress_collectives: every functional collective of an AOT graph, compressed in place.

Runs on the forward, backward and inference graphs aot_autograd produces, where a collective
is a plain ``torch.ops._c10d_functional`` op followed by its ``wait_tensor``, whoever made it
(DTensor tensor or sequence parallel, a parametrization that gathers sharded parameters,
the user's own funcol code). The backward's collectives are nodes of the backward graph,
compressed on their own: no autograd rule is needed. Two steps, as ``grad_buckets``:

1. :func:`find_collectives`: each collective in node order (a :class:`FoundCollective`: its
   kind, the call it makes (:class:`ccfx.wire.collectives.CollectiveCall`), its group, its
   wait) and what in the graph's shape forbids replacing it (``problem``: no wait, its result
   read before the wait, a dynamic shape, a collective ccfx does not know). An all_to_all
   with split sizes is sent row by row, so a symbolic row count or symbolic split sizes (an
   expert dispatch or combine under ``capture_scalar_outputs``) are no problem as long as its
   rows (the trailing dims) are static; its shape then holds dim 0's expression
   (``("u2+u3", 16)``), and a read of its row count before the wait (``sym_size``, which the
   partitioner saves for the backward) is allowed. The caller (the compile layer) decides each one's codec, with the wire layer's
   ``refuse``, and gives every one an index (the plan's).
2. :func:`compress_collectives` (the pass): for each :class:`Rewrite` with a compressed form
   (:class:`ccfx.wire.collectives.CompressedCollective`), its phases traced with
   ``make_fx(tracing_mode="fake")`` over a :class:`~ccfx.wire.comm.FunctionalComm` naming the
   collective's own group, spliced in with ``Graph.graph_copy``: phase 0 where the collective
   was issued, the last phase (which returns the result) where it was waited on, the phases
   between spread evenly over the nodes in between (issue early, wait late: the compute
   between them overlaps the transfers). Both original nodes are then removed. A collective
   left alone keeps its node, which gets the fact saying why. Split sizes that are graph
   nodes (SymInts) are inputs of every traced phase, bound to those nodes
   (:meth:`~ccfx.wire.collectives.CompressedCollective.bind`), so the spliced all_to_all
   sends with the sizes the graph computes; a read of the row count moves to phase 0's
   handle, whose dim 0 is the same sum.

Codec state (error feedback's residual) becomes placeholders ``ccfx_cstate_<index>_<name>``
(a dot in the name becomes ``_``) appended after the graph's own inputs (in rewrite order,
names sorted), updated in the graph with ``copy_``: the caller passes the tensors it owns there
(``backends.collectives``).

Facts: every collective node kept, every node spliced in and every state placeholder gets a
:class:`~ccfx.passes.facts.CollectiveFacts`; the graph gets ``gm.meta["ccfx"]["collectives"]``
(the :class:`FoundCollective` list, in node order) and ``["collective_state_inputs"]``
(``(index, name)`` per state placeholder, in order).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from ccfx import _torch_compat as tc
from ccfx.errors import CcfxError

from .facts import CollectiveFacts, put
from .graph_utils import splice_traced, trace_phase

#: The collectives ccfx compresses: the functional op's name → the wire layer's kind.
KIND_OF_OP = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
_NAMESPACE = "_c10d_functional"


@dataclass(frozen=True)
class FoundCollective:
    """One functional collective of a graph, as :func:`find_collectives` found it.

    ``position``: its place among the graph's collectives (0, 1, ... in node order); ``node``
    and ``wait``: the names of its node and of its ``wait_tensor`` (None: none found);
    ``op``: the functional op's name (``all_reduce``, ``broadcast``...); ``kind``: the wire
    layer's kind (one of ``ccfx.wire.collectives.KINDS``) or "" for a collective ccfx does not
    compress; ``group_name``: the process group the op names; ``world``: its size;
    ``shape`` / ``dtype``: the input's; ``reduce_op``: "sum", "avg", "max"... for reductions;
    ``problem``: why the graph forbids replacing it, else ""; ``input_splits`` /
    ``output_splits``: an all_to_all_single's split sizes (None: equal; a symbolic size stays
    a string, ``"u2"``); ``shape``: a symbolic dim 0 of an all_to_all with split sizes is its
    expression, ``"u2+u3"`` (any other symbolic shape is a ``problem``, shape ``()``)."""

    position: int
    node: str
    wait: str | None
    op: str
    kind: str
    group_name: str
    world: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    reduce_op: str | None = None
    problem: str = ""
    input_splits: tuple | None = None
    output_splits: tuple | None = None

    @property
    def agreed_shape(self) -> list:
        """The shape the ranks of its group agree on: the input's, but an all_to_all with
        unequal split sizes (an expert dispatch or combine) has ``"rows"`` for dim 0, since its
        ranks send different numbers of rows by design."""
        call = self.call
        if call is not None and call.by_rows and self.shape:
            return ["rows", *self.shape[1:]]
        return list(self.shape)

    @property
    def call(self):
        """The wire layer's :class:`~ccfx.wire.collectives.CollectiveCall` for it (None for a
        collective ccfx does not compress)."""
        from ccfx.wire.collectives import CollectiveCall

        if not self.kind:
            return None
        return CollectiveCall(self.kind, self.shape, self.dtype, self.world, self.reduce_op,
                              self.input_splits, self.output_splits)


@dataclass
class Rewrite:
    """The caller's decision for one found collective: its ``index`` (the plan's), its codec
    (``"none"``: left alone, ``reason`` says why) and, when compressed, the
    ``CompressedCollective`` and its state tensors (real, for their shapes and dtypes)."""

    index: int
    codec: str = "none"
    reason: str = ""
    compressed: object = None
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)


def _is_collective(node: torch.fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and getattr(target, "namespace", None) == _NAMESPACE
            and _op_name(target) != "wait_tensor")


def _op_name(target) -> str:
    return target.overloadpacket.__name__ if hasattr(target, "overloadpacket") else str(target)


def _val(node) -> object:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _static(shape) -> tuple[int, ...] | None:
    if any(not isinstance(d, int) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _group_name(node: torch.fx.Node) -> str:
    if "group_name" in node.kwargs:
        return str(node.kwargs["group_name"])
    strings = [a for a in node.args if isinstance(a, str)]
    return strings[-1] if strings else ""


def find_collectives(gm: torch.fx.GraphModule,
                     world_of: Callable[[str], int]) -> list[FoundCollective]:
    """Every functional collective of ``gm`` in node order; ``world_of(group_name)`` gives a
    group's size where the op does not carry it (all_reduce, all_to_all_single)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    found = []
    for node in nodes:
        if not _is_collective(node):
            continue
        op = _op_name(node.target)
        kind = KIND_OF_OP.get(op, "")
        group = _group_name(node)
        x = node.args[0] if node.args else None
        value = _val(x)
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        dtype = value.dtype if isinstance(value, torch.Tensor) else torch.float32
        problem = ""
        reduce_op = None
        if kind in ("all_gather", "reduce_scatter"):
            world = int(node.args[2] if kind == "reduce_scatter" else node.args[1])
        else:
            world = int(world_of(group)) if group else 1
        if kind in ("all_reduce", "reduce_scatter"):
            reduce_op = str(node.args[1]).lower()
        waits = [u for u in node.users if u.op == "call_function"
                 and _op_name(u.target) == "wait_tensor"]
        wait = min(waits, key=pos.__getitem__) if waits else None
        splits = (_splits(node.args[2]), _splits(node.args[1])) if kind == "all_to_all" \
            else (None, None)
        static = _static(shape)
        rows = _by_rows_shape(kind, shape, splits)
        if not kind:
            problem = f"ccfx does not compress _c10d_functional.{op}"
        elif not isinstance(value, torch.Tensor):
            problem = "its input is not a single tensor"
        elif static is None and rows is None:
            problem = f"its input's shape {tuple(str(d) for d in shape)} is dynamic"
        elif wait is None:
            problem = "it has no wait_tensor in this graph"
        elif any(u is not wait and pos[u] < pos[wait] and not (rows and _row_count(u))
                 for u in node.users):
            problem = "its result is read before its wait_tensor"
        found.append(FoundCollective(len(found), node.name, wait.name if wait else None, op,
                                     kind, group, world, static or rows or (), dtype, reduce_op,
                                     problem, *splits))
    return found


def _by_rows_shape(kind: str, shape, splits) -> tuple | None:
    """An all_to_all with split sizes whose row count (dim 0, or a split size) is symbolic
    but whose rows are static (an expert dispatch or combine under ``capture_scalar_outputs``):
    its shape with dim 0 as its expression (``("u2+u3", 16)``); else None. It is sent row by
    row (:attr:`ccfx.wire.collectives.CollectiveCall.by_rows`), which needs no row count at
    compile time."""
    if kind != "all_to_all" or not shape or not any(splits) or _static(shape[1:]) is None:
        return None
    if _static(shape) is not None and all(isinstance(v, int) for s in splits if s for v in s):
        return None  # static: the ordinary path
    return (shape[0] if isinstance(shape[0], int) else str(shape[0]).replace(" ", ""),
            *_static(shape[1:]))


def _row_count(node: torch.fx.Node) -> bool:
    """``aten.sym_size.int(collective, 0)``: a read of the result's row count (the partitioner
    saves it for the backward), which the compressed form's issued all_to_all also has."""
    return (node.op == "call_function" and node.target is torch.ops.aten.sym_size.int
            and len(node.args) > 1 and node.args[1] == 0)


_SPLIT_LITERALS = re.compile(
    r"(_c10d_functional\.all_to_all_single(?:\.default)?\([^,\[\]()]+, )"
    r"\[[0-9, ]*\], \[[0-9, ]*\]")


def agreed_code(code: str) -> str:
    """A graph's code as the ranks of a group agree on it: the split sizes an
    ``all_to_all_single`` is given as int literals (an expert-parallel dispatch or combine, whose
    sizes differ from rank to rank by design, or a graph Dynamo resumed after ``.tolist()``,
    which specialises them) left out; everything else as it is. Ranks whose splits do not
    match fail as they would uncompressed (the compressed all-to-all sends whole rows with the
    same splits)."""
    return _SPLIT_LITERALS.sub(r"\1[splits], [splits]", code)


def _splits(value) -> tuple | None:
    """An all_to_all_single's split sizes: ints, and a symbolic size as its expression
    (``"u2"``: the SymInt a graph node holds, not the node's name)."""
    if value is None:
        return None
    return tuple(int(v) if isinstance(v, int) else
                 str(v.meta.get("val", v.name) if isinstance(v, torch.fx.Node) else v)
                 for v in value)



def _default_comm(group_name: str, world: int):
    from ccfx.wire.comm import FunctionalComm

    return FunctionalComm(group_name, world)


def compress_collectives(gm: torch.fx.GraphModule, found: Sequence[FoundCollective],
                         rewrites: Sequence[Rewrite], decompositions=None,
                         comm_for: Callable[[str, int], object] | None = None
                         ) -> torch.fx.GraphModule:
    """Replace each collective of ``found`` whose ``rewrites`` entry (aligned with ``found``)
    has a compressed form; tag the others (see the module docstring). ``comm_for(group_name,
    world)``: the comm the phases issue their collectives through (default: a
    ``FunctionalComm`` on that group)."""
    if len(found) != len(rewrites):
        raise CcfxError(f"compress_collectives: {len(found)} collectives but {len(rewrites)} "
                        "decisions")
    comm_for = comm_for or _default_comm
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    fake_mode = tc.detect_fake_mode([n.meta.get("val") for n in placeholders])
    first_op = next(n for n in nodes if n.op != "placeholder")
    state_nodes, state_inputs = _state_placeholders(graph, found, rewrites, fake_mode, first_op)

    replaced: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    for f, r in zip(found, rewrites):
        node = by_name[f.node]
        if r.compressed is None:
            put(node, CollectiveFacts(r.index, "none", reason=r.reason or f.problem))
            continue
        if f.problem:
            raise CcfxError(f"collective {r.index} ({f.op}) cannot be replaced: {f.problem}")
        wait = by_name[f.wait]
        anchors = _anchors(nodes, pos[node], pos[wait], len(r.compressed.phases))
        carry = _splice_phases(graph, f, r, node, anchors, comm_for(f.group_name, f.world),
                               state_nodes[f.position], decompositions)
        out = carry[0] if len(carry) == 1 else None
        _check_result(f, r, out, wait)
        replaced.append((node, wait))
        wait.replace_all_uses_with(out)
    for node, wait in replaced:
        graph.erase_node(wait)
        graph.erase_node(node)
    meta = gm.meta.setdefault("ccfx", {})
    meta["collectives"] = list(found)
    meta["collective_state_inputs"] = state_inputs
    graph.lint()
    gm.recompile()
    return gm


def _state_placeholders(graph: torch.fx.Graph, found: Sequence[FoundCollective],
                        rewrites: Sequence[Rewrite], fake_mode, first_op: torch.fx.Node
                        ) -> tuple[dict[int, list[torch.fx.Node]], list[tuple[int, str]]]:
    """A placeholder per codec state tensor of each replaced collective (before the first
    op): the placeholders by the collective's position, and (collective, state name) in
    input order."""
    state_nodes: dict[int, list[torch.fx.Node]] = {}
    state_inputs = []
    with graph.inserting_before(first_op):
        for f, r in zip(found, rewrites):
            if r.compressed is None:
                continue
            row = []
            for name in sorted(r.state):
                node = graph.placeholder(f"ccfx_cstate_{r.index}_{name.replace('.', '_')}")
                value = r.state[name]
                node.meta["val"] = (fake_mode.from_tensor(value, static_shapes=True)
                                    if fake_mode is not None else value)
                put(node, CollectiveFacts(r.index, r.codec, state=name))
                row.append(node)
                state_inputs.append((r.index, name))
            state_nodes[f.position] = row
    return state_nodes, state_inputs


def _splice_phases(graph: torch.fx.Graph, f: FoundCollective, r: Rewrite, node: torch.fx.Node,
                   anchors: list[torch.fx.Node], comm, state: list[torch.fx.Node],
                   decompositions) -> list[torch.fx.Node]:
    """Trace each phase of the compressed form of collective ``node`` and splice it at its
    anchor, each phase taking the input, the split sizes, the codec state and the previous
    phase's outputs; the last phase's outputs."""
    x = node.args[0]
    sizes = _size_nodes(node) if f.kind == "all_to_all" else []
    carry: list[torch.fx.Node] = []
    for k, anchor in enumerate(anchors):
        # the split sizes the graph computes (SymInts: .tolist() under
        # capture_scalar_outputs) are inputs of the traced phase, bound to those nodes
        inputs = [x, *sizes, *state, *carry]
        n_z, n_s = len(sizes), len(state)

        def fn(*flat, k=k, n_z=n_z, n_s=n_s, comm=comm, cc=r.compressed, node=node,
               sizes=sizes):
            if n_z:
                cc = cc.bind(*_bound_splits(node, sizes, flat[1:1 + n_z]))
            rest = flat[1 + n_z:]
            return list(cc.phases[k](flat[0], list(rest[:n_s]), list(rest[n_s:]), comm))

        traced = trace_phase(fn, [n.meta["val"] for n in inputs], decompositions)
        carry = splice_traced(graph, traced, inputs, anchor,
                              CollectiveFacts(r.index, r.codec, phase=k))
        if k == 0:
            _move_row_counts(node, carry)
    return carry


def _size_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph nodes among an all_to_all_single's split sizes (output's, then input's), each
    once, in order: what its traced phases take as SymInt inputs."""
    out: list[torch.fx.Node] = []
    for sizes in (node.args[1], node.args[2]):
        for v in sizes or ():
            if isinstance(v, torch.fx.Node) and v not in out:
                out.append(v)
    return out


def _bound_splits(node: torch.fx.Node, sizes: list[torch.fx.Node], values) -> tuple:
    """``(input_splits, output_splits)`` of ``node`` with each size node replaced by its value
    at trace time (``values``, aligned with ``sizes``)."""
    value = dict(zip(sizes, values))

    def bound(split):
        return tuple(value.get(v, v) if isinstance(v, torch.fx.Node) else v for v in split)

    return bound(node.args[2]), bound(node.args[1])


def _move_row_counts(node: torch.fx.Node, carry: list[torch.fx.Node]) -> None:
    """Reads of the collective's row count (``sym_size.int(node, 0)``, before its wait: the
    partitioner saves it for the backward) read it from the issued all_to_all (phase 0's
    handle), whose dim 0 is the same sum of output splits."""
    for user in [u for u in node.users if _row_count(u)]:
        handle = next((c for c in carry if isinstance(_val(c), torch.Tensor)), None)
        if handle is None or str(_val(handle).shape[0]) != str(_val(user)):
            raise CcfxError(f"{node.name}: its row count {_val(user)} is read before its wait, "
                            "and the compressed all_to_all's first phase does not have it; "
                            "this is a bug in ccfx.wire.collectives")
        user.replace_input_with(node, handle)


def _anchors(nodes: list[torch.fx.Node], issue: int, wait: int, n: int) -> list[torch.fx.Node]:
    """Where each of ``n`` phases goes (inserted before the node): the first at the
    collective, the last at its wait, those between spread evenly over the nodes between."""
    if n == 1:
        return [nodes[wait]]
    return [nodes[issue + math.floor(k * (wait - issue) / (n - 1))] for k in range(n)]


def _check_result(f: FoundCollective, r: Rewrite, out, wait: torch.fx.Node) -> None:
    want, got = _val(wait), _val(out)
    # shapes compared as text: symbolic sizes (u2+u3) without a guard on their values
    if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)
            and tuple(map(str, want.shape)) == tuple(map(str, got.shape))
            and want.dtype == got.dtype):
        raise CcfxError(
            f"collective {r.index} ({f.op}, codec {r.codec}): the compressed form returns "
            f"{_describe(got)} where the collective returned {_describe(want)}; this is a bug "
            "in ccfx.wire.collectives")


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
    return type(v).__name__


