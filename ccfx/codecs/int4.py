"""``int4``: blockwise absmax quantization to 4 bits, two codes per byte.

Each block sends an fp32 scale ``absmax / 7`` and per element ``q = round(x / scale)`` in
[-7, 7], stored as the nibble ``q + 8`` (element ``2i`` in the low nibble of byte ``i``). Error
at most half a step, ``scale / 2``. Wire bytes ``ceil(n / 2) + 4 * ceil(n / block)``: 0.1289 of
fp32 at block 256.

A block holding NaN or ±inf gets a NaN scale and decodes to NaN everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _bits
from ._fast import fast
from .base import blocked, nonfinite_rows, numel_of
from .blockwise import BlockScaled
from .registry import register


@fast
def int4_encode_reference(x: torch.Tensor, block: int):
    """``x`` → ``(packed uint8 [ceil(n/2)], scales fp32 [ceil(n/block)])``."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    rows = blocked(flat, block)
    absmax = rows.abs().amax(dim=1, keepdim=True)
    scales = torch.where(nonfinite_rows(rows), float("nan"), absmax / 7.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.where(scales > 0, torch.round(rows / safe), torch.zeros_like(rows)).clamp_(-7, 7)
    codes = (q + 8).to(torch.uint8).view(-1)[:n]
    return _bits.pack(codes, 4), scales.view(-1)


@fast
def int4_decode_reference(packed, scales, block: int, shape, dtype):
    n = numel_of(shape)
    q = _bits.unpack(packed, n, 4).float() - 8
    rows = blocked(q, block)
    return (rows * scales.view(-1, 1)).view(-1)[:n].view(shape).to(dtype)


@register
@dataclass(frozen=True)
class Int4(BlockScaled):
    name = "int4"
    summary = "blockwise absmax int4, two codes per byte, one fp32 scale per block"
    bits = 4
    encode_reference = staticmethod(int4_encode_reference)
    decode_reference = staticmethod(int4_decode_reference)
