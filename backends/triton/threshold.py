"""Triton kernels for the ``threshold`` codec: compact the entries with ``|x| > tau`` into the
fixed-capacity ``(values, int32 indices, count)`` payload of ``threshold_encode_reference``.

Selection is a two-pass stream compaction (a prefix scan, not an atomic counter, so the result
is deterministic):

1. ``_threshold_count_kernel``: each program counts the entries of its tile that pass;
2. an exclusive ``torch.cumsum`` over those per-program counts gives each program's first slot;
3. ``_threshold_compact_kernel``: each program writes its passing entries at
   ``offset + (inclusive scan of the pass mask) - 1``, dropping slots ``>= capacity``.

The compacted entries come out in ascending index order; the reference (``torch.topk`` with
``sorted=True``) lists the kept entries by descending magnitude. So the launcher then sorts the
``capacity`` slots by magnitude with ``torch.sort(descending=True, stable=True)`` (a sort of
``capacity = cap * n`` elements, 1% of the input by default). The same set in the same order;
entries of equal magnitude (ties, or several NaN/inf) come in ascending index order here, while
``torch.topk`` leaves their order unspecified. Padding slots hold value 0 at index 0, as in the
reference.

"Passes" is exactly the reference's test: ``|x|`` with NaN read as +inf, compared in the input's
dtype with ``tau`` rounded to that dtype (torch compares an fp16 tensor with a Python float in
fp16). fp16/bf16/fp32 compare in fp32 (exact for those values), fp64 in fp64.

Overflow: when more than ``capacity`` entries pass, the reference keeps the largest ones. The
compaction cannot know which, so the launcher reads the total count on the host (one
device-to-host sync) and, in that case only, runs the torch reference instead.

Decode is the reference's ``index_add_`` scatter on every device (on CUDA it is already one
scatter kernel; a Triton copy would gain nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, is_nonfinite

BLOCK_SIZE = 1024  # elements per program in both passes


# %% kernels
@triton.jit
def _passes(x_ptr, tau_ptr, offs, mask, F64: tl.constexpr):
    """Pass mask of a tile: ``where(isnan(|x|), inf, |x|) > tau`` (masked lanes: False)."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if F64:
        a = tl.abs(x.to(tl.float64))
    else:
        a = tl.abs(x.to(tl.float32))
    a = tl.where(is_nonfinite(a), float("inf"), a)  # NaN -> inf (inf stays inf)
    return (a > tl.load(tau_ptr)) & mask


@triton.jit
def _threshold_count_kernel(
    x_ptr,  # *Pointer* to the flattened input [n], any float dtype
    tau_ptr,  # *Pointer* to tau (1 element: fp32, or fp64 for fp64 input), rounded to x's dtype
    counts_ptr,  # *Pointer* to int32 [nprograms]: entries of each tile that pass
    n,  # number of elements
    F64: tl.constexpr,  # compare in fp64 (fp64 input)
    BLOCK_SIZE: tl.constexpr,  # elements per program
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    keep = _passes(x_ptr, tau_ptr, offs, offs < n, F64)
    tl.store(counts_ptr + pid, tl.sum(keep.to(tl.int32), axis=0))


@triton.jit
def _threshold_compact_kernel(
    x_ptr,  # *Pointer* to the flattened input [n]
    tau_ptr,  # *Pointer* to tau, as for the count kernel
    start_ptr,  # *Pointer* to int32 [nprograms]: first output slot of each tile (exclusive scan)
    values_ptr,  # *Pointer* to the values [capacity], x's dtype, zero-filled
    idx_ptr,  # *Pointer* to the int32 indices [capacity], zero-filled
    n,  # number of elements
    capacity,  # slots in the payload
    F64: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    keep = _passes(x_ptr, tau_ptr, offs, mask, F64)
    slot = tl.load(start_ptr + pid) + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    store = keep & (slot < capacity)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(values_ptr + slot, x, mask=store)
    tl.store(idx_ptr + slot, offs.to(tl.int32), mask=store)


# %% launcher
def threshold_encode(x: torch.Tensor, tau: float, capacity: int):
    """``x`` → ``(values [capacity] x.dtype, indices int32 [capacity], count int32 [1])``, the
    payload of ``threshold_encode_reference`` (see the module docstring for tie order)."""
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    values = torch.zeros(capacity, dtype=x.dtype, device=x.device)
    idx = torch.zeros(capacity, dtype=torch.int32, device=x.device)
    if n == 0:
        return values, idx, torch.zeros(1, dtype=torch.int32, device=x.device)
    f64 = x.dtype == torch.float64
    # tau rounded to x's dtype first (torch's tensor-vs-scalar comparison), then widened.
    tau_t = torch.tensor(tau, dtype=x.dtype).to(torch.float64 if f64 else torch.float32)
    tau_t = tau_t.view(1).to(x.device)
    nprog = cdiv(n, BLOCK_SIZE)
    counts = torch.empty(nprog, dtype=torch.int32, device=x.device)
    _threshold_count_kernel[(nprog,)](flat, tau_t, counts, n, F64=f64, BLOCK_SIZE=BLOCK_SIZE)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    total = ends[-1:]
    if int(total.item()) > capacity:  # the one host sync: keep the largest, as the reference
        from ccfx.codecs._sparse import top_above  # the reference's definition

        return top_above(x, tau, capacity)
    starts = ends - counts
    _threshold_compact_kernel[(nprog,)](
        flat, tau_t, starts, values, idx, n, capacity, F64=f64, BLOCK_SIZE=BLOCK_SIZE,
    )
    # Ascending index order -> the reference's descending magnitude order. Padding (value 0,
    # magnitude 0 <= tau < every kept magnitude) stays last.
    mag = values.abs()
    mag = torch.where(torch.isnan(mag), float("inf"), mag)
    order = torch.sort(mag, descending=True, stable=True).indices
    return values[order], idx[order], total.clone()
