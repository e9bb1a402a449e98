"""``redsync``: magnitudes at or above a cut estimated from a random sample (RedSync, Fang et al.
2019), in a fixed-capacity payload with the count inside.

Unlike ``topk``, which selects exactly the ``k = ceil(density * n)`` largest magnitudes, the
cut comes from a sample and nothing is sorted: the number sent varies around ``k``.

1. *sample*: ``SAMPLE`` magnitudes, one at a random position in each stratum of the flat range,
   drawn from ``seed`` and the ``step`` state (reruns and ranks agree); a tensor of at most
   ``SAMPLE`` entries is its own sample, and then exactly ``k`` pass (ties aside);
2. *cut*: the sample's magnitude of rank ``k (m + 1) / n`` (largest first), plus a margin of
   ``MARGIN_SIGMAS`` standard deviations so that a little more than ``k`` reach it; one pass
   over the tensor compacts them (``ccfx.codecs._sparse``'s packed compaction);
3. *adjust* (RedSync's binary search on the count): while the count is more than
   ``TOLERANCE * k`` away from ``k``, the next cut is another sample magnitude, by a secant
   step on the count inside a bracket of sample ranks (bisection when the step leaves it).
   A cut above the lowest one compacted is counted over its candidates only; a lower one
   costs another pass (``PASSES`` in all). At most ``PROBES`` cuts after the first.

What reaches the final cut is sent; more than ``capacity`` (ties at the cut: zeros are never
selected, but a tensor of few distinct values can tie many) keep the largest ``capacity``, by a
topk over the candidates. The count is distribution-free (it depends on ranks, not values):
heavy tails change nothing. It lands within ``TOLERANCE`` of ``k`` unless ties or the search's
limits stop it first (see tests/test_codec_redsync.py for the figures).

Format: values (input dtype), int32 indices in ascending order and a 1-element int32 ``count``,
``capacity = min(n, ceil(margin * k))`` slots; slots past ``count`` hold 0 at index 0 and decode
to nothing. Wire bytes count the capacity, as ``threshold``'s do (the payload's size must follow
from the shape alone): ``capacity * (itemsize + 4) + 4``, 0.025 of fp32 at density 0.01 and
margin 1.25 (``topk``: 0.02). Kept entries are exact, the rest decode to 0: use ``ef``. NaN and
±inf rank above every finite magnitude and propagate.

The achieved density, ``count / n``, is state beside the ``step`` counter: ``density`` (the
last encode's) and ``density_sum`` (over ``step`` encodes). :func:`achieved` reads a codec's,
:func:`densities` every channel's in a holder's state dict
(``ccfx.codec_state(compiled).state_dict()``). (Collectives and the ring all-reduce take only
codecs whose state is a ``step``, so they refuse this one: use it on gradient buckets and cuts.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from . import _sparse
from ._random import key, take_step, uniform
from .base import Codec, Context, Encoded, numel_of
from .registry import register

#: Sampled magnitudes per encode (under torch's parallel grain size, as ``_sparse.SAMPLE``).
SAMPLE = _sparse.SAMPLE
#: The search stops once the count is within ``TOLERANCE * k`` of ``k``.
TOLERANCE = 0.1
#: The first cut's margin, in standard deviations of the sample count (see first_rank).
MARGIN_SIGMAS = 3.0
#: Cuts probed after the first, at most.
PROBES = 6
#: Passes over the tensor at most (each compacts at a cut lower than any before).
PASSES = 2


def sample_positions(n: int, m: int, noise_key: torch.Tensor) -> torch.Tensor:
    """``m`` int64 positions in ``[0, n)``, one uniformly drawn in each stratum
    ``[floor(i n / m), floor((i + 1) n / m))``, from the counter-based hash (same on every
    device). Integer arithmetic: ``uniform``'s 24-bit draws times a stratum's length, shifted."""
    device = noise_key.device
    bounds = torch.arange(m + 1, dtype=torch.int64, device=device) * n // m
    lengths = bounds[1:] - bounds[:-1]
    draws = (uniform(torch.arange(m, dtype=torch.int64, device=device), noise_key)
             * 2.0**24).to(torch.int64)
    return bounds[:-1] + ((draws * lengths) >> 24)


def _sample(flat: torch.Tensor, noise_key: torch.Tensor) -> torch.Tensor:
    """Magnitudes of the sample: the whole tensor when it has at most ``SAMPLE`` entries."""
    n = flat.numel()
    if n <= SAMPLE:
        return _sparse.magnitude(flat)
    return _sparse.magnitude(flat.index_select(0, sample_positions(n, SAMPLE, noise_key)))


def _cut_at(sample: torch.Tensor, rank: int) -> torch.Tensor:
    """The sample's ``rank``-th largest magnitude (``1 <= rank <= m``), a 0-d tensor."""
    return torch.kthvalue(sample, sample.numel() + 1 - rank).values


def _reaching(flat: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """Ascending indices of the entries whose magnitude reaches ``cut``; nonzero ones only,
    so a cut of 0 does not select zeros."""
    return _sparse._compact(flat, cut, strict=bool(cut == 0))


def _passing(mag: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """Bool mask of the magnitudes that reach ``cut`` (above it, for a cut of 0)."""
    return mag > cut if bool(cut == 0) else mag >= cut


def first_rank(k: int, n: int, m: int) -> int:
    """The sample rank whose magnitude a little more than ``k`` of ``n`` entries reach: the
    share of a population above the ``r``-th largest of ``m`` samples is about ``r / (m + 1)``,
    plus ``MARGIN_SIGMAS`` standard deviations of the sample count, so that the probes after
    the first pass need not pass again. Exactly ``k`` when the sample is the whole tensor."""
    if m == n:
        return k
    mean = k * (m + 1) / n
    return min(m, max(1, math.ceil(mean + MARGIN_SIGMAS * math.sqrt(mean))))


def next_rank(rank: int, reached: int, k: int, lo: int, hi: int) -> int | None:
    """The next sample rank to probe, strictly between the bracket's ranks ``lo`` (too few
    reach) and ``hi`` (too many): the secant step to ``k`` from ``reached`` at ``rank``, or
    the bracket's middle when the secant leaves it; None when no rank is left between."""
    if hi - lo < 2:
        return None
    guess = round(rank * k / reached) if reached else 2 * rank
    return guess if lo < guess < hi else (lo + hi) // 2


class _Probe:
    """The search's state: the lowest cut compacted so far with its candidates (a superset of
    the entries reaching any higher cut, so probing one costs a pass over them only)."""

    def __init__(self, flat: torch.Tensor, cut: torch.Tensor):
        self.flat, self.passes = flat, 0
        self._compact(cut)

    def _compact(self, cut: torch.Tensor) -> None:
        self.cut, self.passes = cut, self.passes + 1
        self.idx = _reaching(self.flat, cut)
        self.values = self.flat.index_select(0, self.idx)
        self.mag = _sparse.magnitude(self.values)

    def count(self, cut: torch.Tensor) -> int:
        """How many entries reach ``cut``: a new pass over the tensor below the lowest cut."""
        if bool(cut < self.cut):
            self._compact(cut)
            return self.idx.numel()
        return int(_passing(self.mag, cut).sum())

    def reaching(self, cut: torch.Tensor):
        """``(indices, values)`` of the entries that reach ``cut`` (not below the lowest cut),
        indices ascending."""
        if cut is self.cut:
            return self.idx, self.values
        keep = _passing(self.mag, cut).nonzero().view(-1)
        return self.idx.index_select(0, keep), self.values.index_select(0, keep)


def _split_gap(probe: _Probe, low: torch.Tensor, high: torch.Tensor | None, need: int):
    """The cut that lets ``need`` more entries through than ``high`` does (None: +inf, none
    through), taken among the candidates in ``[low, high)``: adjacent sample magnitudes whose
    gap holds the count's target. A kthvalue over a few ``n / m`` entries, no full sort."""
    inside = _passing(probe.mag, low)
    if high is not None:
        inside &= probe.mag < high
    gap = probe.mag[inside]
    return torch.kthvalue(gap, gap.numel() + 1 - need).values


def _search(probe: _Probe, sample: torch.Tensor, k: int, rank: int) -> torch.Tensor:
    """The final cut (see the module docstring): sample ranks bracket the search, ``lo``
    letting too few entries through (at the cut ``few``), ``hi`` too many."""
    m = sample.numel()
    cut, count = probe.cut, probe.idx.numel()
    lo, hi, few = 0, m + 1, None
    for _ in range(PROBES):
        if abs(count - k) <= TOLERANCE * k:
            break
        if count < k:
            lo, few = rank, (cut, count)
        else:
            hi = rank
        rank = next_rank(rank, count, k, lo, hi)
        if rank is None:  # adjacent ranks: the target lies in the gap between their cuts
            if hi <= m:
                high, through = few if few is not None else (None, 0)
                cut = _split_gap(probe, _cut_at(sample, hi), high, k - through)
            break
        nxt = _cut_at(sample, rank)
        if bool(nxt < probe.cut) and probe.passes == PASSES:
            break
        cut, count = nxt, probe.count(nxt)
    return cut


def select(flat: torch.Tensor, k: int, capacity: int, noise_key: torch.Tensor):
    """``(indices, values)`` of the selected entries of the 1-D ``flat`` (int64 indices,
    ascending; at most ``capacity``): the module docstring's method."""
    flat = flat.contiguous()
    if k >= flat.numel():  # density 1: everything
        return torch.arange(flat.numel(), device=flat.device), flat
    sample = _sample(flat, noise_key)
    rank = first_rank(k, flat.numel(), sample.numel())
    probe = _Probe(flat, _cut_at(sample, rank))
    cut = _search(probe, sample, k, rank)
    idx, values = probe.reaching(cut)
    if idx.numel() > capacity:  # ties at the cut: the largest, then the first ties
        idx, values = _sparse._keep_largest(flat, idx, capacity, cut)
    return idx, values


def _capacity_of(n, k, margin: float):
    """``min(n, ceil(margin * k))`` for ints, SymInts (fake-tensor shapes) and sympy sizes."""
    c = _sparse.count(k, margin)
    if isinstance(n, int):
        return min(n, c)
    if isinstance(n, torch.SymInt):
        return torch.sym_min(n, c)
    import sympy  # symbolic sizes only, as ccfx.codecs.base.ceil_div

    return sympy.Min(n, c)


def redsync_encode(x: torch.Tensor, k: int, capacity: int, noise_key: torch.Tensor):
    """``(values, int32 indices, count)``: the selection in ``capacity`` slots, zero-padded."""
    flat = x.reshape(-1)
    padded = torch.zeros(capacity, dtype=flat.dtype, device=flat.device)
    slots = torch.zeros(capacity, dtype=_sparse.INDEX_DTYPE, device=flat.device)
    kept = 0
    if flat.numel():
        idx, values = select(flat, k, capacity, noise_key)
        kept = idx.numel()
        padded[:kept].copy_(values)
        slots[:kept].copy_(idx)  # int64 to int32 in the copy
    return padded, slots, torch.tensor([kept], dtype=torch.int32, device=flat.device)


@register
@dataclass(frozen=True)
class RedSync(Codec):
    name = "redsync"
    summary = "magnitudes above a sampled cut (RedSync): ~density * n kept, fixed capacity"
    stateful = True
    density: float = 0.01
    margin: float = 1.25
    seed: int = 0

    def __post_init__(self):
        _sparse.check_ratio("density", self.density)
        if not self.margin >= 1:
            raise ValueError(f"margin (capacity over density * n) must be >= 1, got "
                             f"{self.margin}: the payload must hold the target count")

    def payload_layout(self, shape, dtype):
        n = numel_of(shape)
        c = _capacity_of(n, _sparse.count(n, self.density), self.margin)
        return (((c,), dtype), ((c,), _sparse.INDEX_DTYPE), ((1,), torch.int32))

    def state_layout(self, shape, dtype):
        return {"step": ((), torch.int64), "density": ((), torch.float64),
                "density_sum": ((), torch.float64)}

    def encode_with(self, x, state):
        n = x.numel()
        _sparse.check_indexable(n)
        k = _sparse.count(n, self.density)
        capacity = _capacity_of(n, k, self.margin)
        noise_key = key(self.seed, take_step(state), x.device)
        payload = redsync_encode(x, k, capacity, noise_key)
        share = payload[2].to(torch.float64) / max(n, 1)
        state["density"].copy_(share.view(()))
        state["density_sum"].add_(share.view(()))
        return Encoded(payload, Context(tuple(x.shape), x.dtype))

    def decode_with(self, enc, state):
        values, idx, _count = enc.payload
        return _sparse.scatter(values, idx, enc.ctx.shape, enc.ctx.dtype)


def achieved(state: Mapping[str, torch.Tensor]) -> dict:
    """A redsync codec's achieved density from its state (``codec.state_dict()``): the last
    encode's ``count / n``, the mean over its encodes, and how many there were."""
    steps = int(state["step"])
    return {"last": float(state["density"]), "steps": steps,
            "mean": float(state["density_sum"]) / steps if steps else 0.0}


def densities(state_dict: Mapping[str, torch.Tensor]) -> dict[str, dict]:
    """:func:`achieved` for every channel of a holder's state dict that holds a redsync
    codec's state (``<channel>.density_sum`` and its siblings), by channel name."""
    out = {}
    for name in state_dict:
        channel, _, leaf = name.rpartition(".")
        if leaf == "density_sum" and channel:
            out[channel] = achieved({k: state_dict[f"{channel}.{k}"]
                                     for k in ("step", "density", "density_sum")})
    return out
