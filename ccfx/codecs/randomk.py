"""``randomk``: ``k = ceil(ratio * n)`` entries chosen at random; only their values travel.

Both sides derive the indices from ``seed`` and the step: the index set is never sent.
Sampling is stratified: the flat range is cut into ``k`` near-equal chunks and one position is
drawn in each (sorted, distinct, each element kept with probability about ``k / n``, O(k) work).
With the same seed and step on every rank the indices agree, so payloads all-reduce
(``reduction = "sum"``). Values are not rescaled (biased, as in GRACE and BytePS): use ``ef``.

Step bookkeeping: ``encode`` uses and advances the ``step`` state tensor and records the step in
the local context; ``decode`` of that Encoded uses it. A receiver that only decodes (a pipeline
stage) has no such context and counts its own decodes in ``decode_step``: decode each payload
exactly once, in order. NaN and ±inf among the sampled entries propagate; unsampled ones drop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _sparse
from ._random import StepCounter, generator, take_step
from .base import Codec, Context, Encoded, numel_of
from .registry import register


def randomk_indices(n: int, k: int, seed: int, step: int, device=None) -> torch.Tensor:
    """Sorted distinct int64 indices, one per chunk ``[floor(i*n/k), floor((i+1)*n/k))``.
    Drawn on the CPU generator, so every device type gets the same set."""
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    bounds = torch.arange(k + 1, dtype=torch.long) * n // k
    lengths = bounds[1:] - bounds[:-1]
    draw = torch.randint(0, 2**62, (k,), generator=generator(seed, step))
    return (bounds[:-1] + draw % lengths).to(device)


@register
@dataclass(frozen=True)
class RandomK(StepCounter, Codec):
    name = "randomk"
    reduction = "sum"
    summary = "random subset from a shared seed: values only, indices derived on both sides"
    ratio: float = 0.01
    seed: int = 0

    def __post_init__(self):
        _sparse.check_ratio("ratio", self.ratio)

    def state_layout(self, shape, dtype):
        return {"step": ((), torch.int64), "decode_step": ((), torch.int64)}

    def payload_layout(self, shape, dtype):
        return (((_sparse.count(numel_of(shape), self.ratio),), dtype),)

    def encode_with(self, x, state):
        n = x.numel()
        step = take_step(state)
        idx = randomk_indices(n, _sparse.count(n, self.ratio), self.seed, step, x.device)
        values = x.reshape(-1)[idx]
        return Encoded((values,), Context(tuple(x.shape), x.dtype, extra=step))

    def decode_with(self, enc, state):
        step = enc.ctx.extra if enc.ctx.extra is not None else take_step(state, "decode_step")
        n = numel_of(enc.ctx.shape)
        (values,) = enc.payload
        idx = randomk_indices(n, values.numel(), self.seed, step, values.device)
        return _sparse.scatter(values, idx, enc.ctx.shape, enc.ctx.dtype)
