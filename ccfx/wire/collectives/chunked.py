"""What the chunked algorithms share: the input cut into chunks, each chunk's payload one
message, ``W`` messages per all-to-all or all-gather.

The flattened input is padded to ``chunks`` equal chunks of ``used`` elements (``W`` chunks,
one per destination; the all-gather's one: its shard), each encoded as ``chunk`` elements
(``used``, or zero-padded to whole blocks), all in one encode where the codec allows it
(``rows``, :mod:`.chunking`) or one by one (a state per chunk, ``chunk0003.residual``).
"""

from __future__ import annotations

import torch

from ... import codecs
from ...errors import ConfigError
from .base import CompressedCollective
from .call import Tensors
from .chunking import inner_codec, rows_chunk
from .packing import Packing


class Chunked(CompressedCollective):
    """The base of the all-reduce, all-gather, reduce-scatter and equal all-to-all."""

    #: Rounds of ``W-1`` messages each rank sends (the all-reduce: two).
    ROUNDS = 1

    def _split(self, numel: int, world: int) -> tuple[int, int]:
        """``(elements per chunk, chunks)``: 1/W of the input (the last chunk zero-padded),
        one chunk per destination."""
        return -(-numel // world), world

    def _setup(self, rows: bool | None) -> None:
        call = self.call
        w, dtype = call.world, call.dtype
        self.used, self.chunks = self._split(call.numel, w)
        #: Elements each chunk is encoded as (``used``, or zero-padded to whole blocks).
        #: ``rows``: one encode and one decode for all chunks (else one per chunk).
        self.chunk, self.rows = self.used, False
        if rows is not False:
            self.chunk, self.rows = rows_chunk(self.codec, self.used, w, dtype)
            if rows and not self.rows:
                raise ConfigError(f"codec {self.spec!r} cannot encode {w} chunks of "
                                  f"{self.used} elements in one call")
        self.packing = Packing.of(self.codec.payload_layout((self.chunk,), dtype))
        inner = codecs.prototype(inner_codec(self.codec).spec)
        self._inner_spec = inner.spec
        if self.rows or self.chunks == 1:  # the encode's state: one for all rows, or per chunk
            self._encode_state = dict(self.codec.state_layout((self.chunks * self.chunk,),
                                                              dtype))
            self._chunk_names = [sorted(self._encode_state)]
        else:
            per = self.codec.state_layout((self.chunk,), dtype)
            self._encode_state = {f"chunk{j:04d}.{k}": v for j in range(self.chunks)
                                  for k, v in per.items()}
            self._chunk_names = [[f"chunk{j:04d}.{k}" for k in sorted(per)]
                                 for j in range(self.chunks)]
        self._owner_spec = inner.spec
        self._owner_names: list[str] = []

    def _wire_bytes(self) -> int:
        return self.ROUNDS * (self.call.world - 1) * self.packing.nbytes

    def _messages(self) -> list[tuple[str, int]]:
        return [("all_to_all", self.call.world * self.packing.nbytes)]

    def init_state(self, device=None) -> dict[str, torch.Tensor]:
        dtype = self.call.dtype
        if self.rows or self.chunks == 1:
            out = self.codec.init_state((self.chunks * self.chunk,), dtype, device)
        else:
            init = self.codec.init_state((self.chunk,), dtype, device)
            out = {f"chunk{j:04d}.{k}": v.clone() for j in range(self.chunks)
                   for k, v in init.items()}
        if self._owner_state:
            owner = codecs.prototype(self._owner_spec)
            for k, v in owner.init_state((self.chunk,), dtype, device).items():
                out[f"owner.{k}"] = v
        return out

    # -- pieces --------------------------------------------------------------------------------

    def _decoded(self, buf: torch.Tensor) -> Tensors:
        """The ``W`` messages of ``buf`` decoded: ``W`` tensors of ``chunk`` elements (padding
        included), rank order."""
        w, c = self.call.world, self.chunk
        if self.rows:
            return list(self._decode(self.packing.unpack_rows(buf, w), w * c).view(w, c))
        b = self.packing.nbytes
        return [self._decode(self.packing.unpack(buf, src * b), c) for src in range(w)]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``(chunks, chunk)``: flattened, zero-padded to ``chunks * used`` elements,
        each chunk zero-padded from ``used`` to ``chunk``."""
        flat = x.reshape(-1)
        pad = self.chunks * self.used - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        rows = flat.view(self.chunks, self.used)
        if self.chunk > self.used:
            rows = torch.cat([rows, rows.new_zeros(self.chunks, self.chunk - self.used)], dim=1)
        return rows

    def _encode_chunks(self, x: torch.Tensor, state: Tensors) -> torch.Tensor:
        """This rank's chunks encoded: ``chunks`` messages back to back."""
        named = self._named(state)
        rows = self._rows(x)
        if self.rows or self.chunks == 1:
            payload = self._encode(rows.reshape(-1), self.spec,
                                   [named[k] for k in self._chunk_names[0]])
            return self.packing.pack_rows(payload, self.chunks)
        return torch.cat([
            self.packing.pack(self._encode(rows[j], self.spec, [named[k] for k in names]))
            for j, names in enumerate(self._chunk_names)])

    def _sum_in_rank_order(self, buf: torch.Tensor) -> torch.Tensor:
        """The sum of the ``W`` chunk payloads in ``buf``, rank 0 first, in fp32 (fp64 for fp64
        data); ``avg`` divides."""
        acc = torch.promote_types(self.call.dtype, torch.float32)
        parts = self._decoded(buf)
        total = parts[0].to(acc)
        for part in parts[1:]:
            total = total + part.to(acc)
        if self._avg:
            total = total / self.call.world
        return total

    def _decode_all(self, buf: torch.Tensor) -> torch.Tensor:
        """The ``W`` messages of ``buf`` decoded, padding dropped, concatenated (flat)."""
        w = self.call.world
        if self.rows:
            flat = self._decode(self.packing.unpack_rows(buf, w), w * self.chunk)
            if self.chunk == self.used:
                return flat
            return flat.view(w, self.chunk)[:, :self.used].reshape(-1)
        return torch.cat(self._decoded(buf))

    # -- phases more than one algorithm runs ----------------------------------------------------

    def _scatter_issue(self, x, state, carry, comm):
        """Every destination's chunk encoded, one all-to-all."""
        return [comm.all_to_all(self._encode_chunks(x, state))]

    def _gather_finish(self, x, state, carry, comm):
        """The gathered messages decoded, the result in the collective's shape."""
        flat = self._decode_all(comm.wait(carry[0]))
        return [flat[:self._out_numel()].reshape(self.call.out_shape)]

    def _out_numel(self) -> int:
        return self.call.numel
