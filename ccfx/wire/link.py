"""The link between ranks, and the one choice of collective for a non-summable payload.

:class:`Link` is what the planner prices (bandwidth, latency, one shared medium or a link per
pair). :func:`choose_collective` is ``gradient_collective="auto"`` and ``outer_collective=
"auto"``: the re-encoding ring or the all-gather, whichever is predicted faster on the link.
Every place that resolves a collective calls :func:`resolve_collective` (the compiled
data-parallel backward, the pipeline's data-parallel gradients, local steps, the DDP comm
hook, and the planner's data-parallel and local-steps models), so they all agree.
:func:`pair_gather_wait_s` is what a 2-rank all-gather loses on gloo's TCP (the planner
prices it; measured, below).
"""

from __future__ import annotations

import torch

from .. import codecs
from ..cluster_spec import Link
from ..config import AUTO
from ..errors import ConfigError
from .ring import gather_wire_bytes, ring_codec, ring_wire_bytes

#: A 2-rank all-gather on gloo's TCP transport ("buffered"): both directions of the exchange
#: travel on the pair's one connection, and the message that tells a sender its peer has
#: posted the receive goes on that same connection, behind whatever payload is already in it:
#: the two directions partly take turns instead of running at once: about 0.6 of one payload
#: at the link's whole rate on top of the bandwidth's time (one pair alone: 1.50x one
#: direction's time, bench/RESULTS.md, The shaped link).
PAIR_GATHER_WAIT = 0.6


def pair_gather_wait_s(link: Link, payload_bytes: float, world: int, flows: int = 1) -> float:
    """Seconds a ``world``-rank all-gather of ``payload_bytes`` per rank loses to its two
    directions taking turns (:data:`PAIR_GATHER_WAIT`): only ``world == 2`` on a per-pair link
    of the buffered transport (gloo's TCP); a shared medium already carries every byte in
    turn, and NCCL's blocking transport was not measured. ``link``: as priced, its bandwidth
    divided among ``flows`` flows; the wait is at the link's whole rate."""
    if world != 2 or link.shared or link.rendezvous or payload_bytes <= 0:
        return 0.0
    return PAIR_GATHER_WAIT * payload_bytes * 8 / (link.gbps * max(flows, 1) * 1e9)


def configured_link(config) -> Link | None:
    """The link the options describe (``link_gbps``, ``link_latency_ms``, ``link_shared``), or
    None when ``link_gbps`` is not given."""
    if config.link_gbps is None:
        return None
    return Link(config.link_gbps, config.link_latency_ms, config.link_shared)


def collective_seconds(spec: str, numel: int, dtype: torch.dtype, world: int, link: Link, *,
                       decode_s: float = 0.0) -> dict[str, float]:
    """The predicted seconds of averaging a ``numel``-element payload of codec ``spec`` over
    ``world`` ranks on ``link`` by each collective :func:`choose_collective` weighs (the ring
    only where the codec allows it): what it compares, and what a plan shows beside the
    choice.

    * all-gather: ``W-1`` payloads in per rank, one collective (one latency, as the planner
      prices every collective), then ``W-1`` more decodes than the local round trip;
    * ring (:mod:`ccfx.wire.ring`): ``2 (W-1)/W`` of a payload in ``2 (W-1)`` sequential
      hops, each paying the latency, ``(W-1)/W`` of a decode more; and a payload re-encoded at
      every hop (more error: the ring is chosen only where it is cheaper)."""
    share = world if link.shared else 1
    gather_bytes = gather_wire_bytes(numel, spec, dtype, world)
    out = {"all_gather": link.seconds(gather_bytes * share) + (world - 1) * decode_s}
    try:
        ring_codec(spec)
    except ConfigError:
        return out
    ring_bytes = ring_wire_bytes(numel, spec, dtype, world)
    hops = 2 * (world - 1)
    out["ring"] = (hops * link.latency_ms * 1e-3 + ring_bytes * share * 8 / (link.gbps * 1e9)
                   + (world - 1) / world * decode_s)
    return out


def choose_collective(spec: str, numel: int, dtype: torch.dtype, world: int,
                      link: Link | None = None, *, decode_s: float = 0.0) -> str:
    """"ring" or "all_gather" for averaging a ``numel``-element payload of codec ``spec``
    over ``world`` ranks: the one predicted faster (:func:`collective_seconds`).

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
    if link is None:
        ring_bytes = ring_wire_bytes(numel, spec, dtype, world)
        gather_bytes = gather_wire_bytes(numel, spec, dtype, world)
        return "ring" if ring_bytes < gather_bytes else "all_gather"
    seconds = collective_seconds(spec, numel, dtype, world, link, decode_s=decode_s)
    return "ring" if seconds["ring"] < seconds["all_gather"] else "all_gather"


def resolve_collective(asked: str, spec: str, numel: int, dtype: torch.dtype, world: int,
                       link: Link | None = None) -> str:
    """The collective an option asks for (``gradient_collective``, ``outer_collective``, the
    comm hook's ``collective``), ``"auto"`` resolved by :func:`choose_collective`."""
    if asked != AUTO:
        return asked
    return choose_collective(spec, numel, dtype, world, link)
