"""``topk``: the ``ceil(ratio * n)`` largest magnitudes, as values (input dtype) + int32 indices.

Kept entries are exact; the rest decode to 0, so use it with ``ef`` (Stich et al. 2018; Lin et
al., DGC). Wire bytes ``k * (itemsize + 4)``: 0.02 of fp32 at ratio 0.01. NaN and ±inf rank
above every finite magnitude, so they are sent and propagate (up to ``k`` of them).

No Triton kernel, by choice: selection is ``torch.topk`` on every device, CUDA included (its
radix select is what a Triton top-k would have to reimplement), and decode is the shared
``index_add_`` scatter (one kernel on CUDA). ``threshold`` is the codec with a Triton selection
(stream compaction) when a fixed cut-off is acceptable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _sparse
from .base import Codec, Context, Encoded, numel_of
from .registry import register


def topk_encode_reference(x: torch.Tensor, k: int):
    flat = x.reshape(-1)
    _, idx = torch.topk(_sparse.magnitude(flat), k, sorted=False)
    return flat[idx], idx.to(_sparse.INDEX_DTYPE)


@register
@dataclass(frozen=True)
class TopK(Codec):
    name = "topk"
    summary = "largest magnitudes: values + int32 indices"
    ratio: float = 0.01

    def __post_init__(self):
        _sparse.check_ratio("ratio", self.ratio)

    def payload_layout(self, shape, dtype):
        k = _sparse.count(numel_of(shape), self.ratio)
        return (((k,), dtype), ((k,), _sparse.INDEX_DTYPE))

    def encode_with(self, x, state):
        _sparse.check_indexable(x.numel())
        k = _sparse.count(x.numel(), self.ratio)
        # torch.topk on every device (see the module docstring).
        payload = topk_encode_reference(x, k)
        return Encoded(payload, Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        values, idx = enc.payload
        return _sparse.scatter(values, idx, enc.ctx.shape, enc.ctx.dtype)
