"""What one tensor looks like on the wire: a codec's payload tensors packed into one flat
``uint8`` buffer, and back.

One packer (:func:`offsets`, :func:`pack`, :func:`unpack`) serves every message ccfx sends:

* :class:`WireFormat`, a pipeline hop's activation or gradient: every payload tensor starts at
  a multiple of 8 bytes (``align=8``), so the receiver views the buffer as each dtype without
  a copy;
* the re-encoding ring's chunks (:mod:`ccfx.wire.ring`): packed tight (``align=1``), so the
  bytes on the wire are exactly the payload's (:func:`ccfx.wire.ring.ring_wire_bytes`); a
  tensor at an offset its dtype cannot be viewed at is copied out.

A layout is the codec's ``payload_layout(shape, dtype)``: ``[(shape, dtype), ...]``. Both ends
derive it from the shape, the dtype and the codec, so nothing but the payload bytes is sent.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import codecs

Layout = Sequence[tuple[Sequence[int], torch.dtype]]


def offsets(layout: Layout, align: int = 1) -> tuple[tuple[int, int], ...]:
    """``(byte offset, byte length)`` of each payload tensor in the packed buffer; each tensor
    starts at a multiple of ``align`` bytes."""
    out, at = [], 0
    for shape, dtype in layout:
        n = math.prod(int(d) for d in shape) * dtype.itemsize
        out.append((at, n))
        at += -(-n // align) * align
    return tuple(out)


def nbytes(spans: Sequence[tuple[int, int]]) -> int:
    """Bytes of the packed buffer (the last tensor is not padded)."""
    if not spans:
        return 0
    at, n = spans[-1]
    return at + n


def layout_nbytes(layout: Layout, align: int = 1) -> int:
    """Bytes of ``layout`` packed with ``align``."""
    return nbytes(offsets(layout, align))


def pack(payload: Sequence[torch.Tensor], spans: Sequence[tuple[int, int]],
         device=None) -> torch.Tensor:
    """The payload tensors as one ``uint8`` buffer laid out by ``spans`` (:func:`offsets`);
    padding bytes are left uninitialised (never read)."""
    if device is None:
        device = payload[0].device if payload else "cpu"
    buf = torch.empty(nbytes(spans), dtype=torch.uint8, device=device)
    for t, (at, n) in zip(payload, spans, strict=True):
        buf[at:at + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf


def unpack(buf: torch.Tensor, layout: Layout,
           spans: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """The payload tensors of ``buf``: views where the offset suits the dtype, else copies (a
    slice at an odd offset cannot be viewed as a wider dtype)."""
    out = []
    for (shape, dtype), (at, n) in zip(layout, spans, strict=True):
        piece = buf[at:at + n]
        if at % dtype.itemsize:
            piece = piece.clone()
        out.append(piece.view(dtype).view(tuple(int(d) for d in shape)))
    return out


_ALIGN = 8  # every payload tensor of a hop starts at a multiple of 8 bytes: views of any dtype


@dataclass(frozen=True)
class WireFormat:
    """How one tensor travels: the codec, and its payload packed into one uint8 buffer.

    A stateful codec's state is not kept here: ``init_state`` makes it, the owner (a pipeline
    stage) registers it (:mod:`ccfx.codecs.state`) and passes it to every ``encode``,
    ``decode_into`` and ``roundtrip``, which update it in place."""

    codec: codecs.Codec
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def raw(self) -> bool:
        return self.codec.spec == "none"

    @property
    def stateful(self) -> bool:
        return self.codec.stateful

    def init_state(self, device=None) -> dict[str, torch.Tensor]:
        """Fresh state tensors for this tensor's codec (empty for stateless codecs)."""
        return self.codec.init_state(self.shape, self.dtype, device) if self.stateful else {}

    # Computed once per hop (every microbatch's send and receive reads them).

    @functools.cached_property
    def layout(self):
        return self.codec.payload_layout(self.shape, self.dtype)

    @functools.cached_property
    def offsets(self) -> tuple[tuple[int, int], ...]:
        """(byte offset, byte length) of each payload tensor in the packed buffer."""
        return offsets(self.layout, _ALIGN)

    @functools.cached_property
    def nbytes(self) -> int:
        return nbytes(self.offsets)

    @property
    def raw_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """``x`` through the codec, packed: what goes on the wire."""
        with torch.no_grad():
            x = x.detach()
            self.codec.check_input(x)
            enc = self.codec.encode_with(x, state)
            return pack(enc.payload, self.offsets, x.device)

    def roundtrip(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Encode and decode here (a hop between two stages of one rank)."""
        if self.raw:
            return x
        with torch.no_grad():
            x = x.detach()
            self.codec.check_input(x)
            enc = self.codec.encode_with(x, state)
            return self.codec.decode_with(enc, state).to(x.dtype)

    def decode_into(self, buf: torch.Tensor, out: torch.Tensor,
                    state: dict[str, torch.Tensor]) -> None:
        """Unpack ``buf``, decode it and write the result into torch's receive buffer."""
        payload = tuple(unpack(buf, self.layout, self.offsets))
        with torch.no_grad():
            enc = codecs.Encoded(payload, codecs.Context(self.shape, self.dtype))
            out.copy_(self.codec.decode_with(enc, state))
