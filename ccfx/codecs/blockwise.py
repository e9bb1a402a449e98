"""The block-scaled family: int8, int4, sign, fp8, qsgd and terngrad.

Each cuts the flattened tensor into blocks of ``block`` elements and sends two payload tensors:
the codes, ``bits`` per element packed into ``code_dtype``, and one fp32 scale per block. A
member is a small module: its torch references (``encode_reference(x, *encode_args)`` →
``(codes, scales)`` and ``decode_reference(codes, scales, *decode_args, shape, dtype)``) and a
class that names them and declares its parameters; on CUDA the Triton kernels
``<name>_encode`` / ``<name>_decode`` in ``ccfx.backends.triton.<name>`` run instead, with the
same arguments (same payload, bit for bit or to stated ulps).

A member declares ``block: int = 256`` among its own fields: a codec's fields in declaration
order are its spec's parameter order (``qsgd:levels=1000,block=16``), so the base cannot
declare it for all of them. The block check is here, once.

The helpers below are the references' shared steps: the same torch operations each reference
spelled out before, so payloads are bit for bit what they were, eager and compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ._random import StepCounter
from .base import Codec, Context, Encoded, blocked, ceil_div, nonfinite_rows, numel_of
from .dispatch import pick


@dataclass(frozen=True)
class BlockScaled(Codec):
    """Base of the block-scaled codecs: payload ``(codes, scales)``; see the module docstring.

    A subclass is a frozen dataclass that sets ``name``, ``bits``, ``encode_reference`` and
    ``decode_reference`` (and ``code_dtype`` when not uint8), declares ``block: int = 256``, and
    overrides ``encode_args`` / ``decode_args`` when its references take more than ``block``.
    """

    #: Bits per element in the codes; ``code_dtype`` holds ``8 * itemsize // bits`` of them.
    bits: ClassVar[int]
    code_dtype: ClassVar[torch.dtype] = torch.uint8
    encode_reference: ClassVar[Callable]
    decode_reference: ClassVar[Callable]

    def __post_init__(self):
        if self.block < 1:
            raise ValueError(f"block must be a positive integer, got {self.block}")

    def payload_layout(self, shape, dtype):
        n = numel_of(shape)
        width = 8 * self.code_dtype.itemsize
        codes = n if self.bits == width else ceil_div(n * self.bits, width)
        return (((codes,), self.code_dtype), ((ceil_div(n, self.block),), torch.float32))

    def encode_args(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> tuple:
        """The encode's arguments after ``x``."""
        return (self.block,)

    def decode_args(self) -> tuple:
        """The decode's arguments between ``(codes, scales)`` and ``(shape, dtype)``."""
        return (self.block,)

    def _impl(self, t: torch.Tensor, which: str) -> Callable:
        return pick(t, self.name, which, getattr(type(self), f"{which}_reference"))

    def encode_with(self, x, state):
        codes, scales = self._impl(x, "encode")(x, *self.encode_args(x, state))
        return Encoded((codes, scales), Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        codes, scales = enc.payload
        return self._impl(codes, "decode")(codes, scales, *self.decode_args(),
                                           enc.ctx.shape, enc.ctx.dtype)


@dataclass(frozen=True)
class StochasticBlockScaled(StepCounter, BlockScaled):
    """A block-scaled codec that draws fresh noise every call (qsgd, terngrad): its encode takes
    this call's 0-d int64 noise key first, ``encode(x, key, block, ...)``. The subclass declares
    ``seed: int = 0``; the step counter is its state (see :class:`StepCounter`)."""

    def encode_args(self, x, state):
        return (self.noise_key(state, x), *super().encode_args(x, state))


# -- the references' shared steps ---------------------------------------------------------


def safe_divisor(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` with every entry that is not positive (0 or NaN) replaced by 1."""
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def absmax_scales(rows: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """``(nblocks, 1)`` fp32 ``absmax / divisor`` per row of ``rows``; NaN for a row holding NaN
    or ±inf (``amax`` drops NaN on some backends: non-finite rows are made explicit)."""
    absmax = rows.abs().amax(dim=1, keepdim=True)
    if divisor != 1:
        # by a tensor, not a Python float: CUDA multiplies by a scalar divisor's reciprocal
        # (one ulp off the quotient); the kernels and the CPU divide correctly rounded
        absmax = absmax / torch.full_like(absmax, divisor)
    return torch.where(nonfinite_rows(rows), float("nan"), absmax)


def absmax_blocks(x: torch.Tensor, block: int, divisor: float):
    """``x`` flattened to fp32 blocks, each divided by its scale ``absmax / divisor``, in one
    pass over ``x`` once compiled: ``(scaled (nblocks, block), absmax (nblocks,))``. A block
    whose scale is 0 or NaN scales to zeros; the zero padding of the last block stays 0. Slice
    the codes to ``x.numel()``; :func:`block_scales` turns ``absmax`` into the scales.

    ``|x| + (x - x)`` is ``|x|`` where ``x`` is finite and NaN where it is NaN or ±inf, and
    ``amax`` propagates NaN: so the block reduction that finds the absmax also marks the
    non-finite blocks (NaN, with whatever NaN bits), and inductor fuses it with the loop that
    divides the block (one read of ``x`` instead of two)."""
    rows = blocked(x.reshape(-1).float(), block)
    absmax = (rows.abs() + (rows - rows)).amax(dim=1, keepdim=True)
    # by a tensor, not a Python float: see absmax_scales
    scales = absmax / torch.full_like(absmax, divisor)
    positive = scales > 0
    scaled = torch.where(positive, rows / torch.where(positive, scales, 1.0), 0.0)
    return scaled, absmax.view(-1)


def block_scales(absmax: torch.Tensor, divisor: float) -> torch.Tensor:
    """The fp32 scales ``absmax / divisor`` from :func:`absmax_blocks`' ``absmax``, with the
    canonical NaN (the payload's bits) for the non-finite blocks, as :func:`absmax_scales`."""
    return torch.where(absmax.isnan(), float("nan"), absmax / torch.full_like(absmax, divisor))


def rescaled(values: torch.Tensor, scales: torch.Tensor, block: int, shape, dtype,
             limit: float | None = None) -> torch.Tensor:
    """Decode: the flat fp32 ``values`` (one per element) times their block's scale, as a tensor
    of ``shape`` and ``dtype``; with ``limit``, saturated at ``±limit`` first (NaN stays NaN:
    the comparisons are false for it)."""
    n = numel_of(shape)
    y = blocked(values, block) * scales.view(-1, 1)
    if limit is not None:
        y = torch.where(y > limit, limit, torch.where(y < -limit, -limit, y))
    return y.view(-1)[:n].view(shape).to(dtype)
