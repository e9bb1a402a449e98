"""One chunk's payload tensors packed into one ``uint8`` message, and back."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .call import Tensors


@dataclass(frozen=True)
class Packing:
    """How one chunk's payload tensors (the codec's ``payload_layout``) lie in a ``uint8``
    message: widest dtype first (every tensor starts at a multiple of its itemsize), the
    message padded to a multiple of the widest itemsize (``W`` messages back to back stay
    aligned)."""

    layout: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    order: tuple[int, ...]           # payload indices, widest first
    spans: tuple[tuple[int, int], ...]   # (offset, nbytes) per payload index
    nbytes: int                      # the message, padding included

    @staticmethod
    def of(layout) -> Packing:
        layout = tuple((tuple(int(d) for d in s), d) for s, d in layout)
        order = tuple(sorted(range(len(layout)), key=lambda i: -layout[i][1].itemsize))
        spans: list[tuple[int, int]] = [(0, 0)] * len(layout)
        at = 0
        for i in order:
            shape, dtype = layout[i]
            n = math.prod(shape) * dtype.itemsize
            spans[i] = (at, n)
            at += n
        widest = max((d.itemsize for _, d in layout), default=1)
        return Packing(layout, order, tuple(spans), -(-at // widest) * widest)

    @property
    def _padding(self) -> int:
        return self.nbytes - sum(n for _, n in self.spans)

    def pack(self, payload: Tensors) -> torch.Tensor:
        parts = [payload[i].contiguous().reshape(-1).view(torch.uint8) for i in self.order]
        if self._padding:
            parts.append(parts[0].new_zeros(self._padding))
        return torch.cat(parts)

    def unpack(self, buf: torch.Tensor, start: int = 0) -> Tensors:
        """The payload tensors of the message at byte ``start`` of ``buf`` (views)."""
        return [buf[start + at:start + at + n].view(dtype).view(shape)
                for (shape, dtype), (at, n) in zip(self.layout, self.spans)]

    def pack_rows(self, payload: Tensors, rows: int) -> torch.Tensor:
        """``rows`` messages back to back from one payload of ``rows`` chunks whose tensors are
        1-D and hold the chunks' tensors one after the other (see :func:`~.chunking.rows_split`)."""
        parts = [payload[i].contiguous().view(rows, math.prod(self.layout[i][0]))
                 .view(torch.uint8) for i in self.order]  # sizes given: 0 rows work too
        if self._padding:
            parts.append(parts[0].new_zeros(rows, self._padding))
        return torch.cat(parts, dim=1).reshape(-1)

    def unpack_rows(self, buf: torch.Tensor, rows: int) -> Tensors:
        """The inverse of :meth:`pack_rows`: the 1-D payload of ``rows`` chunks (copies)."""
        grid = buf.view(rows, self.nbytes)
        return [grid[:, at:at + n].contiguous().view(dtype).reshape(-1)
                for (_, dtype), (at, n) in zip(self.layout, self.spans)]

