"""``topk``: the ``ceil(ratio * n)`` largest magnitudes, as values (input dtype) + int32 indices.

Kept entries are exact; the rest decode to 0, so use it with ``ef`` (Stich et al. 2018; Lin et
al., DGC). Wire bytes ``k * (itemsize + 4)``: 0.02 of fp32 at ratio 0.01. NaN and ±inf rank
above every finite magnitude, so they are sent and propagate (up to ``k`` of them).

Where what runs:

* CUDA: ``torch.topk`` over the whole tensor (:func:`topk_encode_reference`). Its radix select
  is what a Triton top-k would have to reimplement, so there is no Triton kernel, by choice.
* CPU (plain tensors, not under tracing): :func:`topk_encode_sampled`. ``torch.topk`` over the
  whole tensor is a single-threaded partial sort there (18x a clone at 16M elements, k = 1%), so
  a sampled cut-off, a compaction pass and a topk over the ~1.2 k candidates select the same
  set (:func:`ccfx.codecs._sparse.largest`; exact whatever the data, see its docstring).
  The payload lists the kept entries in ascending index order, which also makes the decode's
  scatter walk memory forward.
* Anything else (fake tensors, dispatch modes, ``implementation("reference")``): the reference.

Decode is the shared ``index_add_`` scatter on every device (one kernel on CUDA).
``threshold`` is the codec with a Triton selection (stream compaction) when a fixed cut-off is
acceptable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _sparse
from .base import Codec, Context, Encoded, numel_of
from .dispatch import current
from .registry import register


def topk_encode_reference(x: torch.Tensor, k: int):
    """The definition: ``torch.topk`` over all magnitudes (entries in unspecified order)."""
    flat = x.reshape(-1)
    _, idx = torch.topk(_sparse.magnitude(flat), k, sorted=False)
    return flat[idx], idx.to(_sparse.INDEX_DTYPE)


def topk_encode_sampled(x: torch.Tensor, k: int):
    """The same set of magnitudes by sampled cut-off and compaction; ascending index order."""
    flat = x.reshape(-1)
    idx, values = _sparse.largest(flat, k)
    return values, idx.to(_sparse.INDEX_DTYPE)


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

    @staticmethod
    def _impl(t: torch.Tensor):
        if current() != "reference" and _sparse.sampled_path(t):
            return topk_encode_sampled
        return topk_encode_reference

    def encode_with(self, x, state):
        _sparse.check_indexable(x.numel())
        k = _sparse.count(x.numel(), self.ratio)
        payload = self._impl(x)(x, k)
        return Encoded(payload, Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        values, idx = enc.payload
        return _sparse.scatter(values, idx, enc.ctx.shape, enc.ctx.dtype)
