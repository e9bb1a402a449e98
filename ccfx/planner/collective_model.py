"""``collective_codec="auto"``: price every collective of a compiled graph on the link, and
compress only those where it pays.

A collective in a compiled graph is issued at one node and waited on at another; the compute
between the two runs while it is in flight, and only the rest of its time is **exposed** (a
tensor-parallel all-reduce is waited on at once: all of it is exposed; a prefetched all-gather
may hide). For each collective and candidate codec the model prices:

* **the wire**: the messages the wire layer would issue (:meth:`CompressedCollective.messages
  <ccfx.wire.collectives.CompressedCollective.messages>`; the uncompressed collective's own
  bytes for ``none``), each paying the link's latency once per sequential step (a ring
  all-reduce has ``2 (W-1)`` steps, an all-gather or reduce-scatter ``W-1``, an all-to-all one)
  and its bytes at the link's bandwidth, every rank's bytes on one medium when the link is
  shared. A compressed all-reduce is an all-to-all then an all-gather: one latency fewer per
  step than a ring but two collectives, which is why a decode step's all-reduce of a few
  kilobytes stays raw on any link with a latency;
* **the codec**: the compressed collective's own compute (encode, decode, the owner's sum,
  padding, packing), timed by running its phases on this machine over a loopback ``Comm``
  that hands back this rank's own messages as every rank's (the bytes a real group would
  return), cached beside the codec timings; with a :class:`~ccfx.planner.codec_cost.CodecTimer`
  of fixed throughput, an encode and a decode per payload instead (deterministic: tests);
* **the compute it hides behind**: the FLOPs between the collective's node and its wait, at
  the machine's measured rate.

A codec wins a collective when its exposed time plus its codec time is below the
uncompressed exposed time by at least ``auto_min_gain`` of that time; and the graph's choices
stand only if they make its predicted time (compute plus exposed collectives) at least
``auto_min_gain`` faster, else every collective stays raw and the decision says why. Lossy
codecs come from the loss budget (:mod:`ccfx.planner.candidates`): a forward collective (the
all-reduce after a row-parallel matmul, a sequence-parallel or sharded-parameter all-gather or
reduce-scatter, an expert dispatch) is priced under the ``activation`` rows, a backward
all-reduce or all-to-all under ``activation_grad``; a backward all-gather may carry weights
gathered again (sharded parameters) or gradients (sequence parallel), and a backward
reduce-scatter gradients of parameters or of activations, so those take only the codecs within
the budget of both (``activation`` and ``activation_grad``; ``gradient`` and
``activation_grad``): bench/convergence measured these roles on pipeline edges and buckets,
the closest measured stand-ins.

On gloo, torch's CPU ``reduce_scatter_tensor`` costs a whole all-reduce (twice an all-gather
of the same bytes: bench/RESULTS.md, Sharded data parallel), so an
uncompressed reduce-scatter on a gloo group is priced as one; the compressed one is an
all-to-all and is not.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..plan import Decision, Prediction
from ..wire.collectives import CollectiveCall, CompressedCollective, refuse
from ..wire.link import Link
from .codec_cost import CodecTimer


@dataclass(frozen=True)
class CollectiveTraffic:
    """One collective as the planner sees it: the plan's ``index``, the wire layer's ``call``,
    the graph ``part`` it is in, and the compute seconds between its issue and its wait."""

    index: int
    call: CollectiveCall
    part: str
    overlap_s: float = 0.0
    #: The process group's backend ("gloo", "nccl", ...; "" unknown): how the raw one runs.
    backend: str = ""

    @property
    def roles(self) -> tuple[str, ...]:
        """Its loss-budget roles (:data:`ccfx.planner.candidates.MEASURED`'s keys): a codec
        must be within the budget of each (see the module docstring)."""
        if self.part != "backward":
            return ("activation",)
        if self.call.kind == "all_gather":
            return ("activation", "activation_grad")
        if self.call.kind == "reduce_scatter":
            return ("gradient", "activation_grad")
        return ("activation_grad",)

    @property
    def role(self) -> str:
        return " and ".join(self.roles)


@dataclass(frozen=True)
class CollectiveCost:
    """Seconds of one collective under one codec: on the link (all of it, and the part the
    compute between issue and wait does not hide) and of the codec's own compute."""

    spec: str
    link_s: float
    exposed_s: float
    codec_s: float

    @property
    def total_s(self) -> float:
        return self.exposed_s + self.codec_s


def _steps(kind: str, world: int) -> int:
    """Sequential link steps of one collective (each pays the latency once)."""
    if kind == "all_reduce":
        return 2 * (world - 1)
    if kind in ("all_gather", "reduce_scatter"):
        return world - 1
    return 1  # all_to_all: every pair at once


def _sent(kind: str, input_bytes: int, world: int) -> float:
    """Bytes one rank sends for a collective of ``kind`` on ``input_bytes`` (the convention of
    :attr:`CollectiveCall.raw_bytes`)."""
    if kind == "all_reduce":
        return 2 * (world - 1) / world * input_bytes
    if kind == "all_gather":
        return (world - 1) * input_bytes
    return (world - 1) / world * input_bytes  # reduce_scatter, all_to_all


def link_seconds(call: CollectiveCall, spec: str, link: Link, backend: str = "") -> float:
    """Seconds on ``link`` of the collective ``call`` under codec ``spec``, on a process group
    of ``backend`` (gloo's reduce-scatter is an all-reduce's cost)."""
    share = call.world if link.shared else 1
    if spec == "none":
        kind = "all_reduce" if call.kind == "reduce_scatter" and backend == "gloo" else call.kind
        messages = [(kind, call.numel * call.dtype.itemsize)]
    else:
        messages = CompressedCollective(call, spec).messages()
    total = 0.0
    for kind, nbytes in messages:
        total += (_steps(kind, call.world) * link.latency_ms * 1e-3
                  + _sent(kind, nbytes, call.world) * share * 8 / (link.gbps * 1e9))
    return total


class _Loopback:
    """A ``Comm`` of ``world`` simulated ranks that all sent what this rank sent: the shapes and
    bytes a real group returns, no network (what the codec's compute costs)."""

    def __init__(self, world: int):
        self.world = world

    def all_to_all(self, t, output_splits=None, input_splits=None):
        if output_splits is None:
            return t.clone()
        rows = sum(output_splits)  # unequal splits: this rank's rows again, as many as it gets
        if t.shape[0] == 0:
            return t.new_zeros((rows, *t.shape[1:]))
        return t.repeat(-(-rows // t.shape[0]), *[1] * (t.dim() - 1))[:rows]

    def all_gather(self, t):
        return t.reshape(-1).repeat(self.world)

    def reduce_scatter(self, t):
        return t[: t.shape[0] // self.world] * self.world

    def all_reduce(self, t):
        return t * self.world

    def wait(self, t):
        return t


def codec_seconds(call: CollectiveCall, spec: str, timer: CodecTimer) -> float:
    """Seconds of the compressed collective's own compute on one rank, measured (see the
    module docstring), or modelled at ``timer.throughput``."""
    if spec == "none":
        return 0.0
    if timer.throughput is not None:
        c = timer.cost(spec, (call.numel,), call.dtype)
        decodes = 2 if call.kind == "all_reduce" else 1
        encodes = 2 if call.kind == "all_reduce" else 1
        if call.kind == "all_gather":
            decodes = call.world
        return encodes * c.encode_s + decodes * c.decode_s

    def measure() -> dict:
        compressed = CompressedCollective(call, spec)
        x = torch.randn(call.shape, generator=torch.Generator().manual_seed(0)).to(call.dtype)
        state = compressed.init_state()
        comm = _Loopback(call.world)
        times = []
        for i in range(max(timer.repeats, 3) + 1):
            t0 = time.perf_counter()
            compressed.run(x, state, comm)
            if i:  # the first call warms up
                times.append(time.perf_counter() - t0)
        return {"codec_s": statistics.median(times)}

    key = (f"collective:{call.kind}:{spec}|{'x'.join(map(str, call.shape))}|"
           f"{str(call.dtype).replace('torch.', '')}|w{call.world}|{call.reduce_op}")
    return float(timer.cached(key, measure)["codec_s"])


def collective_cost(t: CollectiveTraffic, spec: str, link: Link,
                    timer: CodecTimer) -> CollectiveCost:
    on_link = link_seconds(t.call, spec, link, t.backend)
    return CollectiveCost(spec, on_link, max(on_link - t.overlap_s, 0.0),
                          codec_seconds(t.call, spec, timer))


@dataclass
class CollectiveChoice:
    """What :func:`choose_collective_codecs` decided: a codec per collective index, a
    :class:`~ccfx.plan.Decision` for each one it weighed, and the predicted time of the graph
    part (compute plus exposed collectives), uncompressed and as chosen."""

    codecs: dict[int, str]
    decisions: list[Decision]
    uncompressed_s: float
    chosen_s: float


def choose_collective_codecs(traffic: Sequence[CollectiveTraffic], compute_s: float,
                             pool: Mapping[int, Sequence[str]], link: Link, *,
                             timer: CodecTimer | None = None,
                             min_gain: float = 0.10) -> CollectiveChoice:
    """Per collective, the candidate of ``pool[index]`` with the least exposed-plus-codec time
    (see the module docstring); ``compute_s``: the graph part's compute."""
    timer = timer or CodecTimer()
    tables: dict[int, list[tuple[str, float]]] = {}
    choice: dict[int, str] = {}
    raw: dict[int, float] = {}
    for t in traffic:
        specs = [s for s in pool.get(t.index, ["none"])
                 if s == "none" or refuse(t.call, s) is None]
        costs = {s: collective_cost(t, s, link, timer) for s in dict.fromkeys(["none", *specs])}
        raw[t.index] = costs["none"].total_s
        table = sorted(((s, c.total_s) for s, c in costs.items()), key=lambda sc: sc[1])
        tables[t.index] = table
        best, best_s = table[0]
        choice[t.index] = (best if best != "none" and best_s < raw[t.index] * (1 - min_gain)
                           else "none")
    step = {t.index: dict(tables[t.index]) for t in traffic}
    uncompressed = compute_s + sum(raw.values())
    chosen = compute_s + sum(step[i][choice[i]] for i in choice)
    overall_short = uncompressed > 0 and chosen > uncompressed * (1 - min_gain)
    decisions = []
    for t in traffic:
        table = tables[t.index]
        picked = choice[t.index]
        if overall_short and picked != "none":
            reason = (f"{picked} would save {raw[t.index] - step[t.index][picked]:.3g} s, but all "
                      f"of this graph's choices together save {1 - chosen / uncompressed:.1%} of "
                      f"its predicted {uncompressed:.4g} s, less than auto_min_gain "
                      f"({min_gain:.0%}): every collective stays raw")
            picked = choice[t.index] = "none"
        else:
            reason = _reason(t, picked, table, raw[t.index], link, timer, min_gain)
        decisions.append(Decision(f"collective {t.index}", picked, table, reason))
    if overall_short:
        chosen = uncompressed
    return CollectiveChoice(choice, decisions, uncompressed, chosen)


def _reason(t: CollectiveTraffic, spec: str, table, raw_s: float, link: Link,
            timer: CodecTimer, min_gain: float) -> str:
    times = dict(table)
    call = t.call
    what = f"{call.kind} of {call.numel * call.dtype.itemsize / 1e6:.3g} MB on {call.world} ranks"
    if spec != "none":
        c = collective_cost(t, spec, link, timer)
        return (f"{what}: {raw_s:.3g} s exposed uncompressed -> {c.exposed_s:.3g} s on the "
                f"link + {c.codec_s:.3g} s of codec ({1 - times[spec] / raw_s:.0%} less)")
    others = [(s, v) for s, v in table if s != "none"]
    if not others:
        return (f"{what}: no codec within the loss budget for its role ({t.role}; raise "
                "auto_loss_budget, or name one in auto_candidates)")
    best, best_s = others[0]
    if raw_s <= 0:
        return f"{what}: hidden behind the compute between its issue and its wait"
    if best_s >= raw_s:
        none = collective_cost(t, "none", link, timer)
        c = collective_cost(t, best, link, timer)
        return (f"{what}: compression does not pay: {best} predicts {c.exposed_s:.3g} s on "
                f"the link + {c.codec_s:.3g} s of codec against {none.exposed_s:.3g} s raw "
                "(latency and codec overhead outweigh the bytes saved)")
    return (f"{what}: the best codec, {best}, saves {1 - best_s / raw_s:.0%} of its time, less "
            f"than auto_min_gain ({min_gain:.0%})")


#: The schedule a collectives prediction names (what tells it apart in a plan).
SCHEDULE = "compute, then every collective's exposed time"


def prediction(choice: CollectiveChoice, link_text: str, compute: str) -> Prediction:
    return Prediction(choice.uncompressed_s, choice.chosen_s, link_text, SCHEDULE, 1, compute)
