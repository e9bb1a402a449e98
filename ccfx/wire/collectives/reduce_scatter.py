"""The compressed reduce-scatter: dim 0's ``W`` chunks each encoded, one all-to-all, the ``W``
payloads of this rank's chunk decoded and summed in fp32 in rank order; ``(W-1) B``."""

from __future__ import annotations

from collections.abc import Callable

from .chunked import Chunked


class ReduceScatter(Chunked, serves="reduce_scatter"):
    """Reduce-scatter (sum or avg) through a codec."""

    @property
    def phases(self) -> list[Callable]:
        return [self._scatter_issue, self._reduce_finish]

    def _reduce_finish(self, x, state, carry, comm):
        reduced = self._sum_in_rank_order(comm.wait(carry[0]))[:self.used]
        return [reduced.to(self.call.dtype).reshape(self.call.out_shape)]
