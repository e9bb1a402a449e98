"""Triton kernels for the ``fp8`` codec: fused per-block absmax scale + quantize to float8
(e4m3fn or e5m2), and dequantize.

Bit-compatible with ``fp8_encode_reference`` / ``fp8_decode_reference`` in ``ccfx.codecs.fp8``:
fp32 arithmetic, correctly rounded division (``div_rn``), scale ``absmax / fmax``, NaN scale
(and zero codes) for a block holding NaN or inf.

The float8 encoding is written with integer ops (:func:`_fp8_bits`, :func:`_fp8_value`) instead
of ``.to(tl.float8e4nv)`` (the same integer form as the torch reference's ``fp8_bits``): the
interpreter's float8 casts truncate and drop the mantissa carry
(``1.0625 -> 1.125``, ``-127.8 -> -64`` for e4m3), so a cast would not match torch's
round-to-nearest-even there. On a GPU the integer form is the same result as ``cvt.rn``, and the
kernels stay memory-bound, so there is one code path everywhere. Codes travel as uint8.

One encode program handles ``ROWS`` blocks at once (a ``ROWS x WIDTH`` tile, ``WIDTH`` the block
rounded up to a power of two and masked), as in ``int8.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ccfx.codecs.fp8 import BITS

from ._common import (
    launch_block_encode,
    launch_decode,
    load_block_tile,
    rint,
    row_absmax,
    store_float,
)


# %% the float8 formats
def _format_args(fmt: torch.dtype) -> dict:
    exp, man, bias, fn = BITS[fmt]  # (exponent bits, mantissa bits, bias, no-inf "fn" format)
    return {
        "FMAX": float(torch.finfo(fmt).max),
        "EXP": exp,
        "MAN": man,
        "BIAS": bias,
        "FN": fn,
        "MIN_NORMAL": 2.0 ** (1 - bias),  # smallest normal magnitude
        "SUB_UNIT": 2.0 ** (1 - bias - man),  # value of the smallest subnormal code
    }


# %% kernel helpers
@triton.jit
def _fp8_bits(y, MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr,
              SUB_UNIT: tl.constexpr):
    """fp32 ``y`` (finite, ``|y| <= fmax``) -> float8 bit pattern (uint8), round to nearest
    even, sign kept (``-0.0`` -> ``0x80``), as torch's ``.to(float8)`` does.

    Normal range: round the fp32 mantissa to ``MAN`` bits on the bit pattern (the same trick as
    ``to_bf16_rne``: a carry out of the mantissa bumps the exponent, which is right), then rebias
    the exponent. Subnormal range: the code is ``|y| / SUB_UNIT`` rounded half to even (exact:
    a power-of-two scaling, and the quotient is at most ``2**MAN``; ``2**MAN`` itself is the
    smallest normal's code)."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    mag = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MAN
    rounded = mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)
    normal = (rounded >> SHIFT) - ((127 - BIAS) << MAN)
    a = tl.abs(y)
    sub = rint(a * (1.0 / SUB_UNIT)).to(tl.uint32)
    code = tl.where(a < MIN_NORMAL, sub, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8_value(c, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, FN: tl.constexpr,
               SUB_UNIT: tl.constexpr):
    """float8 bit pattern (int32 in [0, 255]) -> its fp32 value (exact), NaN/inf included."""
    e = (c >> MAN) & ((1 << EXP) - 1)
    m = c & ((1 << MAN) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MAN))).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * SUB_UNIT, normal)
    EMAX: tl.constexpr = (1 << EXP) - 1
    MMAX: tl.constexpr = (1 << MAN) - 1
    if FN:  # e4m3fn: S.1111.111 is NaN, no inf
        v = tl.where((e == EMAX) & (m == MMAX), float("nan"), v)
    else:  # IEEE-like: all-ones exponent is inf (m == 0) or NaN
        v = tl.where(e == EMAX, tl.where(m == 0, float("inf"), float("nan")), v)
    # The sign as a factor, not ``-v``: Triton 3.6 compiles ``-v`` to ``0 - v``, which turns
    # the code 0x80 into +0.0 (triton-lang/triton#10270; the interpreter negates correctly).
    return v * tl.where((c >> 7) != 0, -1.0, 1.0)


# %% kernels
@triton.jit
def _fp8_encode_kernel(
    x_ptr,  # *Pointer* to the flattened input, any float dtype
    code_ptr,  # *Pointer* to the uint8 float8 codes [n]
    scale_ptr,  # *Pointer* to the fp32 scales [nblocks]
    n,  # number of elements
    nblocks,  # ceil(n / block)
    block,  # elements per block (runtime: any positive integer)
    FMAX: tl.constexpr,  # largest finite value of the format (448 or 57344)
    EXP: tl.constexpr,  # exponent bits of the format
    MAN: tl.constexpr,  # mantissa bits of the format
    BIAS: tl.constexpr,  # exponent bias of the format
    FN: tl.constexpr,  # True for e4m3fn (unused here; the launchers pass one dict)
    MIN_NORMAL: tl.constexpr,  # smallest normal magnitude of the format
    SUB_UNIT: tl.constexpr,  # value of the smallest subnormal
    WIDTH: tl.constexpr,  # block rounded up to a power of two
    ROWS: tl.constexpr,  # blocks per program
):
    x, offs, mask, rows = load_block_tile(x_ptr, n, nblocks, block, WIDTH, ROWS)
    absmax, bad = row_absmax(x)
    # scale = absmax / fmax; NaN for a block that holds NaN or inf (its codes are 0).
    scale = tl.where(bad, float("nan"), tl.math.div_rn(absmax, FMAX))
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.where(scale[:, None] > 0, tl.math.div_rn(x, safe[:, None]), 0.0)
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    code = _fp8_bits(y, MAN, BIAS, MIN_NORMAL, SUB_UNIT)
    tl.store(code_ptr + offs, code, mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < nblocks)


@triton.jit
def _fp8_decode_kernel(
    code_ptr,  # *Pointer* to the uint8 float8 codes [n]
    scale_ptr,  # *Pointer* to the fp32 scales [nblocks]
    out_ptr,  # *Pointer* to the output [n], in the decoded dtype
    n,
    block,
    FMAX: tl.constexpr,  # (unused here; the launchers pass one dict)
    EXP: tl.constexpr,
    MAN: tl.constexpr,
    BIAS: tl.constexpr,
    FN: tl.constexpr,
    MIN_NORMAL: tl.constexpr,  # (unused here)
    SUB_UNIT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    c = tl.load(code_ptr + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scale_ptr + offs // block, mask=mask, other=0.0)
    v = _fp8_value(c, EXP, MAN, BIAS, FN, SUB_UNIT)
    store_float(out_ptr + offs, v * s, mask)


# %% launchers
def fp8_encode(x: torch.Tensor, block: int, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, float) → ``(codes uint8 [n], scales fp32 [ceil(n / block)])``."""
    return launch_block_encode(_fp8_encode_kernel, x, block, torch.uint8, **_format_args(fmt))


def fp8_decode(codes: torch.Tensor, scales: torch.Tensor, block: int, fmt: torch.dtype, shape,
               dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`fp8_encode`: a tensor of ``shape`` and ``dtype``."""
    return launch_decode(_fp8_decode_kernel, codes, scales, block, shape, dtype,
                         **_format_args(fmt))

