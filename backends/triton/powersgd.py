"""Triton kernel for PowerSGD's orthogonalization: Gram-Schmidt over the columns of a batch of
matrices of one shape, ``[B, m, r]`` (any leading dims), one program per matrix.

The same algorithm as ``gram_schmidt`` in ``ccfx.codecs.powersgd`` (itself the hook's modified
Gram-Schmidt): two passes of MGS ("twice is enough"), a zero column stays zero. Arithmetic is
fp32 whatever the input dtype (the result is cast back); per column one sweep over the rows
accumulates ``|a_i|^2`` and every ``<a_i, a_j>``, and a second sweep writes
``q_i = a_i / |a_i|`` and ``a_j -= <a_i, a_j> / |a_i| * q_i`` for ``j > i``. The reference
normalises first and then takes the dot products, and sums in another order, so the two agree
to fp32 rounding (the tests state the tolerance), not bit for bit.

PowerSGD calls this for every rank on CUDA. For ``r <= 2`` that is exactly the reference's
choice; for ``r > 2`` the CPU reference (and torch's hook) use ``torch.linalg.qr``, whose columns
can differ from Gram-Schmidt's by a sign (Householder QR does not make R's diagonal positive):
the same subspace, the same ``P Qᵀ`` to rounding, so the decoded tensor agrees while the signs
of P's and Q's columns on the wire may not.

Rows are swept in chunks of ``BLOCK_M`` (tall matrices never sit in registers whole); the
matrix is updated in place in the output buffer, so a barrier separates each sweep's stores
from the next sweep's loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# %% kernel
@triton.jit
def _gram_schmidt_kernel(
    a_ptr,  # *Pointer* to fp32 [B, m, r], contiguous: the input, orthogonalised in place
    m,  # rows of each matrix
    r,  # columns of each matrix (r <= R_PAD)
    PASSES: tl.constexpr,  # Gram-Schmidt passes (2: "twice is enough")
    BLOCK_M: tl.constexpr,  # rows per chunk of a sweep
    R_PAD: tl.constexpr,  # r rounded up to a power of two
):
    base = a_ptr + tl.program_id(0).to(tl.int64) * m * r
    cols = tl.arange(0, R_PAD)
    col_ok = cols < r
    for _ in tl.static_range(PASSES):
        for i in range(r):
            # Sweep 1: dots[j] = <a_i, a_j> (dots[i] = |a_i|^2).
            dots = tl.zeros([R_PAD], dtype=tl.float32)
            for m0 in range(0, m, BLOCK_M):
                rows = m0 + tl.arange(0, BLOCK_M)
                offs = rows[:, None].to(tl.int64) * r + cols[None, :]
                mask = (rows[:, None] < m) & col_ok[None, :]
                tile = tl.load(base + offs, mask=mask, other=0.0)
                ai = tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)
                dots += tl.sum(ai[:, None] * tile, axis=0)
            norm = tl.sqrt(tl.sum(tl.where(cols == i, dots, 0.0), axis=0))
            safe = tl.where(norm > 0, norm, 1.0)  # a zero column stays zero
            coef = tl.where(cols > i, dots / safe, 0.0)  # <q_i, a_j> for j > i
            # Sweep 2: q_i = a_i / |a_i|, a_j -= <q_i, a_j> q_i.
            for m0 in range(0, m, BLOCK_M):
                rows = m0 + tl.arange(0, BLOCK_M)
                offs = rows[:, None].to(tl.int64) * r + cols[None, :]
                mask = (rows[:, None] < m) & col_ok[None, :]
                tile = tl.load(base + offs, mask=mask, other=0.0)
                qi = tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1) / safe
                upd = tl.where(cols[None, :] > i, tile - qi[:, None] * coef[None, :], tile)
                tile = tl.where(cols[None, :] == i, qi[:, None], upd)
                tl.store(base + offs, tile, mask=mask)
            tl.debug_barrier()  # the next sweep reads what this one wrote


# %% launcher
def gram_schmidt(p: torch.Tensor, passes: int = 2) -> torch.Tensor:
    """Orthonormal columns of ``p`` (``[..., m, r]``), batched over the leading dims: a new
    tensor of ``p``'s shape and dtype (fp32 arithmetic)."""
    if p.dim() < 2:
        raise ValueError(f"gram_schmidt needs a [..., m, r] tensor, got shape {tuple(p.shape)}")
    m, r = p.shape[-2], p.shape[-1]
    a = torch.empty(p.shape, dtype=torch.float32, device=p.device).copy_(p)  # contiguous
    batch = a.numel() // max(m * r, 1)
    if a.numel():
        r_pad = triton.next_power_of_2(r)
        block_m = min(triton.next_power_of_2(m), max(16, 4096 // r_pad))
        _gram_schmidt_kernel[(batch,)](a, m, r, PASSES=passes, BLOCK_M=block_m, R_PAD=r_pad)
    return a.to(p.dtype)

