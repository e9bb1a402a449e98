"""The predicted step of a pipeline under one choice of codecs.

Inputs are the facts the plan already holds plus three measurements:

* per stage, seconds of forward and backward per microbatch (:class:`StageCompute`: from the
  stage's FLOPs and the machine's measured throughput, or from a timed profile);
* per cut edge, the tensor that crosses (:class:`EdgeTraffic`: shape, dtype, hops, whether a
  gradient comes back);
* the links (:class:`~ccfx.wire.link.Link`) and each codec's encode / decode seconds and
  payload bytes at the tensor's size (:class:`~ccfx.planner.codec_cost.CodecTimer`).

:meth:`PipelineModel.predict` turns a codec choice per edge and direction into per-stage costs
and per-message bytes and runs the schedule simulator: the prediction is the simulated step.

**Links per hop.** ``PipelineModel(compute, edges, link)`` prices every hop on one ``link``;
give a sequence instead, ``[link_0, ..., link_{n-2}]`` (``link_s`` joins stages s and s+1,
both directions), and each hop is priced on its own. From a cluster::

    from ccfx.planner.links import hop_links
    priced = hop_links(cluster, num_stages, replicas=dp, placement=devices)  # PricedLink each
    model = PipelineModel(compute, edges, [p.link for p in priced])

(:func:`ccfx.planner.links.hop_links`: stage s of replica d on device ``placement[d × P + s]``,
NIC contention already in the bandwidth; ``p.describe()`` says which link and why.) Tied
parameters' gradient sums are priced on ``group_link(stages)``; by default the slowest hop
link between the first and the last stage that holds one. Everything here is pure (no
``torch.distributed``): the layout search calls it for every layout it weighs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..wire.link import Link
from ..wire.schedules import Message, StageCost, epilogue_backwards
from .codec_cost import CodecCost, CodecTimer
from .schedule import Timeline, hop_links, simulate


@dataclass(frozen=True)
class StageCompute:
    """Seconds per microbatch; ``source`` says where they came from ("flops", "profile")."""

    forward_s: float
    backward_s: float
    source: str = "profile"


@dataclass(frozen=True)
class EdgeTraffic:
    """One cut edge as the planner sees it: the plan's edge ``index`` at the microbatch shape."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    hops: tuple[tuple[int, int], ...]
    requires_grad: bool = True

    @property
    def raw_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * self.dtype.itemsize


#: edge index → (forward spec, backward spec)
Choice = Mapping[int, tuple[str, str]]


@dataclass
class PipelinePrediction:
    step_s: float
    timeline: Timeline
    wire_bytes: int  # per step, every hop, both directions
    raw_bytes: int
    codec_s: float  # encode + decode seconds per step, every rank


class PipelineModel:
    """``link``: one :class:`Link` for every hop, or one per hop (``link[s]`` joins stages s
    and s+1): the module's docstring."""

    def __init__(self, compute: Sequence[StageCompute], edges: Sequence[EdgeTraffic],
                 link: Link | Sequence[Link], *, schedule: str = "1F1B",
                 microbatches: int = 8, timer: CodecTimer | None = None,
                 epilogue_only: bool = False,
                 shared: Sequence[tuple[tuple[int, ...], int]] = (),
                 tail_s: Sequence[float] = (),
                 group_link: Callable[[tuple[int, ...]], Link] | None = None):
        self.compute = list(compute)
        self.edges = list(edges)
        #: per hop s → s+1, the link it is priced on
        self.links = hop_links(link, len(self.compute))
        #: the one link (or, per hop, the slowest): what a one-line description names
        self.link = link if isinstance(link, Link) else min(
            self.links, key=lambda x: (x.gbps, -x.latency_ms), default=None)
        self.group_link = group_link
        self.schedule = schedule
        self.microbatches = microbatches
        self.timer = timer or CodecTimer()
        #: backward sends compressed only in the cool-down (Optimus-CC): the others cost
        #: their raw bytes on the wire and no codec time
        self.epilogue_only = epilogue_only
        #: tied parameters (the stages that hold one, its bytes): their gradient partials are
        #: summed over those stages' ranks after the step (``ccfx.sync_grads``), uncompressed
        self.shared = list(shared)
        #: per stage, seconds after its part of the schedule (the optimizer step)
        self.tail_s = list(tail_s)
        #: predictions by choice: ``auto``'s descent asks for the same choice again
        self._memo: dict[tuple, PipelinePrediction] = {}

    @property
    def num_stages(self) -> int:
        return len(self.compute)

    def cost(self, edge: EdgeTraffic, spec: str) -> CodecCost:
        return self.timer.cost(spec, edge.shape, edge.dtype)

    def predict(self, choice: Choice | None = None) -> PipelinePrediction:
        """The step with ``choice`` (edges not in it: uncompressed), memoised per choice."""
        choice = choice or {}
        known = {e.index for e in self.edges}
        key = tuple(sorted((k, tuple(v)) for k, v in choice.items()
                           if k in known and tuple(v) != ("none", "none")))
        key = (key, self._settings())
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._predict(choice)
        return hit

    def _settings(self) -> tuple:
        """What a prediction depends on besides the choice: the attributes a caller may set
        between two predictions (a memoised step never outlives a change to them)."""
        return (tuple(self.compute), tuple(self.edges), tuple(self.links), self.schedule,
                self.microbatches, self.epilogue_only, tuple(self.shared),
                tuple(self.tail_s), self.group_link, id(self.timer))

    def _predict(self, choice: Choice) -> PipelinePrediction:
        n = self.num_stages
        enc = {k: [0.0] * n for k in ("fwd", "bwd")}
        dec = {k: [0.0] * n for k in ("fwd", "bwd")}
        size: dict[tuple[str, int], int] = {}
        raw_size: dict[int, int] = {}
        codec_s = raw = wire = 0.0
        for e in self.edges:
            fwd, bwd = choice.get(e.index, ("none", "none"))
            for direction, spec in (("fwd", fwd), ("bwd", bwd)):
                if direction == "bwd" and not e.requires_grad:
                    continue
                c = self.cost(e, spec)
                for a, b in e.hops:
                    sender, receiver = (a, b) if direction == "fwd" else (b, a)
                    enc[direction][sender] += c.encode_s
                    dec[direction][receiver] += c.decode_s
                    size[(direction, a)] = size.get((direction, a), 0) + c.wire_bytes
                    if direction == "bwd":
                        raw_size[a] = raw_size.get(a, 0) + c.raw_bytes
                    codec_s += (c.encode_s + c.decode_s) * self.microbatches
                    raw += c.raw_bytes * self.microbatches
                    wire += c.wire_bytes * self.microbatches
        def epilogue(stage: int) -> frozenset[int] | None:
            if not self.epilogue_only or stage >= n:
                return None
            return epilogue_backwards(self.schedule, stage, n, self.microbatches)

        stages = [StageCost(sc.forward_s, sc.backward_s, encode_fwd_s=enc["fwd"][s],
                            decode_fwd_s=dec["fwd"][s], encode_bwd_s=enc["bwd"][s],
                            decode_bwd_s=dec["bwd"][s], encode_bwd_mbs=epilogue(s),
                            decode_bwd_mbs=epilogue(s + 1))
                  for s, sc in enumerate(self.compute)]

        def nbytes(m: Message) -> int:
            if self.epilogue_only and m.kind == "bwd" and m.microbatch not in \
                    epilogue_backwards(self.schedule, m.hop + 1, n, self.microbatches):
                return raw_size.get(m.hop, 0)
            return size.get((m.kind, m.hop), 0)

        timeline = simulate(self.schedule, stages, self.microbatches, nbytes, self.links)
        end = list(timeline.end_s)
        for holders, size in self.shared:  # the tied-weight all-reduce after the step
            k = len(holders)
            link = self.link_of_group(tuple(holders))
            moved = 2 * (k - 1) / k * size * (k if link.shared else 1)
            done = max(end[s] for s in holders) + link.seconds(moved)
            for s in holders:
                end[s] = done
        step = max(e + (self.tail_s[s] if s < len(self.tail_s) else 0.0)
                   for s, e in enumerate(end))
        return PipelinePrediction(step, timeline, int(wire), int(raw), codec_s)


    def link_of_group(self, stages: tuple[int, ...]) -> Link:
        """The link a sum over ``stages``' ranks crosses: ``group_link(stages)``, else the
        slowest hop link between the first and the last of them."""
        if self.group_link is not None:
            return self.group_link(stages)
        lo, hi = min(stages), max(stages)
        between = self.links[lo:hi] or self.links
        return min(between, key=lambda x: (x.gbps, -x.latency_ms)) if between else self.link


def edges_from_plan(plan, graph: int = 0) -> list[EdgeTraffic]:
    """The cut edges of one graph of a :class:`~ccfx.Plan` (shapes as the plan holds them:
    compile at the microbatch shape to plan a pipeline)."""
    g = plan.graphs[graph]
    return [EdgeTraffic(e.index, e.source, tuple(int(d) for d in e.shape),
                        getattr(torch, e.dtype.replace("torch.", "")), tuple(map(tuple, e.hops)),
                        e.grad_codec is not None)
            for e in g.edges]


def shared_from_plan(plan, graph: int = 0) -> list[tuple[tuple[int, ...], int]]:
    """The plan's tied parameters as (stages holding one, its bytes)."""
    return [(tuple(p.stages), p.nbytes) for p in plan.graphs[graph].shared]
