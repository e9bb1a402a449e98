"""``terngrad``: TernGrad (Wen et al., 2017), stochastic ternary {-s, 0, +s}, unbiased.

Per block: ``s = max |x|`` (fp32) and per element ``sign(x) * b``, ``b ~ Bernoulli(|x| / s)``,
so ``E[decode] = x``. Codes ``{0, 1, 2}`` for ``{-1, 0, +1}`` travel as 2 bits, four per byte:
wire ``ceil(n / 4) + 4 * ceil(n / block)``, 0.0664 of fp32 at block 256. Randomness: fresh per
call, deterministic from ``seed`` and the step counter.

The Bernoulli draws compare with ``_random.uniform`` of the element's flat index and the step's
key, computed inside the compiled encode (no noise tensor). This replaced ``torch.rand``: the
same seed and step now draw different numbers than before, so a checkpoint from an older
version resumes with another (equally valid) stream. Tensors of more than 2**32 elements raise
CodecError.

A block holding NaN or ±inf gets a NaN scale and decodes to NaN everywhere.

On CUDA the Triton kernels in ``ccfx.backends.triton.terngrad`` run, bit for bit the same as
the references here (the same hashed noise, in uint32 arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _bits
from ._fast import fast
from ._random import uniform
from .base import blocked, numel_of
from .blockwise import StochasticBlockScaled, absmax_scales, rescaled, safe_divisor
from .registry import register


def _codes(v, j, n: int, block: int, scales, safe, key):
    """int32 codes ``{0, 1, 2}`` of the elements at flat indices ``j`` (values ``v``); 0 past
    ``n``, as ``_bits.pack`` pads."""
    b = j.clamp(max=max(n - 1, 0)) // block
    keep = (uniform(j, key) < v.abs() / safe[b]) & (scales[b] > 0)
    code = torch.where(keep, torch.sign(v), 0.0) + 1
    return torch.where(j < n, code, 0.0).to(torch.int32)


@fast
def terngrad_encode_reference(x, key, block: int):
    """``x``, 0-d int64 ``key`` → ``(codes uint8 [ceil(n/4)], scales [nblocks])``."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    scales = absmax_scales(blocked(flat, block)).view(-1)
    safe = safe_divisor(scales)
    # Bytes straight in _bits.pack's layout: byte i holds elements 4i + r in bits 2r. One
    # strided field at a time, so inductor fuses the whole encode into one vectorized loop over
    # bytes (a (bytes, 4) reduction hashed in scalar code and stored a bool per element: the
    # encode ran 5x slower).
    n4 = -(-n // 4) * 4
    fields = torch.nn.functional.pad(flat, (0, n4 - n)).view(-1, 4)
    first = torch.arange(0, n4, 4, device=x.device)
    packed = torch.zeros(n4 // 4, dtype=torch.int32, device=x.device)
    for r in range(4):
        j = first + r
        packed = packed | (_codes(fields[:, r], j, n, block, scales, safe, key) << 2 * r)
    return packed.to(torch.uint8), scales


@fast
def terngrad_decode_reference(codes, scales, block: int, shape, dtype):
    t = _bits.unpack(codes, numel_of(shape), 2).float() - 1
    return rescaled(t, scales, block, shape, dtype)


@register
@dataclass(frozen=True)
class TernGrad(StochasticBlockScaled):
    name = "terngrad"
    summary = "TernGrad: {-s, 0, +s} per block, stochastic and unbiased, 2 bits per element"
    bits = 2
    encode_reference = staticmethod(terngrad_encode_reference)
    decode_reference = staticmethod(terngrad_decode_reference)
    block: int = 256
    seed: int = 0
