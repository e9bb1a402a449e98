"""shard_buckets: ``ccfx.shard``'s per-parameter all-gathers and reduce-scatters, one per block.

``ccfx.shard`` gathers every parameter where it is read and reduce-scatters every gradient, so
an AOT graph holds one ``all_gather_into_tensor`` and one ``reduce_scatter_tensor`` per
parameter, each paying its own latency and, compressed, its own encode. This pass merges the
parameter collectives of one block into one, before ``compress_collectives`` (which then
compresses each bucket as one collective): one latency and one encode per block. The
arithmetic is torch's own (``bucket_all_gather`` / ``bucket_reduce_scatter`` in
torch/_inductor/fx_passes/bucketing.py, SimpleFSDP's bucketing); the grouping is by block.

Which collectives: a *parameter gather* is an all-gather whose input derives from exactly one
graph input (the shard: torch's ``is_fsdp_all_gather``), a *gradient reduce-scatter* one whose
result reaches the graph's output through single-input ops only (``is_fsdp_reduce_scatter``);
each must be waited on by one ``wait_tensor``. Others (sequence parallel's, the user's, a tied
weight's two gradients summed) stay as they are. A bucket is a run of consecutive collectives
of one kind (among that kind's) with one key: group, world, reduction, dtype and **block**,
the module path (``nn_module_stack``; a backward node's: the forward's) up to its first index
(``blocks.3`` for ``blocks.3.attn.qkv``), "" outside any numbered block (embeddings, final
norm). A run of one is left alone.

Where (one bucket in flight beside the one computing, as FSDP prefetches): a gather bucket is
waited where the first of its members was waited on, and issued just before the previous gather
bucket's wait (the first: where its first member was issued), so that it moves while the
previous block computes (its members' inputs, ops on their shard only, move up before it); a
reduce-scatter bucket is issued where its last member was (every gradient of the block exists
there) and waited where the next one is issued (the last: before the output), so that it moves
while the next block's backward computes (the ops on the way to the output that read a
member's result move after its wait). Where every node sits
never decides a bucket: ranks with uneven shards have different graphs (padding, narrowing)
around the same collectives, and must bucket alike.

Arithmetic (exact): gather: the shards flattened and concatenated, one all-gather, its result
viewed ``[W, n]``, split by columns into each member's ``[W, n_i]`` and reshaped to
``[W * rows_i, ...]``; reduce-scatter: each gradient viewed ``[W, n_i]`` (row r: rank r's
chunk), concatenated by columns and flattened, one reduce-scatter, split into each member's
rows. Every element is reduced with the same peers' elements as unbucketed, so with codec
``none`` the results are bit for bit the same. Each member's gathered value then passes
through ``wait_tensor`` (nothing to wait for: no collective fills it), so that inductor makes
it a buffer of its own, as the unbucketed gather's result is; without it inductor folds the
split into the kernels that read the weight, whose CPU vectorization then differs (the tiny
GPT's gradients moved by up to 6e-8).

Facts: every spliced node gets :class:`ShardBucketFacts`; ``gm.meta["ccfx"]["shard_buckets"]``
lists the :class:`ShardBucket` s in graph order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.fx

from ccfx.config import SHARD_BUCKET
from ccfx.errors import ConfigError

from .graph_utils import normalize_fqn, splice_traced, trace_phase

_NAMESPACE = "_c10d_functional"
#: The functional ops this pass buckets → their kind.
_KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


@dataclass(frozen=True)
class ShardBucketFacts:
    """shard_buckets: a node spliced for bucket ``bucket`` (its index in
    ``gm.meta["ccfx"]["shard_buckets"]``); ``phase`` 0 where it is issued, 1 where waited."""

    key: ClassVar[str] = "shard_bucket"
    writer: ClassVar[str] = "shard_buckets"

    bucket: int
    phase: int


@dataclass(frozen=True)
class ShardBucket:
    """One bucket: its ``kind`` ("all_gather" / "reduce_scatter"), ``block`` (module path,
    "" outside a numbered block), the replaced collectives' node names and the elements each
    sends per rank (their sum is the bucket's)."""

    kind: str
    block: str
    members: tuple[str, ...]
    numels: tuple[int, ...]


@dataclass(frozen=True)
class _Member:
    node: torch.fx.Node
    wait: torch.fx.Node
    kind: str
    key: tuple


def bucket_shard_collectives(gm: torch.fx.GraphModule, policy: str = "block",
                             decompositions=None) -> torch.fx.GraphModule:
    """Merge ``gm``'s parameter gathers and gradient reduce-scatters per block (``policy``
    "block"; "none" leaves the graph as it is), in place; see the module docstring."""
    if policy not in SHARD_BUCKET:
        raise ConfigError(f"shard_bucket={policy!r} is not valid; choose one of "
                          f"{', '.join(map(repr, SHARD_BUCKET))}")
    buckets: list[ShardBucket] = []
    if policy == "block":
        members = _parameter_collectives(gm)
        gathers, scatters = ([r for r in _runs([m for m in members if m.kind == kind])
                              if len(r) > 1] for kind in ("all_gather", "reduce_scatter"))
        ahead = None  # the previous gather bucket's wait: the next one is issued before it
        for run in gathers:
            bucket, ahead = _splice(gm.graph, run, len(buckets), decompositions, ahead)
            buckets.append(bucket)
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        for j, run in enumerate(scatters):  # waited where the next one is issued
            later = scatters[j + 1][-1].node if j + 1 < len(scatters) else output
            buckets.append(_splice(gm.graph, run, len(buckets), decompositions, later)[0])
    gm.meta.setdefault("ccfx", {})["shard_buckets"] = buckets
    if buckets:
        gm.graph.lint()
        gm.recompile()
    return gm


# -- which collectives ---------------------------------------------------------------------------


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if node.op != "call_function" or getattr(target, "namespace", None) != _NAMESPACE:
        return ""
    return target.overloadpacket.__name__ if hasattr(target, "overloadpacket") else ""


def _parameter_collectives(gm: torch.fx.GraphModule) -> list[_Member]:
    """The graph's parameter gathers and gradient reduce-scatters, in node order."""
    out = []
    for node in gm.graph.nodes:
        kind = _KINDS.get(_op_name(node))
        if kind is None or len(node.users) != 1:
            continue
        wait = next(iter(node.users))
        x = node.args[0]
        value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if _op_name(wait) != "wait_tensor" or not isinstance(value, torch.Tensor) \
                or not all(isinstance(d, int) for d in value.shape) or value.dim() == 0:
            continue
        if kind == "all_gather" and not _from_one_input(x):
            continue
        if kind == "reduce_scatter" and not _to_output(wait):
            continue
        reduce_op = str(node.args[1]) if kind == "reduce_scatter" else ""
        key = (_group_name(node), _world(node), reduce_op, value.dtype, _block(node))
        out.append(_Member(node, wait, kind, key))
    return out


def _group_name(node: torch.fx.Node) -> str:
    return str(node.kwargs.get("group_name", node.args[-1]))


def _world(node: torch.fx.Node) -> int:
    """The group size the op carries: ``all_gather_into_tensor(x, W, group)``,
    ``reduce_scatter_tensor(x, op, W, group)``."""
    return int(node.args[1] if _op_name(node) == "all_gather_into_tensor" else node.args[2])


def _from_one_input(x: torch.fx.Node) -> bool:
    """``x`` is computed from exactly one graph input by pure ops (a shard, maybe padded)."""
    seen, stack, inputs = set(), [x], 0
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            inputs += 1
        elif n.op != "call_function" or n.is_impure() or _op_name(n):
            return False
        stack.extend(n.all_input_nodes)
    return inputs == 1


def _to_output(wait: torch.fx.Node) -> bool:
    """The result reaches the graph's output through single-input ops only (a gradient)."""
    stack, seen = [wait], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "output":
                continue
            if len(user.all_input_nodes) != 1:
                return False
            stack.append(user)
    return True


def _block(node: torch.fx.Node) -> str:
    """The node's block: its module path up to the first index ("blocks.3"), "" without one."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    parts = normalize_fqn(list(stack.values())[-1][0]).split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ""


# -- which buckets -------------------------------------------------------------------------------


def _runs(members: Sequence[_Member]) -> list[list[_Member]]:
    """Consecutive members of one key. Decided from the members alone, never from where other
    nodes sit, so that every rank buckets alike: the graphs of ranks with uneven shards differ
    (padding, narrowing) around the same collectives."""
    runs: list[list[_Member]] = []
    for m in members:
        if runs and runs[-1][0].key == m.key:
            runs[-1].append(m)
        else:
            runs.append([m])
    return runs


# -- the bucket ----------------------------------------------------------------------------------


def _splice(graph: torch.fx.Graph, run: list[_Member], index: int, decompositions,
            early: torch.fx.Node | None = None) -> tuple[ShardBucket, torch.fx.Node]:
    """Replace the collectives of ``run`` by one (see the module docstring): a gather issued
    before ``early`` where given (the previous bucket's wait), a reduce-scatter waited before
    ``early`` where that is later than its members' waits (the next bucket's issue). Returns
    the bucket and the node of its wait."""
    gather = run[0].kind == "all_gather"
    pos = {n: i for i, n in enumerate(graph.nodes)}
    issue_at = run[0].node if gather else run[-1].node
    waits = sorted((m.wait for m in run), key=pos.__getitem__)
    wait_at = waits[0] if gather else waits[-1]
    issue_before, wait_before = issue_at, wait_at
    inputs = [m.node.args[0] for m in run]
    if gather:
        issue_before = early if early is not None and pos[early] < pos[issue_at] else issue_at
        _hoist(graph, inputs, issue_before)
    else:  # the gradients' single-input ops to the output, which read a result earlier
        if early is not None and pos[early] > pos[wait_at]:
            wait_before = early
        late = _readers_before(run, wait_before, pos)
    world = _world(issue_at)
    shapes = [tuple(x.meta["val"].shape) for x in inputs]
    issue_args = tuple(issue_at.args[1:])
    target, wait_target = issue_at.target, wait_at.target

    def issue(*xs):
        flat = (torch.cat([x.reshape(-1) for x in xs]) if gather else
                torch.cat([x.reshape(world, -1) for x in xs], dim=1).reshape(-1))
        return target(flat, *issue_args)

    def finish(handle):
        out = wait_target(handle)
        if gather:
            parts = out.reshape(world, -1).split([_numel(s) for s in shapes], dim=1)
            return [wait_target(p.reshape((world * s[0], *s[1:])))
                    for p, s in zip(parts, shapes)]
        parts = out.split([_numel(s) // world for s in shapes])
        return [p.reshape((s[0] // world, *s[1:])) for p, s in zip(parts, shapes)]

    traced = trace_phase(issue, [x.meta["val"] for x in inputs], decompositions)
    handle = splice_traced(graph, traced, inputs, issue_before, ShardBucketFacts(index, 0))
    traced = trace_phase(finish, [handle[0].meta["val"]], decompositions)
    before = wait_before.prev
    outs = splice_traced(graph, traced, handle, wait_before, ShardBucketFacts(index, 1))
    waited = before.next
    if not gather:
        for n in late:
            wait_before.prepend(n)
    for m, out in zip(run, outs):
        m.wait.replace_all_uses_with(out)
    for m in run:
        graph.erase_node(m.wait)
        graph.erase_node(m.node)
    return ShardBucket(run[0].kind, run[0].key[-1], tuple(m.node.name for m in run),
                       tuple(_numel(s) // (1 if gather else world) for s in shapes)), waited


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _readers_before(run: list[_Member], wait_at: torch.fx.Node,
                    pos: dict) -> list[torch.fx.Node]:
    """The nodes reading the results of ``run`` (reduce-scatters: single-input ops on the way
    to the output, :func:`_to_output`) that come before ``wait_at``, in order: they move
    after the bucket's wait."""
    found: set[torch.fx.Node] = set()
    stack = [u for m in run for u in m.wait.users]
    while stack:
        n = stack.pop()
        if n in found or n.op == "output" or pos[n] > pos[wait_at]:
            continue
        found.add(n)
        stack.extend(n.users)
    return sorted(found, key=pos.__getitem__)


def _hoist(graph: torch.fx.Graph, inputs: Sequence[torch.fx.Node], before: torch.fx.Node):
    """Move the nodes computing ``inputs`` that come after ``before`` up before it, in order
    (ops on a shard alone: :func:`_from_one_input` checked they are pure)."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    late: set[torch.fx.Node] = set()
    stack = [x for x in inputs if pos[x] > pos[before]]
    while stack:
        n = stack.pop()
        if n in late or pos[n] < pos[before]:
            continue
        late.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(late, key=pos.__getitem__):
        before.prepend(n)
