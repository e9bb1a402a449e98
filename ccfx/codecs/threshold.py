"""``threshold``: entries with ``|x| > tau``, in a fixed-capacity payload with the length inside.

The payload size must follow from the shape alone (the receiver allocates it before anything
arrives, and the custom op's fake kernel must know it), but how many entries pass a threshold
depends on the data. So the payload holds ``capacity = ceil(cap * n)`` slots: values (input
dtype), int32 indices, and a 1-element int32 ``count``. Slots past ``count`` hold value 0 at
index 0 and decode to nothing. When more than ``capacity`` entries pass, the largest ones are
kept (the rest drop: use ``ef`` to carry them over). Wire bytes ``capacity * (itemsize + 4) + 4``.

NaN and ±inf pass any threshold (they rank first) and propagate.

Where what runs:

* CUDA: Triton stream compaction (``ccfx.backends.triton.threshold``), then a stable sort of the
  kept slots by magnitude; more than ``capacity`` passing entries fall back to the reference.
* CPU (plain tensors, not under tracing): :func:`threshold_encode_compact`, the same payload in
  the same order as the Triton path. The passing entries are compacted in ascending index order
  and stably sorted by magnitude, largest first, so entries of equal magnitude come in ascending
  index order (``torch.topk`` leaves their order unspecified). When more than ``capacity`` pass,
  the largest ``capacity`` are selected by :func:`ccfx.codecs._sparse.largest` (a sampled
  cut-off above ``tau`` and a topk over the candidates, not over the whole tensor: with the
  default ``tau`` nearly every entry of a unit-scale tensor passes).
* Anything else (fake tensors, dispatch modes, ``implementation("reference")``):
  :func:`threshold_encode_reference`, which defines the payload with ``torch.topk``.

Decode is an ``index_add_`` scatter on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _sparse
from .base import Codec, Context, Encoded, numel_of
from .dispatch import current, use_triton
from .registry import register


def threshold_encode_reference(x: torch.Tensor, tau: float, capacity: int):
    """The definition: of the ``capacity`` largest magnitudes, those ``> tau``, largest first
    (``tau`` compared in ``x``'s dtype, as torch compares a tensor with a Python float)."""
    return _sparse.top_above(x, tau, capacity)


def threshold_encode_compact(x: torch.Tensor, tau: float, capacity: int):
    """The reference's payload by compaction; equal magnitudes in ascending index order."""
    flat = x.reshape(-1)
    tau_t = torch.tensor(tau, dtype=flat.dtype)  # in x's dtype, as the reference's mag > tau
    idx, values = _sparse.largest(flat, capacity, above=tau_t)  # ascending index
    order = _sparse.by_magnitude(values)
    kept = idx.numel()
    padded = torch.zeros(capacity, dtype=flat.dtype, device=flat.device)
    slots = torch.zeros(capacity, dtype=torch.int64, device=flat.device)
    torch.index_select(values, 0, order, out=padded[:kept])  # written in place: fewer copies
    torch.index_select(idx, 0, order, out=slots[:kept])
    slots = slots.to(_sparse.INDEX_DTYPE)
    return padded, slots, torch.tensor([kept], dtype=torch.int32, device=flat.device)


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
        if use_triton(t):  # imported lazily: only the Triton path needs triton
            from ccfx.backends.triton.threshold import threshold_encode

            return threshold_encode
        if current() != "reference" and _sparse.sampled_path(t):
            return threshold_encode_compact
        return threshold_encode_reference

    def encode_with(self, x, state):
        _sparse.check_indexable(x.numel())
        capacity = _sparse.count(x.numel(), self.cap)
        payload = self._impl(x)(x, self.tau, capacity)
        return Encoded(payload, Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        values, idx, _count = enc.payload
        return _sparse.scatter(values, idx, enc.ctx.shape, enc.ctx.dtype)
