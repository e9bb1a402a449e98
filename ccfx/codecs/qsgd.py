"""``qsgd``: QSGD stochastic quantization (Alistarh et al., 2017), unbiased.

Per block of ``block`` elements: the L2 norm (fp32), and per element a signed level
``sign(x) * floor(|x| / norm * levels + u)``, ``u ~ U[0, 1)``, so ``E[level] = |x| / norm * levels``
and ``E[decode(encode(x))] = x``. Levels travel as int8 (``levels <= 127``) or int16 (up to
32767). Randomness: fresh on every call, deterministic from ``seed`` and the step counter
(a state tensor). Give each data-parallel rank its own seed for independent noise.

``u`` is ``_random.uniform`` of the element's flat index and the step's key, computed inside the
compiled encode (no noise tensor). This replaced ``torch.rand``: the same seed and step now draw
different numbers than before, so a checkpoint from an older version resumes with another
(equally valid) stream. Tensors of more than 2**32 elements raise CodecError.

The norm is taken as ``absmax * ||x / absmax||`` and saturates at FLT_MAX: a block full of
``finfo.min`` (an additive attention mask) would otherwise square to inf and decode to NaN.
Any scale at or above the block's absmax keeps the levels unbiased, so saturating only costs
variance. Decoded values saturate at the output dtype's largest finite value (stochastic
rounding can land above the largest input). A block holding NaN or ±inf gets a NaN norm and
decodes to NaN everywhere.

On CUDA the Triton kernels in ``ccfx.backends.triton.qsgd`` run (norms, then levels with the
same hashed noise): levels bit for bit the same as here given the same norms, norms to a few
ulps (block sums in another order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._fast import fast
from ._random import uniform
from .base import blocked, nonfinite_rows
from .blockwise import StochasticBlockScaled, rescaled, safe_divisor
from .registry import register


def _block_norms(rows: torch.Tensor) -> torch.Tensor:
    """``(nblocks, 1)`` fp32 L2 norms, finite for every finite block (see the module docstring);
    NaN for a block holding NaN or ±inf."""
    absmax = rows.abs().amax(dim=1, keepdim=True)
    norms = absmax * torch.linalg.vector_norm(rows / safe_divisor(absmax), dim=1, keepdim=True)
    norms = torch.clamp(norms, max=torch.finfo(torch.float32).max)
    return torch.where(nonfinite_rows(rows), float("nan"), norms)


@fast
def qsgd_encode_reference(x, key, block: int, levels: int, qdtype: torch.dtype):
    """``x``, 0-d int64 ``key`` → ``(levels [n], norms fp32 [nblocks])``."""
    n = x.numel()
    rows = blocked(x.reshape(-1).float(), block)
    norms = _block_norms(rows).view(-1)
    safe = safe_divisor(norms)
    # Element-wise over the flat index, each element reading its block's norm: so inductor
    # hashes the noise inside the quantization loop. Over (nblocks, block) rows it stored the
    # noise in a 64 MB buffer first (1.8x slower encode). Over the padded length: with a
    # ragged last block, inductor 2.13 splits the loop at i // block and drops the tail.
    flat = rows.view(-1)
    i = torch.arange(flat.numel(), device=x.device)
    b = i // block
    level = torch.floor(flat.abs() / safe[b] * levels + uniform(i, key)).clamp_(max=levels)
    q = torch.where(norms[b] > 0, torch.sign(flat) * level, torch.zeros_like(flat))
    return q.to(qdtype)[:n], norms


@fast
def qsgd_decode_reference(q, norms, block: int, levels: int, shape, dtype):
    big = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    # by a tensor: CUDA multiplies by a Python divisor's reciprocal (one ulp off the kernel)
    return rescaled(q.float(), norms / torch.full_like(norms, levels), block, shape, dtype,
                    limit=big)


@register
@dataclass(frozen=True)
class Qsgd(StochasticBlockScaled):
    name = "qsgd"
    summary = "QSGD: L2 norm per block, unbiased stochastic levels"
    encode_reference = staticmethod(qsgd_encode_reference)
    decode_reference = staticmethod(qsgd_decode_reference)
    levels: int = 127
    block: int = 256
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.levels <= 32767:
            raise ValueError(f"levels must be in [1, 32767], got {self.levels}")
        super().__post_init__()

    @property
    def code_dtype(self) -> torch.dtype:
        """Levels travel as int8 up to 127, else int16."""
        return torch.int8 if self.levels <= 127 else torch.int16

    @property
    def bits(self) -> int:
        return 8 * self.code_dtype.itemsize

    def encode_args(self, x, state):
        return (*super().encode_args(x, state), self.levels, self.code_dtype)

    def decode_args(self):
        return (*super().decode_args(), self.levels)
