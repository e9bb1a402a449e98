"""Triton kernels for ``int4``: quantize two elements and pack them into one byte; unpack and
dequantize. Bit-compatible with ``int4_encode_reference`` / ``int4_decode_reference``.

Pairs ``(2j, 2j+1)`` may straddle a block boundary (odd block sizes), so the scales come first
(``blocks.block_scales``) and the packing kernel runs over bytes, reading each element's own
block scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, flat_contiguous, launch_decode, rint, store_float
from .blocks import block_scales


@triton.jit
def _int4_pack_kernel(
    x_ptr,  # *Pointer* to the flattened input [n]
    scale_ptr,  # *Pointer* to fp32 scales [nblocks]
    out_ptr,  # *Pointer* to packed uint8 [ceil(n / 2)]
    n,
    block,
    BYTES: tl.constexpr,  # bytes per program
):
    j = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    i = j[:, None] * 2 + tl.arange(0, 2)[None, :]  # (BYTES, 2) element indices
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + i // block, mask=mask, other=0.0)
    safe = tl.where(s > 0, s, 1.0)
    q = tl.where(s > 0, rint(tl.math.div_rn(x, safe)), 0.0)
    q = tl.minimum(tl.maximum(q, -7.0), 7.0) + 8.0  # nibble in [1, 15]
    nib = tl.where(mask, q.to(tl.int32), 0)
    byte = tl.sum(nib << (tl.arange(0, 2)[None, :] * 4), axis=1)  # low nibble first
    tl.store(out_ptr + j, byte.to(tl.uint8), mask=j < (n + 1) // 2)


@triton.jit
def _int4_unpack_kernel(packed_ptr, scale_ptr, out_ptr, n, block, BLOCK_SIZE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = i < n
    byte = tl.load(packed_ptr + i // 2, mask=mask, other=0).to(tl.int32)
    q = ((byte >> ((i % 2) * 4).to(tl.int32)) & 15).to(tl.float32) - 8.0
    s = tl.load(scale_ptr + i // block, mask=mask, other=0.0)
    store_float(out_ptr + i, q * s, mask)


def int4_encode(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` → ``(packed uint8 [ceil(n/2)], scales fp32 [ceil(n/block)])``."""
    flat = flat_contiguous(x)
    n = flat.numel()
    scales = block_scales(flat, block, "absmax", 7.0)
    packed = torch.empty(cdiv(n, 2), dtype=torch.uint8, device=x.device)
    if n:
        size = 512
        _int4_pack_kernel[(cdiv(cdiv(n, 2), size),)](flat, scales, packed, n, block, BYTES=size)
    return packed, scales


def int4_decode(packed, scales, block: int, shape, dtype) -> torch.Tensor:
    return launch_decode(_int4_unpack_kernel, packed, scales, block, shape, dtype)
