"""Codecs whose payload size depends on the data (``Codec.variable``: ``tlc``), and which paths
send what.

Such a codec's payload has a fixed capacity (its ``payload_layout``, what ``wire_bytes``
counts: the receiver and the custom ops' fake kernels allocate it from the shape alone) and a
used length inside. Only a path that runs eagerly over a process group can send a size known
at run time: the all-gather of a data-parallel bucket through
:class:`ccfx.wire.exchange.GatherExchange` on a ``ProcessGroupComm`` (DDP's comm hook, the
pipeline's data-parallel replicas, local steps' outer sync) sends the used bytes and the ledger
counts them. Every other path (a compiled backward's buckets, whose collectives are traced with
static shapes; cut edges and pipeline sends; the ring; collectives in compiled graphs and
FSDP2) sends the whole capacity, and the ledger counts that, which is what crossed:
:func:`capacity_note` is what the plan says about such a channel.
"""

from __future__ import annotations

from .registry import prototype


def capacity_note(where: str, spec: str | None, wire_bytes) -> str | None:
    """The plan's note for a channel (``where``: "graph 0 bucket 1") whose codec ``spec`` has
    a variable payload on a path that sends its capacity; None for any other codec. A pair
    ``"a/b"`` (two codecs of one channel) is noted when either part is variable."""
    if spec in (None, "none") or not any(prototype(p).variable for p in spec.split("/")):
        return None
    return (f"{where}: codec {spec!r} packs to a data-dependent size, but this path sends its "
            f"fixed capacity ({wire_bytes} B) and the ledger counts that; only eager "
            "data-parallel all-gathers (DDP's comm hook, pipeline replicas, local steps) send "
            "the used bytes")
