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
from .base import blocked, nonfinite_rows
from .blockwise import BlockScaled
from .registry import register


@fast
def int8_encode_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``x`` (any shape) → ``(q int8 [n], scales fp32 [ceil(n/block)])``."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    padded = blocked(flat, block)
    absmax = padded.abs().amax(dim=1, keepdim=True)
    # amax drops NaN on some backends: make non-finite blocks explicit.
    scales = torch.where(nonfinite_rows(padded), float("nan"), absmax / 127.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.where(scales > 0, torch.round(padded / safe), torch.zeros_like(padded))
    q = q.clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    return q, scales.view(-1)


@fast
def int8_decode_reference(
    q: torch.Tensor, scales: torch.Tensor, block: int, shape, dtype: torch.dtype
) -> torch.Tensor:
    n = q.numel()
    padded = blocked(q.float(), block)
    y = padded * scales.view(-1, 1)
    # 127 * (absmax / 127) can round one ulp past FLT_MAX (a mask holding finfo.min): keep it
    # finite. NaN (a non-finite block) is left alone: the comparisons are false for NaN.
    big = torch.finfo(torch.float32).max
    y = torch.where(y > big, big, torch.where(y < -big, -big, y))
    return y.view(-1)[:n].view(shape).to(dtype)


@register
@dataclass(frozen=True)
class Int8(BlockScaled):
    name = "int8"
    summary = "blockwise absmax int8, one fp32 scale per block"
    bits = 8
    code_dtype = torch.int8
    encode_reference = staticmethod(int8_encode_reference)
    decode_reference = staticmethod(int8_decode_reference)
