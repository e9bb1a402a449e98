"""Per-block scales, shared by the blockwise codecs' Triton kernels (int4, sign, fp8).

``block_scales(x, block, kind, divisor)`` gives one fp32 per block: ``absmax / divisor``
(``kind="absmax"``, bit-exact with the torch references: correctly rounded division) or the mean
magnitude (``kind="meanabs"``: fp32 sums in a different order from torch's, so equal to a few
ulps). A block holding NaN or inf gets NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch_block_reduce, load_block_tile, row_absmax


@triton.jit
def _block_scale_kernel(
    x_ptr,  # *Pointer* to the flattened input
    scale_ptr,  # *Pointer* to the fp32 output [nblocks]
    n,
    nblocks,
    block,
    divisor,  # absmax is divided by this (fp32)
    MEAN: tl.constexpr,  # True: mean |x| over the block's real elements; False: absmax
    WIDTH: tl.constexpr,
    ROWS: tl.constexpr,
):
    x, _offs, _mask, rows = load_block_tile(x_ptr, n, nblocks, block, WIDTH, ROWS)
    absmax, bad = row_absmax(x)
    if MEAN:
        count = tl.minimum(n - rows.to(tl.int64) * block, block).to(tl.float32)
        # Divide before summing, as the reference does: stays finite near FLT_MAX.
        scale = tl.sum(tl.abs(x) / tl.maximum(count, 1.0)[:, None], axis=1)
    else:
        scale = tl.math.div_rn(absmax, divisor)
    tl.store(scale_ptr + rows, tl.where(bad, float("nan"), scale), mask=rows < nblocks)


def block_scales(flat: torch.Tensor, block: int, kind: str = "absmax", divisor: float = 1.0):
    return launch_block_reduce(_block_scale_kernel, flat, block, divisor,
                               MEAN=kind == "meanabs")
