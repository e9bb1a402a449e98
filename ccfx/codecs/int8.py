"""``int8``: blockwise absmax quantization.

The flattened tensor is cut into blocks of ``block`` elements. Each block sends its scale
``absmax / 127`` (fp32) and one int8 per element, ``round(x / scale)`` (half to even). The error
is at most half a step, ``scale / 2``, per element. Wire bytes: ``n + 4 * ceil(n / block)``; for
fp32 input at block 256 that is 0.2539 of the raw bytes.

A block holding NaN or ±inf gets a NaN scale and decodes to NaN everywhere: non-finite input
propagates, it never becomes finite garbage. On CUDA the Triton kernels in
``ccfx.backends.triton.int8`` run, bit for bit the same as the reference here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._fast import fast
from .blockwise import BlockScaled, absmax_blocks, block_scales, rescaled
from .registry import register


def _int8_scales(out, x, block):
    q, absmax = out
    return q, block_scales(absmax, 127.0)


@fast(finish=_int8_scales)
def int8_encode_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``x`` (any shape) → ``(q int8 [n], scales fp32 [ceil(n/block)])`` (the
    body returns the raw block absmax, :func:`_int8_scales` the scales: see ``fast``)."""
    scaled, absmax = absmax_blocks(x, block, 127.0)
    q = torch.round(scaled).clamp_(-127, 127).to(torch.int8).view(-1)[:x.numel()]
    return q, absmax


@fast
def int8_decode_reference(
    q: torch.Tensor, scales: torch.Tensor, block: int, shape, dtype: torch.dtype
) -> torch.Tensor:
    # 127 * (absmax / 127) can round one ulp past FLT_MAX (a mask holding finfo.min): saturate.
    return rescaled(q.float(), scales, block, shape, dtype, limit=torch.finfo(torch.float32).max)


@register
@dataclass(frozen=True)
class Int8(BlockScaled):
    name = "int8"
    summary = "blockwise absmax int8, one fp32 scale per block"
    bits = 8
    code_dtype = torch.int8
    encode_reference = staticmethod(int8_encode_reference)
    decode_reference = staticmethod(int8_decode_reference)
    block: int = 256
