"""Small ``@triton.jit`` helpers shared by the kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rint(v):
    """Round half to even, like ``torch.round`` (libdevice's rint is not available to the
    interpreter, so it is written out: exact for |v| < 2**23, which every caller has)."""
    f = tl.floor(v)
    d = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def is_nonfinite(x):
    """NaN or ±inf: ``x - x`` is 0 exactly for finite x."""
    return (x - x) != 0.0


@triton.jit
def load_block_tile(x_ptr, n, nblocks, block, WIDTH: tl.constexpr, ROWS: tl.constexpr):
    """This program's ``ROWS`` blocks of the flattened input as an fp32 ``(ROWS, WIDTH)`` tile
    (``WIDTH`` = block rounded up to a power of two; masked lanes read 0), with the tile's
    offsets, mask and block (row) indices."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    offs = rows[:, None].to(tl.int64) * block + cols[None, :]
    mask = (cols[None, :] < block) & (offs < n) & (rows[:, None] < nblocks)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x, offs, mask, rows


@triton.jit
def row_absmax(x):
    """Per row of a tile: ``(absmax, holds NaN or inf)``."""
    return tl.max(tl.abs(x), axis=1), tl.sum(is_nonfinite(x).to(tl.int32), axis=1) > 0


def block_tile(block: int, target: int = 4096) -> tuple[int, int]:
    """(padded block width, blocks per program) for kernels that reduce one row per block."""
    width = triton.next_power_of_2(max(block, 1))
    return width, max(1, target // width)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flat_contiguous(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def launch_block_encode(kernel, x, block: int, code_dtype, **constexprs):
    """Flatten ``x``, allocate one code per element and one fp32 scale per block, and run a
    fused per-block encode kernel over ``(ROWS, WIDTH)`` tiles, called as
    ``kernel(flat, codes, scales, n, nblocks, block, WIDTH=..., ROWS=..., **constexprs)``.
    Returns ``(codes [n], scales [ceil(n / block)])``."""
    flat = flat_contiguous(x)
    n = flat.numel()
    nblocks = cdiv(n, block)
    codes = torch.empty(n, dtype=code_dtype, device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    if n:
        width, rows = block_tile(block)
        kernel[(cdiv(nblocks, rows),)](flat, codes, scales, n, nblocks, block,
                                       WIDTH=width, ROWS=rows, **constexprs)
    return codes, scales


def launch_block_reduce(kernel, flat: torch.Tensor, block: int, *extra, **constexprs):
    """One fp32 per block of the flat contiguous ``flat``, from a kernel that reduces ``ROWS``
    blocks per program over ``(ROWS, WIDTH)`` tiles, called as
    ``kernel(flat, out, n, nblocks, block, *extra, WIDTH=..., ROWS=..., **constexprs)``."""
    n = flat.numel()
    nblocks = cdiv(n, block)
    out = torch.empty(nblocks, dtype=torch.float32, device=flat.device)
    if nblocks:
        width, rows = block_tile(block)
        kernel[(cdiv(nblocks, rows),)](flat, out, n, nblocks, block, *extra,
                                       WIDTH=width, ROWS=rows, **constexprs)
    return out


#: Elements per program of the elementwise decode kernels.
DECODE_BLOCK = 1024


def launch_decode(kernel, codes, scales, block: int, shape, dtype, *extra, **constexprs):
    """Allocate the decoded tensor and run an elementwise decode kernel over it, called as
    ``kernel(codes, scales, out, n, block, *extra, BLOCK_SIZE=..., **constexprs)`` (the
    signature every codec's ``_*_decode_kernel`` / ``_*_unpack_kernel`` has)."""
    n = 1
    for d in shape:
        n *= d
    out = torch.empty(n, dtype=dtype, device=codes.device)
    if n:
        kernel[(cdiv(n, DECODE_BLOCK),)](codes, scales, out, n, block, *extra,
                                         BLOCK_SIZE=DECODE_BLOCK, **constexprs)
    return out.view(shape)


@triton.jit
def to_bf16_rne(y):
    """fp32 → bf16, round to nearest even, as torch does. Written with integer ops because the
    interpreter's own fp32 → bf16 cast does not round to even (and drops the mantissa carry);
    on a GPU this is the same result as ``cvt.rn.bf16.f32``. NaN and inf survive the add."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_float(ptr, y, mask):
    """Store fp32 ``y`` as ``ptr``'s element type, rounding to nearest even like ``.to()``."""
    ty = ptr.dtype.element_ty
    if ty == tl.bfloat16:
        tl.store(ptr, to_bf16_rne(y), mask=mask)
    else:
        tl.store(ptr, y.to(ty), mask=mask)


@triton.jit
def _lowbias32(x):
    """Chris Wellons' lowbias32 on uint32 (wrapping multiplies): ``ccfx.codecs._random``'s
    ``lowbias32``, which does the same arithmetic in int64 tensors."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def uniform(index, key_ptr):
    """``ccfx.codecs._random.uniform(index, key)`` bit for bit: fp32 in [0, 1) from int64 flat
    indices and the 0-d int64 key at ``key_ptr`` (read on the device: no host sync)."""
    key = tl.load(key_ptr)
    lo = (key & 0xFFFFFFFF).to(tl.uint32)
    hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = _lowbias32(_lowbias32((index & 0xFFFFFFFF).to(tl.uint32) ^ lo) ^ hi)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
