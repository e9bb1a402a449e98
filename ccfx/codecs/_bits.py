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
    ``2i`` in the low nibble of byte ``i``), read as little-endian int16 pairs:
    ``lo | hi << 8`` becomes ``lo | hi << 4`` with two masks and a shift on contiguous words,
    which inductor vectorizes (the pairwise form gathers every other element one at a time:
    1.3x slower). ``codes`` may run past ``n`` (a block's padding, packed whole and sliced
    after: slicing the codes first, then padding, miscompiled under inductor with torch 2.13);
    for odd ``n`` the last byte's high nibble is cleared, as :func:`pack` pads with 0.
    Big-endian hosts take :func:`pack`."""
    flat = codes.reshape(-1).to(torch.uint8)
    if sys.byteorder != "little":
        return pack(flat[:n], 4)
    flat = torch.nn.functional.pad(flat, (0, flat.numel() % 2))
    pairs = flat.view(torch.int16)
    m = packed_len(n, 4)
    packed = ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).to(torch.uint8)[:m]
    if n % 2:
        packed = torch.where(torch.arange(m, device=packed.device) < m - 1, packed,
                             packed & 0x0F)
    return packed


def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[n]`` codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & mask
    return codes.view(-1)[:n].to(torch.uint8)
