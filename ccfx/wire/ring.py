"""A compressed ring all-reduce whose result is bit-identical on every rank.

Codecs whose payloads cannot be summed (int8, int4, fp8, topk, sign, qsgd, ...) are averaged by
:class:`~ccfx.wire.exchange.GatherExchange` with an all-gather: every rank receives
and decodes every other rank's payload, ``(W-1)`` payloads in per rank. The ring here moves
``2 (W-1) / W`` of a payload per rank instead, the bandwidth of a plain ring all-reduce, at the
price of re-encoding partial sums (INTELLECT-1 averaged its pseudo-gradients this way, int8 on a
ring, and found that replicas drift apart unless every rank ends with the *same bytes*):

1. **Reduce-scatter**, ``W-1`` hops. The tensor is split into ``W`` chunks. At hop ``h`` rank
   ``r`` encodes its running sum of chunk ``(r-h) mod W`` (hop 0: its own values), sends the
   payload to rank ``r+1`` and receives chunk ``(r-h-1) mod W`` from ``r-1``, which it decodes and
   adds its own values of that chunk to, in fp32. Every hop re-encodes (the codec sees a partial
   sum), but the sum itself is kept in fp32, never in the codec's format.
2. **The owner** of each fully summed chunk (rank ``r`` owns chunk ``(r+1) mod W``) divides by
   ``W``, encodes it once, and decodes its own payload: it keeps what the others will decode,
   not its more precise fp32 mean.
3. **All-gather**, ``W-1`` hops. The owners' payload bytes go round the ring unchanged (no
   re-encoding) and every rank decodes the same bytes of every chunk. All ranks therefore end
   with the same bits: replicas stay identical, with no broadcast afterwards.

Chunks follow the codec's ``block`` (int8, int4, fp8, sign, qsgd, terngrad: ``block`` elements
per scale), so a chunk holds whole blocks, its payload's shapes come from the codec's
``payload_layout`` and a receiver allocates without being told a size; the chunk payloads of a
blockwise codec add up to exactly the whole tensor's payload. Chunks are as even as whole
blocks allow (a tensor smaller than ``W`` blocks leaves some ranks an empty chunk; those hops
send nothing). Each hop sends one message: the chunk's payload tensors packed tight into one
byte buffer (:mod:`ccfx.wire.format`'s packer, ``align=1``). The all-gather forwards hop ``h``'s bytes before decoding them, so decodes overlap the
next transfer; the reduce-scatter cannot (hop ``h+1`` sends what hop ``h`` decoded and added).

Error feedback (``"topk:ratio=0.01,ef"``): the state is this rank's residual ``e``. The ring
averages ``c = x + e`` through the inner codec and ``e ← c − decode(encode(c))``, chunk by chunk
with the ring's chunks: each rank's *local* quantisation error, as in EF-SGD (the hop-0 payload
is that very encode). What later hops lose re-encoding partial sums is not fed back: no rank owns
that error (it belongs to a sum of several ranks' values). With ``W = 1`` the result is the
codec's round trip and ``e`` is exactly what it lost.

Only codecs whose decode needs no state run on a ring (decode here runs on other ranks'
payloads, ``W-1`` or ``2W-2`` times per call): stochastic codecs' ``step`` counter (qsgd,
terngrad) is used by encode only and advances once per encode. randomk counts its decodes in
state and PowerSGD is a pair of all-reduces (its payloads are summable): both raise
:class:`~ccfx.ConfigError` pointing at the all-gather.

Every wait is bounded by the group's timeout (point-to-point works on gloo honour it); a failed
or timed-out hop raises :class:`~ccfx.CollectiveError` naming this rank,
the phase and hop, and the peer it was sending to or waiting for.

Inside a compiled backward the ring runs as the custom op ``ccfx::ring_all_reduce`` (point to
point is not a functional collective, so it cannot be traced as one): the op resolves its group
by name and blocks until the averaged tensor is there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _torch_compat as tc
from .. import codecs
from ..codecs import ops as _ops  # noqa: F401  (registers torch.ops.ccfx_codecs)
from ..codecs.base import Codec
from ..codecs.ef import ErrorFeedback
from ..errors import CollectiveError, ConfigError
from . import format as _format

#: The tag of the ring's messages: apart from a user's own point-to-point traffic on a group.
TAG = 0xCCF


@dataclass(frozen=True)
class RingCodec:
    """A codec spec as the ring applies it: ``inner`` at every hop, error feedback around."""

    spec: str
    inner: Codec
    error_feedback: bool

    @property
    def unit(self) -> int:
        """Chunks hold a multiple of this many elements (the codec's block, else 1)."""
        block = getattr(self.inner, "block", 1)
        return block if isinstance(block, int) and block >= 1 else 1


def ring_codec(spec: str) -> RingCodec:
    """``spec`` checked for the ring; :class:`~ccfx.ConfigError` when it cannot run on one."""
    from ..codecs.powersgd import PowerSGD

    codec = codecs.prototype(spec)
    ef = isinstance(codec, ErrorFeedback)
    inner = codec.inner if ef else codec
    why = ""
    if isinstance(inner, PowerSGD):
        why = ("PowerSGD's payloads are summable (it all-reduces P and then Q) and it keeps Q "
               "between calls, so it has an exchange of its own")
    elif inner.variable:
        why = ("its payload's size depends on the data, and the ring's point-to-point hops "
               "send fixed-size chunks, so every hop would send the whole capacity (an eager "
               "all-gather over a process group sends only the used bytes)")
    else:
        extra = sorted(set(inner.state_layout((1,), torch.float32)) - {"step"})
        if extra:
            why = (f"its decode keeps state ({', '.join(extra)}), and a ring decodes other ranks' "
                   "payloads several times per call")
    if why:
        raise ConfigError(
            f"codec {codec.spec!r} cannot run on the ring all-reduce: {why}. Use "
            "collective='all_gather' (gradient_collective / outer_collective 'all_gather'); a "
            "summable codec all-reduces whichever collective is asked.")
    return RingCodec(codec.spec, inner, ef)


def chunk_sizes(numel: int, world: int, unit: int = 1) -> list[int]:
    """``world`` chunk sizes that add up to ``numel``: whole ``unit``s, as even as that allows
    (the first chunks get one unit more), the last non-empty chunk trimmed to fit."""
    units = -(-numel // unit)
    q, r = divmod(units, world)
    sizes = [(q + (i < r)) * unit for i in range(world)]
    excess = sum(sizes) - numel
    if excess:
        last = max(i for i, s in enumerate(sizes) if s)
        sizes[last] -= excess
    return sizes


def _layout_bytes(layout) -> int:
    return _format.layout_nbytes(layout)


def chunk_payload_bytes(numel: int, spec: str, dtype: torch.dtype, world: int) -> list[int]:
    """Bytes of each chunk's payload (0 for an empty chunk)."""
    rc = ring_codec(spec)
    return [_layout_bytes(rc.inner.payload_layout((n,), dtype)) if n else 0
            for n in chunk_sizes(numel, world, rc.unit)]


def ring_wire_bytes(numel: int, spec: str, dtype: torch.dtype, world: int,
                    rank: int | None = None) -> int:
    """Bytes rank ``rank`` *sends* in one ring all-reduce of ``numel`` elements: ``W-1`` chunk
    payloads in the reduce-scatter (every chunk but the one it ends up owning, ``r+1``) and
    ``W-1`` in the all-gather (every chunk but ``r+2``'s), about ``2 (W-1) / W`` payloads; it
    receives as many up to the chunks' unevenness (every chunk but ``r``'s, then but
    ``r+1``'s). ``rank=None``: the most any rank sends (chunks can differ by a block)."""
    if world <= 1:
        return 0
    sizes = chunk_payload_bytes(numel, spec, dtype, world)
    total = 2 * sum(sizes)

    def sent(r: int) -> int:
        return total - sizes[(r + 1) % world] - sizes[(r + 2) % world]

    return sent(rank) if rank is not None else max(sent(r) for r in range(world))


def gather_wire_bytes(numel: int, spec: str, dtype: torch.dtype, world: int) -> int:
    """Bytes one rank *receives* in the all-gather exchange: the ``W-1`` other ranks' payloads
    of the whole tensor. (It contributes one payload, ``Exchange.wire_bytes()``; a ring-shaped
    all-gather, as gloo's and NCCL's are, also sends ``W-1`` payloads per rank, forwarding.)"""
    codec = codecs.prototype(spec)
    return (world - 1) * int(codec.wire_bytes((numel,), dtype))


#: The last sentence of a ring error (a caller that says it for its own context drops it).
PEER_HINT = "A peer rank died, hung or runs a different step; see that rank's own error."


def _group_timeout(group) -> str:
    try:
        pg = group if group is not None else tc.c10d_default_group()
        return f"group timeout {tc.group_timeout_s(pg):g} s"
    except Exception:  # noqa: BLE001 (only for the message)
        return "the group's timeout"


class _Ring:
    """One call's ring: this rank's place in it, the codec and its (inner) state."""

    def __init__(self, rc: RingCodec, group, numel: int, dtype: torch.dtype, device,
                 inner_state: list[torch.Tensor]):
        self.rc, self.group, self.dtype, self.device = rc, group, dtype, device
        self.inner_state = inner_state
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        pg = group if group is not None else dist.group.WORLD
        self.next = dist.get_global_rank(pg, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(pg, (self.rank - 1) % self.world)
        self.sizes = chunk_sizes(numel, self.world, rc.unit)
        self.layouts = [rc.inner.payload_layout((n,), dtype) for n in self.sizes]
        #: each chunk's payload packed tight: one message per hop
        self.spans = [_format.offsets(layout) for layout in self.layouts]
        self.numel = numel

    # -- codec ------------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.rc.inner.spec
        payload, new = torch.ops.ccfx_codecs.encode(x.to(self.dtype), spec, self.inner_state)
        for s, n in zip(self.inner_state, new):  # a stochastic codec's step counter
            s.copy_(n)
        return _format.pack(payload, _format.offsets(
            [(tuple(t.shape), t.dtype) for t in payload]), x.device)

    def decode(self, buf: torch.Tensor, chunk: int) -> torch.Tensor:
        payload = _format.unpack(buf, self.layouts[chunk], self.spans[chunk])
        out, _ = torch.ops.ccfx_codecs.decode(payload, self.rc.inner.spec, [self.sizes[chunk]],
                                              self.dtype, self.inner_state)
        return out

    # -- transport ----------------------------------------------------------------------------

    def start(self, phase: str, hop: int, send: torch.Tensor | None, recv_chunk: int):
        """Post this hop's send to the next rank and receive from the previous one."""
        works = []
        recv = torch.empty(_layout_bytes(self.layouts[recv_chunk]) if self.sizes[recv_chunk]
                           else 0, dtype=torch.uint8, device=self.device)
        if send is not None and send.numel():
            try:
                works.append(("sending to", self.next,
                              dist.isend(send, dst=self.next, group=self.group, tag=TAG)))
            except RuntimeError as e:
                raise self._error(phase, hop, "posting a send to", self.next, e) from e
        if recv.numel():
            try:
                works.append(("waiting for", self.prev,
                              dist.irecv(recv, src=self.prev, group=self.group, tag=TAG)))
            except RuntimeError as e:
                raise self._error(phase, hop, "posting a receive from", self.prev, e) from e
        return phase, hop, works, recv

    def finish(self, pending) -> torch.Tensor:
        phase, hop, works, recv = pending
        for what, peer, work in works:
            try:
                work.wait()
            except RuntimeError as e:
                raise self._error(phase, hop, what, peer, e) from e
        return recv

    def _error(self, phase: str, hop: int, what: str, peer: int, e: BaseException):
        me = dist.get_rank()
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return CollectiveError(
            f"rank {me} (rank {self.rank} of {self.world} in the ring's group): ring "
            f"all-reduce of {self.numel} elements through {self.rc.spec!r} failed in the "
            f"{phase}, hop {hop + 1} of {self.world - 1}, {what} rank {peer} "
            f"({_group_timeout(self.group)}): {text}. {PEER_HINT}")

    # -- the algorithm --------------------------------------------------------------------------

    def run(self, chunks: list[torch.Tensor], first: torch.Tensor | None) -> list[torch.Tensor]:
        """The averaged chunks; ``first``: this rank's own chunk already encoded (EF)."""
        w, r = self.world, self.rank
        acc: dict[int, torch.Tensor] = {}
        send = first if first is not None else (
            self.encode(chunks[r]) if self.sizes[r] else None)
        for hop in range(w - 1):
            got_c = (r - hop - 1) % w
            got = self.finish(self.start("reduce-scatter", hop, send, got_c))
            if self.sizes[got_c]:
                acc[got_c] = self.decode(got, got_c).float() + chunks[got_c].float()
            if hop < w - 2:
                send = self.encode(acc[got_c]) if self.sizes[got_c] else None
        own = (r + 1) % w
        owned: dict[int, torch.Tensor] = {}
        out: list[torch.Tensor | None] = [None] * w
        if self.sizes[own]:
            owned[own] = self.encode(acc[own] / w)
            out[own] = self.decode(owned[own], own)
        pending = self.start("all-gather", 0, owned.get(own), r) if w > 1 else None
        for hop in range(w - 1):
            got_c = (r - hop) % w
            owned[got_c] = self.finish(pending)
            if hop < w - 2:  # forward these bytes before decoding them
                pending = self.start("all-gather", hop + 1, owned[got_c], (r - hop - 1) % w)
            if self.sizes[got_c]:
                out[got_c] = self.decode(owned[got_c], got_c)
        return [o if o is not None else chunks[c].new_empty(0) for c, o in enumerate(out)]


def _split_state(rc: RingCodec, numel: int, dtype: torch.dtype, state):
    """(residual or None, the inner codec's state tensors in its own order)."""
    state = list(state or [])
    names = sorted(codecs.prototype(rc.spec).state_layout((numel,), dtype))
    if len(names) != len(state):
        raise ConfigError(
            f"codec {rc.spec!r} takes {len(names)} state tensors ({', '.join(names) or 'none'}),"
            f" got {len(state)}: allocate them with ccfx.codecs.ops.init_state(spec, (numel,), "
            "dtype)")
    named = dict(zip(names, state))
    residual = named.pop("residual") if rc.error_feedback else None
    return residual, [named[k] for k in sorted(named)]


def _finite(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _check(flat: torch.Tensor) -> None:
    if flat.dim() != 1 or not flat.is_floating_point():
        raise ConfigError(f"the ring all-reduce takes a 1-D floating-point tensor, got "
                          f"{flat.dtype} of shape {tuple(flat.shape)}")


def ring_round_trip(flat: torch.Tensor, spec: str,
                    state: list[torch.Tensor] | None = None) -> torch.Tensor:
    """What the ring computes on one rank (world size 1, no process group needed): the codec's
    round trip of ``flat`` (+ the residual, which then keeps exactly what it lost)."""
    _check(flat)
    rc = ring_codec(spec)
    residual, inner_state = _split_state(rc, flat.numel(), flat.dtype, state)
    x = flat if residual is None else flat + residual
    if not x.numel():
        return x.clone()
    payload, new = torch.ops.ccfx_codecs.encode(x, rc.inner.spec, inner_state)
    for s, n in zip(inner_state, new):
        s.copy_(n)
    out, _ = torch.ops.ccfx_codecs.decode(payload, rc.inner.spec, [x.numel()], x.dtype,
                                          inner_state)
    if residual is not None:
        residual.copy_(_finite(x - out))
    return out


def ring_all_reduce(flat: torch.Tensor, spec: str, group=None,
                    state: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The mean of ``flat`` over the ranks of ``group`` (None: WORLD), through codec ``spec``
    on a re-encoding ring (see the module docstring); the result has ``flat``'s dtype and is
    bit-identical on every rank. Eager, blocking: every rank of the group must call it with
    the same ``numel``, ``spec`` and dtype.

    ``state``: the codec's state tensors for a ``(numel,)`` input, in
    :func:`ccfx.codecs.ops.state_names` order (:func:`ccfx.codecs.ops.init_state` makes them),
    updated in place: error feedback's residual, a stochastic codec's step counter. Without a
    process group (and ``group=None``) it is :func:`ring_round_trip`.

    The fp32 sums are rounded to ``flat``'s dtype where they are encoded (a bf16 tensor's
    partial sums travel as bf16 under ``none``), so the payloads are those of ``flat``'s dtype,
    as the all-gather's are.
    """
    _check(flat)
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return ring_round_trip(flat, spec, state)
    if dist.get_world_size(group) == 1:
        return ring_round_trip(flat, spec, state)
    rc = ring_codec(spec)
    n, dtype = flat.numel(), flat.dtype
    residual, inner_state = _split_state(rc, n, dtype, state)
    ring = _Ring(rc, group, n, dtype, flat.device, inner_state)
    x = flat.detach() if residual is None else flat.detach() + residual
    if not n:
        return x.clone()
    chunks = list(x.split(ring.sizes))
    first = None
    if residual is not None:
        errors = []
        for c, part in enumerate(chunks):
            if not part.numel():
                continue
            sent = ring.encode(part)
            errors.append(_finite(part - ring.decode(sent, c)))
            if c == ring.rank:
                first = sent
        residual.copy_(torch.cat(errors))
    return torch.cat(ring.run(chunks, first))


@torch.library.custom_op("ccfx::ring_all_reduce", mutates_args=())
def ring_all_reduce_op(flat: torch.Tensor, spec: str, group_name: str,
                       state: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`ring_all_reduce` as an op for traced graphs: the group by name
    (``ProcessGroup.group_name``), the state functional (returned updated, inputs untouched)."""
    new = [t.clone() for t in state]
    out = ring_all_reduce(flat, spec, tc.resolve_process_group(group_name), new)
    return out, new


@ring_all_reduce_op.register_fake
def _(flat, spec, group_name, state):
    return torch.empty_like(flat), [torch.empty_like(t) for t in state]
