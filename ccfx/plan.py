"""The Plan: what the passes decided, printable and JSON-serialisable.

One ``GraphPlan`` per graph Dynamo hands the backend (graph breaks make several; compile with
``fullgraph=True`` to get one pipeline). A ``Plan`` groups them. Sizes are ints at the example
shapes, with the symbolic expression beside them (``"512*s0"``) when shapes are dynamic.

Cut edges are counted *per hop*: a tensor produced in stage 0 and read in stage 3 crosses the
boundaries 0→1, 1→2 and 2→3, and each hop is one encode → wire → decode, exactly what a linear
pipeline on torch.distributed.pipelining sends. ``wire_bytes_fwd`` is per hop; ``total_wire_*``
multiplies by the number of hops.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

PLAN_FORMAT = 1


@dataclass
class Stage:
    graph: int
    index: int
    nodes: list[str]
    cost: float
    cost_expr: str
    flops: int
    param_bytes: int
    params: list[str] = field(default_factory=list)


@dataclass
class CutEdge:
    graph: int
    index: int
    source: str
    source_stage: int
    dest_stages: list[int]
    hops: list[tuple[int, int]]
    shape: list[Any]
    dtype: str
    codec: str
    grad_codec: str | None
    raw_bytes: int
    raw_bytes_expr: str
    wire_bytes_fwd: int
    wire_bytes_fwd_expr: str
    wire_bytes_bwd: int
    users: list[str] = field(default_factory=list)

    @property
    def total_raw_bytes(self) -> int:
        return self.raw_bytes * len(self.hops)

    @property
    def total_wire_fwd(self) -> int:
        return self.wire_bytes_fwd * len(self.hops)

    @property
    def total_wire_bwd(self) -> int:
        return self.wire_bytes_bwd * len(self.hops)


@dataclass
class SharedParam:
    graph: int
    name: str
    stages: list[int]
    nbytes: int


@dataclass
class Bucket:
    """One data-parallel gradient bucket: parameters whose gradients travel together.

    ``codec`` is what is applied (``"none"`` where the policy skipped compression, ``reason``
    says why); ``collective`` is how the payload is reduced: ``all_reduce`` (sum-compatible
    payloads), ``all_gather`` (then every rank decodes every payload and sums in rank order, so
    all ranks get the same bits), or ``powersgd`` (two all-reduces: P, then Q). ``wire_bytes``
    is the payload one rank contributes per step, exact from the codec's payload layout.
    """

    graph: int
    index: int
    params: list[str]
    numel: int
    dtype: str
    codec: str
    collective: str
    raw_bytes: int
    wire_bytes: int
    reason: str = ""

    @property
    def ratio(self) -> float:
        return self.wire_bytes / self.raw_bytes if self.raw_bytes else 1.0


@dataclass
class Collective:
    """One functional collective of a compiled graph (tensor / sequence parallel, sharded
    parameters, the user's funcol code), kept or compressed (``collective_codec``).

    ``index``: the plan's (``collective_overrides`` key ``"collective N"``), counted over the
    graph's forward then backward (or its inference graph); ``part``: "forward", "backward"
    or "inference"; ``kind``: all_reduce, all_gather, reduce_scatter, all_to_all (or the
    functional op's name, for one ccfx does not compress); ``group``: the process group's name,
    ``group_size`` its ranks; ``shape`` / ``dtype``: the input's; ``codec``: what runs
    (``"none"``: the original collective, ``reason`` says why); ``raw_bytes`` / ``wire_bytes``:
    what this rank sends per call, uncompressed (ring convention: an all-reduce sends
    2(W-1)/W of its input) and as it runs; ``per_row``: an expert all-to-all whose row count
    is only known at run time (data-dependent split sizes; ``shape[0]`` is its expression,
    ``"u2+u3"``): ``raw_bytes`` / ``wire_bytes`` are then one row's, a call sends (W-1)/W
    of its rows."""

    graph: int
    index: int
    part: str
    kind: str
    group: str
    group_size: int
    shape: list[int]
    dtype: str
    codec: str
    raw_bytes: int
    wire_bytes: int
    reduce_op: str | None = None
    reason: str = ""
    per_row: bool = False

    @property
    def ratio(self) -> float:
        return self.wire_bytes / self.raw_bytes if self.raw_bytes else 1.0


@dataclass
class Decision:
    """One choice of the planner (``"auto"``): ``what`` is "edge 3 forward", "edge 3 backward"
    or "bucket 1"; ``candidates`` the predicted step seconds of each codec it weighed, fastest
    first; ``reason`` why the winner won."""

    what: str
    chosen: str
    candidates: list[tuple[str, float]] = field(default_factory=list)
    reason: str = ""

    def predicted(self, spec: str) -> float | None:
        return next((s for c, s in self.candidates if c == spec), None)


@dataclass
class Prediction:
    """The planner's predicted step for one graph: uncompressed, and with its choices."""

    uncompressed_s: float
    chosen_s: float
    link: str  # "0.1 Gbit/s, 0.05 ms, shared"
    schedule: str
    microbatches: int
    compute: str  # where the compute seconds came from ("flops: 1.1e+10 FLOP/s ...")


@dataclass
class DataParallelInfo:
    """How gradients are synchronized: the world the plan was made for and the policy."""

    world_size: int
    backend: str  # "gloo", "nccl", ... or "none" (no process group: world size 1)
    gradient_codec: str
    warmup_steps: int = 0
    note: str = ""


@dataclass
class GraphPlan:
    index: int
    requested_stages: int
    num_stages: int
    balance: str
    stages: list[Stage]
    edges: list[CutEdge]
    shared: list[SharedParam]
    notes: list[str] = field(default_factory=list)
    symbolic: bool = False
    #: Data-parallel gradient buckets, filled when the backward graph is compiled.
    buckets: list[Bucket] = field(default_factory=list)
    #: The functional collectives of the graph's forward, backward or inference graph, filled
    #: when each compiles.
    collectives: list[Collective] = field(default_factory=list)
    #: What ``auto`` chose and why (empty without ``auto``), and the step it predicted.
    decisions: list[Decision] = field(default_factory=list)
    prediction: Prediction | None = None
    #: Why the graph was left whole (one stage although more were asked: too small a share of
    #: the model's FLOPs, next to a graph break), else "". The notes say it too.
    left_whole: str = ""

    @property
    def imbalance(self) -> float:
        """Slowest stage's cost over the ideal (total / stages); 1.0 is perfect."""
        costs = [s.cost for s in self.stages]
        total = sum(costs)
        return max(costs) / (total / len(costs)) if total > 0 else 1.0


@dataclass
class Plan:
    config: dict[str, Any]
    graphs: list[GraphPlan] = field(default_factory=list)
    #: Where each option came from: "default", "environment" ($CCFX_OPTIONS) or "options".
    option_sources: dict[str, str] = field(default_factory=dict)
    data_parallel: DataParallelInfo | None = None
    #: canonical codec spec → as the user wrote it (``powersgd:ef`` → ``powersgd:rank=4,ef``),
    #: where they differ: the JSON keeps the canonical specs and this, so a plan read in
    #: another process is shown as written. Filled from this process's spellings when empty.
    spelled: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not self.spelled:
            from .codecs.registry import spellings

            self.spelled = spellings(_specs_of(self.config, self.data_parallel))

    # Convenience views over every graph.
    @property
    def stages(self) -> list[Stage]:
        return [s for g in self.graphs for s in g.stages]

    @property
    def edges(self) -> list[CutEdge]:
        return [e for g in self.graphs for e in g.edges]

    @property
    def shared(self) -> list[SharedParam]:
        return [p for g in self.graphs for p in g.shared]

    @property
    def buckets(self) -> list[Bucket]:
        return [b for g in self.graphs for b in g.buckets]

    @property
    def collectives(self) -> list[Collective]:
        return [c for g in self.graphs for c in g.collectives]

    @property
    def num_stages(self) -> int:
        return max((g.num_stages for g in self.graphs), default=0)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps({"format": PLAN_FORMAT, **dataclasses.asdict(self)}, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        if data.pop("format", None) != PLAN_FORMAT:
            raise ValueError(f"not a ccfx plan of format {PLAN_FORMAT}")
        graphs = []
        for g in data["graphs"]:
            edges = [CutEdge(**{**e, "hops": [tuple(h) for h in e["hops"]]}) for e in g["edges"]]
            graphs.append(
                GraphPlan(
                    **{
                        **g,
                        "stages": [Stage(**s) for s in g["stages"]],
                        "edges": edges,
                        "shared": [SharedParam(**p) for p in g["shared"]],
                        "buckets": [Bucket(**b) for b in g.get("buckets", [])],
                        "collectives": [Collective(**c) for c in g.get("collectives", [])],
                        "decisions": [Decision(**{**d, "candidates": [tuple(c) for c in
                                                                       d["candidates"]]})
                                      for d in g.get("decisions", [])],
                        "prediction": (Prediction(**g["prediction"]) if g.get("prediction")
                                       else None),
                    }
                )
            )
        dp = data.get("data_parallel")
        from .codecs.registry import remember_spellings

        remember_spellings(data.get("spelled") or {})  # shown as written here too
        return cls(config=data["config"], graphs=graphs,
                   option_sources=data.get("option_sources", {}),
                   data_parallel=DataParallelInfo(**dp) if dp else None,
                   spelled=dict(data.get("spelled") or {}))

    def __eq__(self, other) -> bool:
        return isinstance(other, Plan) and self.to_json() == other.to_json()

    def __str__(self) -> str:
        return format_plan(self)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _specs_of(config: dict, dp) -> list[str]:
    """Every codec spec a plan's options and data-parallel record hold."""
    out = [v for k, v in config.items() if k.endswith("_codec") and isinstance(v, str)]
    for key in ("codec_overrides", "collective_overrides"):
        out += [v for v in (config.get(key) or {}).values() if isinstance(v, str)]
    out += [v for v in (config.get("gradient_codec_stages") or ()) if isinstance(v, str)]
    if dp is not None:
        out.append(dp.gradient_codec)
    return out


def spelled(spec):
    """A codec spec as the user wrote it (:func:`ccfx.codecs.spelled`)."""
    from .codecs import spelled as _spelled

    return _spelled(spec)


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def format_plan(plan: Plan) -> str:
    """The plan as text. Codec specs appear as the user wrote them where this process saw it
    (:func:`ccfx.codecs.spelled`); the JSON keeps the canonical form."""
    out = [_plan_head(plan)]
    if len(plan.graphs) > 1:
        whole = [g.index for g in plan.graphs if g.left_whole]
        cut = sum(1 for g in plan.graphs if g.num_stages > 1)
        kept = (f"; graph(s) {', '.join(map(str, whole))} left whole (too small to cut, or "
                "holding no parameters)" if whole else "")
        split = (f"{cut} graph(s) cut into stages, each its own pipeline" if cut
                 else "each graph compiled on its own")
        out.append(f"  (graph breaks split the model: {split}{kept}. "
                   "Compile with fullgraph=True for one.)")
    for g in plan.graphs:
        out += _graph_text(g)
    if plan.data_parallel is not None:
        dp = plan.data_parallel
        out.append("")
        backend = _backend_text(dp)
        out.append(f"data parallel: world size {dp.world_size}"
                   + (f" ({backend})" if backend else "") + f", gradient codec "
                   f"{spelled(dp.gradient_codec)}" + (f", {dp.warmup_steps} uncompressed warm-up steps"
                                             if dp.warmup_steps else ""))
        if dp.note:
            out.append(f"  note: {dp.note}")
    changed = {k: v for k, v in plan.option_sources.items() if v != "default"}
    if changed:
        out.append("options from: " + ", ".join(f"{k}={v}" for k, v in sorted(changed.items())))
    return "\n".join(out)


def _plan_head(plan: Plan) -> str:
    """The plan's first line: its graphs and the codecs that apply (activation codec only
    where there are stages, gradient codec and world size, collective codec)."""
    codec = spelled(plan.config.get("activation_codec"))
    grad_codec = spelled(plan.config.get("activation_grad_codec"))
    if grad_codec and grad_codec != codec:
        codec = f"{codec} forward, {grad_codec} backward"
    overrides = plan.config.get("codec_overrides")
    if overrides:
        codec += " (" + ", ".join(f"{k}: {spelled(v)}" for k, v in sorted(overrides.items())) + ")"
    dp = plan.data_parallel
    head = f"ccfx plan: {len(plan.graphs)} graph(s)"
    if dp is None or any(g.edges for g in plan.graphs):
        head += f", codec {codec}"  # an activation codec means something only between stages
    if dp is not None:
        head += f", gradient codec {spelled(dp.gradient_codec)}, world size {dp.world_size}"
        backend = _backend_text(dp)
        head += f" ({backend})" if backend else ""
    if any(g.collectives for g in plan.graphs):
        head += f", collective codec {spelled(plan.config.get('collective_codec', 'none'))}"
        table = plan.config.get("collective_overrides")
        if table:
            head += " (" + ", ".join(f"{k}: {spelled(v)}" for k, v in sorted(table.items())) + ")"
    return head


def _graph_text(g: GraphPlan) -> list[str]:
    """One graph's section: its stages, cut edges, shared parameters, gradient buckets and
    collectives."""
    out = [""]
    out.append(
        f"graph {g.index}: {g.num_stages} stage(s) (asked {g.requested_stages}), "
        f"balanced by {g.balance}, imbalance {g.imbalance:.3f}"
    )
    for note in g.notes:
        out.append(f"  note: {note}")
    rows = [
        [s.index, len(s.nodes), f"{s.cost:.4g}", human_bytes(s.param_bytes), s.nodes[0] if s.nodes else "",
         s.nodes[-1] if s.nodes else ""]
        for s in g.stages
    ]
    out += ["  " + r for r in _table(rows, ["stage", "nodes", "cost", "params", "first", "last"])]
    if g.edges:
        out += _edges_table(g)
    if g.shared:
        out.append("  shared parameters (used in several stages, gradients summed):")
        for p in g.shared:
            out.append(f"    {p.name}: stages {p.stages}, {human_bytes(p.nbytes)}")
    if g.buckets:
        out += _buckets_table(g.buckets)
    if g.collectives:
        out += _collectives_table(g.collectives)
    return out


def _edges_table(g: GraphPlan) -> list[str]:
    """The cut edges of one graph: each edge's stages, shape, codec and bytes per hop, and
    the forward's raw and wire bytes per compiled call."""
    out = [""]
    rows = []
    for e in g.edges:
        raw = f"{e.raw_bytes}" + (f" ({e.raw_bytes_expr})" if g.symbolic else "")
        rows.append([
            e.index, e.source, f"{e.source_stage}->{','.join(map(str, e.dest_stages))}",
            len(e.hops), "x".join(map(str, e.shape)), e.dtype.replace("torch.", ""),
            spelled(e.codec) if e.grad_codec in (None, e.codec)
            else f"{spelled(e.codec)} / {spelled(e.grad_codec)}",
            raw, e.wire_bytes_fwd, e.wire_bytes_bwd,
        ])
    out += ["  " + r for r in _table(
        rows, ["edge", "source", "stages", "hops", "shape", "dtype", "codec", "raw B/hop",
               "wire fwd", "wire bwd"])]
    raw = sum(e.total_raw_bytes for e in g.edges)
    wire = sum(e.total_wire_fwd for e in g.edges)
    ratio = wire / raw if raw else 1.0
    out.append(
        f"  forward per compiled call (one microbatch when a pipeline schedule runs it): "
        f"{human_bytes(raw)} raw -> {human_bytes(wire)} on the wire "
        f"({ratio:.3f})"
    )
    return out


def _buckets_table(buckets: list[Bucket]) -> list[str]:
    """The gradient buckets in the order backward makes them: codec, collective, bytes per
    step and what each holds, and the gradients' raw and wire bytes per step per rank."""
    out = ["", "  gradient buckets (in the order backward makes them):"]
    rows = [[b.index, len(b.params), b.numel, spelled(b.codec), b.collective,
             human_bytes(b.raw_bytes), human_bytes(b.wire_bytes), f"{b.ratio:.4f}",
             b.reason or _param_summary(b.params)] for b in buckets]
    out += ["  " + r for r in _table(
        rows, ["bucket", "params", "numel", "codec", "collective", "raw/step",
               "wire/step", "ratio", "holds"])]
    raw = sum(b.raw_bytes for b in buckets)
    wire = sum(b.wire_bytes for b in buckets)
    out.append(f"  gradients per step per rank: {human_bytes(raw)} raw -> "
               f"{human_bytes(wire)} on the wire ({wire / raw if raw else 1.0:.4f})")
    return out


def _collectives_table(rows: list[Collective]) -> list[str]:
    """The collectives of one graph: what each one is, its codec, its bytes per call, and why
    (one left alone, one ``auto`` chose)."""
    out = ["", ("  collectives (functional collectives of the compiled graphs; bytes this rank "
                "sends per call):")]
    table = [[c.index, c.part, c.kind + (f" ({c.reduce_op})" if c.reduce_op else ""),
              f"{c.group_size} ({c.group})", "x".join(
                  f"({d})" if isinstance(d, str) else str(d) for d in c.shape) or "scalar",
              c.dtype.replace("torch.", ""), spelled(c.codec),
              human_bytes(c.raw_bytes) + ("/row" if c.per_row else ""),
              human_bytes(c.wire_bytes) + ("/row" if c.per_row else ""), f"{c.ratio:.4f}",
              c.reason]
             for c in rows]
    out += ["  " + r for r in _table(
        table, ["coll", "graph", "kind", "ranks (group)", "shape", "dtype", "codec", "raw/call",
                "wire/call", "ratio", "why"])]
    per_call = [c for c in rows if not c.per_row]  # a row count known only at run time: out
    raw = sum(c.raw_bytes for c in per_call)
    wire = sum(c.wire_bytes for c in per_call)
    done = sum(c.codec != "none" for c in rows)
    out.append(f"  collectives per call of each graph: {human_bytes(raw)} raw -> "
               f"{human_bytes(wire)} on the wire ({wire / raw if raw else 1.0:.4f}); "
               f"{done} of {len(rows)} compressed")
    return out


def _backend_text(dp: DataParallelInfo) -> str:
    """The process group's backend as the plan shows it: nothing when unknown (torch says
    "undefined" for a group it cannot name) or when there is no process group."""
    backend = (dp.backend or "").strip()
    if backend.lower() in ("", "undefined", "none"):
        return "no process group" if dp.world_size == 1 and backend.lower() == "none" else ""
    return backend


def _param_summary(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} … {names[-1]}"
