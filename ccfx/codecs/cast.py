"""``fp16`` and ``bf16``: cast to a 16-bit float on the wire, back to the input dtype after.

fp16 overflows to ±inf above 65504; the inf then propagates (training sees it), it is never
clamped into a finite wrong value. bf16 keeps fp32's range with 8 bits of mantissa.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, Context, Encoded, numel_of
from .registry import register


@dataclass(frozen=True)
class _Cast(Codec):
    wire_dtype: ClassVar[torch.dtype]
    reduction = "sum"

    def encode(self, x: torch.Tensor) -> Encoded:
        self.check_input(x)
        return Encoded((x.to(self.wire_dtype).contiguous(),), Context(tuple(x.shape), x.dtype))

    def decode(self, enc: Encoded) -> torch.Tensor:
        out = enc.payload[0].to(enc.ctx.dtype)
        # Same dtype on both sides (fp16 → fp16) returns the payload itself; never alias.
        return out.clone() if out.data_ptr() == enc.payload[0].data_ptr() else out

    def wire_bytes(self, shape, dtype):
        if dtype.itemsize <= self.wire_dtype.itemsize:
            return numel_of(shape) * dtype.itemsize
        return numel_of(shape) * self.wire_dtype.itemsize


@register
@dataclass(frozen=True)
class Fp16(_Cast):
    name = "fp16"
    wire_dtype = torch.float16
    summary = "cast to float16 (overflow above 65504 becomes inf)"

    def encode(self, x: torch.Tensor) -> Encoded:
        if x.dtype.itemsize <= 2:  # already 16-bit: nothing to gain, send as is
            self.check_input(x)
            return Encoded((x.contiguous(),), Context(tuple(x.shape), x.dtype))
        return super().encode(x)


@register
@dataclass(frozen=True)
class Bf16(_Cast):
    name = "bf16"
    wire_dtype = torch.bfloat16
    summary = "cast to bfloat16 (fp32 range, 8-bit mantissa)"

    def encode(self, x: torch.Tensor) -> Encoded:
        if x.dtype.itemsize <= 2:
            self.check_input(x)
            return Encoded((x.contiguous(),), Context(tuple(x.shape), x.dtype))
        return super().encode(x)
