"""Triton kernels for the ``int8`` codec: fused absmax + quantize per block, and dequantize.

Bit-compatible with ``int8_encode_reference`` / ``int8_decode_reference`` in
``ccfx.codecs.int8``: fp32 arithmetic, correctly rounded division (``div_rn``), round half to
even, NaN scale for blocks holding NaN or inf.

One program quantizes ``ROWS`` blocks at once (a ``ROWS x WIDTH`` tile, ``WIDTH`` the block
size rounded up to a power of two and masked), so small blocks still give large programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    launch_block_encode,
    launch_decode,
    load_block_tile,
    rint,
    row_absmax,
    store_float,
)

# %% kernels
#: Largest finite float32: decoded values are clamped to it (never rounded into inf).
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # a global a kernel reads must be a constexpr


@triton.jit
def _int8_encode_kernel(
    x_ptr,  # *Pointer* to the flattened input, any float dtype
    q_ptr,  # *Pointer* to the int8 output [n]
    scale_ptr,  # *Pointer* to the fp32 scales [nblocks]
    n,  # number of elements
    nblocks,  # ceil(n / block)
    block,  # elements per block (runtime: any positive integer)
    WIDTH: tl.constexpr,  # block rounded up to a power of two
    ROWS: tl.constexpr,  # blocks per program
):
    x, offs, mask, rows = load_block_tile(x_ptr, n, nblocks, block, WIDTH, ROWS)
    absmax, bad = row_absmax(x)
    # scale = absmax / 127, NaN for a block that holds NaN or inf (it decodes to NaN).
    scale = tl.where(bad, float("nan"), tl.math.div_rn(absmax, 127.0))
    safe = tl.where(scale > 0, scale, 1.0)
    q = rint(tl.math.div_rn(x, safe[:, None]))
    q = tl.where(scale[:, None] > 0, q, 0.0)
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < nblocks)


@triton.jit
def _int8_decode_kernel(
    q_ptr,  # *Pointer* to int8 codes [n]
    scale_ptr,  # *Pointer* to fp32 scales [nblocks]
    out_ptr,  # *Pointer* to the output [n], in the decoded dtype
    n,
    block,
    BLOCK_SIZE: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    s = tl.load(scale_ptr + offs // block, mask=mask, other=0.0)
    y = q * s
    # Keep 127 * (absmax / 127) finite when it rounds past FLT_MAX; NaN compares false: kept.
    y = tl.where(y > FLT_MAX, FLT_MAX, tl.where(y < -FLT_MAX, -FLT_MAX, y))
    store_float(out_ptr + offs, y, mask)


# %% launchers
def int8_encode(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, float) → ``(q int8 [n], scales fp32 [ceil(n / block)])``."""
    return launch_block_encode(_int8_encode_kernel, x, block, torch.int8)


def int8_decode(
    q: torch.Tensor, scales: torch.Tensor, block: int, shape, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`int8_encode`: a tensor of ``shape`` and ``dtype``."""
    return launch_decode(_int8_decode_kernel, q, scales, block, shape, dtype)
