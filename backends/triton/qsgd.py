"""Triton kernels for ``qsgd``: per-block L2 norms, then unbiased stochastic levels; and
dequantizing. Against ``qsgd_encode_reference`` / ``qsgd_decode_reference``: the norms are sums
in another order (equal to a few fp32 ulps); given the same norms, the levels are bit-exact (the
same counter-based noise, ``_common.uniform``, the same correctly rounded fp32 operations, with
no fused multiply-add: the launch turns fp fusion off) and so is the decoded tensor.

The norm is ``absmax * ||x / absmax||``, as in the reference: it stays finite for blocks of
huge finite values (an attention mask full of ``finfo.min``), saturating at FLT_MAX.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    cdiv,
    flat_contiguous,
    launch_block_reduce,
    launch_decode,
    load_block_tile,
    row_absmax,
    store_float,
    uniform,
)

FLT_MAX = tl.constexpr(3.4028234663852886e38)  # a global a kernel reads must be a constexpr


# %% kernels
@triton.jit
def _qsgd_norm_kernel(
    x_ptr,  # *Pointer* to the flattened input, any float dtype
    norm_ptr,  # *Pointer* to the fp32 norms [nblocks]
    n,
    nblocks,
    block,
    WIDTH: tl.constexpr,  # block rounded up to a power of two
    ROWS: tl.constexpr,  # blocks per program
):
    x, _offs, _mask, rows = load_block_tile(x_ptr, n, nblocks, block, WIDTH, ROWS)
    absmax, bad = row_absmax(x)
    safe = tl.where(absmax > 0, absmax, 1.0)
    unit = tl.math.div_rn(x, safe[:, None])
    norm = absmax * tl.sqrt_rn(tl.sum(unit * unit, axis=1))
    norm = tl.where(bad, float("nan"), tl.minimum(norm, FLT_MAX))
    tl.store(norm_ptr + rows, norm, mask=rows < nblocks)


@triton.jit
def _qsgd_level_kernel(
    x_ptr,  # *Pointer* to the flattened input [n]
    norm_ptr,  # *Pointer* to the fp32 norms [nblocks]
    key_ptr,  # *Pointer* to the 0-d int64 noise key of this step
    q_ptr,  # *Pointer* to the signed levels [n] (int8 or int16)
    n,
    block,
    levels,  # fp32 number of levels
    BLOCK_SIZE: tl.constexpr,  # elements per program
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    norm = tl.load(norm_ptr + i // block, mask=mask, other=0.0)
    safe = tl.where(norm > 0, norm, 1.0)
    level = tl.floor(tl.math.div_rn(tl.abs(x), safe) * levels + uniform(i, key_ptr))
    level = tl.minimum(level, levels)
    sign = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
    q = tl.where(norm > 0, sign * level, 0.0)
    tl.store(q_ptr + i, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qsgd_decode_kernel(q_ptr, norm_ptr, out_ptr, n, block, levels,
                        BIG: tl.constexpr,  # the output dtype's largest finite value
                        BLOCK_SIZE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = i < n
    q = tl.load(q_ptr + i, mask=mask, other=0).to(tl.float32)
    step = tl.math.div_rn(tl.load(norm_ptr + i // block, mask=mask, other=0.0), levels)
    y = q * step
    # Stochastic rounding can land above the largest input: saturate (NaN compares false).
    y = tl.where(y > BIG, BIG, tl.where(y < -BIG, -BIG, y))
    store_float(out_ptr + i, y, mask)


# %% launchers
def qsgd_norms(flat: torch.Tensor, block: int) -> torch.Tensor:
    return launch_block_reduce(_qsgd_norm_kernel, flat, block)


def qsgd_levels(flat, norms, key, block: int, levels: int, qdtype) -> torch.Tensor:
    """The stochastic levels of ``flat`` for given ``norms`` (exposed for bit-exact tests)."""
    n = flat.numel()
    q = torch.empty(n, dtype=qdtype, device=flat.device)
    if n:
        size = 1024
        _qsgd_level_kernel[(cdiv(n, size),)](
            flat, norms, key.to(device=flat.device, dtype=torch.int64), q, n, block,
            float(levels), BLOCK_SIZE=size, enable_fp_fusion=False)
    return q


def qsgd_encode(x: torch.Tensor, key: torch.Tensor, block: int, levels: int, qdtype):
    """``x``, 0-d int64 ``key`` → ``(levels qdtype [n], norms fp32 [ceil(n / block)])``."""
    flat = flat_contiguous(x)
    norms = qsgd_norms(flat, block)
    return qsgd_levels(flat, norms, key, block, levels, qdtype), norms


def qsgd_decode(q, norms, block: int, levels: int, shape, dtype) -> torch.Tensor:
    big = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    return launch_decode(_qsgd_decode_kernel, q, norms, block, shape, dtype, float(levels),
                         BIG=big)
