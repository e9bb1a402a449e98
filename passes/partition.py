"""partition: a pipeline stage for every node.

Stages are contiguous in the graph's (topological) order, so running the stages one after the
other is running the graph. The cuts are chosen in two steps:

1. balance: cut k aims at the point where the running cost reaches k/S of the total, for the
   cost the config names ("flops", "params" = parameter bytes first used there, "memory" =
   activation bytes);
2. within 5 % of a stage's ideal cost around that point, take the cut with the fewest bytes
   crossing it (a block boundary of a transformer carries one tensor; its inside carries two).

A position is never a cut when a non-tensor value (a tuple of a multi-output op, a list)
would cross it: such values stay inside one stage with their ``getitem`` users.

Parameters and buffers are not activations: they live in the stage(s) that use them. One used
in several stages (tied embeddings) is *shared*; a real pipeline keeps a copy per stage and sums
their gradients, which is what one process computes anyway. Graph inputs enter stage 0, except
inputs mutated in place: those stay where they are (the caller must see the mutation).

If the graph has fewer cost-bearing nodes than stages, ccfx uses fewer stages and warns
(``CcfxWarning``) rather than failing: a small graph next to a graph break is common. With
``split_points``, the cuts are exactly before those modules. A graph holding stage markers
(``ccfx.stage_boundary()``, which is ``torch.distributed.pipelining.pipe_split()``) is cut
exactly at them, one stage more than markers; the markers are then removed from the graph.

Graph breaks: a model Dynamo captures as several graphs reaches ccfx one graph at a time, in
execution order. ``stages`` is what the user wants for the *model*, so a graph too small to be
worth a pipeline stage is **left whole** (one stage, no cut, no codec): a graph whose FLOPs are
below ``WHOLE_BELOW`` (1 %) of the model's FLOPs seen so far (``flops_before``, the other graphs
compiled before it, plus its own). A loss function after a break, or a tail of a few FLOPs, is
never a pipeline stage of its own. The first graph (``flops_before`` 0 or None) is measured
against itself and always gets its stages; when no graph of the model costs anything, nothing
is left whole (the small-graph rule above applies). Markers and ``split_points`` are explicit
and always obeyed. ``PartitionFacts.left_whole`` says why, and a note in the plan repeats it.

Facts: a :class:`~ccfx.passes.facts.StageFacts` on every node (with ``stages``, all user
stages, on placeholders and ``get_attr`` nodes), and a
:class:`~ccfx.passes.facts.PartitionFacts` in ``gm.meta["ccfx"]["partition"]``.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence

import sympy
import torch
import torch.fx

from ccfx import cost as costs
from ccfx.errors import CcfxWarning, PartitionError

from .facts import NodeFacts, PartitionFacts, StageFacts, need, put, stage_of
from .graph_utils import is_stage_marker, module_paths, val

WINDOW = 0.05
#: A graph below this share of the model's FLOPs seen so far is left whole (one stage).
WHOLE_BELOW = 0.01
STATE_KINDS = ("param", "buffer")


def _is_inplace(node: torch.fx.Node) -> bool:
    name = costs.op_name(node)
    return (name.endswith("_") and not name.startswith("_")) or name.startswith("__i")


def _mutated_inputs(ops: list[torch.fx.Node]) -> set[torch.fx.Node]:
    out = set()
    for n in ops:
        if _is_inplace(n) and n.args and isinstance(n.args[0], torch.fx.Node):
            target = n.args[0]
            if target.op == "placeholder" and need(target, NodeFacts).kind == "input":
                out.add(target)
    return out


def _node_costs(ops: list[torch.fx.Node], balance: str) -> list[sympy.Expr]:
    if balance == "flops":
        return [need(n, NodeFacts).flops for n in ops]
    if balance == "memory":
        return [need(n, NodeFacts).bytes for n in ops]
    seen: set[torch.fx.Node] = set()
    out = []
    for n in ops:
        c = sympy.Integer(0)
        for a in n.all_input_nodes:
            f = need(a, NodeFacts)
            if f.kind in STATE_KINDS and a not in seen:
                seen.add(a)
                c += f.bytes
        out.append(c)
    return out


def _crossing(gm, ops, index, skip) -> tuple[list[int], list[int]]:
    """Per cut position p (cut before ops[p]): bytes crossing it, and how many non-tensor
    values would cross it (a cut there is not allowed)."""
    n = len(ops)
    nbytes = [0] * (n + 1)
    blocked = [0] * (n + 1)
    for node in gm.graph.nodes:
        if node.op == "output" or node in skip or not node.users:
            continue
        if node.op == "placeholder" and need(node, NodeFacts).kind != "input":
            continue
        start = index.get(node, -1) + 1
        last = max(index.get(u, n) for u in node.users)
        if last < start:
            continue
        value = val(node)
        if isinstance(value, torch.Tensor):
            b = need(node, NodeFacts).bytes_hint
            nbytes[start] += b
            nbytes[min(last + 1, n)] -= b
        elif not isinstance(value, (torch.SymInt, int, float, bool)):
            blocked[start] += 1
            blocked[min(last + 1, n)] -= 1
    for p in range(1, n + 1):
        nbytes[p] += nbytes[p - 1]
        blocked[p] += blocked[p - 1]
    return nbytes, blocked


def _split_point_cuts(ops, split_points, valid, notes) -> list[int]:
    cuts = []
    for fqn in split_points:
        pos = next((i for i, n in enumerate(ops)
                    if any(p == fqn or p.startswith(fqn + ".") for p in module_paths(n))), None)
        if pos is None:
            names = sorted({p for n in ops for p in module_paths(n) if p.count(".") <= 1})
            raise PartitionError(
                f"split point {fqn!r} matches no module in the graph; modules seen: "
                f"{', '.join(names[:40]) or '(none: the graph has no module information)'}"
            )
        moved = next((p for p in range(max(pos, 1), len(ops)) if valid[p]), None)
        if moved is None:
            raise PartitionError(f"no valid cut at or after split point {fqn!r}")
        if moved != pos:
            notes.append(f"split point {fqn!r} moved {moved - pos} node(s) later to keep a "
                         f"multi-output op with its users")
        if cuts and moved <= cuts[-1]:
            raise PartitionError(
                f"split points must follow the order of execution: {fqn!r} comes before "
                f"{split_points[len(cuts) - 1]!r} in the graph"
            )
        cuts.append(moved)
    return cuts


def _marker_cuts(ops, markers, stages, valid, notes) -> list[int]:
    """One cut right after each marker (moved later only to keep a multi-output op whole)."""
    if stages not in (1, len(markers) + 1):
        raise PartitionError(
            f"this graph has {len(markers)} stage_boundary() marker(s), making "
            f"{len(markers) + 1} stages, but stages={stages}; drop `stages` (the markers decide) "
            f"or change the markers"
        )
    cuts: list[int] = []
    for m in markers:
        moved = next((p for p in range(m + 1, len(ops)) if valid[p]), None)
        start = cuts[-1] if cuts else 0
        empty = not any(not is_stage_marker(n) for n in ops[start:m])
        if empty or moved is None or not any(not is_stage_marker(n) for n in ops[moved:]):
            raise PartitionError(
                f"stage_boundary() marker {ops[m].name} leaves a stage with no computation "
                "(it comes first, last, or right after another marker); remove it"
            )
        if moved != m + 1:
            notes.append(f"stage marker {ops[m].name} moved {moved - m - 1} node(s) later to "
                         "keep a multi-output op with its users")
        cuts.append(moved)
    return cuts


def _balanced_cuts(prefix, crossing, valid, stages) -> list[int]:
    total = prefix[-1]
    ideal = total / stages
    positions = [p for p in range(1, len(prefix) - 1) if valid[p]]
    cuts: list[int] = []
    for k in range(1, stages):
        remaining = stages - 1 - k  # cuts still to place after this one
        lo = bisect.bisect_right(positions, cuts[-1]) if cuts else 0
        hi = len(positions) - remaining
        options = positions[lo:hi]
        if not options:
            raise PartitionError(f"cannot place {stages - 1} cuts in this graph")
        target = k * ideal
        near = [p for p in options if abs(prefix[p] - target) <= WINDOW * ideal]
        if near:
            best = min(near, key=lambda p: (crossing[p], abs(prefix[p] - target), p))
        else:
            best = min(options, key=lambda p: (abs(prefix[p] - target), crossing[p], p))
        cuts.append(best)
    return cuts


def partition(
    gm: torch.fx.GraphModule,
    stages: int = 1,
    balance: str = "flops",
    split_points: Sequence[str] | None = None,
    flops_before: int | None = None,
) -> torch.fx.GraphModule:
    """``flops_before``: the FLOPs, at the example shapes, of the graphs of the same model
    compiled before this one (graph breaks; None or 0 for the first): below ``WHOLE_BELOW`` of
    the model's FLOPs seen so far, the graph is left whole."""
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    index = {n: i for i, n in enumerate(ops)}
    notes: list[str] = []
    hints = gm.meta.get("ccfx", {}).get("hints", {})
    node_costs, values = _costs_or_count(ops, balance, hints, notes)
    prefix = _prefix_sums(values)

    mutated = _mutated_inputs(ops)
    if mutated:
        notes.append("inputs mutated in place stay uncompressed: "
                     + ", ".join(sorted(n.name for n in mutated)))
    crossing, blocked = _crossing(gm, ops, index, mutated)
    valid = [b == 0 for b in blocked]

    requested = stages
    markers = [i for i, n in enumerate(ops) if is_stage_marker(n)]
    if markers and split_points:
        raise PartitionError("the model has stage_boundary() markers and split_points were "
                             "given: use one or the other")
    left_whole = ""
    if markers:
        cuts = _marker_cuts(ops, markers, stages, valid, notes)
        requested = len(cuts) + 1
    elif split_points:
        cuts = _split_point_cuts(ops, list(split_points), valid, notes)
    elif stages > 1 and (left_whole := _holds_no_parameters(gm)
                         or _too_small(gm, flops_before or 0)):
        notes.append(left_whole)
        cuts = []
    else:
        cuts = _usable_balanced_cuts(values, prefix, crossing, valid, stages, balance, notes)
    num_stages = len(cuts) + 1
    _assign_stages(gm, ops, cuts, num_stages, mutated)

    for i in markers:
        gm.graph.erase_node(ops[i])
    if markers:
        gm.recompile()

    stage_costs = _stage_costs(node_costs, cuts)
    gm.meta.setdefault("ccfx", {})["partition"] = PartitionFacts(
        requested=requested,
        num_stages=num_stages,
        balance=balance,
        cuts=tuple(ops[c].name for c in cuts),
        crossing_bytes=tuple(crossing[c] for c in cuts),
        stage_costs=tuple(stage_costs),
        stage_cost_values=tuple(costs.evaluate(c, hints) for c in stage_costs),
        notes=tuple(notes),
        left_whole=left_whole,
    )
    return gm


def _prefix_sums(values: list) -> list:
    """``prefix[i]``: the cost of the first ``i`` ops (``prefix[0] == 0``)."""
    prefix = [0]
    for v in values:
        prefix.append(prefix[-1] + v)
    return prefix


def _stage_costs(node_costs: list, cuts: list[int]) -> list:
    """Each stage's cost (symbolic): the sum of its ops' between the cuts."""
    bounds = [0, *cuts, len(node_costs)]
    return [sum(node_costs[bounds[s]:bounds[s + 1]], sympy.Integer(0))
            for s in range(len(cuts) + 1)]


def _costs_or_count(ops: list[torch.fx.Node], balance: str, hints: dict,
                    notes: list[str]) -> tuple[list, list]:
    """Each op's cost (symbolic) and its value at the hints; one per node where the graph
    has no cost of ``balance`` at all (a note says so)."""
    node_costs = _node_costs(ops, balance)
    values = [costs.evaluate(c, hints) for c in node_costs]
    if sum(values) == 0:
        notes.append(f"no {balance} cost in this graph: balanced by node count")
        node_costs = [sympy.Integer(1)] * len(ops)
        values = [1] * len(ops)
    return node_costs, values


def _usable_balanced_cuts(values: list, prefix: list, crossing: list, valid: list[bool],
                          stages: int, balance: str, notes: list[str]) -> list[int]:
    """Balanced cuts for ``stages`` stages, or as many as the graph's cost-bearing nodes and
    possible cuts allow (a warning and a note say how many)."""
    bearing = sum(1 for v in values if v > 0)
    n_valid = sum(valid[1:len(values)])
    usable = max(1, min(stages, bearing, n_valid + 1))
    if usable < stages:
        msg = (f"this graph has {bearing} node(s) with {balance} cost and {n_valid} possible "
               f"cut(s): using {usable} stage(s) instead of {stages}")
        warnings.warn(f"ccfx: {msg}", CcfxWarning, stacklevel=3)
        notes.append(msg)
    return _balanced_cuts(prefix, crossing, valid, usable)


def _assign_stages(gm: torch.fx.GraphModule, ops: list[torch.fx.Node], cuts: list[int],
                   num_stages: int, mutated) -> None:
    """Each op's stage from the cuts; the output on the last stage; a placeholder or
    attribute on the stages that use it (state and mutated inputs pinned: replicated where
    used, never sent)."""
    for i, n in enumerate(ops):
        put(n, StageFacts(bisect.bisect_right(cuts, i)))
    for n in gm.graph.nodes:
        if n.op == "output":
            put(n, StageFacts(num_stages - 1))
        elif n.op == "placeholder" or n.op == "get_attr":
            user_stages = tuple(sorted({stage_of(u) for u in n.users} - {None}))
            if need(n, NodeFacts).kind in STATE_KINDS or n.op == "get_attr" or n in mutated:
                # replicated where used, never sent
                put(n, StageFacts(user_stages[0] if user_stages else 0, user_stages, pinned=True))
            else:
                put(n, StageFacts(0, user_stages))


def graph_flops(gm: torch.fx.GraphModule) -> int:
    """The graph's FLOPs at the example shapes (annotate's ``flops_hint``, summed)."""
    return sum(need(n, NodeFacts).flops_hint for n in gm.graph.nodes
               if n.op not in ("placeholder", "output"))


def uses_parameters(gm: torch.fx.GraphModule) -> bool:
    """Whether any node of the graph is a parameter: a placeholder or ``get_attr`` annotate
    calls "param", or a Dynamo placeholder whose source is a module's ``_parameters`` (annotate
    sees a Parameter only when it is given the example inputs)."""
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "get_attr"):
            continue
        if need(n, NodeFacts).kind == "param":
            return True
        source = getattr(n.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", "") if source is not None else ""
        if "_parameters" in (name() if callable(name) else str(name)):
            return True
    return False


def _holds_no_parameters(gm: torch.fx.GraphModule) -> str:
    """Why this graph is left whole for want of parameters ("" when it uses some). Pipeline
    stages exist to hold parameters: code that holds none (mask creation or input scaling
    before a graph break, a loss function after one) is not split, whatever its FLOPs and
    wherever it comes in the model, even first, before anything bigger has been seen."""
    if uses_parameters(gm):
        return ""
    return (f"left whole (one stage, no cut, no codec): the graph uses no parameters "
            f"({graph_flops(gm)} FLOP), and pipeline stages exist to hold parameters")


def _too_small(gm: torch.fx.GraphModule, flops_before: int) -> str:
    """Why this graph is left whole ("" when it is worth its stages)."""
    mine = graph_flops(gm)
    seen = flops_before + mine
    if seen <= 0 or mine >= WHOLE_BELOW * seen:
        return ""
    return (f"left whole (one stage, no cut, no codec): {mine} FLOP, {100 * mine / seen:.2g} % "
            f"of the model's {seen} FLOP seen so far; a graph below {100 * WHOLE_BELOW:g} % "
            "is not worth a pipeline stage")
