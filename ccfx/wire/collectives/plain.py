"""The identity spec ``"none"``: the original collective itself (the same bits as torch's),
as the same two phases, so a collective left uncompressed runs through the same pass."""

from __future__ import annotations

from collections.abc import Callable

from .base import CompressedCollective


class Plain(CompressedCollective, serves="plain"):
    """Any kind of collective, unchanged; no state, the uncompressed bytes on the wire."""

    def _wire_bytes(self) -> int:
        return self.raw_bytes

    def row_wire_bytes(self) -> int:
        if not self.by_rows:
            return super().row_wire_bytes()
        return self.call.row_bytes

    def _messages(self) -> list[tuple[str, int]]:
        return [(self.kind, self.call.numel * self.call.dtype.itemsize)]

    @property
    def phases(self) -> list[Callable]:
        return [self._plain_issue, self._plain_finish]

    def _plain_issue(self, x, state, carry, comm):
        kind = self.kind
        if kind == "all_reduce":
            return [comm.all_reduce(x)]
        if kind == "all_gather":
            return [comm.all_gather(x)]
        if kind == "reduce_scatter":
            return [comm.reduce_scatter(x)]
        if self.by_rows:
            return [comm.all_to_all(x, list(self.call.output_splits),
                                    list(self.call.input_splits))]
        return [comm.all_to_all(x)]

    def _plain_finish(self, x, state, carry, comm):
        out = comm.wait(carry[0])
        if self._avg:
            out = out / self.call.world
        if self.by_rows:
            return [out]  # (the output splits' sum, *row shape): torch's own result
        return [out.reshape(self.call.out_shape)]
