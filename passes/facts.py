"""The facts ccfx's passes leave on a graph: small frozen dataclasses, read by attribute.

A node's facts live in ``node.meta["ccfx"]``, a dict holding at most one instance of each
type under the type's ``key``; write them with :func:`put` and read them with :func:`fact`
(``None`` when absent) or :func:`need` (an error naming the pass that should have run):

===============  ============  ====================  ===========================================
type             key           written by            on
===============  ============  ====================  ===========================================
NodeFacts        "node"        annotate              every node of the graph Dynamo captured
StageFacts       "stage"       partition             every node; cut_edges gives its cut nodes
                                                     one too
CutFacts         "cut"         cut_edges             each ``ccfx::cut`` node (one hop of one
                                                     edge)
BucketFacts      "bucket"      grad_buckets          the backward's spliced exchange nodes and
                                                     codec-state placeholders (data-parallel
                                                     gradient buckets)
CollectiveFacts  "collective"  compress_collectives  an AOT graph's functional collectives (kept
                                                     or replaced), the nodes spliced in their
                                                     place and their codec-state placeholders
===============  ============  ====================  ===========================================

Graph-level facts live in ``gm.meta["ccfx"]``: ``"hints"`` (annotate: symbol → example
value), ``"partition"`` (:class:`PartitionFacts`), ``"edges"`` (cut_edges: a list of
:class:`EdgeFacts`, in edge order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import sympy
import torch.fx

ZERO = sympy.Integer(0)


@dataclass(frozen=True)
class NodeFacts:
    """annotate: what a node is and what it costs.

    ``kind``: placeholders "param", "buffer", "input" or "symint"; ``get_attr`` nodes "param"
    or "buffer"; other nodes "op" ("output" for the output node). ``name``: a parameter's or
    buffer's qualified name in the user's module ("blocks.0.weight"), else None. ``shape``:
    ints, or strings for symbolic sizes; ``dtype``: "torch.float32" (a type name for
    non-tensors). ``flops`` and ``bytes`` are sympy expressions (symbolic under dynamic
    shapes), ``*_hint`` their values at the example shapes."""

    key: ClassVar[str] = "node"
    writer: ClassVar[str] = "annotate"

    kind: str
    name: str | None = None
    shape: tuple[int | str, ...] = ()
    dtype: str = ""
    flops: sympy.Expr = ZERO
    bytes: sympy.Expr = ZERO
    flops_hint: int = 0
    bytes_hint: int = 0


@dataclass(frozen=True)
class StageFacts:
    """partition: the pipeline stage that runs a node.

    Placeholders and ``get_attr`` nodes also list ``stages``, every stage whose nodes read
    them (a parameter read in two is shared). ``pinned`` values (parameters, buffers, inputs
    mutated in place) stay where they are used and never cross a cut; other graph inputs
    enter stage 0."""

    key: ClassVar[str] = "stage"
    writer: ClassVar[str] = "partition"

    stage: int
    stages: tuple[int, ...] = ()
    pinned: bool = False


@dataclass(frozen=True)
class CutFacts:
    """cut_edges: one ``ccfx::cut`` node, the hop ``hop`` (source stage, destination stage)
    of edge ``edge``, carrying the value of the node named ``source`` with the forward codec
    ``codec`` and the gradient codec ``grad_codec`` (canonical specs; "none" where the codec
    does not apply to the dtype)."""

    key: ClassVar[str] = "cut"
    writer: ClassVar[str] = "cut_edges"

    edge: int
    hop: tuple[int, int]
    codec: str
    grad_codec: str
    source: str


@dataclass(frozen=True)
class BucketFacts:
    """grad_buckets, on the AOT backward graph: a node of data-parallel gradient bucket
    ``bucket``. A node spliced from the bucket's exchange has its ``phase`` (the exchange's
    phase that made it); a codec-state placeholder (``ccfx_state_<bucket>_<name>``) has the
    state's ``state`` name instead."""

    key: ClassVar[str] = "bucket"
    writer: ClassVar[str] = "grad_buckets"

    bucket: int
    phase: int | None = None
    state: str | None = None

    @property
    def kind(self) -> str:
        """"ccfx_state" on a codec-state placeholder, "exchange" on a spliced node."""
        return "ccfx_state" if self.state is not None else "exchange"


@dataclass(frozen=True)
class CollectiveFacts:
    """compress_collectives, on an AOT forward, backward or inference graph: a node of the
    graph's functional collective ``collective`` (the plan's index). The collective node itself
    when it was left alone (``codec`` "none"; ``reason`` why); a node spliced from its
    compressed form has the ``phase`` that made it; a codec-state placeholder
    (``ccfx_cstate_<collective>_<name>``) has the state's ``state`` name."""

    key: ClassVar[str] = "collective"
    writer: ClassVar[str] = "compress_collectives"

    collective: int
    codec: str = "none"
    phase: int | None = None
    state: str | None = None
    reason: str = ""

    @property
    def kind(self) -> str:
        """"ccfx_state" on a codec-state placeholder, "compressed" on a spliced node, "kept"
        on a collective left as it was."""
        if self.state is not None:
            return "ccfx_state"
        return "compressed" if self.phase is not None else "kept"


@dataclass(frozen=True)
class PartitionFacts:
    """partition, for the whole graph (``gm.meta["ccfx"]["partition"]``).

    ``requested``: the stages asked for (the markers' count plus one when the model has
    ``stage_boundary()`` markers); ``num_stages``: the stages made. ``cuts``: the first node
    of each stage after the first; ``crossing_bytes``: the bytes crossing each cut at the
    example shapes. ``stage_costs``: each stage's cost under ``balance`` (sympy), and
    ``stage_cost_values`` at the example shapes. ``notes``: what the partitioner changed or
    could not do, for the plan. ``left_whole``: why a graph was left whole (one stage although
    more were requested: too small a share of the model's FLOPs; see ``partition``), else ""."""

    requested: int
    num_stages: int
    balance: str
    cuts: tuple[str, ...]
    crossing_bytes: tuple[int, ...]
    stage_costs: tuple[sympy.Expr, ...]
    stage_cost_values: tuple[int, ...]
    notes: tuple[str, ...]
    left_whole: str = ""


@dataclass(frozen=True)
class EdgeFacts:
    """cut_edges, per crossing value (``gm.meta["ccfx"]["edges"]``, in edge order): the node
    named ``source`` made in ``source_stage`` and read in ``dest_stages``, sent over ``hops``
    (one cut node each, reporting under ``uids``), by the nodes named in ``users``."""

    index: int
    source: str
    source_stage: int
    dest_stages: tuple[int, ...]
    hops: tuple[tuple[int, int], ...]
    uids: tuple[Any, ...]
    codec: str
    grad_codec: str
    requires_grad: bool
    users: tuple[str, ...]


F = TypeVar("F", NodeFacts, StageFacts, CutFacts, BucketFacts, CollectiveFacts)


def fact(node: torch.fx.Node, kind: type[F]) -> F | None:
    """The node's fact of type ``kind``, or None."""
    return node.meta.get("ccfx", {}).get(kind.key)


def need(node: torch.fx.Node, kind: type[F]) -> F:
    """The node's fact of type ``kind``; a LookupError naming the pass that writes it when
    absent (the passes ran out of order, or the node was added without it)."""
    found = fact(node, kind)
    if found is None:
        raise LookupError(f"{node.name} has no {kind.__name__}: {kind.writer} writes it")
    return found


def put(node: torch.fx.Node,
        *facts: NodeFacts | StageFacts | CutFacts | BucketFacts | CollectiveFacts) -> None:
    """Store each of ``facts`` on the node under its type's key (replacing one of that type)."""
    box = node.meta.setdefault("ccfx", {})
    for f in facts:
        box[f.key] = f


def stage_of(node: torch.fx.Node) -> int | None:
    """The node's stage (partition's), or None before partition."""
    f = fact(node, StageFacts)
    return None if f is None else f.stage


def kind_of(node: torch.fx.Node) -> str | None:
    """"cut" for a codec op cut_edges inserted, else annotate's kind (None before annotate)."""
    if fact(node, CutFacts) is not None:
        return "cut"
    f = fact(node, NodeFacts)
    return None if f is None else f.kind
