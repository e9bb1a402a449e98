"""Triton kernels for ``terngrad``: per-block absmax scales, then stochastic ternary codes packed
four per byte; and unpacking. Bit-exact with ``terngrad_encode_reference`` /
``terngrad_decode_reference``: the same scales (absmax, NaN for non-finite blocks), the same
counter-based noise (``_common.uniform``, the reference's hash in uint32 arithmetic), the same
correctly rounded division.

As for int4, a byte's four elements may straddle a block boundary, so the scales come first
(``blocks.block_scales``) and the packing kernel runs over bytes, each element reading its own
block's scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, flat_contiguous, launch_decode, store_float, uniform
from .blocks import block_scales


# %% kernels
@triton.jit
def _terngrad_pack_kernel(
    x_ptr,  # *Pointer* to the flattened input [n]
    scale_ptr,  # *Pointer* to fp32 scales [nblocks] (absmax; NaN for a non-finite block)
    key_ptr,  # *Pointer* to the 0-d int64 noise key of this step
    out_ptr,  # *Pointer* to packed uint8 codes [ceil(n / 4)]
    n,
    block,
    BYTES: tl.constexpr,  # bytes per program
):
    j = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    i = j[:, None] * 4 + tl.arange(0, 4)[None, :]  # (BYTES, 4) element indices
    mask = i < n
    v = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + i // block, mask=mask, other=0.0)
    safe = tl.where(s > 0, s, 1.0)
    # Bernoulli(|v| / s): NaN never passes (its block decodes to NaN whatever the code).
    keep = (uniform(i, key_ptr) < tl.math.div_rn(tl.abs(v), safe)) & (s > 0)
    sign = tl.where(v > 0, 1, tl.where(v < 0, -1, 0))
    code = tl.where(mask, tl.where(keep, sign, 0) + 1, 0)  # {0, 1, 2}; padding fields 0
    byte = tl.sum(code << (tl.arange(0, 4)[None, :] * 2), axis=1)
    tl.store(out_ptr + j, byte.to(tl.uint8), mask=j < (n + 3) // 4)


@triton.jit
def _terngrad_unpack_kernel(codes_ptr, scale_ptr, out_ptr, n, block, BLOCK_SIZE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = i < n
    byte = tl.load(codes_ptr + i // 4, mask=mask, other=0).to(tl.int32)
    t = ((byte >> ((i % 4) * 2).to(tl.int32)) & 3).to(tl.float32) - 1.0
    s = tl.load(scale_ptr + i // block, mask=mask, other=0.0)
    store_float(out_ptr + i, t * s, mask)


# %% launchers
def terngrad_encode(x: torch.Tensor, key: torch.Tensor, block: int):
    """``x``, 0-d int64 ``key`` → ``(codes uint8 [ceil(n/4)], scales fp32 [ceil(n/block)])``."""
    flat = flat_contiguous(x)
    n = flat.numel()
    scales = block_scales(flat, block, "absmax", 1.0)
    codes = torch.empty(cdiv(n, 4), dtype=torch.uint8, device=x.device)
    if n:
        size = 256
        _terngrad_pack_kernel[(cdiv(cdiv(n, 4), size),)](
            flat, scales, key.to(device=x.device, dtype=torch.int64), codes, n, block, BYTES=size)
    return codes, scales


def terngrad_decode(codes, scales, block: int, shape, dtype) -> torch.Tensor:
    return launch_decode(_terngrad_unpack_kernel, codes, scales, block, shape, dtype)
