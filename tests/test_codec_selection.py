"""The CPU selection of ``topk`` and ``threshold`` (``ccfx.codecs._sparse.largest``: a sampled
cut-off, a compaction pass, a topk over the candidates) against ``torch.topk``.

Exactness, no tolerance: the selected magnitudes are, as a multiset, the ``k`` largest (ties may
be broken either way, as torch.topk breaks them), the values are the input's at the chosen
indices, the indices are distinct and ascending. The data includes what defeats the sample (the
large values where it does not look, or only where it looks), ties, NaN and inf; sizes of 2**20
and more take the inductor-compiled mask (``CCFX_CODEC_COMPILE=1`` forces it at any size), and
a size that is not a multiple of 8 exercises the packed mask's tail.
"""

from __future__ import annotations

import pytest
import torch

from ccfx import codecs
from ccfx.codecs import _sparse
from ccfx.codecs.threshold import threshold_encode_compact, threshold_encode_reference
from ccfx.codecs.topk import topk_encode_reference, topk_encode_sampled

N = 2**20 + 3  # large enough to sample; 3 past a multiple of 8
NAN, INF = float("nan"), float("inf")


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.setenv("CCFX_CODEC_COMPILE", "1")


@pytest.fixture
def spy(monkeypatch):
    """Records how the selection went: the size of each compaction, and whether the exact
    fallback ran (its own compaction at ``tau`` included)."""
    calls = {"compactions": [], "exact": 0}
    compact, exact = _sparse._compact, _sparse._exact

    def _compact(flat, cut, strict=False):
        idx = compact(flat, cut, strict)
        calls["compactions"].append(idx.numel())
        return idx

    def _exact(*args):
        calls["exact"] += 1
        return exact(*args)

    monkeypatch.setattr(_sparse, "_compact", _compact)
    monkeypatch.setattr(_sparse, "_exact", _exact)
    return calls


def check_largest(flat, k, above=None):
    """``largest`` selects the k largest magnitudes (of those > above) exactly."""
    idx, values = _sparse.largest(flat, k, above)
    assert idx.dtype == torch.long and values.dtype == flat.dtype
    assert (idx[1:] > idx[:-1]).all(), "indices not distinct and ascending"
    torch.testing.assert_close(values, flat[idx], rtol=0, atol=0, equal_nan=True)
    mag = _sparse.magnitude(flat)
    if above is not None:
        mag = mag[mag > above]
    want = torch.topk(mag, min(k, mag.numel())).values
    got = _sparse.magnitude(values).sort(descending=True).values
    assert torch.equal(got, want)
    return idx


def _randn(n=N, seed=0, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _stride(n=N):
    return max(_sparse.MIN_STRIDE, n // _sparse.SAMPLE) | 1


# %% topk: the sampled path on data it estimates well


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_random_data_takes_one_compaction(compiled, spy, dtype):
    x = _randn(dtype=dtype)
    k = _sparse.count(N, 0.01)
    check_largest(x, k)
    assert spy["exact"] == 0 and len(spy["compactions"]) == 1
    assert k <= spy["compactions"][0] < 1.5 * k  # ~1.2 k candidates


@pytest.mark.parametrize("ratio", [0.001, 0.05, 0.2, 0.5])
def test_ratios(compiled, ratio):
    check_largest(_randn(seed=1), _sparse.count(N, ratio))


def test_eager_mask_gives_the_same_selection(monkeypatch):
    x = _randn(seed=2)
    k = _sparse.count(N, 0.01)
    monkeypatch.setenv("CCFX_CODEC_COMPILE", "0")
    eager = check_largest(x, k)
    monkeypatch.setenv("CCFX_CODEC_COMPILE", "1")
    assert torch.equal(check_largest(x, k), eager)  # no ties in this data: the same indices


def test_codec_payload_equals_torch_topk(compiled):
    x = _randn(2**20, seed=3).view(1024, -1)[:, :1000].t()  # non-contiguous, 2-D
    k = _sparse.count(x.numel(), 0.01)
    values, idx = topk_encode_sampled(x, k)
    ref_values, ref_idx = topk_encode_reference(x, k)
    assert idx.dtype == torch.int32 and values.shape == ref_values.shape
    assert torch.equal(idx.sort().values, ref_idx.sort().values)  # no ties: the same set
    flat = x.reshape(-1)
    assert torch.equal(values, flat[idx.long()])
    codec = codecs.get("topk")
    y = codec.decode(codec.encode(x))
    assert torch.equal(y.reshape(-1)[idx.long()], values) and int((y != 0).sum()) == k


# %% topk: data that defeats the sample


def test_large_values_only_where_the_sample_does_not_look(compiled, spy):
    """The sample sees small values: the cut is low, more candidates, the same answer."""
    x = _randn(seed=4) * 1e-3
    k = _sparse.count(N, 0.01)
    unsampled = torch.arange(N)
    unsampled = unsampled[unsampled % _stride() != 0][:k]
    x[unsampled] = 100 + torch.rand(k)
    idx = check_largest(x, k)
    assert torch.equal(idx, unsampled)
    assert spy["exact"] == 0


def test_sample_sees_only_large_values_and_retries(compiled, spy):
    """The sample overestimates the density of large values: too few reach the first cut, the
    second (deeper, from the count observed) gathers enough."""
    x = _randn(seed=5)
    x[:: _stride()] = x[:: _stride()].abs() + 1
    check_largest(x, _sparse.count(N, 0.01))
    assert spy["exact"] == 0 and len(spy["compactions"]) == 2
    assert spy["compactions"][0] < _sparse.count(N, 0.01) <= spy["compactions"][1]


def test_sample_cannot_go_lower_falls_back_to_torch_topk(compiled, spy):
    """Every sampled value equal and above the rest, and fewer of them than k."""
    x = _randn(seed=6)
    x[:: _stride()] = 100.0
    k = _sparse.count(N, 0.05)
    assert k > x[:: _stride()].numel()
    check_largest(x, k)
    assert spy["exact"] == 1


@pytest.mark.parametrize("name", ["all equal", "four levels", "mostly zeros", "signed ties"])
def test_ties(compiled, spy, name):
    g = torch.Generator().manual_seed(7)
    x = {
        "all equal": lambda: torch.full((N,), 0.5),
        "four levels": lambda: torch.randint(0, 4, (N,), generator=g).float(),
        "mostly zeros": lambda: torch.where(torch.rand(N, generator=g) < 0.005,
                                            torch.randn(N, generator=g), torch.zeros(N)),
        "signed ties": lambda: torch.randint(-2, 3, (N,), generator=g).float(),
    }[name]()
    check_largest(x, _sparse.count(N, 0.01))
    assert spy["exact"] == 0  # ties at the cut are settled without the full topk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nan_and_inf_are_selected_first(compiled, dtype):
    x = _randn(seed=8, dtype=dtype)
    special = torch.tensor([3, 1000, 77777, N - 1, N - 2])
    x[special] = torch.tensor([NAN, INF, -INF, NAN, -0.0], dtype=dtype)
    idx = check_largest(x, _sparse.count(N, 0.01))
    assert set(special[:4].tolist()) <= set(idx.tolist())


def test_more_nan_than_k(compiled, spy):
    x = _randn(seed=9)
    x[::40] = NAN  # 2.5% NaN, k = 1%: every selected entry is NaN (ranked as +inf)
    idx = check_largest(x, _sparse.count(N, 0.01))
    assert torch.isnan(x[idx]).all()
    assert spy["exact"] == 0


def test_fp16_overflow_ties_at_inf(compiled):
    x = _randn(seed=10).mul(3e4).half()  # a few percent overflow to ±inf
    check_largest(x, _sparse.count(N, 0.01))


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 9, 1000])
@pytest.mark.parametrize("ratio", [0.01, 0.5, 1.0])
def test_tiny_sizes_through_the_codec(compiled, n, ratio):
    x = _randn(n, seed=n)
    codec = codecs.get(f"topk:ratio={ratio}")
    values, idx = codec.encode(x).payload
    k = _sparse.count(n, ratio)
    assert values.shape == (k,) and idx.shape == (k,) and idx.dtype == torch.int32
    want = torch.topk(x.abs(), k).values
    assert torch.equal(values.abs().sort(descending=True).values, want)
    assert torch.equal(codec.decode(codec.encode(x)).reshape(-1)[idx.long()], values)


def test_past_the_recompile_limit_the_plain_mask_runs(compiled, monkeypatch):
    """One compile per shape: past the fast path's recompile limit (``_fast.RECOMPILE_LIMIT``)
    the packing function runs eagerly, where it would cost 8 strided passes, so it declines and
    the plain mask runs instead."""
    from ccfx.codecs import _fast

    monkeypatch.setattr(_fast, "RECOMPILE_LIMIT", 1)
    packed = []
    reach_bits = _sparse._reach_bits

    def spy(*args):
        out = reach_bits(*args)
        packed.append(out is not None)
        return out

    monkeypatch.setattr(_sparse, "_reach_bits", spy)
    for n in (4096, 4096 + 8):
        check_largest(_randn(n, seed=n), 100, above=torch.tensor(0.1))
    assert packed == [True, False]


def test_ratio_one_keeps_everything(compiled):
    x = _randn(seed=11)
    idx = check_largest(x, N)
    assert torch.equal(idx, torch.arange(N))


@pytest.mark.parametrize("seed", range(40))
def test_small_tensors_with_a_tight_sample(monkeypatch, seed):
    """Sampling at every size, every entry sampled or none skipped, no margin: the first cut is
    often too high, so retries and fallbacks run on odd shapes, ties and NaN."""
    monkeypatch.setattr(_sparse, "SAMPLED_MIN_NUMEL", 0)
    monkeypatch.setattr(_sparse, "MIN_STRIDE", [1, 2, 3][seed % 3])
    monkeypatch.setattr(_sparse, "MARGIN_SIGMAS", 0.0)
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 3000, (1,), generator=g))
    x = torch.randn(n, generator=g)
    if seed % 4 == 1:
        x = x.round()  # ties
    if seed % 4 == 2:
        x[torch.randint(0, n, (max(1, n // 50),), generator=g)] = NAN
    for ratio in (0.01, 0.1, 0.3):
        check_largest(x, _sparse.count(n, ratio))
        check_largest(x, _sparse.count(n, ratio), above=torch.tensor(0.5))


# %% threshold


def _expected_threshold(x, tau, capacity):
    """The payload spelled out: the entries with magnitude > tau (tau in x's dtype), by
    magnitude descending then index ascending, when they fit."""
    flat = x.reshape(-1)
    mag = _sparse.magnitude(flat)
    idx = (mag > torch.tensor(tau, dtype=x.dtype)).nonzero().view(-1)
    assert idx.numel() <= capacity
    idx = idx[torch.sort(mag[idx], descending=True, stable=True).indices]
    values = torch.zeros(capacity, dtype=x.dtype)
    values[: idx.numel()] = flat[idx]
    slots = torch.zeros(capacity, dtype=torch.int32)
    slots[: idx.numel()] = idx.int()
    return values, slots, torch.tensor([idx.numel()], dtype=torch.int32)


def _assert_payloads_equal(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _canonical(values, idx, count):
    """Kept slots by magnitude descending, then index ascending (ties in any order before)."""
    c = int(count)
    order = torch.sort(idx[:c].long(), stable=True).indices
    v, i = values[:c][order], idx[:c][order]
    order = torch.sort(_sparse.magnitude(v), descending=True, stable=True).indices
    return torch.cat([v[order], values[c:]]), torch.cat([i[order], idx[c:]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_threshold_under_capacity_is_the_compaction_order(compiled, dtype):
    x = _randn(2**20, seed=12, dtype=dtype).mul(3).view(1024, -1)
    x.view(-1)[[5, 99, 4000]] = torch.tensor([NAN, -INF, 9.0], dtype=dtype)
    capacity = _sparse.count(x.numel(), 0.01)
    got = threshold_encode_compact(x, 8.0, capacity)  # ~0.8% pass, many ties in fp16/bf16
    _assert_payloads_equal(got, _expected_threshold(x, 8.0, capacity))
    ref = threshold_encode_reference(x, 8.0, capacity)
    _assert_payloads_equal(got, (*_canonical(*ref), ref[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_threshold_over_capacity_keeps_the_largest(compiled, spy, dtype):
    x = _randn(seed=13, dtype=dtype)
    capacity = _sparse.count(N, 0.01)
    got = threshold_encode_compact(x, 0.01, capacity)  # ~99% pass
    assert int(got[2]) == capacity
    ref = threshold_encode_reference(x, 0.01, capacity)
    assert torch.equal(_sparse.magnitude(got[0]), _sparse.magnitude(ref[0]))  # sorted alike
    assert torch.equal(got[0], x[got[1].long()])
    assert torch.equal(_canonical(*got)[1], got[1]), "ties not in ascending index order"
    # A sampled cut above tau, one compaction of ~1.2 capacity: not the whole tensor.
    assert spy["exact"] == 0 and max(spy["compactions"]) < 1.5 * capacity


def test_threshold_sparse_pass_compacts_at_tau(compiled, spy):
    x = _randn(seed=14)
    capacity = _sparse.count(N, 0.01)
    got = threshold_encode_compact(x, 3.5, capacity)  # ~0.05% pass: tau is the tighter cut
    _assert_payloads_equal(got, _expected_threshold(x, 3.5, capacity))
    assert spy["exact"] == 1 and spy["compactions"] == [int(got[2])]


@pytest.mark.parametrize("tau", [100.0, 1e6])
def test_threshold_none_pass(compiled, tau):
    x = _randn(seed=15).half()
    x[7] = NAN  # NaN passes a finite tau (as +inf), not a tau that rounds to inf in fp16
    capacity = _sparse.count(N, 0.01)
    got = threshold_encode_compact(x, tau, capacity)
    assert int(got[2]) == (1 if tau == 100.0 else 0)
    _assert_payloads_equal(got, _expected_threshold(x, tau, capacity))
    _assert_payloads_equal(got, threshold_encode_reference(x, tau, capacity))


@pytest.mark.parametrize("n", [0, 1, 9, 300])
@pytest.mark.parametrize("tau,cap", [(0.0, 1.0), (0.5, 0.05), (1.5, 0.5)])
def test_threshold_small_sizes_equal_the_reference(n, tau, cap):
    x = _randn(n, seed=16).round()  # ties
    capacity = _sparse.count(n, cap)
    got = threshold_encode_compact(x, tau, capacity)
    ref = threshold_encode_reference(x, tau, capacity)
    assert torch.equal(got[2], ref[2])
    _assert_payloads_equal(got, (*_canonical(*got), got[2]))
    if int((x.abs() > tau).sum()) <= capacity:
        _assert_payloads_equal(got, (*_canonical(*ref), ref[2]))
    else:  # which of the tied entries at the boundary fill the capacity is unspecified
        assert torch.equal(got[0].abs(), ref[0].abs())
        assert torch.equal(got[0], x[got[1].long()])


# %% dispatch, decode


def test_cpu_tensors_take_the_sampled_path_unless_the_reference_is_asked_for():
    x = torch.randn(8)
    topk, threshold = codecs.get("topk"), codecs.get("threshold")
    assert topk._impl(x) is topk_encode_sampled
    assert threshold._impl(x) is threshold_encode_compact
    with codecs.implementation("reference"):
        assert topk._impl(x) is topk_encode_reference
        assert threshold._impl(x) is threshold_encode_reference


def test_decode_of_both_payload_orders_is_the_same():
    x = _randn(5000, seed=17)
    codec = codecs.get("topk:ratio=0.1")
    y = codec.decode(codec.encode(x))
    with codecs.implementation("reference"):
        assert torch.equal(codec.decode(codec.encode(x)), y)


def test_by_magnitude_is_stable_and_descending():
    v = torch.tensor([1.0, -3.0, NAN, 3.0, 0.0, -INF, 1.0, -0.0])
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        order = _sparse.by_magnitude(v.to(dtype)).tolist()
        assert order == [2, 5, 1, 3, 0, 6, 4, 7]
