"""``fp16`` and ``bf16``: cast to a 16-bit float on the wire, back to the input dtype after.

fp16 overflows to ±inf above 65504; the inf then propagates (training sees it), it is never
clamped into a finite wrong value. bf16 keeps fp32's range with 8 bits of mantissa. NaN stays
NaN in both. Inputs already 16 bits wide travel as they are (nothing to gain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Codec, Context, Encoded
from .registry import register


@dataclass(frozen=True)
class _Cast(Codec):
    wire_dtype: ClassVar[torch.dtype]
    reduction = "sum"

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if dtype.itemsize <= self.wire_dtype.itemsize else self.wire_dtype

    def payload_layout(self, shape, dtype):
        return ((tuple(shape), self._wire(dtype)),)

    def encode_with(self, x, state):
        wire = x.to(self._wire(x.dtype)).contiguous()
        return Encoded((wire,), Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        out = enc.payload[0].to(enc.ctx.dtype)
        # Same dtype on both sides (fp16 → fp16) returns the payload itself; never alias.
        return out.clone() if out.data_ptr() == enc.payload[0].data_ptr() else out


@register
@dataclass(frozen=True)
class Fp16(_Cast):
    name = "fp16"
    wire_dtype = torch.float16
    summary = "cast to float16 (overflow above 65504 becomes inf)"


@register
@dataclass(frozen=True)
class Bf16(_Cast):
    name = "bf16"
    wire_dtype = torch.bfloat16
    summary = "cast to bfloat16 (fp32 range, 8-bit mantissa)"
