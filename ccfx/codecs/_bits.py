"""Packing small unsigned codes (1, 2 or 4 bits each) into bytes, and back.

Element ``i`` lands in byte ``i // per`` at bit offset ``bits * (i % per)`` (little-endian
within the byte, ``per = 8 // bits``). The Triton kernels in ``ccfx.backends.triton`` use the
same layout, so either side can pack and the other unpack.
"""

from __future__ import annotations

import sys

import torch


def packed_len(n, bits: int):
    from .base import ceil_div

    return ceil_div(n * bits, 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8-valued, each ``< 2**bits``, any shape) → uint8 ``[ceil(n*bits/8)]``."""
    per = 8 // bits
    flat = codes.reshape(-1).to(torch.uint8)
    n = flat.numel()
    rows = torch.nn.functional.pad(flat, (0, -(-n // per) * per - n)).view(-1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=flat.device)
    # Disjoint bit fields: a sum is an OR. int32 accumulation, then back to a byte.
    return (rows.to(torch.int32) << shifts.to(torch.int32)).sum(dim=1).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`pack` of the first ``n`` of ``codes`` for ``bits=4`` (the same bytes: code
    ``2i`` in the low nibble of byte ``i``), by shifts and masks on little-endian int64 words of
    eight codes (:func:`_squeeze_nibbles`): contiguous and vectorized by inductor, where the
    pairwise form gathers every other element one at a time (4x slower compiled).

    ``codes`` may run past ``n`` (a block's padding, packed whole and sliced after: slicing the
    codes first, then padding, miscompiled under inductor with torch 2.13); for odd ``n`` the
    last byte's high nibble is cleared, as :func:`pack` pads with 0. Codes whose last dimension
    is a multiple of 8 keep their shape: flattening them first makes inductor compute them in a
    loop of their own, apart from the block reduction they come from (a second pass over the
    encode's input, 2x slower). Big-endian hosts take :func:`pack`."""
    codes = codes.to(torch.uint8)
    if sys.byteorder != "little":
        return pack(codes.reshape(-1)[:n], 4)
    if (codes.dim() == 0 or codes.shape[-1] % 8 or not codes.is_contiguous()
            or codes.storage_offset() % 8):
        flat = codes.reshape(-1)
        codes = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
    m = packed_len(n, 4)
    packed = _squeeze_nibbles(codes.view(torch.int64)).view(torch.uint8).reshape(-1)[:m]
    if n % 2:
        packed = torch.where(torch.arange(m, device=packed.device) < m - 1, packed,
                             packed & 0x0F)
    return packed


def _squeeze_nibbles(w: torch.Tensor) -> torch.Tensor:
    """int64 words of eight byte codes (each < 16) → int32 words of their eight nibbles in
    order: the bytes' low nibbles pair up, then the pairs, then the quads (the int32
    conversion drops the high half)."""
    w = (w | (w >> 4)) & 0x00FF00FF00FF00FF
    w = (w | (w >> 8)) & 0x0000FFFF0000FFFF
    return (w | (w >> 16)).to(torch.int32)


def unpack_nibble_rows(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles` row by row: uint8 ``(r, k)`` packed bytes, ``k`` a
    multiple of 4 and the rows 4-byte aligned (see :func:`nibble_rows_ok`) → uint8 ``(r, 2k)``
    codes. Each int32 word of eight nibbles spreads to an int64 word of eight bytes by shifts
    and masks (:func:`_squeeze_nibbles` backwards): contiguous and vectorized by inductor, where
    interleaving the low and high nibbles stores every other element one at a time."""
    r, k = rows.shape
    w = rows.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    w = (w | (w << 16)) & 0x0000FFFF0000FFFF
    w = (w | (w << 8)) & 0x00FF00FF00FF00FF
    w = (w | (w << 4)) & 0x0F0F0F0F0F0F0F0F
    return w.view(torch.uint8).view(r, 2 * k)


def nibble_rows_ok(packed: torch.Tensor) -> bool:
    """Whether :func:`unpack_nibble_rows` may read ``packed`` (flat, contiguous) as int32
    words: little-endian host, 4-byte aligned start."""
    return (sys.byteorder == "little" and packed.is_contiguous()
            and packed.storage_offset() % 4 == 0)


def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[n]`` codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & mask
    return codes.view(-1)[:n].to(torch.uint8)
