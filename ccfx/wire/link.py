"""The link between ranks, and the one choice of collective for a non-summable payload.

:class:`Link` is what the planner prices (bandwidth, latency, one shared medium or a link per
pair). :func:`choose_collective` is ``gradient_collective="auto"`` and ``outer_collective=
"auto"``: the re-encoding ring or the all-gather, whichever is predicted faster on the link.
Every place that resolves a collective calls :func:`resolve_collective` (the compiled
data-parallel backward, the pipeline's data-parallel gradients, local steps, the DDP comm
hook, and the planner's data-parallel and local-steps models), so they all agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import codecs
from ..config import AUTO
from ..errors import ConfigError
from .ring import gather_wire_bytes, ring_codec, ring_wire_bytes


@dataclass(frozen=True)
class Link:
    """Bandwidth in Gbit/s and one-way latency in ms. ``shared``: every message of every rank
    crosses one medium (a single switch port, the shaped loopback), not a link per pair."""

    gbps: float
    latency_ms: float = 0.05
    shared: bool = False
    #: A message leaves only once its receiver has posted the receive (else: at the send).
    rendezvous: bool = False
    #: A send's work completes when the transport takes the bytes (socket buffers), not when
    #: they arrive: the sender goes on computing while the link drains.
    buffered_sends: bool = True

    def seconds(self, nbytes: float) -> float:
        return self.latency_ms * 1e-3 + nbytes * 8 / (self.gbps * 1e9)


def configured_link(config) -> Link | None:
    """The link the options describe (``link_gbps``, ``link_latency_ms``, ``link_shared``), or
    None when ``link_gbps`` is not given."""
    if config.link_gbps is None:
        return None
    return Link(config.link_gbps, config.link_latency_ms, config.link_shared)


def choose_collective(spec: str, numel: int, dtype: torch.dtype, world: int,
                      link: Link | None = None, *, decode_s: float = 0.0) -> str:
    """"ring" or "all_gather" for averaging a ``numel``-element payload of codec ``spec``
    over ``world`` ranks: the one predicted faster.

    * all-gather: ``W-1`` payloads in per rank, one collective (one latency, as the planner
      prices every collective), then ``W-1`` more decodes than the local round trip;
    * ring (:mod:`ccfx.wire.ring`): ``2 (W-1)/W`` of a payload in ``2 (W-1)`` sequential
      hops, each paying the latency, ``(W-1)/W`` of a decode more; and a payload re-encoded at
      every hop (more error: the ring is chosen only where it is cheaper).

    ``decode_s``: seconds to decode the whole payload once (0: codec time left out; it only
    ever favours the ring). Without a ``link`` the decision is by bytes: the ring for
    ``W ≥ 3``. ``W ≤ 2`` is always the all-gather (same bytes, one quantisation fewer).
    Summable codecs (none, fp16, bf16, randomk, PowerSGD) all-reduce whatever this says, and
    codecs the ring refuses get "all_gather". Deterministic in its arguments: ranks that
    call it with the same ones agree."""
    if world <= 2 or codecs.prototype(spec).reduction == "sum":
        return "all_gather"
    try:
        ring_codec(spec)
    except ConfigError:
        return "all_gather"
    ring_bytes = ring_wire_bytes(numel, spec, dtype, world)
    gather_bytes = gather_wire_bytes(numel, spec, dtype, world)
    if link is None:
        return "ring" if ring_bytes < gather_bytes else "all_gather"
    share = world if link.shared else 1
    hops = 2 * (world - 1)
    ring_s = (hops * link.latency_ms * 1e-3 + ring_bytes * share * 8 / (link.gbps * 1e9)
              + (world - 1) / world * decode_s)
    gather_s = link.seconds(gather_bytes * share) + (world - 1) * decode_s
    return "ring" if ring_s < gather_s else "all_gather"


def resolve_collective(asked: str, spec: str, numel: int, dtype: torch.dtype, world: int,
                       link: Link | None = None) -> str:
    """The collective an option asks for (``gradient_collective``, ``outer_collective``, the
    comm hook's ``collective``), ``"auto"`` resolved by :func:`choose_collective`."""
    if asked != AUTO:
        return asked
    return choose_collective(spec, numel, dtype, world, link)
