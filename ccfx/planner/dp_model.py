"""The predicted data-parallel step under one choice of gradient codecs, and ``auto`` for
``gradient_codec``.

The backward runs for ``backward_s``; bucket ``i`` is ready when the backward has done the
fraction of its FLOPs that precede the bucket's last gradient (the backward graph says where
that is). Its codec's work (encode, and decode of what comes back) runs on the ranks' own
cores, so it delays the rest of the backward; its collective goes on the link once the bucket
is ready and the link is free (collectives of one group run one after the other). The step is
the forward, then whichever ends last: the backward with the codecs' work, or the last
collective. Bytes per rank: an all-reduce moves ``2 (W-1)/W`` times its payload (ring), an
all-gather ``W-1`` times, PowerSGD's two all-reduces their P and Q, ccfx's re-encoding ring
(``gradient_collective="ring"``) ``2 (W-1)/W`` of the payload in ``2 (W-1)`` sequential hops,
each paying the link's latency; on a shared medium every rank's bytes cross the one link. A
2-rank all-gather on gloo's TCP also waits for its two directions to take turns
(:func:`ccfx.wire.link.pair_gather_wait_s`, measured).

``gradient_collective="auto"`` (and ``outer_collective``) is resolved by the wire layer's one
rule, :func:`ccfx.wire.link.choose_collective`: ring or all-gather for one non-summable
payload, from the same prices.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ..plan import Decision
from ..wire.comm import LocalComm
from ..wire.exchange import BucketLayout, exchange_for
from ..wire.link import Link, pair_gather_wait_s, resolve_collective
from ..wire.ring import ring_wire_bytes
from .codec_cost import CodecTimer


@dataclass(frozen=True)
class BucketTraffic:
    index: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    ready_frac: float  # of the backward's work done when its last gradient exists


@dataclass(frozen=True)
class BucketCost:
    codec_s: float
    link_bytes: float  # per rank
    wire_bytes: int  # the payload one rank contributes (the plan's wire/step)
    hops: int = 1  # sequential messages, each paying the link's latency
    #: seconds the link adds beyond its bytes (a 2-rank all-gather's turns on gloo's TCP:
    #: :func:`ccfx.wire.link.pair_gather_wait_s`)
    wait_s: float = 0.0
    collective: str = "all_reduce"  # what the exchange runs


@dataclass
class DataParallelPrediction:
    step_s: float
    backward_end_s: float
    comm_end_s: float


class DataParallelModel:
    """``collective``: how non-summable payloads are averaged, ``gradient_collective``
    ("all_gather", "ring", or "auto": :func:`ccfx.wire.link.choose_collective` per bucket and
    codec)."""

    def __init__(self, forward_s: float, backward_s: float, buckets: Sequence[BucketTraffic],
                 world: int, link: Link, timer: CodecTimer | None = None,
                 collective: str = "all_gather", flows: int = 1):
        """``link`` as priced (its bandwidth divided among ``flows`` groups that share it)."""
        self.forward_s, self.backward_s = forward_s, backward_s
        self.buckets = list(buckets)
        self.world, self.link, self.flows = world, link, flows
        self.timer = timer or CodecTimer()
        self.collective = collective
        self._costs: dict[tuple[int, str], BucketCost] = {}

    def cost(self, b: BucketTraffic, spec: str) -> BucketCost:
        key = (b.index, spec)
        if key not in self._costs:
            numel = sum(math.prod(s) for s in b.shapes)
            collective = resolve_collective(self.collective, spec, numel, b.dtype, self.world,
                                            self.link)
            cost = _bucket_cost(b, spec, self.world, self.timer, collective)
            if cost.collective == "all_gather":
                cost = replace(cost, wait_s=pair_gather_wait_s(self.link, cost.wire_bytes,
                                                               self.world, self.flows))
            self._costs[key] = cost
        return self._costs[key]

    def predict(self, choice: Mapping[int, str]) -> DataParallelPrediction:
        share = self.world if self.link.shared else 1
        codec_done = link_free = 0.0
        work = 0.0  # codec seconds added to the backward so far
        for b in sorted(self.buckets, key=lambda b: b.ready_frac):
            c = self.cost(b, choice.get(b.index, "none"))
            ready = self.forward_s + b.ready_frac * self.backward_s + work
            work += c.codec_s
            codec_done = ready + c.codec_s
            start = max(codec_done, link_free)
            link_free = (start + self.link.seconds(c.link_bytes * share)
                         + (c.hops - 1) * self.link.latency_ms * 1e-3 + c.wait_s)
        backward_end = self.forward_s + self.backward_s + work
        end = max(backward_end, link_free, codec_done)
        return DataParallelPrediction(end, backward_end, link_free)


def _bucket_cost(b: BucketTraffic, spec: str, world: int, timer: CodecTimer,
                 collective: str = "all_gather") -> BucketCost:
    layout = BucketLayout(b.shapes, b.dtype)
    ex = exchange_for(layout, spec, collective)
    payload = ex.wire_bytes()
    hops = 1
    if ex.collective == "all_gather":
        per_rank = (world - 1) * payload
    elif ex.collective == "ring":
        per_rank = ring_wire_bytes(layout.numel, spec, b.dtype, world)
        hops = max(2 * (world - 1), 1)
    else:  # all_reduce, powersgd: ring all-reduces
        per_rank = 2 * (world - 1) / world * payload
    if spec == "none":
        return BucketCost(0.0, per_rank, payload, collective=ex.collective)
    def measure() -> dict:
        grads = [torch.randn(s, dtype=b.dtype) for s in b.shapes]
        state = ex.init_state()
        times = []
        for i in range(4):
            t0 = time.perf_counter()
            ex.run([g.clone() for g in grads], state, LocalComm())
            if i:  # the first call warms up
                times.append(time.perf_counter() - t0)
        decode = (timer.cost(spec, (layout.numel,), b.dtype).decode_s
                  if ex.collective in ("all_gather", "ring") else 0.0)
        return {"local_s": statistics.median(times), "decode_s": decode}

    def modelled() -> dict:  # the timer's fixed throughput: one encode, one decode
        c = timer.cost(spec, (layout.numel,), b.dtype)
        gathered = ex.collective in ("all_gather", "ring")
        return {"local_s": c.encode_s + c.decode_s, "decode_s": c.decode_s if gathered else 0.0}

    key = f"bucket:{spec}|{';'.join('x'.join(map(str, s)) for s in b.shapes)}|{b.dtype}"
    hit = timer.cached(key, measure if timer.throughput is None else modelled)
    # On top of the local round trip (one encode, one decode): after an all-gather every rank
    # decodes the W-1 other payloads; on the ring a rank encodes W chunks (one payload's worth)
    # and decodes 2W-1 (its reduce-scatter receipts, its own mean, the all-gather's), (W-1)/W
    # of a payload more.
    extra = (world - 1) if ex.collective == "all_gather" else (world - 1) / world
    return BucketCost(hit["local_s"] + extra * hit["decode_s"], per_rank, payload, hops,
                      collective=ex.collective)


def choose_bucket_codecs(model: DataParallelModel, pool: Mapping[int, Sequence[str]], *,
                         min_gain: float = 0.02, passes: int = 2
                         ) -> tuple[dict[int, str], list[Decision]]:
    """Per bucket, the candidate in ``pool[bucket]`` with the lowest predicted step."""
    choice = {b.index: "none" for b in model.buckets}
    base = model.predict(choice)
    tables: dict[int, list[tuple[str, float]]] = {}
    for _ in range(passes):
        for b in model.buckets:
            specs = list(pool.get(b.index, ["none"]))
            if len(specs) < 2:
                continue
            table = sorted(((s, model.predict({**choice, b.index: s}).step_s) for s in specs),
                           key=lambda t: t[1])
            tables[b.index] = table
            none_s = dict(table)["none"]
            best, best_s = table[0]
            choice[b.index] = best if best != "none" and best_s < none_s * (1 - min_gain) \
                else "none"
    decisions = []
    for b in model.buckets:
        table = tables.get(b.index)
        if table is None:
            if list(pool.get(b.index, [])) == ["none"]:  # compressible, but nothing admitted
                decisions.append(Decision(
                    f"bucket {b.index}", "none", [("none", base.step_s)],
                    "no codec is within the loss budget for gradient buckets (raise "
                    "auto_loss_budget, or name one in auto_candidates)"))
            continue
        decisions.append(Decision(f"bucket {b.index}", choice[b.index], table,
                                  _reason(choice[b.index], table, base, min_gain)))
    return choice, decisions


def _reason(spec: str, table, base: DataParallelPrediction, min_gain: float) -> str:
    times = dict(table)
    none_s = times["none"]
    if spec != "none":
        return (f"{spec}: {none_s:.4g} s -> {times[spec]:.4g} s per step predicted "
                f"({1 - times[spec] / none_s:.0%} faster)")
    best, best_s = next((c, s) for c, s in table if c != "none")
    if base.comm_end_s <= base.backward_end_s:
        return (f"hidden behind compute: uncompressed, the gradient collectives end "
                f"({base.comm_end_s:.4g} s) before the backward does ({base.backward_end_s:.4g}"
                f" s); a codec only adds its work ({best}: {best_s:.4g} s vs {none_s:.4g} s)")
    if best_s >= none_s:
        return (f"compression does not pay here: the best codec, {best}, predicts {best_s:.4g} s"
                f" against {none_s:.4g} s uncompressed")
    return (f"the best codec, {best}, saves {1 - best_s / none_s:.1%} of the step, less than the "
            f"{min_gain:.0%} a lossy codec must save")
