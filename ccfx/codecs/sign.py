"""``sign``: one bit per element plus one fp32 scale per block (signSGD / EF-signSGD /
1-bit Adam style; use it with ``ef``, as those methods do).

Per block the scale is the mean magnitude ``||x||_1 / count`` (the L2-optimal scale for a sign
vector), the bit is ``x >= 0``; decode gives ``+scale`` or ``-scale``. Zeros decode to
``+scale``. Wire bytes ``ceil(n / 8) + 4 * ceil(n / block)``: 0.0352 of fp32 at block 256.

A block holding NaN or ±inf gets a NaN scale and decodes to NaN everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._fast import fast
from .base import blocked, numel_of
from .blockwise import BlockScaled
from .registry import register


def _sign_scales(out, x, block):
    bits, sums = out
    return bits, torch.where(sums.isnan(), float("nan"), sums)  # canonical NaN bits


@fast(finish=_sign_scales)
def sign_encode_reference(x: torch.Tensor, block: int):
    """``x`` → ``(bits uint8 [ceil(n/8)], scales fp32 [ceil(n/block)])`` (the body returns the
    raw block sums, NaN for a non-finite block; :func:`_sign_scales` the scales: see ``fast``)."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    rows = blocked(flat, block)
    # The last block may be partial: divide by its real element count, not by ``block``.
    counts = (n - torch.arange(rows.shape[0], device=x.device) * block).clamp(max=block)
    # Divide before summing: the mean of magnitudes near FLT_MAX stays finite. ``+ (x - x)``
    # adds +0 to a finite term (the same sum, in the same order) and makes a NaN or ±inf one
    # NaN, so the sum marks the non-finite blocks (see blockwise.absmax_blocks).
    sums = (rows.abs() / counts.view(-1, 1) + (rows - rows)).sum(dim=1)
    # _bits.pack's layout (bit j of byte i is element 8i + j), one strided column at a time,
    # which inductor compiles to one loop over the bytes (a sum over a dimension of 8 ran
    # scalar reductions, 2x slower): padding reads -1.0, whose bit is 0 (as is NaN's).
    eights = torch.nn.functional.pad(flat, (0, -(-n // 8) * 8 - n), value=-1.0).view(-1, 8)
    bits = torch.where(eights[:, 0] >= 0, 1, 0)
    for j in range(1, 8):
        bits = bits + torch.where(eights[:, j] >= 0, 1 << j, 0)
    return bits.to(torch.uint8), sums


@fast
def sign_decode_reference(bits, scales, block: int, shape, dtype):
    n = numel_of(shape)
    if block % 8 == 0:
        # Whole bytes per block: unpack each block's bytes against its own scale (a row),
        # which inductor makes one vectorized pass (3x faster than indexing scales per element).
        nblocks = scales.numel()
        padded = torch.nn.functional.pad(bits, (0, nblocks * block // 8 - bits.numel()))
        shifts = torch.arange(8, dtype=torch.int32, device=bits.device)
        positive = ((padded.view(nblocks, block // 8, 1).to(torch.int32) >> shifts) & 1) != 0
        s = scales.view(-1, 1, 1)
        return torch.where(positive, s, -s).view(-1)[:n].view(shape).to(dtype)
    # Unpack (_bits.unpack's layout) and look each element's scale up by index: no padded
    # temporaries, so inductor makes it one pass (3x faster compiled than unpack + blocked).
    shifts = torch.arange(8, dtype=torch.int32, device=bits.device)
    positive = ((bits.to(torch.int32).view(-1, 1) >> shifts) & 1).view(-1)[:n] != 0
    s = scales[torch.arange(n, device=bits.device) // block]
    return torch.where(positive, s, -s).view(shape).to(dtype)


@register
@dataclass(frozen=True)
class Sign(BlockScaled):
    name = "sign"
    summary = "1 bit per element (packed) and a mean-magnitude fp32 scale per block"
    bits = 1
    encode_reference = staticmethod(sign_encode_reference)
    decode_reference = staticmethod(sign_decode_reference)
    block: int = 256
