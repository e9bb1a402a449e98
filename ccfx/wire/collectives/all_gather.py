"""The compressed all-gather: the local shard encoded, the payloads all-gathered, each decoded,
concatenated along dim 0; ``(W-1) B`` bytes sent per rank."""

from __future__ import annotations

from collections.abc import Callable

from .chunked import Chunked


class AllGather(Chunked, serves="all_gather"):
    """All-gather through a codec: one chunk, this rank's shard."""

    def _split(self, numel: int, world: int) -> tuple[int, int]:
        return numel, 1

    def _messages(self) -> list[tuple[str, int]]:
        return [("all_gather", self.packing.nbytes)]

    def _out_numel(self) -> int:
        return self.call.numel * self.call.world

    @property
    def phases(self) -> list[Callable]:
        return [self._gather_issue, self._gather_finish]

    def _gather_issue(self, x, state, carry, comm):
        return [comm.all_gather(self._encode_chunks(x, state))]
