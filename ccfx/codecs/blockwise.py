"""The shape shared by int8, int4 and sign: ``bits`` per element, packed, plus one fp32 scale
per block of ``block`` elements. A subclass gives its torch references; on CUDA the Triton
kernels ``<name>_encode`` / ``<name>_decode`` in ``ccfx.backends.triton.<name>`` run instead
(same payload, bit for bit or to stated ulps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, Context, Encoded, ceil_div, numel_of
from .dispatch import pick


@dataclass(frozen=True)
class BlockScaled(Codec):
    bits: ClassVar[int]
    code_dtype: ClassVar[torch.dtype] = torch.uint8
    #: ``(x, block) -> (codes, scales)`` and ``(codes, scales, block, shape, dtype) -> x``.
    encode_reference: ClassVar[Callable]
    decode_reference: ClassVar[Callable]

    block: int = 256

    def __post_init__(self):
        if self.block < 1:
            raise ValueError(f"block must be a positive integer, got {self.block}")

    def payload_layout(self, shape, dtype):
        n = numel_of(shape)
        return (((ceil_div(n * self.bits, 8),), self.code_dtype),
                ((ceil_div(n, self.block),), torch.float32))

    def _impl(self, t: torch.Tensor, which: str) -> Callable:
        return pick(t, self.name, which, getattr(type(self), f"{which}_reference"))

    def encode_with(self, x, state):
        codes, scales = self._impl(x, "encode")(x, self.block)
        return Encoded((codes, scales), Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        codes, scales = enc.payload
        return self._impl(codes, "decode")(codes, scales, self.block, enc.ctx.shape, enc.ctx.dtype)
