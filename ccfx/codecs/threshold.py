"""``threshold``: entries with ``|x| > tau``, in a fixed-capacity payload with the length inside.

The payload size must follow from the shape alone (the receiver allocates it before anything
arrives, and the custom op's fake kernel must know it), but how many entries pass a threshold
depends on the data. So the payload holds ``capacity = ceil(cap * n)`` slots: values (input
dtype), int32 indices, and a 1-element int32 ``count``. Slots past ``count`` hold value 0 at
index 0 and decode to nothing. When more than ``capacity`` entries pass, the largest ones are
kept (the rest drop: use ``ef`` to carry them over). Wire bytes ``capacity * (itemsize + 4) + 4``.

NaN and ±inf pass any threshold (they rank first) and propagate.

On CUDA the selection runs as Triton stream compaction (``ccfx.backends.triton.threshold``):
the same payload, entries of equal magnitude in ascending index order (``torch.topk`` leaves
their order unspecified); more than ``capacity`` passing entries fall back to this reference.
Decode is an ``index_add_`` scatter on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _sparse
from .base import Codec, Context, Encoded, numel_of
from .registry import register


def threshold_encode_reference(x: torch.Tensor, tau: float, capacity: int):
    flat = x.reshape(-1)
    mag, idx = torch.topk(_sparse.magnitude(flat), capacity, sorted=True)
    keep = mag > tau  # sorted descending: the kept slots come first
    values = torch.where(keep, flat[idx], torch.zeros((), dtype=flat.dtype, device=flat.device))
    idx = torch.where(keep, idx, 0).to(_sparse.INDEX_DTYPE)
    return values, idx, keep.sum().to(torch.int32).view(1)


@register
@dataclass(frozen=True)
class Threshold(Codec):
    name = "threshold"
    summary = "magnitudes above tau, fixed capacity (cap * n slots) with a count inside"
    tau: float = 0.01
    cap: float = 0.01

    def __post_init__(self):
        _sparse.check_ratio("cap", self.cap)
        if not self.tau >= 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")

    def payload_layout(self, shape, dtype):
        c = _sparse.count(numel_of(shape), self.cap)
        return (((c,), dtype), ((c,), _sparse.INDEX_DTYPE), ((1,), torch.int32))

    @staticmethod
    def _impl(t: torch.Tensor):
        if t.is_cuda:  # imported lazily: only CUDA tensors need triton
            from ccfx.backends.triton.threshold import threshold_encode

            return threshold_encode
        return threshold_encode_reference

    def encode_with(self, x, state):
        _sparse.check_indexable(x.numel())
        capacity = _sparse.count(x.numel(), self.cap)
        payload = self._impl(x)(x, self.tau, capacity)
        return Encoded(payload, Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        values, idx, _count = enc.payload
        return _sparse.scatter(values, idx, enc.ctx.shape, enc.ctx.dtype)
