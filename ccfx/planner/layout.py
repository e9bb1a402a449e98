"""One parallel layout, and its predicted step and memory on a cluster: :func:`predict_layout`.

A :class:`Layout` is the pipeline × data × tensor degrees, the microbatches, the schedule,
replicated or sharded data parallel, where each rank runs (``order``: how the three axes nest
over the cluster's devices taken node by node), the stage boundaries, and the codecs of each
pipeline hop, each stage's gradient exchange and (local steps) the outer sync. Ranks are
numbered as ``ccfx run``'s ``(dp, pp)`` DeviceMesh, tensor-parallel innermost:
``rank = (d · pp + s) · tp + t``.

The model (analytic, per link: each hop and each group priced on the link its own devices
cross, as :mod:`ccfx.planner.links` prices them for the ``placement`` option: the slowest of
the replicas' hops, a group's slowest pair, the bandwidth shared among the flows that leave
one node on the same level; with tensor parallelism, the slowest pair without contention):

* **compute**: with the model timed here (``facts.measured``,
  :func:`~ccfx.planner.compute.measure_model`: forward and backward per FLOP and per op, an
  AdamW step per parameter), a stage's own seconds at the microbatch, scaled to a described
  device by its rate against this machine's, and stretched where ranks share this machine's
  cores (:func:`~ccfx.planner.compute.contention`); else a stage's forward FLOPs per
  microbatch / ``tp`` at its slowest device's rate (``Cluster.rate``), the backward twice that
  (the usual 2:1), a device measured here timed on the model's own main matmul at the
  microbatch's rows, plus a fixed time per op (the trace counts them), as
  :func:`~ccfx.planner.compute.from_flops` prices CPU stages;
* **tensor parallel**: Megatron's two all-reduces of a layer's output per layer forward and
  two backward, ``2 (tp-1)/tp`` of the tensor each, on the critical path (with sequence
  parallelism, ``sequence_parallel``, each is an all-gather and a reduce-scatter: the same
  bytes); its memory, every saved activation split over the TP ranks with sequence
  parallelism, Megatron's TP span only without (:func:`~ccfx.planner.memory_model.
  activation_bytes`);
* **recomputation** (``recompute``): the backward runs each block's forward again
  ("block"), or the attention core's FLOPs at the forward's rate ("selective");
* **pipeline**: torch's GPipe / 1F1B program simulated rank by rank with each hop on its own
  link (:class:`~ccfx.planner.pipeline_model.PipelineModel` with per-hop links, the simulator
  validated against measured steps on the shaped harness); an analytic
  ``(m - 1) · period + fill + drain`` was up to 45 % short of it where links are slow (the
  1F1B dependencies put transfers on the critical path), so it is not used. The breakdown:
  the same schedule with instant links and no codecs gives compute + bubble; what the links
  and codecs add is theirs;
* **gradient buckets**: without a pipeline the exchange overlaps the backward bucket by bucket
  (25 MiB each, one latency each); under PP × DP ccfx averages each stage's gradients after
  the step (``ccfx.sync_grads``), so stage ``s`` starts when its program ends in the
  simulation: a late stage's exchange hides behind the drain (Optimus-CC's selective stage
  compression). All-reduce ``2 (dp-1)/dp`` of the payload; a gather codec (int8 …) the
  all-gather ccfx runs for it, ``dp-1`` payloads in per rank and ``dp`` decodes, and with
  two replicas on gloo's TCP the turns its two directions take on the pair's one connection
  (:func:`ccfx.wire.link.pair_gather_wait_s`, measured; :func:`exchange_wire_s`);
* **sharded data parallel** (``ccfx.shard``, no pipeline): the weights all-gathered in the
  forward and again in the backward, the gradients reduce-scattered, each hidden behind the
  compute of its pass where it fits; a latency per message, one per block
  (``shard_bucket="block"``) or one per parameter (:func:`shard_messages`);
* **local steps** (``sync_every`` H): the data-parallel exchange replaced by an outer sync
  every H steps, priced by :func:`ccfx.planner.local_model.predict_local_steps` on the group's
  link; its effect on the loss per step is not priced;
* **codecs**: payload bytes exact (``CodecTimer``), encode and decode at the timer's rate on
  the sending and receiving stage.

* **optimizer**: an AdamW step per stage after its exchange (a model timed here only).

Not modelled: NIC contention under tensor parallelism, the optimizer step of a model not timed
here, overlap of tensor-parallel collectives with compute, the cores a rank blocked on a slow
link frees for the others.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from .. import codecs
from ..config import SHARD_BUCKET, Config
from ..errors import ConfigError
from ..wire.link import Link, pair_gather_wait_s
from .cluster import Cluster
from .codec_cost import CodecTimer
from .compute import contention, machine_rate
from .links import data_parallel_link, hop_links, stage_group_links
from .local_model import predict_local_steps
from .memory_model import (
    MEMORY_LIMIT,
    SCHEDULES,
    MemoryEstimate,
    bucket_memory,
    in_flight,
    recompute_bytes,
    stage_memory,
)
from .model_facts import ModelFacts, StageFacts
from .pipeline_model import EdgeTraffic, PipelineModel, StageCompute

AXES = ("tp", "pp", "dp")
#: activation recomputation the search weighs: none, the attention core (Megatron's
#: selective recomputation), or every block checkpointed
RECOMPUTE = ("none", "selective", "block")
#: the data-parallel bucket cap ccfx uses (``bucket_mb``), one latency per bucket
BUCKET_BYTES = 25 * 2 ** 20
#: a link that costs nothing: the pipeline without communication
INSTANT = Link(1e12, 0.0)
#: this machine's FLOP/s per matmul shape (rows, inner, columns), timed once per process
_RATES: dict[tuple[int, int, int], float] = {}


@dataclass(frozen=True)
class Layout:
    """Degrees, microbatches, schedule, placement order (axes innermost first over the
    node-major device list), stage boundaries (the first layer of each stage), codecs."""

    pp: int
    dp: int
    tp: int = 1
    microbatches: int = 1
    schedule: str = "1F1B"
    sharded: bool = False
    order: tuple[str, ...] = AXES
    boundaries: tuple[int, ...] = (0,)
    hop_codecs: tuple[tuple[str, str], ...] = ()  # per hop s -> s+1: (forward, backward)
    gradient_codecs: tuple[str, ...] = ()  # per stage
    sync_every: int | None = None
    outer_codec: str = "none"
    #: each rank's device (names), overriding ``order``: a placement given by hand
    devices: tuple[str, ...] | None = None
    #: activation recomputation: "none"; "selective" (Megatron's: the attention core's
    #: scores, softmax and dropout dropped and its forward run again in the backward); or
    #: "block" (each block checkpointed: its backward runs its forward again, and only its
    #: input is kept between the passes)
    recompute: str = "none"
    #: sharded data parallel: ``ccfx.shard``'s collectives one per block ("block", the
    #: ``shard_bucket`` default) or one per parameter ("none"): a latency each
    shard_bucket: str = "block"
    #: with tensor parallelism, Megatron's sequence parallelism: the norms, dropouts and
    #: residual stream split along the sequence over the TP ranks (every saved activation
    #: divided by ``tp``); False: TP alone, those activations whole on each TP rank. The
    #: collectives move the same bytes either way (an all-gather and a reduce-scatter for
    #: each all-reduce). Ignored at tp=1
    sequence_parallel: bool = True

    def __post_init__(self):
        for name in ("pp", "dp", "tp", "microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"layout: {name} is {v!r}: a whole number ≥ 1")
        if self.shard_bucket not in SHARD_BUCKET:
            raise ConfigError(f"layout: shard_bucket {self.shard_bucket!r}: use one of "
                              f"{SHARD_BUCKET}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"layout: schedule {self.schedule!r}: use one of {SCHEDULES}")
        if sorted(self.order) != sorted(AXES):
            raise ConfigError(f"layout: order {self.order!r} must name each of {AXES} once")
        if len(self.boundaries) != self.pp or self.boundaries[0] != 0 or any(
                a >= b for a, b in zip(self.boundaries, self.boundaries[1:])):
            raise ConfigError(f"layout: boundaries {self.boundaries} must be {self.pp} "
                              "increasing first-layer indices starting at 0")
        if self.pp > 1 and self.microbatches < self.pp:
            raise ConfigError(f"layout: {self.microbatches} microbatches for {self.pp} stages: "
                              "a pipeline needs at least one microbatch per stage")
        if self.devices is not None and len(self.devices) != self.world:
            raise ConfigError(f"layout: devices lists {len(self.devices)} devices for "
                              f"{self.world} ranks (pp × dp × tp): give one per rank")
        if self.sharded and self.pp > 1:
            raise ConfigError("layout: sharded data parallel (ccfx.shard) runs without a "
                              "pipeline: use pp=1, or replicated data parallel")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"layout: recompute {self.recompute!r}: use one of {RECOMPUTE}")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"layout: sequence_parallel is {self.sequence_parallel!r}: "
                              "use True (the norms' activations split over the TP ranks) or "
                              "False (TP alone)")

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def rank(self, s: int, d: int, t: int = 0) -> int:
        return (d * self.pp + s) * self.tp + t

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, tensor-parallel lane) of ``rank``."""
        t = rank % self.tp
        s = (rank // self.tp) % self.pp
        return s, rank // (self.tp * self.pp), t

    def position(self, s: int, d: int, t: int) -> int:
        """The place in the node-major device list of the rank at (s, d, t)."""
        index, degree = {"tp": t, "pp": s, "dp": d}, {"tp": self.tp, "pp": self.pp,
                                                        "dp": self.dp}
        pos, mult = 0, 1
        for axis in self.order:
            pos += index[axis] * mult
            mult *= degree[axis]
        return pos

    def placement(self, cluster: Cluster) -> tuple[str, ...]:
        """The device of each rank, in rank order."""
        if self.devices is not None:
            for name in self.devices:
                cluster.index(name)  # a ConfigError naming an unknown device
            return tuple(self.devices)
        devices = node_major(cluster)
        return tuple(devices[self.position(*self.coords(r))] for r in range(self.world))

    def stage_layers(self, num_layers: int) -> list[tuple[int, int]]:
        ends = list(self.boundaries[1:]) + [num_layers]
        return list(zip(self.boundaries, ends, strict=True))

    def describe(self) -> str:
        parts = [f"pp={self.pp}", f"dp={self.dp}" + (" sharded" if self.sharded else "")]
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + ("" if self.sequence_parallel else " sp=off"))
        parts.append(f"mb={self.microbatches}")
        nested = [a for a in self.order if getattr(self, a) > 1]
        if self.devices is not None:
            parts.append("placed by hand")
        elif len(nested) > 1:
            parts.append(f"{nested[0]} inside nodes")
        if self.sync_every:
            parts.append(f"local H={self.sync_every}")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        return " ".join(parts)


def node_major(cluster: Cluster) -> tuple[str, ...]:
    """The device names grouped by region, then node (in order of first appearance)."""
    groups: dict[tuple, list[str]] = {}
    for d in cluster.devices:
        groups.setdefault((d.region, d.node), []).append(d.name)
    regions: dict = {}
    for (region, node), names in groups.items():
        regions.setdefault(region, []).extend(names)
    return tuple(n for names in regions.values() for n in names)


class Links:
    """The cluster's links by device position, cached (a search asks for the same pairs
    many times)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.index = {n: i for i, n in enumerate(cluster.names)}
        self._pair: dict[tuple[int, int], Link] = {}
        self._priced: dict[tuple, tuple[list, list]] = {}
        self._simulated: dict[tuple, object] = {}

    def link(self, a: str, b: str) -> Link:
        return self._by_index(self.index[a], self.index[b])

    def priced(self, layout: Layout) -> tuple[list, list]:
        """Without tensor parallelism, the hops' and the data-parallel groups' links as
        :mod:`ccfx.planner.links` prices them (NIC contention among the flows that leave a
        node; the same rank → device rules as the ``placement`` option), cached per
        degrees and order; with it ([], []): the caller takes the slowest pair."""
        if layout.tp > 1:
            return [], []
        key = (layout.pp, layout.dp, layout.order, layout.devices)
        hit = self._priced.get(key)
        if hit is None:
            idx = [self.index[n] for n in layout.placement(self.cluster)]
            pp, dp = layout.pp, layout.dp
            hops = hop_links(self.cluster, pp, replicas=dp, placement=idx) if pp > 1 else []
            groups: list = [None] * pp
            if dp > 1:
                groups = (stage_group_links(self.cluster, pp, dp, placement=idx) if pp > 1
                          else [data_parallel_link(self.cluster, dp, placement=idx)])
            hit = self._priced[key] = (hops, groups)
        return hit

    def rate_here(self, facts: ModelFacts, fraction: float) -> float:
        """FLOP/s of this machine on the model's main matmul at a microbatch's rows
        (``fraction`` of the traced batch; at most 16 Ki rows), timed once per shape; the
        cluster's 512³ rate (:meth:`Cluster.rate`) without one."""
        if facts.matmul is None:
            return machine_rate()[0]
        rows, inner, cols = facts.matmul
        rows = max(1, min(1 << 14, round(rows * fraction)))
        key = (rows, inner, cols)
        if key not in _RATES:
            a, b = torch.randn(rows, inner), torch.randn(inner, cols)
            a @ b  # warm-up
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t0)
            _RATES[key] = 2 * rows * inner * cols / max(best, 1e-9)
        return _RATES[key]

    def simulate(self, compute, edges, hop_links, schedule, m, timer, choice):
        """:meth:`PipelineModel.predict`'s timeline, memoised (local-step variants and the
        codec choice ask for the same pipeline again)."""
        if not choice and all(x is INSTANT for x in hop_links):  # compute alone
            key = (tuple(compute), schedule, m)
        else:
            key = (tuple(compute), tuple((e.shape, e.dtype) for e in edges), tuple(hop_links),
                   schedule, m, tuple(sorted(choice.items())))
        hit = self._simulated.get(key)
        if hit is None:
            model = PipelineModel(compute, edges, list(hop_links), schedule=schedule,
                                  microbatches=m, timer=timer)
            hit = self._simulated[key] = model.predict(choice).timeline
        return hit

    def slowest(self, pairs) -> Link:
        """The slowest link among ``pairs`` (lowest bandwidth), with their highest latency."""
        return _slowest({self.link(a, b) for a, b in pairs if a != b})

    def slowest_within(self, groups) -> Link:
        """:meth:`slowest` of every pair of distinct devices inside each group of ``groups``
        (device names), from one pair per kind of link (:meth:`Cluster.pair_kinds`): a
        data-parallel group of 512 is 512 devices, not 261,632 pairs."""
        links = set()
        for group in groups:
            idx = sorted({self.index[n] for n in group})
            links |= {self._by_index(i, j) for i, j in self.cluster.pair_kinds(idx)}
        return _slowest(links)

    def _by_index(self, i: int, j: int) -> Link:
        hit = self._pair.get((i, j))
        if hit is None:
            hit = self._pair[(i, j)] = self.cluster.link(i, j)
        return hit


def _slowest(links: set[Link]) -> Link:
    """The lowest bandwidth among ``links`` (of equals, the highest latency), with the highest
    latency of any: a collective waits for its last message."""
    worst = min(links, key=lambda x: (x.gbps, -x.latency_ms))
    return replace(worst, latency_ms=max(x.latency_ms for x in links))


@dataclass
class LayoutPrediction:
    """A layout's predicted step (seconds) and its parts, its memory per stage, and why it was
    refused (None: it fits)."""

    layout: Layout
    step_s: float
    compute_s: float
    codec_s: float
    hops_s: float
    buckets_s: float
    collectives_s: float
    syncs_s: float
    bubble_s: float
    memory: tuple[MemoryEstimate, ...]
    device_memory: tuple[int, ...]  # per stage: the smallest device's bytes
    hop_links: tuple[Link, ...] = ()
    dp_links: tuple[Link | None, ...] = ()
    tp_links: tuple[Link | None, ...] = ()
    refused: str | None = None
    notes: list[str] = field(default_factory=list)
    #: how :mod:`ccfx.planner.links` describes each hop's and group's link (level, sharing)
    hop_text: tuple[str, ...] = ()
    dp_text: tuple[str, ...] = ()
    #: what the pipeline was simulated with: (per-stage compute, the hops' edges, their links)
    pipeline: tuple | None = field(default=None, repr=False)
    #: the optimizer step after the schedule and the exchange (a model measured here only)
    optimizer_s: float = 0.0
    #: per stage, how many data-parallel groups share its group's link (1: none)
    dp_flows: tuple[int, ...] = ()
    #: a step no codec or link can beat: the pipeline's compute and bubble with instant
    #: links (:func:`step_lower_bound`); what the search prunes by
    lower_bound_s: float = 0.0

    @property
    def peak_memory_bytes(self) -> int:
        return max(m.total for m in self.memory)

    @property
    def fits(self) -> bool:
        return self.refused is None

    def breakdown(self) -> str:
        def ms(x: float) -> str:
            return f"{x * 1e3:.4g} ms"

        parts = [f"compute {ms(self.compute_s)}"]
        for name, value in (("codecs", self.codec_s), ("hops", self.hops_s),
                            ("buckets", self.buckets_s), ("collectives", self.collectives_s),
                            ("syncs", self.syncs_s), ("bubble", self.bubble_s),
                            ("optimizer", self.optimizer_s)):
            if value > 5e-7:
                parts.append(f"{name} {ms(value)}")
        return " + ".join(parts)


def default_timer(cluster: Cluster, facts: ModelFacts | None = None) -> CodecTimer:
    """Codec prices, bytes always exact: where a device's rate is "measure here" (the planner
    runs where the model will), encode and decode at the rate this machine's int8 codec runs on
    a 4 Mi-element tensor (measured once, then cached with the codec timings: timing every
    codec at a 1 B model's sizes would allocate them); else a modelled 200 GB/s each (an
    elementwise kernel on a data-centre GPU, memory-bound). A model timed here
    (``facts.measured``: small, on this CPU) has its codecs timed here too, at their real
    sizes (a 4 Mi-element int8 rate was 10x fast for a (8, 64, 384) activation)."""
    if facts is not None and facts.measured is not None:
        return CodecTimer()
    if any(d.flops is None for d in cluster.devices):
        c = CodecTimer().cost("int8", (1 << 22,), torch.float32)
        return CodecTimer(throughput=c.raw_bytes / max(c.encode_s, c.decode_s, 1e-9))
    return CodecTimer(throughput=2e11)


@dataclass
class _Pricing:
    """What every cost term of one layout's prediction reads: the model, the cluster, the
    layout with its codec timer and links, where each rank runs, a microbatch's share of the
    traced batch and each stage's layers and facts."""

    facts: ModelFacts
    cluster: Cluster
    layout: Layout
    timer: CodecTimer
    links: Links
    where: tuple[str, ...]
    samples: int
    fraction: float
    stages: list[tuple[int, int]]
    sf: list[StageFacts]

    def dev(self, s: int, d: int, t: int) -> str:
        """The device of stage ``s``, replica ``d``, tensor shard ``t``."""
        return self.where[self.layout.rank(s, d, t)]


@dataclass
class _StageTimes:
    """Per stage: a microbatch's forward and backward seconds, its tensor-parallel
    collectives' seconds per pass and their link, the optimizer step, and the factors a
    codec's time here is scaled by on the critical path and in the gradient sync."""

    fwd: list[float]
    bwd: list[float]
    tp_s: list[float]
    tp_links: list[Link | None]
    opt_s: list[float]
    scales: list[float]
    sync_scales: list[float]


@dataclass
class _PipelineRun:
    """The pipeline's step (``pipe``), the same without links or codecs (``alone``), when
    each stage's program ends, and what it was simulated with (per-stage work, hop edges)."""

    per_mb: list[float]
    compute_mb: list[StageCompute]
    pipe: float
    alone: float
    ends: list[float]
    edges: list[EdgeTraffic]


def predict_layout(facts: ModelFacts, cluster: Cluster, layout: Layout, *,
                   timer: CodecTimer | None = None, links: Links | None = None,
                   simulate: bool = True) -> LayoutPrediction:
    """The predicted step and per-device memory of ``layout`` for a model of ``facts`` on
    ``cluster``, with the layout's own codecs (the search chooses them; this prices them).
    The traced batch is the whole step's (every replica's microbatches together).
    ``simulate=False``: links, compute and memory only, the pipeline's step left as its
    slowest stage's work (what the search needs to choose codecs, without a simulation)."""
    split = _check_layout(facts, cluster, layout)
    timer = timer or default_timer(cluster, facts)
    links = links or Links(cluster)
    samples = facts.batch // split
    stages = layout.stage_layers(facts.num_layers)
    ctx = _Pricing(facts, cluster, layout, timer, links, layout.placement(cluster), samples,
                   samples / facts.batch, stages, [facts.stage(lo, hi) for lo, hi in stages])
    pp, dp = layout.pp, layout.dp
    notes: list[str] = []
    times = _stage_times(ctx)
    priced_hops, priced_groups = links.priced(layout)
    enc_dec, codec_mem, hop_links = _price_hops(ctx, times, priced_hops)
    exchange_mem = [0] * pp
    run = _run_pipeline(ctx, times, enc_dec, hop_links, simulate)
    pipe = run.pipe

    # data parallel: buckets, sharded, or local steps
    buckets = syncs = 0.0
    synced = list(run.ends) if pp > 1 else [pipe]  # when each stage's gradients are averaged
    dp_links = _dp_links(ctx, priced_groups)
    if dp > 1 and layout.sync_every:
        syncs = _local_steps_s(ctx, pipe, dp_links)
        notes.append(f"local steps: the replicas sync every {layout.sync_every} steps "
                     f"({layout.outer_codec}); their effect on the loss per step is not priced")
    elif dp > 1:
        buckets = _price_buckets(ctx, times, dp_links, priced_groups, run, synced, codec_mem,
                                 exchange_mem)
    optimizer = _optimizer_s(pp, synced, times.opt_s, pipe, buckets)
    step = pipe + buckets + syncs + optimizer
    compute, collectives, bubble, codec, hop_exposed = _breakdown(ctx, times, run, enc_dec)
    memory, device_memory, refused = _price_memory(ctx, codec_mem, exchange_mem)
    where_text = ([p.describe() for p in priced_hops],
                  [p.describe() if p is not None else "" for p in priced_groups])
    return LayoutPrediction(layout, step, compute, codec, hop_exposed, buckets, collectives,
                            syncs, bubble, tuple(memory), tuple(device_memory),
                            tuple(hop_links), tuple(dp_links), tuple(times.tp_links), refused,
                            notes, tuple(where_text[0]), tuple(where_text[1]),
                            (run.compute_mb, run.edges, tuple(hop_links)) if pp > 1 else None,
                            optimizer, tuple(p.flows if p is not None else 1
                                             for p in priced_groups),
                            step_lower_bound(times.fwd, times.bwd, times.tp_s,
                                             layout.microbatches))


def step_lower_bound(fwd: list[float], bwd: list[float], tp_s: list[float], m: int) -> float:
    """Seconds no schedule, link or codec can beat: stage ``s`` starts its first forward
    after the forwards of the stages before it, runs its ``m`` forwards and backwards one
    after the other, and the stages before it run their last backward after it (codecs and
    links only add to each). The 1F1B step with instant links when stages are alike."""
    best = before = 0.0
    for f, b, t in zip(fwd, bwd, tp_s):
        work_f, work_b = f + t, b + t
        best = max(best, before + m * (work_f + work_b))
        before += work_f + work_b
    return best


def _check_layout(facts: ModelFacts, cluster: Cluster, layout: Layout) -> int:
    """How many equal parts the traced batch splits into (dp × microbatches); a ConfigError
    where the layout's ranks, stages or split do not fit the cluster and the model."""
    if layout.world != cluster.world:
        raise ConfigError(f"layout {layout.describe()} has {layout.world} ranks but the cluster "
                          f"{cluster.world} devices: pp × dp × tp must equal the devices")
    if layout.boundaries[-1] >= facts.num_layers:
        raise ConfigError(f"layout: {layout.pp} stages need {layout.pp} layers; the model has "
                          f"{facts.num_layers}")
    split = layout.dp * layout.microbatches
    if facts.batch % split:
        raise ConfigError(f"layout {layout.describe()}: the batch of {facts.batch} does not "
                          f"split into dp × microbatches = {split} equal parts")
    return split


def _stage_compute(ctx: _Pricing, st: StageFacts,
                   devs: list[str]) -> tuple[float, float, float, float]:
    """A stage's forward, backward and optimizer seconds per microbatch on its slowest
    device ``devs``, and its scale against this machine's seconds. The backward includes the
    layout's recomputation: each block's forward again (``block``), or the attention core's
    FLOPs at the forward's rate (``selective``)."""
    tp, meas, cluster = ctx.layout.tp, ctx.facts.measured, ctx.cluster
    policy = ctx.layout.recompute
    core = st.attn_core_flops * ctx.fraction / tp if policy == "selective" else 0.0
    if meas is not None:
        # the model's own seconds on this machine, scaled to the slowest device
        scale = max(meas.scale(cluster.device(x).flops) for x in devs)
        work = st.flops * ctx.fraction / tp
        fwd = scale * (work * meas.fwd_per_flop + st.ops * meas.fwd_per_op)
        bwd = scale * (work * meas.bwd_per_flop + st.ops * meas.bwd_per_op)
        again = fwd if policy == "block" else scale * core * meas.fwd_per_flop
        return fwd, bwd + again, scale * st.param_numel / tp * meas.opt_per_param, scale
    here = any(cluster.device(x).flops is None for x in devs)
    rate = min(cluster.device(x).flops or ctx.links.rate_here(ctx.facts, ctx.fraction / tp)
               for x in devs)
    # a device measured here also pays a fixed time per op (small models on CPUs
    # spend it; :func:`ccfx.planner.compute.from_flops` adds the same term)
    op_s = machine_rate()[1] if here else 0.0
    f = st.flops * ctx.fraction / tp / rate
    fwd = f + st.ops * op_s
    again = fwd if policy == "block" else core / rate
    return fwd, 2 * f + 2 * st.ops * op_s + again, 0.0, 1.0


def _stage_tensor_parallel(ctx: _Pricing, s: int, st: StageFacts) -> tuple[float, Link | None]:
    """Seconds of stage ``s``'s tensor-parallel all-reduces in one pass (Megatron's two per
    layer; the backward the same again) on its shards' slowest link; (0, None) at tp 1."""
    tp, dp = ctx.layout.tp, ctx.layout.dp
    if tp == 1:
        return 0.0, None
    link = ctx.links.slowest_within([ctx.dev(s, d, t) for t in range(tp)] for d in range(dp))
    per_layer = 0.0
    for i in range(st.lo, st.hi):
        nbytes = ctx.facts.layers[i].out_bytes * ctx.fraction
        per_layer += link.seconds(2 * (tp - 1) / tp * nbytes) * 2
    return per_layer, link


def _stage_times(ctx: _Pricing) -> _StageTimes:
    """Compute and tensor parallel per stage and microbatch, stretched where ranks share
    this machine's cores (:func:`~ccfx.planner.compute.contention`); the optimizer and the
    buckets' codecs run on every replica of a stage at once."""
    dp, tp, m = ctx.layout.dp, ctx.layout.tp, ctx.layout.microbatches
    fwd, bwd, tp_s, tp_links, opt_s, scales = [], [], [], [], [], []
    for s, st in enumerate(ctx.sf):
        devs = [ctx.dev(s, d, t) for d in range(dp) for t in range(tp)]
        f, b, o, scale = _stage_compute(ctx, st, devs)
        fwd.append(f)
        bwd.append(b)
        opt_s.append(o)
        scales.append(scale)
        collective_s, link = _stage_tensor_parallel(ctx, s, st)
        tp_s.append(collective_s)
        tp_links.append(link)
    meas = ctx.facts.measured
    cores = meas.cores if meas is not None else None
    stretch = contention(cores, [f + b for f, b in zip(fwd, bwd)], dp * tp, m)
    together = max(1.0, dp * tp / cores) if cores else 1.0
    scales = [x * stretch for x in scales]
    return _StageTimes([x * stretch for x in fwd], [x * stretch for x in bwd], tp_s, tp_links,
                       [x * together for x in opt_s], scales,
                       [x / stretch * together for x in scales])


def _price_hops(ctx: _Pricing, times: _StageTimes,
                priced_hops: list) -> tuple[list[float], list[int], list[Link]]:
    """Per stage, the pipeline hops' codec seconds and codec memory (a payload each side and
    an error-feedback residual), and each hop's link."""
    pp, dp, tp, layout = ctx.layout.pp, ctx.layout.dp, ctx.layout.tp, ctx.layout
    enc_dec = [0.0] * pp
    codec_mem = [0] * pp
    hop_links: list[Link] = []
    for h in range(pp - 1):
        if priced_hops:
            link = priced_hops[h].link
        else:
            link = ctx.links.slowest((ctx.dev(h, d, t), ctx.dev(h + 1, d, t)) for d in range(dp)
                                     for t in range(tp))
        hop_links.append(link)
        last = ctx.stages[h][1] - 1
        shape = ctx.facts.cut_shape(last, ctx.samples)
        dtype = getattr(torch, ctx.facts.layers[last].out_dtype)
        fspec, bspec = layout.hop_codecs[h] if h < len(layout.hop_codecs) else ("none", "none")
        cf, cb = ctx.timer.cost(fspec, shape, dtype), ctx.timer.cost(bspec, shape, dtype)
        enc_dec[h] += times.scales[h] * (cf.encode_s + cb.decode_s)
        enc_dec[h + 1] += times.scales[h + 1] * (cf.decode_s + cb.encode_s)
        for c, spec in ((cf, fspec), (cb, bspec)):
            if spec != "none":  # a payload each side, and an error-feedback residual
                residual = c.raw_bytes if spec.endswith("ef") or ",ef" in spec else 0
                codec_mem[h] += c.wire_bytes + residual
                codec_mem[h + 1] += c.wire_bytes + residual
    return enc_dec, codec_mem, hop_links


def _hop_edges(ctx: _Pricing) -> list[EdgeTraffic]:
    """The activation each pipeline hop carries, at the microbatch's samples."""
    edges = []
    for h in range(ctx.layout.pp - 1):
        last = ctx.stages[h][1] - 1
        edges.append(EdgeTraffic(h, f"hop {h}", ctx.facts.cut_shape(last, ctx.samples),
                                 getattr(torch, ctx.facts.layers[last].out_dtype),
                                 ((h, h + 1),)))
    return edges


def _run_pipeline(ctx: _Pricing, times: _StageTimes, enc_dec: list[float],
                  hop_links: list[Link], simulate: bool) -> _PipelineRun:
    """The pipeline's step: torch's schedule simulated rank by rank over each hop's own link
    (:class:`~ccfx.planner.pipeline_model.PipelineModel`), when each stage's program ends
    (its gradients are ready then), and the same schedule with instant links and no codecs
    (compute and bubble only); without a simulation, the slowest stage's work m times."""
    pp, m, layout = ctx.layout.pp, ctx.layout.microbatches, ctx.layout
    fwd, bwd, tp_s = times.fwd, times.bwd, times.tp_s
    per_mb = [fwd[s] + bwd[s] + 2 * tp_s[s] + enc_dec[s] for s in range(pp)]
    compute_mb = [StageCompute(fwd[s] + tp_s[s], bwd[s] + tp_s[s], "flops") for s in range(pp)]
    if pp > 1 and not simulate:
        pipe = m * max(per_mb)
        return _PipelineRun(per_mb, compute_mb, pipe, pipe, [pipe] * pp, [])
    if pp == 1:
        pipe = m * per_mb[0]
        return _PipelineRun(per_mb, compute_mb, pipe, pipe, [pipe], [])
    edges = _hop_edges(ctx)
    choice = {h: tuple(layout.hop_codecs[h]) for h in range(min(len(layout.hop_codecs),
                                                                pp - 1))}
    timeline = ctx.links.simulate(compute_mb, edges, hop_links, layout.schedule, m, ctx.timer,
                                  choice)
    alone = ctx.links.simulate(compute_mb, edges, [INSTANT] * (pp - 1), layout.schedule, m,
                               ctx.timer, {}).step_s
    return _PipelineRun(per_mb, compute_mb, timeline.step_s, alone, list(timeline.end_s), edges)


def _dp_links(ctx: _Pricing, priced_groups: list) -> list[Link | None]:
    """Each stage's data-parallel group's link: as priced, else its slowest pair (None at
    dp 1)."""
    dp, tp = ctx.layout.dp, ctx.layout.tp
    dp_links: list[Link | None] = []
    for s in range(len(ctx.sf)):
        if dp == 1:
            dp_links.append(None)
        elif s < len(priced_groups) and priced_groups[s] is not None:
            dp_links.append(priced_groups[s].link)
        else:
            dp_links.append(ctx.links.slowest_within([ctx.dev(s, a, t) for a in range(dp)]
                                                     for t in range(tp)))
    return dp_links


def _local_steps_s(ctx: _Pricing, pipe: float, dp_links: list[Link | None]) -> float:
    """Seconds the outer sync of local steps adds to a step, at its slowest stage
    (:func:`ccfx.planner.local_model.predict_local_steps` on the group's link)."""
    layout, tp = ctx.layout, ctx.layout.tp
    cfg = Config(sync_every=layout.sync_every, outer_codec=layout.outer_codec)
    worst = 0.0
    for s, st in enumerate(ctx.sf):
        shapes = [_shard(shape, tp) for shape in st.param_shapes] or [(1,)]
        pred = predict_local_steps(pipe, shapes, layout.dp, dp_links[s], cfg, ctx.timer)
        worst = max(worst, pred.step_s - pipe)
    return worst


def shard_messages(st: StageFacts, bucket: str) -> tuple[int, int, int]:
    """The collectives ``ccfx.shard`` issues for stage ``st`` per pass: (forward all-gathers,
    backward all-gathers, reduce-scatters). ``bucket`` "block" (``shard_bucket``): one each
    per block, and one for what comes before the first block and after the last (embeddings,
    final norm); "none": one per parameter, the backward gathering again its matrices only
    (a bias's or norm's gradient does not need the weight)."""
    if bucket == "block":
        n = st.hi - st.lo + 2
        return n, n, n
    params = max(1, len(st.param_shapes))
    matrices = max(1, sum(len(shape) >= 2 for shape in st.param_shapes))
    return params, matrices, params


def _sharded_exposed_s(ctx: _Pricing, st: StageFacts, link: Link, fwd: float,
                       bwd: float) -> float:
    """Sharded data parallel: the weights' all-gather in the forward and again in the
    backward with the gradients' reduce-scatter (a latency per message,
    :func:`shard_messages`), each beyond the compute it hides behind."""
    dp, tp, m = ctx.layout.dp, ctx.layout.tp, ctx.layout.microbatches
    share = dp if link.shared else 1
    wire = (dp - 1) / dp * st.param_bytes / tp * share * 8 / (link.gbps * 1e9)
    gathers, regathers, scatters = shard_messages(st, ctx.layout.shard_bucket)
    forward = link.seconds(0) * gathers + wire
    backward = link.seconds(0) * (regathers + scatters) + 2 * wire
    return max(0.0, forward - m * fwd) + max(0.0, backward - m * bwd)


def _bucket_sync_s(spec: str, c, n_buckets: int, link: Link, flows: int, dp: int,
                   sync_scale: float) -> float:
    """Seconds of a stage's gradient exchange of codec cost ``c``: a latency per bucket, the
    wire (:func:`exchange_wire_s`) and the codec's encode and decodes."""
    gather = spec != "none" and codecs.prototype(spec).reduction != "sum"
    wire = exchange_wire_s(spec, c.wire_bytes, dp, link, flows)
    # an all-reduce decodes once; ccfx's default gradient_collective for a gather
    # codec, the all-gather, decodes all W payloads (its own too: the same sum
    # everywhere)
    decodes = dp if gather else 1
    return (n_buckets * link.latency_ms * 1e-3 + wire
            + sync_scale * (c.encode_s + decodes * c.decode_s))


def _price_buckets(ctx: _Pricing, times: _StageTimes, dp_links: list, priced_groups: list,
                   run: _PipelineRun, synced: list[float], codec_mem: list[int],
                   exchange_mem: list[int]) -> float:
    """Seconds the gradient exchange adds to a step: without a pipeline hidden bucket by
    bucket behind the backward; under PP × DP each stage's after its own program ends
    (``synced`` gets when). Adds the exchange's buffers to ``codec_mem``/``exchange_mem``."""
    layout = ctx.layout
    pp, dp, tp, m = layout.pp, layout.dp, layout.tp, layout.microbatches
    buckets = 0.0
    for s, st in enumerate(ctx.sf):
        link = dp_links[s]
        spec = layout.gradient_codecs[s] if s < len(layout.gradient_codecs) else "none"
        numel = max(1, st.param_numel // tp)
        c = ctx.timer.cost(spec, (numel,), getattr(torch, st.grad_dtype))
        n_buckets = max(1, math.ceil(c.raw_bytes / BUCKET_BYTES))
        # the exchange's buckets in memory (ccfx's bucket plan; memory_model.bucket_memory)
        kept, exchange_mem[s] = bucket_memory(st, spec, dp, tp=tp, sharded=layout.sharded)
        codec_mem[s] += kept
        if layout.sharded:
            buckets += _sharded_exposed_s(ctx, st, link, times.fwd[s], times.bwd[s])
            continue
        flows = priced_groups[s].flows if s < len(priced_groups) and \
            priced_groups[s] is not None else 1
        t_sync = _bucket_sync_s(spec, c, n_buckets, link, flows, dp, times.sync_scales[s])
        if pp == 1:
            backward = m * (times.bwd[s] + times.tp_s[s])
            hidden = backward * (n_buckets - 1) / n_buckets
            buckets = max(buckets, max(t_sync / n_buckets, t_sync - hidden))
        else:
            synced[s] = run.ends[s] + t_sync
    if pp > 1:
        buckets = max(synced) - run.pipe
    return buckets


def _optimizer_s(pp: int, synced: list[float], opt_s: list[float], pipe: float,
                 buckets: float) -> float:
    """The optimizer step (a model measured here only): each stage's after its own schedule
    and exchange; without a pipeline after the exchange."""
    if pp > 1:
        return max(0.0, max(e + o for e, o in zip(synced, opt_s)) - pipe - buckets)
    return opt_s[0]


def _breakdown(ctx: _Pricing, times: _StageTimes, run: _PipelineRun,
               enc_dec: list[float]) -> tuple[float, float, float, float, float]:
    """Compute, collectives, bubble, codecs and exposed hops: the slowest stage's own work m
    times; the rest of the simulated step without links or codecs is bubble, and what the
    links and codecs add is theirs."""
    pp, m = ctx.layout.pp, ctx.layout.microbatches
    s_star = max(range(pp), key=lambda s: run.per_mb[s])
    compute = m * (times.fwd[s_star] + times.bwd[s_star])
    collectives = m * 2 * times.tp_s[s_star]
    bubble = max(0.0, run.alone - compute - collectives)
    added = max(0.0, run.pipe - run.alone)
    codec = min(added, m * enc_dec[s_star])
    return compute, collectives, bubble, codec, added - codec


def _price_memory(ctx: _Pricing, codec_mem: list[int], exchange_mem: list[int]
                  ) -> tuple[list[MemoryEstimate], list[int], str | None]:
    """Each stage's memory estimate, its smallest device's memory, and why the layout is
    refused (the first stage above ``MEMORY_LIMIT`` of its device; None: it fits)."""
    layout, cluster, facts = ctx.layout, ctx.cluster, ctx.facts
    pp, dp, tp, m = layout.pp, layout.dp, layout.tp, layout.microbatches
    memory, device_memory = [], []
    largest = max(x.param_bytes for x in facts.layers)
    refused = None
    for s, st in enumerate(ctx.sf):
        est = stage_memory(st, fraction=ctx.fraction,
                           held=in_flight(layout.schedule, s, pp, m), microbatches=m, tp=tp,
                           dp=dp, sharded=layout.sharded, largest_layer_bytes=largest,
                           codec_bytes=codec_mem[s], exchange_bytes=exchange_mem[s],
                           recompute=(recompute_bytes(facts, *ctx.stages[s])
                                      if layout.recompute == "block" else None),
                           sequence_parallel=layout.sequence_parallel,
                           selective=layout.recompute == "selective")
        devs = [ctx.dev(s, d, t) for d in range(dp) for t in range(tp)]
        smallest = min(devs, key=cluster.memory)
        cap = cluster.memory(smallest)
        memory.append(est)
        device_memory.append(cap)
        if refused is None and est.total > MEMORY_LIMIT * cap:
            refused = (f"stage {s} on {smallest} needs {est.describe()}, above "
                       f"{MEMORY_LIMIT:.0%} of its {cap / 2 ** 30:.3g} GiB")
    return memory, device_memory, refused


def exchange_wire_s(spec: str, wire_bytes: float, dp: int, link: Link, flows: int = 1) -> float:
    """Seconds on ``link`` (as priced: its bandwidth divided among ``flows``) of averaging a
    stage's gradients of ``wire_bytes`` payload over ``dp`` replicas, latency apart: an
    all-reduce (``none`` and the summable codecs) ``2 (W-1)/W`` of the payload per rank; a
    gather codec (int8 …) ccfx's default all-gather, ``W-1`` payloads in per rank (pp1-dp4
    int8 was predicted at half its bytes before), and with two replicas on gloo's TCP the
    turns its two directions take (:func:`ccfx.wire.link.pair_gather_wait_s`: pp2-dp2 int8
    with the replicas across the slow link was predicted 27 % short without them)."""
    share = dp if link.shared else 1
    gather = spec != "none" and codecs.prototype(spec).reduction != "sum"
    per_rank = (dp - 1) * wire_bytes if gather else 2 * (dp - 1) / dp * wire_bytes
    seconds = per_rank * share * 8 / (link.gbps * 1e9)
    if gather:
        seconds += pair_gather_wait_s(link, wire_bytes, dp, flows)
    return seconds


def _shard(shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """A parameter's local shape under tensor parallelism (its first dimension split)."""
    if tp == 1 or not shape:
        return tuple(shape)
    return (max(1, shape[0] // tp), *shape[1:])


def steps_multiplier(layout: Layout, table=None) -> float:
    """How many more steps than uncompressed the layout's hop codecs need to reach a loss
    target (:mod:`ccfx.planner.steps_model`: the table ``bench/time_to_loss`` measures, each
    hop one edge); gradient codecs and local steps count 1 (no multiplier measured for them)."""
    from ..steps_table import DEFAULT
    from .pipeline_model import EdgeTraffic
    from .steps_model import StepsModel

    if layout.pp == 1:
        return 1.0
    edges = [EdgeTraffic(h, f"hop {h}", (1,), torch.float32, ((h, h + 1),))
             for h in range(layout.pp - 1)]
    choice = {h: layout.hop_codecs[h] for h in range(min(len(layout.hop_codecs),
                                                         layout.pp - 1))}
    return StepsModel(table or DEFAULT, edges)(choice)

