"""``none``: the identity. The payload is a copy, so decode never aliases the input."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec, Context, Encoded, raw_bytes
from .registry import register


@register
@dataclass(frozen=True)
class Identity(Codec):
    name = "none"
    reduction = "sum"
    lossless = True
    summary = "identity: the tensor as it is"

    def applies_to(self, dtype: torch.dtype) -> bool:
        return True

    def encode(self, x: torch.Tensor) -> Encoded:
        return Encoded((x.contiguous(),), Context(tuple(x.shape), x.dtype))

    def decode(self, enc: Encoded) -> torch.Tensor:
        return enc.payload[0].clone()

    def wire_bytes(self, shape, dtype):
        return raw_bytes(shape, dtype)
