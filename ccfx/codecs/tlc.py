"""``tlc``: 3LC (Lim, Andersen, Kaminsky, 2019): three values, base-3^5 packing, zero runs.

Per block (``block=0``, the default: the whole tensor, as 3LC) the scale is ``s = M * absmax``
(fp32; ``M = sparsity`` in [1, 2): a larger M sends more zeros) and each element is
``round(x / s)`` in {-1, 0, +1} (half to even); decode gives ``s * value``. The error is at most
``s / 2`` per element. Use it with ``ef`` (``"tlc:ef"``, 3LC proper): the rounding error is fed
back to the next step. Then a lossless stage: five values a byte as the base-3 digits
``0, 1, 2`` for ``0, +1, -1`` (byte values 0..242, five zeros are byte 0), and zero-run
encoding: a run of 2..14 zero bytes becomes one byte 243..255 (longer runs take several).

The payload is ``(codes uint8 [ceil(n / 5)], scales fp32 [nblocks], used int32 [1])``: the
codes' first ``used`` bytes carry the data, the rest is zero padding up to the capacity (zero
runs never lengthen the bytes, so ``ceil(n / 5)`` always fits). ``wire_bytes`` is that
capacity, ``ceil(n / 5) + 4 * nblocks + 4`` (0.05 of fp32 plus 8 bytes); ``used_bytes`` is what
a payload needs, which depends on the data. Where a path can send a variable size (the eager
all-gather of a data-parallel bucket over a process group) it sends ``used`` bytes; elsewhere
the capacity travels and the plan says so (:mod:`ccfx.codecs.variable`).

A block holding NaN or ±inf gets a NaN scale and decodes to NaN everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CodecError
from ._fast import fast
from .base import Codec, Context, Encoded, ceil_div, numel_of
from .blockwise import rescaled
from .registry import register

#: Ternary values a byte holds, and the byte values they take (3 ** 5).
PER_BYTE = 5
LITERALS = 243
#: Zero runs of RUN_MIN..RUN_MAX bytes are one byte ``LITERALS + length - RUN_MIN``.
RUN_MIN, RUN_MAX = 2, 2 + 255 - LITERALS


def _scales(flat: torch.Tensor, block: int, sparsity: float):
    """``(scales (nblocks, 1), rows (nblocks, size))``: fp32 ``sparsity * absmax`` per block (at
    most FLT_MAX; NaN for a non-finite block) and ``flat`` zero-padded to whole blocks."""
    n = flat.numel()
    size = block or max(n, 1)  # block 0: one block, even for an empty tensor
    nblocks = -(-n // size) if block else 1
    rows = torch.nn.functional.pad(flat, (0, nblocks * size - n)).view(nblocks, size)
    absmax = (rows.abs() + (rows - rows)).amax(dim=1, keepdim=True)  # NaN marks non-finite
    scales = torch.clamp(absmax * sparsity, max=torch.finfo(torch.float32).max)
    return torch.where(absmax.isnan(), float("nan"), scales), rows


def base3(digits: torch.Tensor) -> torch.Tensor:
    """Digits ``[n]`` in {0, 1, 2} (any numeric dtype) → uint8 ``[ceil(n/5)]``, byte ``j`` the
    sum of ``digit[5j + i] * 3**i`` (zero-padded: a byte of five zeros is 0)."""
    n = digits.numel()
    m = -(-n // PER_BYTE)
    fields = torch.nn.functional.pad(digits, (0, m * PER_BYTE - n)).view(m, PER_BYTE)
    groups = fields[:, 0]
    for i in range(1, PER_BYTE):  # one strided field at a time: one loop over bytes compiled
        groups = groups + fields[:, i] * 3**i
    return groups.to(torch.uint8)


@fast
def tlc_quantize(x: torch.Tensor, block: int, sparsity: float):
    """``x`` → ``(groups uint8 [ceil(n/5)], scales fp32 [nblocks])``: the values in base 3
    (:func:`base3`), before the zero runs."""
    flat = x.reshape(-1).float()
    scales, rows = _scales(flat, block, sparsity)
    positive = scales > 0  # false for 0 and NaN: those blocks send zeros
    t = torch.where(positive, torch.round(rows / torch.where(positive, scales, 1.0)), 0.0)
    digits = torch.where(t < 0, 2.0, t).view(-1)[:flat.numel()]
    return base3(digits), scales.view(-1)


def pack_ternary(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The lossless stage on its own: int ``values`` in {-1, 0, 1} → ``(codes uint8 [used],
    used)``, base-3^5 packed and zero-run encoded (:func:`unpack_ternary` inverts it)."""
    flat = values.reshape(-1).to(torch.int32)
    codes = zero_runs(base3(torch.where(flat < 0, 2, flat)))
    return codes, codes.numel()


def zero_runs(groups: torch.Tensor) -> torch.Tensor:
    """uint8 ``groups`` (0..242) with each run of zero bytes cut into pieces of at most
    ``RUN_MAX``: a piece of 2 or more becomes one byte ``LITERALS + length - RUN_MIN``, a piece
    of one stays 0. Never longer than ``groups``."""
    m = groups.numel()
    if m == 0:
        return groups.clone()
    idx = torch.arange(m, device=groups.device)
    zero = groups == 0
    before = torch.nn.functional.pad(zero[:-1], (1, 0))
    after = torch.nn.functional.pad(zero[1:], (0, 1))
    start = torch.where(zero & ~before, idx, -1).cummax(dim=0).values  # of each zero's run
    end = torch.where(zero & ~after, idx, m).flip(0).cummin(dim=0).values.flip(0)
    head = zero & ((idx - start) % RUN_MAX == 0)  # the first byte of each piece
    length = (end - idx + 1).clamp(max=RUN_MAX)  # at a head: its piece's length
    run_byte = torch.where(length >= RUN_MIN, length + (LITERALS - RUN_MIN), 0)
    value = torch.where(zero, run_byte, groups.to(torch.int64))
    return value[~zero | head].to(torch.uint8)


def expand_runs(codes: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`zero_runs`: uint8 ``codes`` → the ``groups`` bytes they stand for."""
    c = codes.to(torch.int64)
    run = c >= LITERALS
    counts = torch.where(run, c - (LITERALS - RUN_MIN), 1)
    total = int(counts.sum())
    if total != groups:
        raise CodecError(f"tlc payload expands to {total} bytes, not the {groups} its shape "
                         "needs: the payload was cut or damaged on the way")
    return torch.repeat_interleave(torch.where(run, 0, c), counts, output_size=groups)


def unpack_ternary(codes: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: int8 ``[n]`` values in {-1, 0, 1}."""
    groups = expand_runs(codes, -(-n // PER_BYTE))
    powers = torch.tensor([3**i for i in range(PER_BYTE)], dtype=torch.int64,
                          device=codes.device)
    digits = (groups.view(-1, 1) // powers % 3).view(-1)[:n]
    return torch.where(digits == 2, -1, digits).to(torch.int8)


@register
@dataclass(frozen=True)
class ThreeLC(Codec):
    name = "tlc"
    summary = ("3LC: {-s, 0, +s}, s = sparsity * absmax, base-3^5 packed and zero-run encoded "
               "(data-dependent size; wire bytes are the capacity)")
    variable = True
    sparsity: float = 1.0
    block: int = 0

    def __post_init__(self):
        if not 1.0 <= self.sparsity < 2.0:
            raise ValueError(f"sparsity must be in [1, 2) (3LC's multiplier M), "
                             f"got {self.sparsity}")
        if self.block < 0:
            raise ValueError(f"block must be 0 (one scale for the whole tensor) or a positive "
                             f"integer, got {self.block}")

    def _nblocks(self, n):
        return 1 if self.block == 0 else ceil_div(n, self.block)

    def payload_layout(self, shape, dtype):
        n = numel_of(shape)
        return (((ceil_div(n, PER_BYTE),), torch.uint8), ((self._nblocks(n),), torch.float32),
                ((1,), torch.int32))

    def used_elements(self, payload) -> int:
        return int(payload[2][0])

    def encode_with(self, x, state):
        groups, scales = tlc_quantize(x, self.block, self.sparsity)
        packed = zero_runs(groups)
        codes = torch.zeros(groups.numel(), dtype=torch.uint8, device=x.device)
        codes[:packed.numel()] = packed
        used = torch.tensor([packed.numel()], dtype=torch.int32, device=x.device)
        return Encoded((codes, scales, used), Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        codes, scales, used = enc.payload
        n = numel_of(enc.ctx.shape)
        values = unpack_ternary(codes[:int(used[0])], n).float()
        return rescaled(values, scales, self.block or max(n, 1), enc.ctx.shape, enc.ctx.dtype)
