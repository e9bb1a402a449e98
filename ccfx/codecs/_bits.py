"""Packing small unsigned codes (1, 2 or 4 bits each) into bytes, and back.

Element ``i`` lands in byte ``i // per`` at bit offset ``bits * (i % per)`` (little-endian
within the byte, ``per = 8 // bits``). The Triton kernels in ``ccfx.backends.triton`` use the
same layout, so either side can pack and the other unpack.
"""

from __future__ import annotations

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


def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[n]`` codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & mask
    return codes.view(-1)[:n].to(torch.uint8)
