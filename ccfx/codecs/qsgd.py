"""``qsgd``: QSGD stochastic quantization (Alistarh et al., 2017), unbiased.

Per block of ``block`` elements: the L2 norm (fp32), and per element a signed level
``sign(x) * floor(|x| / norm * levels + u)``, ``u ~ U[0, 1)``, so ``E[level] = |x| / norm * levels``
and ``E[decode(encode(x))] = x``. Levels travel as int8 (``levels <= 127``) or int16 (up to
32767). Randomness: fresh on every call, deterministic from ``seed`` and the step counter
(a state tensor). Give each data-parallel rank its own seed for independent noise.

A block holding NaN or ±inf gets a NaN norm and decodes to NaN everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._fast import fast
from ._random import StepCounter
from .base import Codec, Context, Encoded, blocked, ceil_div, nonfinite_rows, numel_of
from .registry import register


@fast
def qsgd_encode_reference(x, noise, block: int, levels: int, qdtype: torch.dtype):
    """``x``, ``noise`` U[0,1) of shape (nblocks, block) → ``(levels [n], norms fp32 [nblocks])``."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    rows = blocked(flat, block)
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
    norms = torch.where(nonfinite_rows(rows), float("nan"), norms)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    level = torch.floor(rows.abs() / safe * levels + noise).clamp_(max=levels)
    q = torch.where(norms > 0, torch.sign(rows) * level, torch.zeros_like(rows))
    return q.to(qdtype).view(-1)[:n], norms.view(-1)


@fast
def qsgd_decode_reference(q, norms, block: int, levels: int, shape, dtype):
    n = q.numel()
    rows = blocked(q.float(), block)
    return (rows * (norms.view(-1, 1) / levels)).view(-1)[:n].view(shape).to(dtype)


@register
@dataclass(frozen=True)
class Qsgd(StepCounter, Codec):
    name = "qsgd"
    summary = "QSGD: L2 norm per block, unbiased stochastic levels"
    levels: int = 127
    block: int = 256
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.levels <= 32767:
            raise ValueError(f"levels must be in [1, 32767], got {self.levels}")
        if self.block < 1:
            raise ValueError(f"block must be a positive integer, got {self.block}")

    @property
    def qdtype(self) -> torch.dtype:
        return torch.int8 if self.levels <= 127 else torch.int16

    def payload_layout(self, shape, dtype):
        n = numel_of(shape)
        return (((n,), self.qdtype), ((ceil_div(n, self.block),), torch.float32))

    def encode_with(self, x, state):
        g = self.draw(state, x.device)
        nblocks = -(-x.numel() // self.block)
        noise = torch.rand(nblocks, self.block, generator=g, device=x.device)
        payload = qsgd_encode_reference(x, noise, self.block, self.levels, self.qdtype)
        return Encoded(payload, Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        q, norms = enc.payload
        return qsgd_decode_reference(q, norms, self.block, self.levels, enc.ctx.shape, enc.ctx.dtype)
