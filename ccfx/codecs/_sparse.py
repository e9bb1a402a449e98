"""Shared pieces of the sparsifying codecs (topk, randomk, threshold)."""

from __future__ import annotations

from fractions import Fraction

import torch

from ..errors import CodecError
from .base import ceil_div

INDEX_DTYPE = torch.int32


def count(n, ratio: float):
    """``ceil(n * ratio)`` exactly (``ratio`` read as the decimal it was written as, so
    ``0.01 * 300`` gives 3, not 4), for ints, SymInts and sympy sizes. ``0 < ratio <= 1``
    makes it at least 1 for ``n >= 1`` and at most ``n``."""
    r = Fraction(str(ratio))
    return ceil_div(n * r.numerator, r.denominator)


def check_ratio(name: str, ratio: float) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {ratio}")


def check_indexable(n: int) -> None:
    if n >= 2**31:
        raise CodecError(f"sparse codecs send int32 indices; a tensor of {n} elements is too big")


def scatter(values: torch.Tensor, indices: torch.Tensor, shape, dtype) -> torch.Tensor:
    """Dense tensor of ``shape`` with ``values`` at flat ``indices`` (duplicates add up;
    the padding slots of ``threshold`` are zeros at index 0, so they add nothing)."""
    n = 1
    for d in shape:
        n *= d
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    out.index_add_(0, indices.long(), values)
    return out.view(shape).to(dtype)


def magnitude(flat: torch.Tensor) -> torch.Tensor:
    """|x| with NaN ranked above everything (as +inf), so non-finite entries are always sent."""
    mag = flat.abs()
    return torch.where(torch.isnan(mag), float("inf"), mag)
