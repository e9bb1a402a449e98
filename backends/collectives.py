"""Compressed collectives: the compile layer's decisions for every functional collective.

aot_autograd hands the backend's compilers a forward, backward or inference graph; the
collectives in it (``torch.ops._c10d_functional.*`` + ``wait_tensor``, from DTensor tensor or
sequence parallel, sharded parameters gathered in the graph, the user's funcol code) are
found by ``passes.compress_collectives``. Here, once per graph, ccfx decides what each one
becomes and writes it down:

* its **index**, the plan's: counted over the graph's forward then its backward (the backward
  compiles with the forward, ``lowering``), or over its inference graph;
* its **codec**: ``collective_overrides`` by index (``"collective 3"``), else by kind, else
  ``collective_codec``; ``"none"`` keeps the collective as it is, and so does a codec the
  wire layer refuses (:func:`ccfx.wire.collectives.refuse`: a max reduction, integer data, a
  group of one) or a graph shape the pass cannot rewrite; the plan row says why;
* **agreement**: the ranks of each group meet (:func:`ccfx.wire.agree.meet`) on the graph's
  description and the rows of the collectives they run together, before any of them runs:
  ranks that compiled different collectives, or gave different codecs, fail at compile time
  with an error naming what differs, not with gloo's size mismatch or a hang. Groups are met
  in the order of their ranks, the same total order on every rank, so ranks that share
  several groups (a 2-D mesh) never wait for each other crosswise. A graph one rank alone
  recompiles (an MoE's uneven batch) whose collectives are ones the group met on needs no
  meeting (``auto`` takes the group's decisions for them again); one whose codecs differ
  meets, and every call of an agreed graph records the group's step it enters
  (:func:`ccfx.wire.agree.entering`): the rank that recompiled then sees its peer waiting for
  it in a collective and fails within a poll, saying which codecs differ;
* **codec state** (error feedback): tensors made here, registered in the backend's
  ``codec_state`` under ``graph<g>.collective<j>[.<part>].<name>``
  (:mod:`ccfx.codecs.state`), passed to the compiled graph as extra inputs at every call;
* the **plan rows** (:class:`ccfx.plan.Collective`) and the **ledger**: the compiled graph is
  wrapped so that each call appends the state tensors and, once it returned, counts every
  collective's raw and wire bytes (direction ``"collective"``). An expert all-to-all whose
  row count is data-dependent (``.tolist()`` under ``capture_scalar_outputs``) has no bytes
  per call at compile time: its row quotes one row's bytes (``per_row``, and the reason says
  so); the ledger counts each call's bytes from the row count's symbols among the host ints
  the graph takes or returns (the backward takes the split sizes, the forward returns them
  for it: no device sync, no change to the graph), and only its calls where they are not
  there; ``auto`` keeps it raw, saying why (an unbacked size's hint is a guess, not a price).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.fx

from ccfx import _torch_compat as tc
from ccfx import codecs
from ccfx.codecs.state import CodecState
from ccfx.config import AUTO, Config
from ccfx.errors import CollectiveError, first_line
from ccfx.passes.compress_collectives import (
    FoundCollective,
    Rewrite,
    compress_collectives,
    find_collectives,
)
from ccfx.passes.graph_utils import copy_graph, device_of
from ccfx.passes.shard_buckets import bucket_shard_collectives
from ccfx.plan import Collective, GraphPlan
from ccfx.runtime.ledger import Ledger
from ccfx.wire.world import dist as _dist

log = logging.getLogger("ccfx")

WHAT = "the collectives of a compiled graph"
HINT = ("Every rank of a group must compile the same model with the same collective_codec and "
        "collective_overrides: ranks whose collectives or codecs differ would pair different "
        "messages (gloo aborts with a size mismatch, or hangs).")


def collective_channel(graph: int, index: int) -> str:
    """The codec-state channel of graph ``graph``'s collective ``index``:
    ``graph0.collective3`` (a state name ``chunk0001.residual`` lives in the channel
    ``graph0.collective3.chunk0001``)."""
    return f"graph{graph}.collective{index}"


def active() -> bool:
    """Whether a process group exists (functional collectives need one): only then does the
    backend look for collectives."""
    return _dist() is not None


def _group(name: str):
    return tc.resolve_process_group(name)


def _backend(name: str) -> str:
    """The process group's backend ("gloo", "nccl"...), "" where it cannot be told."""
    dist = _dist()
    try:
        return str(dist.get_backend(_group(name))) if dist is not None else ""
    except (RuntimeError, ValueError, AttributeError):
        return ""


def group_size(name: str) -> int:
    return _group(name).size()


def group_ranks(name: str) -> tuple[int, ...]:
    dist = _dist()
    if dist is None:
        return (0,)
    return tuple(dist.get_process_group_ranks(_group(name)))


class Collectives:
    """The compressed collectives of one compiled model (one per backend)."""

    def __init__(self, config: Config, ledger: Ledger, state: CodecState,
                 world_of: Callable[[str], int] = group_size,
                 ranks_of: Callable[[str], tuple[int, ...]] = group_ranks):
        self.config = config
        self.ledger = ledger
        self.state = state
        self.world_of = world_of
        self.ranks_of = ranks_of
        #: What this model's ranks already met on, per graph part and group: the collectives'
        #: agreed rows without the graph (see :meth:`_agree`).
        self._agreed: set[str] = set()
        #: The rows met on, by graph part and group: ``(graph, rows)`` (what a recompiled
        #: graph's rows are compared with, for its peers' errors).
        self._agreed_rows: dict[tuple[str, str], list[tuple[int, list]]] = {}
        #: ``auto``'s decisions by the collective they were made for, without the graph
        #: (:func:`_same_collective`): ``(spec, why, graph)``. A graph recompiled with the same
        #: collectives (an MoE whose split sizes became symbolic on one rank) takes them again.
        self._decided: dict[tuple, tuple[str, str, int]] = {}

    def rewrite(self, plan: GraphPlan, desc: dict, part: str, gm: torch.fx.GraphModule,
                compile_fn: Callable[[torch.fx.GraphModule], Callable], decompositions=None):
        """Compile ``gm`` (the ``part`` graph of ``plan``'s graph) with its collectives
        compressed as the options say: a boxed callable. Without collectives, ``compile_fn(gm)``
        itself."""
        found = find_collectives(gm, self.world_of)
        if not found:
            return compile_fn(gm)
        gm, found = self._bucket(plan, part, gm, found, decompositions)
        base = len(plan.collectives)
        with tc.unset_fake_temporarily():  # compiled inside AOT's fake mode: real timings
            auto = self._plan_auto(plan, desc, part, gm, found, base)
        rewrites = [self._decide(base + f.position, f, auto) for f in found]
        counters = _row_counters(gm, found, rewrites)
        rows = [self._row(plan.index, part, f, r, f.position in counters)
                for f, r in zip(found, rewrites)]
        counters = {base + pos: fn for pos, fn in counters.items()}
        agreed = self._agree(plan.index, desc, part, found, rows)

        with tc.unset_fake_temporarily():  # compiled inside AOT's fake mode: real state tensors
            device = device_of(gm)
            for r in rewrites:
                if r.compressed is not None:
                    r.state = r.compressed.init_state(device)
                    self._register(plan.index, r)
        rewritten = compress_collectives(copy_graph(gm), found, rewrites, decompositions,
                                         lambda name, world: self._comm(name, world, device))
        plan.collectives.extend(rows)
        log.info("ccfx: graph %d %s: %d collective(s), %d compressed", plan.index, part,
                 len(rows), sum(r.codec != "none" for r in rows))
        compiled = compile_fn(rewritten)
        by_index = {r.index: r for r in rewrites}
        extra = [by_index[i].state[name]
                 for i, name in rewritten.meta["ccfx"]["collective_state_inputs"]]
        described = "; ".join(f"collective {c.index}: {c.kind} {c.codec} on group {c.group!r} "
                              f"of {c.group_size}" for c in rows if c.codec != "none")
        return _counting(compiled, extra, self.ledger, plan.index,
                         [(c.index, 0, 0) if c.per_row and c.index not in counters
                          else (c.index, c.raw_bytes, c.wire_bytes) for c in rows],
                         f"the {part} of graph {plan.index}" if described else "", described,
                         counters, agreed)

    def _bucket(self, plan: GraphPlan, part: str, gm: torch.fx.GraphModule,
                found: Sequence[FoundCollective], decompositions):
        """``ccfx.shard``'s parameter collectives merged per block as ``shard_bucket`` says
        (:mod:`ccfx.passes.shard_buckets`) on a copy of ``gm``, and the copy's collectives;
        ``gm`` and ``found`` themselves where nothing merges. The plan notes the buckets."""
        if self.config.shard_bucket == "none" or sum(
                f.kind in ("all_gather", "reduce_scatter") for f in found) < 2:
            return gm, found
        bucketed = bucket_shard_collectives(copy_graph(gm), self.config.shard_bucket,
                                            decompositions)
        buckets = bucketed.meta["ccfx"]["shard_buckets"]
        if not buckets:
            return gm, found
        merged = sum(len(b.members) for b in buckets)
        plan.notes.append(
            f"shard_bucket={self.config.shard_bucket!r}: the {part} of graph {plan.index} "
            f"merges {merged} parameter collectives into {len(buckets)} (one per block: "
            + ", ".join(f"{b.kind} {b.block or '(outside blocks)'} x{len(b.members)}"
                        for b in buckets) + ")")
        return bucketed, find_collectives(bucketed, self.world_of)

    def _comm(self, group_name: str, world: int, device):
        """The comm the compressed phases issue through: on a gloo group of CPU tensors their
        waits give up after ``collective_timeout_s`` (the group is the user's: ccfx leaves its
        timeout alone). Elsewhere torch's own wait: a CUDA wait orders streams (the waiting
        thread's current stream) rather than blocking, and NCCL has its own watchdog."""
        from ccfx.wire.comm import FunctionalComm
        from ccfx.wire.deadline import DeadlineComm

        on_cpu = device is None or torch.device(device).type == "cpu"
        if not on_cpu or _backend(group_name) != "gloo":
            return FunctionalComm(group_name, world)
        return DeadlineComm(group_name, world, self.config.collective_timeout_s)

    # -- decisions ------------------------------------------------------------------------

    def _decide(self, index: int, f: FoundCollective,
                auto: dict[int, tuple[str, str]]) -> Rewrite:
        from ccfx.wire.collectives import CompressedCollective, refuse

        spec, source = self.config.collective_spec(index, f.kind or f.op)
        if f.problem:
            return Rewrite(index, "none", f.problem)
        if spec == AUTO:
            if index not in auto and _sized_at_run_time(f):
                return Rewrite(index, "none", (
                    f"{source}='auto' kept it raw: its split sizes {f.input_splits} are only "
                    "known at run time (data-dependent), and auto does not price a guess; name "
                    "a codec for it (collective_overrides={'all_to_all': 'int8'}) to compress "
                    "it"))
            if index not in auto:
                return Rewrite(index, "none", f"{source}='auto': a group of one, nothing to price")
            spec, why = auto[index]
            if spec == "none":
                return Rewrite(index, "none", f"{source}='auto' kept it raw: {why}")
            source = chose = f"{source}='auto' (chose {spec}: {why})"
        else:
            chose = ""
        spec = codecs.canonical(spec)
        if spec == "none":
            return Rewrite(index, "none", f"{source} is 'none'")
        why = refuse(f.call, spec)
        if why is not None:
            return Rewrite(index, "none", f"{source}={codecs.spelled(spec)!r} refused: {why}")
        return Rewrite(index, spec, chose, CompressedCollective(f.call, spec))

    def _plan_auto(self, plan: GraphPlan, desc: dict, part: str, gm: torch.fx.GraphModule,
                   found: Sequence[FoundCollective], base: int) -> dict[int, tuple[str, str]]:
        """``collective_codec="auto"``: the planner's codec and reason for each collective the
        options leave to it (:mod:`ccfx.planner.plan_collectives`), decided per group by the
        group's first rank and taken by every rank of it (measured timings differ between
        ranks, the codecs must not); the decisions and the predicted time go into the plan."""
        from ccfx.planner.plan_collectives import GraphCollective, plan_collective_codecs
        from ccfx.wire import agree

        asked: dict[str, list[GraphCollective]] = {}
        out: dict[int, tuple[str, str]] = {}
        by_index = {base + f.position: f for f in found}
        for f in found:
            index = base + f.position
            if self.config.collective_spec(index, f.kind or f.op)[0] != AUTO:
                continue
            again = self._decided.get(_same_collective(part, index, f))
            if again is not None and not f.problem and f.call is not None:
                # the group decided this collective for an earlier graph (every rank took
                # the answer): a recompile (symbolic split sizes, another token count) takes
                # it again, on every rank alike, without asking (a peer that did not
                # recompile never would answer)
                spec, why, graph = again
                out[index] = (spec, f"{why}; decided for graph {graph}, the same collective")
                continue
            if (f.problem or f.call is None or f.world < 2 or f.wait is None
                    or _sized_at_run_time(f)):  # nothing to price: _decide says so
                continue
            asked.setdefault(f.group_name, []).append(GraphCollective(
                index, f.call, f.node, f.wait, _backend(f.group_name)))
        groups = sorted(asked, key=lambda name: (self.ranks_of(name), name))
        for name in groups:
            mine = asked[name]
            question = {"graph": desc, "part": part, "collectives": [
                [c.index, c.call.kind,  # unequal all_to_all splits: rows differ by rank
                 ["rows", *c.call.shape[1:]] if c.call.by_rows else list(c.call.shape),
                 str(c.call.dtype), c.call.world, c.call.reduce_op] for c in mine]}
            ranks = self.ranks_of(name) if _dist() is not None else None
            chosen, decisions, predicted = agree.from_rank0(
                "collective_codec='auto' for a graph's collectives", question,
                lambda mine=mine, ranks=ranks: plan_collective_codecs(
                    gm, part, mine, self.config, ranks=ranks),
                ranks=ranks, timeout_s=self.config.collective_timeout_s, hint=HINT)
            why = {int(d.what.split()[-1]): d.reason for d in decisions}
            out.update({i: (spec, why.get(i, "")) for i, spec in chosen.items()})
            for i, spec in chosen.items():
                self._decided.setdefault(_same_collective(part, i, by_index[i]),
                                         (spec, why.get(i, ""), plan.index))
            plan.decisions.extend(decisions)
            _add_prediction(plan, predicted)
        return out

    @staticmethod
    def _row(graph: int, part: str, f: FoundCollective, r: Rewrite,
             counted: bool = False) -> Collective:
        per_row = f.call is not None and f.call.symbolic_rows
        if per_row:  # rows known only at run time: one row's bytes, and the plan says so
            raw = f.call.row_bytes
            wire = int(r.compressed.row_wire_bytes()) if r.compressed is not None else raw
            ledger = ("the ledger counts each call's bytes" if counted else
                      "the ledger counts its calls, not its bytes: the graph neither takes "
                      "nor returns that count")
            note = f"bytes per row ({f.shape[0]} rows a call, known at run time; {ledger})"
            reason = f"{r.reason}; {note}" if r.reason else note
        else:
            raw = _raw_bytes(f)
            wire = int(r.compressed.wire_bytes()) if r.compressed is not None else raw
            reason = r.reason
        return Collective(graph=graph, index=r.index, part=part, kind=f.kind or f.op,
                          group=f.group_name, group_size=f.world, shape=list(f.shape),
                          dtype=str(f.dtype), codec=r.codec, raw_bytes=raw, wire_bytes=wire,
                          reduce_op=f.reduce_op, reason=reason, per_row=per_row)

    def _agree(self, graph: int, desc: dict, part: str, found: Sequence[FoundCollective],
               rows: Sequence[Collective]) -> list[tuple[str, tuple[int, ...]]]:
        """The ranks of every group meet on the graph and the rows of that group's
        collectives (see the module docstring); a group whose collectives the options leave
        uncompressed does not: torch's own collectives run there, as under inductor, and no
        rank waits for a peer at compile time (an expert-parallel model that recompiles on one
        rank only, a graph one rank compiles alone, keep running as they would without ccfx).
        Returns the groups (name, ranks) that agree: each call of the graph says when it
        enters their collectives (see :func:`_counting`)."""
        if _dist() is None:
            return []
        from ccfx.wire import agree

        # where this rank runs: a peer's error names this rank by it should it die or freeze
        # on the user's group (DeviceMesh, ccfx.shard), as on ccfx's own (wire.blame)
        agree.publish_process()
        agreed = []
        groups = {}
        for f in found:
            if f.group_name and f.group_name not in groups:
                groups[f.group_name] = self.ranks_of(f.group_name)
        for name, ranks in sorted(groups.items(), key=lambda kv: (kv[1], kv[0])):
            if len(ranks) < 2:
                continue
            asked = {self.config.collective_spec(c.index, c.kind)[0]
                     for f, c in zip(found, rows) if f.group_name == name}
            if asked == {"none"}:
                continue
            agreed.append((name, ranks))
            mine = [[c.index, c.kind, c.reduce_op, f.agreed_shape, c.dtype, c.codec]
                    for f, c in zip(found, rows) if f.group_name == name]
            # A graph recompiled on this rank alone (an MoE's resumed graph when its own
            # routing counts change) whose collectives are ones the group already met on runs
            # the same messages as the peers' graph: no new meeting (the peers never come)
            same = agree.fingerprint({"part": part, "group": name, "collectives": mine})
            if same in self._agreed:
                continue
            differs = self._differs(part, name, mine, rows)
            if differs:  # the peers' errors quote it, should they wait for this rank
                agree.note_compile(
                    f"rank {_dist().get_rank()} compiled the {part} of graph {graph} with the "
                    f"collectives of graph {differs[0]} on group {name!r}, but their codecs "
                    f"differ: {'; '.join(differs[1:])}")
            agree.meet(WHAT, {"graph": desc, "part": part, "group": name, "collectives": mine},
                       ranks, timeout_s=self.config.collective_timeout_s, hint=HINT)
            self._agreed.add(same)
            self._agreed_rows.setdefault((part, name), []).append((graph, mine))
        return agreed

    def _differs(self, part: str, name: str, mine: list, rows: Sequence[Collective]) -> list:
        """Where ``mine`` (a graph's agreed rows on group ``name``) are the collectives of an
        earlier agreement of this model but with other codecs (a recompile on this rank): that
        graph, then one sentence per collective whose codec differs; else ``[]``."""
        why = {c.index: c.reason for c in rows}
        for graph, theirs in self._agreed_rows.get((part, name), ()):
            if [r[:-1] for r in theirs] != [r[:-1] for r in mine]:
                continue
            changed = [(a, b) for a, b in zip(mine, theirs) if a[-1] != b[-1]]
            reasons = list(dict.fromkeys(_clip(why[a[0]]) for a, _ in changed if why[a[0]]))
            return [graph, ", ".join(f"collective {a[0]} ({a[1]}) {b[-1]} there, {a[-1]} here"
                                     for a, b in changed)
                    + (f" ({'; '.join(reasons[:2])})" if reasons else "")]
        return []

    def _register(self, graph: int, r: Rewrite) -> None:
        """``r``'s state tensors in the backend's codec state (names with a dot go one channel
        deeper: ``chunk0001.residual`` is ``residual`` of ``<channel>.chunk0001``)."""
        base = collective_channel(graph, r.index)
        by_channel: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in r.state.items():
            sub, _, leaf = name.rpartition(".")
            by_channel.setdefault(f"{base}.{sub}" if sub else base, {})[leaf] = t
        for channel, tensors in by_channel.items():
            self.state.add(channel, r.codec, tensors)


def _add_prediction(plan: GraphPlan, predicted) -> None:
    """The graph's predicted time: the forward's and the backward's collectives add up; a
    prediction made for other choices (cut edges, buckets) stays, and this one is a note."""
    from ccfx.planner.collective_model import SCHEDULE

    have = plan.prediction
    if have is None:
        plan.prediction = predicted
    elif have.schedule == SCHEDULE:
        have.uncompressed_s += predicted.uncompressed_s
        have.chosen_s += predicted.chosen_s
        have.compute = f"{have.compute}; {predicted.compute}"
    else:
        plan.notes.append(f"collective_codec='auto' predicts {predicted.uncompressed_s:.4g} s "
                          f"uncompressed, {predicted.chosen_s:.4g} s as chosen for the "
                          "collectives' graph part")


def _same_collective(part: str, index: int, f: FoundCollective) -> tuple:
    """What makes two graphs' collectives the same one for ``auto`` and for the ranks'
    agreement: the graph part, its group, index, kind, reduction, agreed shape (an expert
    all-to-all's rows apart) and dtype; the graph itself left out (a recompile changes its
    code)."""
    return (part, f.group_name, index, f.kind or f.op, f.reduce_op, str(f.agreed_shape),
            str(f.dtype))


def unmatched_overrides(config: Config, rows: Sequence[Collective]):
    """The :class:`ccfx.ConfigError` for ``collective_overrides`` keys that name no collective
    among ``rows`` (every graph compiled so far): an index none has, a kind none is. Accepted,
    they would silently change nothing. None when every key matches."""
    from ccfx.config import COLLECTIVE_KINDS
    from ccfx.errors import ConfigError

    keys = [key for key, _ in config.collective_overrides or ()]
    named = {f"collective {c.index}" for c in rows} | {c.kind for c in rows}
    unmatched = [key for key in keys if key not in named]
    if not unmatched:
        return None
    listed = "\n".join(
        f"  collective {c.index}: {c.kind}{f' ({c.reduce_op})' if c.reduce_op else ''}, graph "
        f"{c.graph} {c.part}, group {c.group!r} of {c.group_size}, {tuple(c.shape)} {c.dtype}"
        for c in rows) or "  (none: no functional collective was compiled)"
    return ConfigError(
        f"collective_overrides key(s) {', '.join(map(repr, unmatched))} match no collective of "
        f"this model, so they would change nothing. Its collectives (as ccfx.plan_of(compiled) "
        f"prints them):\n{listed}\nWrite 'collective N' with N one of those indices (counted "
        "over each graph's forward then backward; it applies in every graph) or a kind ("
        f"{', '.join(COLLECTIVE_KINDS)}) for every collective of that kind.")


def _clip(text: str, n: int = 400) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _sized_at_run_time(f: FoundCollective) -> bool:
    """An all_to_all with unequal splits whose split sizes are symbolic (data-dependent: the
    router's counts read with ``.tolist()`` under ``capture_scalar_outputs``)."""
    call = f.call
    return call is not None and call.by_rows and not all(
        isinstance(v, int) for v in (*(f.input_splits or ()), *(f.output_splits or ())))


def _raw_bytes(f: FoundCollective) -> int:
    """What the uncompressed collective sends from this rank per call (the wire layer's
    convention), 0 for one ccfx does not know."""
    call = f.call
    if call is None:
        return 0
    try:
        return int(call.raw_bytes)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0


#: Bytes of one call of a collective whose row count is symbolic, from the graph's int
#: inputs (position -> value) and its outputs of that call: ``(inputs, outputs) -> (raw,
#: wire)``.
RowCounter = Callable[[dict, Sequence], tuple[int, int]]


def _row_counters(gm: torch.fx.GraphModule, found: Sequence[FoundCollective],
                  rewrites: Sequence[Rewrite]) -> dict[int, RowCounter]:
    """For each collective whose row count is symbolic (an expert all-to-all under
    ``capture_scalar_outputs``: ``u2+u3``), by its position in ``found``, how its bytes per
    call follow from the host ints the graph takes or returns, where each symbol of that count
    is one of them: the backward takes the split sizes as inputs, the forward returns them
    (saved for the backward). Reading them costs no device sync (split sizes are host ints
    anyway). The wire layer's convention: (W-1)/W of the rows, rounded up."""
    import sympy

    where: dict[str, tuple[bool, int]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next((n for n in gm.graph.nodes if n.op == "output"), None)
    outs = output.args[0] if output is not None else ()
    for is_input, nodes in ((True, placeholders),
                            (False, outs if isinstance(outs, (list, tuple)) else ())):
        for i, n in enumerate(nodes):
            v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
            expr = getattr(getattr(v, "node", None), "expr", None)
            if isinstance(v, torch.SymInt) and isinstance(expr, sympy.Symbol):
                where.setdefault(expr.name, (is_input, i))
    counters: dict[int, RowCounter] = {}
    for f, r in zip(found, rewrites):
        call = f.call
        if call is None or not call.symbolic_rows:
            continue
        try:
            expr = sympy.sympify(str(f.shape[0]))
        except (sympy.SympifyError, TypeError, SyntaxError):
            continue
        symbols = sorted(expr.free_symbols, key=lambda s: s.name)
        if not symbols or any(s.name not in where for s in symbols):
            continue
        rows_of = sympy.lambdify(symbols, expr, modules=[])
        places = [where[s.name] for s in symbols]
        per_raw = call.row_bytes
        per_wire = r.compressed.row_wire_bytes() if r.compressed is not None else per_raw

        def count(ins, outs, rows_of=rows_of, places=places, w=f.world, per_raw=per_raw,
                  per_wire=per_wire) -> tuple[int, int]:
            n = int(rows_of(*[int((ins if is_in else outs)[i]) for is_in, i in places]))
            return -(-(w - 1) * n * per_raw // w), -(-(w - 1) * n * per_wire // w)

        counters[f.position] = count
    return counters


#: Calls of compiled graphs whose collectives run on a group, by group name (this process):
#: the step numbers :func:`ccfx.wire.agree.entering` records.
_STEPS: dict[str, int] = {}


def _counting(compiled: Callable, extra: list[torch.Tensor], ledger: Ledger, graph: int,
              rows: list[tuple[int, int, int]], what: str = "", described: str = "",
              counters: dict[int, RowCounter] | None = None,
              groups: Sequence[tuple[str, tuple[int, ...]]] = ()) -> Callable:
    """The compiled graph as aot_autograd calls it (boxed: one list of inputs, which the callee
    clears): the codec state appended, every collective counted once the call returned (a
    row count known only at run time: its bytes from ``counters[index]`` where there is one,
    else none: its row quotes bytes per row). Where ccfx compressed some (``what`` names the
    graph, ``described`` them), a RuntimeError of the call (gloo's, a peer died or hung)
    becomes a :class:`~ccfx.CollectiveError` saying so. Each call first records that this rank
    enters the collectives of ``groups`` (the groups that agree on them): a peer that
    recompiled alone and waits at an agreement meanwhile sees that this rank waits for it in
    a collective (it would never come to the agreement) and fails within a poll, instead of
    after ``collective_timeout_s``."""
    import weakref

    from ccfx.wire import agree

    ledger_ref = weakref.ref(ledger)
    counters = counters or {}
    entering = f"the collectives of {what or f'graph {graph}'}"
    peers = sorted({r for _, ranks in groups for r in ranks}) or None

    def run(args):
        for name, ranks in groups:
            n = _STEPS.get(name, 0)
            _STEPS[name] = n + 1
            agree.entering(entering, name, n, ranks)
        full = list(args) + extra
        if isinstance(args, list):
            args.clear()  # the boxed convention: the callee frees its inputs
        # the host ints among the inputs (the callee may clear ``full``): what counters read
        ints = {i: v for i, v in enumerate(full) if isinstance(v, int)} if counters else {}
        try:
            out = compiled(full)
        except RuntimeError as e:
            if not what:
                raise
            raise failed(e, what, described, peers) from e
        book = ledger_ref()
        if book is not None:
            for index, raw, wire in rows:
                if index in counters:
                    raw, wire = counters[index](ints, out)
                book.record_collective(graph, index, raw, wire)
        return out

    return tc.mark_boxed(run)


def failed(e: BaseException, what: str, described: str,
           ranks: Sequence[int] | None = None) -> CollectiveError:
    """The error of a compiled graph whose compressed collectives failed: this rank, the
    graph, its collectives, gloo's first line, and the peer of ``ranks`` (the ranks of its
    groups; default all) that looks dead if one does."""
    from ccfx.wire import agree

    first = first_line(e)
    agree.gave_up(f"the collectives of {what}", first, ranks or ())
    who = agree.blame(e, ranks)
    who = f" {who[0].upper()}{who[1:]}." if who else ""
    # what peers recompiled, and (no dead peer named) why they gave up
    notes = agree.peer_notes(ranks, failures="rank " not in who.lower())
    who = f"{who} {notes}" if notes else who
    dist = _dist()
    rank = f"rank {dist.get_rank()} of {dist.get_world_size()}: " if dist is not None else ""
    return CollectiveError(
        f"{rank}{what} failed while its compressed collectives were in flight ({described}): "
        f"{first}.{who} A peer rank died, hung, or is running a different model; see that "
        "rank's own error.")



