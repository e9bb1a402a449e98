"""The compressed all-to-all with unequal split sizes: whole rows, each encoded on its own.

An expert-parallel MoE's dispatch and combine send different numbers of rows per rank (some
none). Every row of dim 0 (a token's hidden vector) is encoded on its own, all rows in one
encode (a row that is not whole blocks is zero-padded to them for the encode, and only its
real codes are sent), each row's payload packed into one message of ``b`` bytes, and the
``(rows, b)`` bytes sent by one all-to-all *with the original splits*: the receiver derives
every size from the splits it already has, nothing extra is exchanged; one decode on arrival.
``(W-1) / W`` of the rows' messages, the raw bytes' convention. Split sizes and a row count
that are symbolic when the graph compiles (unbacked SymInts) work alike: the phases read the
row count from their tensors and take the split sizes :meth:`~.base.CompressedCollective.bind`
gives them; a symbolic row count's bytes are quoted per row (:meth:`row_wire_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ... import codecs
from .base import CompressedCollective
from .call import zero
from .chunking import inner_codec, row_encoding
from .packing import Packing


class AllToAllRows(CompressedCollective, serves="rows"):
    """All-to-all with unequal splits through a codec, row by row."""

    def _setup(self, rows: bool | None) -> None:
        """Every row (``call.row`` elements) is encoded on its own, as ``row_padded``
        elements, all rows in one encode; one row's message is
        ``packing.nbytes`` bytes, so chunk ``j``'s bytes are ``input_splits[j]`` rows of them
        and the bytes travel as a ``(rows, nbytes)`` uint8 tensor through an all_to_all with
        the original splits: the receiver knows every size from the splits it already has."""
        call, dtype = self.call, self.call.dtype
        self.chunks, self.rows = call.shape[0], True
        self.used = self.chunk = call.row
        self.row_padded = row_encoding(self.codec, call.row, dtype)
        self.packing = Packing.of(self.codec.payload_layout((call.row,), dtype))
        #: Entries per row of each payload tensor: encoded (padded row) and sent (real row).
        self._row_sizes = [
            (int(math.prod(f)), int(math.prod(o))) for (f, _), (o, _) in zip(
                self.codec.payload_layout((self.row_padded,), dtype),
                self.codec.payload_layout((call.row,), dtype))]
        self._inner_spec = codecs.prototype(inner_codec(self.codec).spec).spec
        self._encode_state = dict(self.codec.state_layout(
            (self._state_rows * self.row_padded,), dtype))
        self._chunk_names = [sorted(self._encode_state)]

    @property
    def _state_rows(self):
        """Rows the encode's state is sized for: the call's, or one where the row count is
        symbolic (refuse() lets through only codecs whose state does not depend on it)."""
        return 1 if self.call.symbolic_rows else self.chunks

    def _wire_bytes(self) -> int:  # the input's rows, (W-1)/W of them (the raw bytes' way)
        w = self.call.world
        return -(-(w - 1) * self.chunks * self.packing.nbytes // w)

    def row_wire_bytes(self) -> int:
        return self.packing.nbytes

    def _messages(self) -> list[tuple[str, int]]:
        return [("all_to_all", self.chunks * self.packing.nbytes)]

    def init_state(self, device=None) -> dict[str, torch.Tensor]:
        return self.codec.init_state((self._state_rows * self.row_padded,), self.call.dtype,
                                     device)

    @property
    def phases(self) -> list[Callable]:
        return [self._rows_issue, self._rows_finish]

    def _rows_issue(self, x, state, carry, comm):
        """Every row encoded on its own (one encode), each row's payload packed into one
        ``packing.nbytes`` message, the ``(rows, nbytes)`` bytes sent with the call's splits."""
        rows, b = x.shape[0], self.packing.nbytes  # a SymInt when traced over one
        call = self.call
        if zero(rows):  # nothing to encode (this rank may still receive)
            buf = torch.empty((0, b), dtype=torch.uint8, device=x.device)
        else:
            flat = x.reshape(rows, self.used)
            if self.row_padded > self.used:
                flat = torch.cat([flat, flat.new_zeros(rows, self.row_padded - self.used)], 1)
            payload = self._encode(flat.reshape(-1), self.spec, state)
            sent = [p.reshape(rows, full)[:, :keep]
                    for p, (full, keep) in zip(payload, self._row_sizes)]
            buf = self.packing.pack_rows(sent, rows).view(rows, b)
        return [comm.all_to_all(buf, list(call.output_splits), list(call.input_splits))]

    def _rows_finish(self, x, state, carry, comm):
        """The rows received, each message unpacked (padded back to a whole row's payload
        where rows are padded), all decoded in one call."""
        buf = comm.wait(carry[0])
        rows = buf.shape[0]  # the output splits' sum (a SymInt when traced over them)
        out_shape = (rows, *self.call.shape[1:])
        if zero(rows):
            return [x.new_empty(out_shape)]
        parts = self.packing.unpack_rows(buf.reshape(-1), rows)
        if self.row_padded > self.used:
            parts = [torch.cat([p.view(rows, keep), p.new_zeros(rows, full - keep)], 1)
                     .reshape(-1) if full > keep else p
                     for p, (full, keep) in zip(parts, self._row_sizes)]
        flat = self._decode(parts, rows * self.row_padded).view(rows, self.row_padded)
        # contiguous, as the collective's own result (inductor checks the strides it planned)
        return [flat[:, :self.used].contiguous().reshape(out_shape)]

