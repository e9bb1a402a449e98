"""Shared pieces of the sparsifying codecs (topk, randomk, threshold).

Selection on the CPU (:func:`largest`)
--------------------------------------
``torch.topk`` over a whole flattened tensor is a single-threaded partial sort on the CPU: about
0.7 s for the top 1% of 16M fp32 elements, 18x a clone of the same tensor. ``topk`` and
``threshold`` only ever want a small top slice, so on plain CPU tensors of ``SAMPLED_MIN_NUMEL``
entries and more (below that torch.topk is as fast) they select in three steps, of which only
the second reads the whole tensor, once:

1. *estimate*: ``torch.kthvalue`` over a strided sample of at most ``SAMPLE`` magnitudes gives a
   cut-off that slightly more than ``k`` entries reach: the sample quantile plus a margin of
   ``MARGIN_SIGMAS`` binomial standard deviations (~1.2 k candidates for k = 1% of 16M);
2. *compact*: one pass marks the entries whose magnitude reaches the cut and ``nonzero`` turns
   the marks into ascending indices. ``nonzero`` has a data-dependent output shape, so only the
   marking compiles (inductor, for large tensors: see :mod:`ccfx.codecs._fast`); compiled, the
   marks are packed 8 to a byte (:func:`_reach_bits`), so ``nonzero`` scans an eighth of the
   entries and only the few marked bytes are unpacked;
3. *select*: ``torch.topk`` over the candidates only.

For 16M fp32 entries and k = 1% (one thread) that is ~14 ms for the compiled pass, ~13 ms of
``nonzero`` and ~10 ms for the rest, against ~50 ms for a clone: the round trip's remaining cost
is the decode's fresh zero-filled tensor (page faults, as for the clone) and its scatter.

Correctness never depends on the estimate. Every entry that is not a candidate is below the cut,
and every candidate is at or above it, so when at least ``k`` entries reach the cut the ``k``
largest are among them. When fewer do (the sample saw values the rest of the tensor lacks), a
deeper cut, from the count observed, is tried once more (``ATTEMPTS``), and after that the full
``torch.topk`` runs. Ties at the cut (a tensor of equal values, or mostly zeros) are settled
without a topk: the entries above the cut, then the first ties in index order. The result is
always in ascending index order.

``threshold`` passes its ``tau`` as ``above``: a strict lower bound. A sample cut that is not
above ``tau`` would only gather more candidates than ``tau`` itself does, so then the compaction
runs with ``tau``, and a topk follows only when more than ``k`` entries pass.

Every op on the ~k candidates runs torch's thread pool once (arrays over its grain size, 32768):
few ops, in place where possible. On a machine whose cores are busy with other processes each
such wake-up can cost a scheduler tick (ms), which is why the sample stays under the grain size.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from .. import _torch_compat as tc
from ..errors import CodecError
from ._fast import fast
from .base import ceil_div

INDEX_DTYPE = torch.int32

#: Magnitudes in the sample that estimates the cut-off, at most: under torch's parallel grain
#: size (32768), so the sample's few small ops run inline, without waking the thread pool.
SAMPLE = 32767
#: ... and at most one in this many entries (small tensors), so the sample stays cheap.
MIN_STRIDE = 16
#: Sampling pays only for tensors at least this large: at 2**16 fp32 entries and k = 1%, both
#: ways take ~0.6 ms, at 2**20 the sampled one is 3.5x faster (tests lower it for small inputs).
SAMPLED_MIN_NUMEL = 1 << 16
#: Margin of the estimate, in standard deviations of the sample count above the true cut-off.
MARGIN_SIGMAS = 4.0
#: Compactions at sampled cut-offs before the exact fallback.
ATTEMPTS = 2


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
    """Dense tensor of ``shape`` with ``values`` at flat ``indices`` (int32 or int64;
    duplicates add up: the padding slots of ``threshold`` are zeros at index 0, so they add
    nothing).

    Most of the time goes to the zero-filled output: a fresh tensor, page-faulted in like a
    clone's. The scatter itself is a tenth or so of that for k = 1% (``index_copy_`` would save
    about half of it, but needs distinct indices, which ``threshold``'s padding is not)."""
    n = 1
    for d in shape:
        n *= d
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    out.index_add_(0, indices, values)  # takes int32 indices as they are
    return out.view(shape).to(dtype)


def magnitude(flat: torch.Tensor) -> torch.Tensor:
    """|x| with NaN ranked above everything (as +inf), so non-finite entries are always sent."""
    inf = float("inf")
    return torch.nan_to_num(flat.abs(), nan=inf, posinf=inf)


def top_above(x: torch.Tensor, tau: float, capacity: int):
    """Of the ``capacity`` largest magnitudes of ``x``, those ``> tau``, largest first, padded
    with zeros at index 0: ``(values, indices, count)``. The threshold codec's definition
    (``tau`` compared in ``x``'s dtype, as torch compares a tensor with a Python float); here so
    that its Triton launcher can fall back to it without importing the codec."""
    flat = x.reshape(-1)
    mag, idx = torch.topk(magnitude(flat), capacity, sorted=True)
    keep = mag > tau  # sorted descending: the kept slots come first
    values = torch.where(keep, flat[idx], torch.zeros((), dtype=flat.dtype, device=flat.device))
    idx = torch.where(keep, idx, 0).to(INDEX_DTYPE)
    return values, idx, keep.sum().to(torch.int32).view(1)


# %% selection on the CPU


def sampled_path(x) -> bool:
    """Whether :func:`largest` selects ``x``: a plain CPU tensor, not under tracing (its control
    flow reads values: fake tensors have none). CUDA keeps ``torch.topk`` / the Triton kernels."""
    return (type(x) is torch.Tensor and x.device.type == "cpu"
            and not torch.compiler.is_compiling() and tc.len_torch_dispatch_stack() == 0)


def _reaches(flat: torch.Tensor, cut: torch.Tensor, strict: bool) -> torch.Tensor:
    """Bool mask of ``magnitude(flat) >= cut`` (``> cut`` when ``strict``; ``cut < inf``),
    written as ``not (|x| < cut)`` so that NaN, which fails every comparison, passes."""
    return ~(flat.abs() <= cut if strict else flat.abs() < cut)


@fast
def _reach_bits(flat: torch.Tensor, cut: torch.Tensor, strict: bool) -> torch.Tensor | None:
    """:func:`_reaches` packed, when compiled: a uint8 per 8 entries (``flat.numel() % 8 == 0``),
    bit ``j`` of byte ``i`` for entry ``8 i + j``. None when the call runs eagerly (the sizes and
    devices that ``fast`` leaves eager, or dynamo past its recompile limit, one compile per
    shape): eagerly this spelling costs 8 strided passes, 2.5x the plain mask.

    Packing writes an eighth of the bytes and leaves ``nonzero`` an eighth of the entries to
    scan (only the bytes with a bit set are unpacked), 2x faster than a byte mask in all. The
    spelling matters to inductor's CPU code: ``where`` of integer constants, one column at a
    time, vectorizes; a bool mask, ``.to(uint8)`` of one, or a sum over a dimension of 8 stores
    or reduces through slow paths (3-10x)."""
    if not torch.compiler.is_compiling():
        return None
    rows = flat.view(-1, 8)
    bits = 0
    for j in range(8):
        a = rows[:, j].abs()
        bits = bits + torch.where(a <= cut if strict else a < cut, 0, 1 << j)
    return bits.to(torch.uint8)


#: Row ``b``: the 8 bits of the byte ``b``, lowest first, as 0/1 bytes.
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Ascending indices of the set bits of :func:`_reach_bits`'s bytes."""
    groups = packed.nonzero().view(-1)  # bytes with a bit set
    bits = _BITS.index_select(0, packed.index_select(0, groups).int())  # (groups, 8) of 0/1
    row, bit = bits.nonzero().unbind(1)
    # In place where possible: few and small ops matter here (see the module docstring).
    return groups.index_select(0, row).mul_(8).add_(bit)


def _compact(flat: torch.Tensor, cut: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """Ascending int64 indices of the entries whose magnitude reaches ``cut`` (a 0-d tensor of
    ``flat``'s dtype, so the comparison happens in that dtype; ``flat`` contiguous): packed
    when compiled (see :func:`_reach_bits`), a plain mask otherwise."""
    if strict and torch.isinf(cut):  # nothing, not even NaN (read as +inf), exceeds +inf
        return torch.zeros(0, dtype=torch.long, device=flat.device)
    body = flat.numel() - flat.numel() % 8
    packed = _reach_bits(flat[:body], cut, strict)
    if packed is None:
        return _reaches(flat, cut, strict).nonzero().view(-1)
    idx = _unpack(packed)
    if body == flat.numel():
        return idx
    tail = _reaches(flat[body:], cut, strict).nonzero().view(-1) + body
    return torch.cat([idx, tail])


def _top_positions(mag: torch.Tensor, k: int, floor: torch.Tensor) -> torch.Tensor:
    """Ascending positions of the ``k`` largest of ``mag`` (``k < mag.numel()``), every one of
    which is ``>= floor``.

    Many more candidates than ``k`` mean many ties at ``floor`` (or a sample far off). When
    fewer than ``k`` exceed ``floor``, the ``k``-th largest *is* ``floor``: all entries above it
    are kept and the first ties fill the rest, which a topk over a sea of equal values (a tensor
    of zeros with a few nonzeros, say) would do far more slowly."""
    if mag.numel() > 2 * k:
        keep = mag > floor
        short = k - int(keep.sum())
        if short > 0:
            keep[(~keep).nonzero().view(-1)[:short]] = True
            return keep.nonzero().view(-1)
    # Back to index order through a mask: cheaper than sorting the topk's positions.
    keep = torch.zeros(mag.shape, dtype=torch.bool, device=mag.device)
    keep[torch.topk(mag, k, sorted=False).indices] = True
    return keep.nonzero().view(-1)


def _sample(flat: torch.Tensor) -> torch.Tensor:
    """At most ``SAMPLE`` magnitudes, at an odd stride of at least ``MIN_STRIDE`` (odd, so rows
    of a power-of-two width are not all sampled in the same columns)."""
    stride = max(MIN_STRIDE, flat.numel() // SAMPLE) | 1
    return magnitude(flat[::stride])


def _first_rank(k: int, n: int, m: int) -> int:
    """Sample rank whose value ``k`` of ``n`` entries reach, plus ``MARGIN_SIGMAS`` standard
    deviations of the binomial count: a cut that at least ``k`` entries reach, usually."""
    mean = m * k / n
    return math.ceil(mean + MARGIN_SIGMAS * math.sqrt(mean) + 1)


def _next_rank(rank: int, reached: int, k: int) -> int:
    """After ``reached < k`` entries reached the cut at ``rank``: a rank that the observed
    density says will reach ``k``, with a factor of two to spare (at least four times deeper)."""
    return max(4 * rank, math.ceil(2 * rank * k / max(reached, 1)))


def _keep_largest(flat: torch.Tensor, idx: torch.Tensor, k: int, floor: torch.Tensor):
    """``(indices, values)`` of the ``k`` largest of the candidates ``idx`` (ascending, all
    ``>= floor``), still in index order: all of them when they are ``k`` or fewer."""
    values = flat.index_select(0, idx)
    if idx.numel() <= k:
        return idx, values
    pos = _top_positions(magnitude(values), k, floor)
    return idx.index_select(0, pos), values.index_select(0, pos)


def _exact(flat: torch.Tensor, k: int, above: torch.Tensor | None):
    """Without a sampled cut: a topk over every entry (``above`` is None: the fallback), or
    the entries above ``above``, with a topk over them if more than ``k``."""
    if above is not None:
        return _keep_largest(flat, _compact(flat, above, strict=True), k, above)
    if k >= flat.numel():
        idx = torch.arange(flat.numel(), device=flat.device)
    else:
        idx = torch.topk(magnitude(flat), k, sorted=False).indices.sort().values
    return idx, flat.index_select(0, idx)


def _sampled(flat: torch.Tensor, k: int, above: torch.Tensor | None):
    """Steps 1-3 of the module docstring: the ``k`` largest (``> above``), or None when no
    sampled cut that ``k`` entries reach is worth a pass over the tensor."""
    sample = _sample(flat)
    m = sample.numel()
    rank, last = _first_rank(k, flat.numel(), m), None
    if 4 * rank > m:  # k is so large a share that a cut would gather most of the tensor
        return None
    for _ in range(ATTEMPTS):
        cut = torch.kthvalue(sample, m + 1 - min(rank, m)).values  # the rank-th largest
        if (above is not None and cut <= above) or (last is not None and cut >= last):
            return None  # tau itself is the tighter cut, or the sample cannot go lower
        idx = _compact(flat, cut)
        if idx.numel() >= k:
            return _keep_largest(flat, idx, k, cut)
        rank, last = _next_rank(rank, idx.numel(), k), cut
    return None


def largest(flat: torch.Tensor, k: int, above: torch.Tensor | None = None):
    """``(indices, values)`` of the ``k`` largest magnitudes of the 1-D ``flat`` (NaN as +inf;
    ties in any order), or, given ``above`` (a 0-d tensor of ``flat``'s dtype), of the ``k``
    largest among those ``> above``: all of them when they are ``k`` or fewer. Indices are
    int64, ascending; values are ``flat``'s entries there.

    See the module docstring for the method; the answer never depends on the sample."""
    flat = flat.contiguous()
    found = None
    if SAMPLED_MIN_NUMEL <= flat.numel() and k < flat.numel():
        found = _sampled(flat, k, above)
    return _exact(flat, k, above) if found is None else found


#: Signed integers as wide as each float dtype: a non-negative float's bits order as its value.
_BITS_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}


def by_magnitude(values: torch.Tensor) -> torch.Tensor:
    """Order of ``values`` by magnitude, largest first; equal magnitudes keep their order.

    Sorted as integers: the bits of a magnitude (never negative, NaN read as +inf) order as its
    value, and an ascending integer sort is torch's radix sort on the CPU, 8x a float sort."""
    bits = magnitude(values).view(_BITS_OF[values.dtype])
    if bits.dtype == torch.int16:
        bits = bits.to(torch.int32)
    return torch.sort(-bits, stable=True).indices
