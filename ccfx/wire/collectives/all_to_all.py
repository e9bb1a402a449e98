"""The compressed all-to-all with equal splits: each destination's chunk encoded, one
all-to-all, decoded on arrival; ``(W-1) B``."""

from __future__ import annotations

from collections.abc import Callable

from .chunked import Chunked


class AllToAll(Chunked, serves="all_to_all"):
    """All-to-all of ``W`` equal chunks of dim 0 through a codec."""

    @property
    def phases(self) -> list[Callable]:
        return [self._scatter_issue, self._a2a_finish]

    def _a2a_finish(self, x, state, carry, comm):
        return [self._decode_all(comm.wait(carry[0])).reshape(self.call.out_shape)]
