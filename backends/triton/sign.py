"""Triton kernels for ``sign``: mean-magnitude scale per block, eight sign bits per byte; and
unpacking. Bits are bit-exact with ``sign_encode_reference``; scales equal it to a few fp32 ulps
(the block sum runs in a different order)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, flat_contiguous, launch_decode, store_float
from .blocks import block_scales


@triton.jit
def _sign_pack_kernel(x_ptr, out_ptr, n, BYTES: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    i = j[:, None] * 8 + tl.arange(0, 8)[None, :]  # (BYTES, 8) element indices
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=-1.0).to(tl.float32)
    bit = (x >= 0).to(tl.int32)  # NaN compares false: 0 (its block's scale is NaN anyway)
    byte = tl.sum(bit << tl.arange(0, 8)[None, :], axis=1)
    tl.store(out_ptr + j, byte.to(tl.uint8), mask=j < (n + 7) // 8)


@triton.jit
def _sign_unpack_kernel(bits_ptr, scale_ptr, out_ptr, n, block, BLOCK_SIZE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = i < n
    byte = tl.load(bits_ptr + i // 8, mask=mask, other=0).to(tl.int32)
    positive = ((byte >> (i % 8).to(tl.int32)) & 1) != 0
    s = tl.load(scale_ptr + i // block, mask=mask, other=0.0)
    store_float(out_ptr + i, s * tl.where(positive, 1.0, -1.0), mask)  # -0.0 for s = 0


def sign_encode(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` → ``(bits uint8 [ceil(n/8)], scales fp32 [ceil(n/block)])``."""
    flat = flat_contiguous(x)
    n = flat.numel()
    scales = block_scales(flat, block, "meanabs")
    bits = torch.empty(cdiv(n, 8), dtype=torch.uint8, device=x.device)
    if n:
        size = 256
        _sign_pack_kernel[(cdiv(cdiv(n, 8), size),)](flat, bits, n, BYTES=size)
    return bits, scales


def sign_decode(bits, scales, block: int, shape, dtype) -> torch.Tensor:
    return launch_decode(_sign_unpack_kernel, bits, scales, block, shape, dtype)
