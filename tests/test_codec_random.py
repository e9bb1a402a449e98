"""The counter-based uniform behind qsgd and terngrad (``ccfx.codecs._random``): the hash is
lowbias32 exactly, its output is uniform enough for stochastic rounding, it is the same bits
eager and compiled, and a new step does not recompile the codec."""

import math
import random

import pytest
import torch

from ccfx import codecs
from ccfx.codecs import _random
from ccfx.errors import CodecError

M32 = (1 << 32) - 1
N = 1 << 20


def lowbias32_reference(x: int) -> int:
    """Wellons' C code on Python ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _words(count=20000, seed=0):
    """Edge values (limb and sign boundaries) and random 32-bit words."""
    rng = random.Random(seed)
    edges = [0, 1, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, M32 - 1, M32]
    return edges + [rng.getrandbits(32) for _ in range(count)]


def test_both_hash_forms_are_lowbias32():
    words = _words()
    want = [lowbias32_reference(w) for w in words]
    x = torch.tensor(words)
    assert _random.lowbias32(x).tolist() == want
    hi, lo = _random.lowbias32_limbs((x >> 16).int(), (x & 0xFFFF).int())
    assert ((hi.long() << 16) | lo.long()).tolist() == want


def test_uniform_is_the_top_24_bits_of_two_keyed_rounds():
    words = _words(2000, seed=1)
    k = _random.key(3, 7)
    lo, hi = int(k) & M32, (int(k) >> 32) & M32
    want = [lowbias32_reference(lowbias32_reference(w ^ lo) ^ hi) >> 8 for w in words]
    got = _random.uniform(torch.tensor(words), k) * 2**24
    assert got.long().tolist() == want


@pytest.mark.parametrize("seed,step", [(0, 0), (1, 0), (0, 12345)])
def test_uniform_in_range_and_uniform(seed, step):
    """1 M draws from sequential indices, bounds at about 6 sigma (p ~ 1e-9 per check for a
    truly uniform source): mean 1/2 within 6 * sqrt(1/12 / N), variance 1/12 within
    6 * sqrt(1/180 / N), lag-1 correlation within 6 / sqrt(N), and a chi-square over 16 equal
    bins (15 degrees of freedom) below 60 (p ~ 1e-7)."""
    u = _random.uniform(torch.arange(N), _random.key(seed, step)).double()
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / 12 / N)
    assert abs(u.var() - 1 / 12) < 6 * math.sqrt(1 / 180 / N)
    c = u - u.mean()
    assert abs((c[1:] * c[:-1]).mean() / c.var()) < 6 / math.sqrt(N)
    counts = torch.bincount((u * 16).long(), minlength=16).double()
    chi2 = ((counts - N / 16) ** 2 / (N / 16)).sum()
    assert chi2 < 60


def test_uniform_differs_across_keys_and_indices():
    n = 1 << 16
    idx = torch.arange(n)
    streams = [_random.uniform(idx, _random.key(s, t)) for s, t in [(0, 0), (0, 1), (1, 0)]]
    # 24-bit outputs: two independent streams agree at about n / 2**24 = 0.004 places.
    for a in range(3):
        for b in range(a):
            assert int((streams[a] == streams[b]).sum()) <= 3
    # Within a stream, about n**2 / 2**25 = 128 repeats among n draws.
    assert streams[0].unique().numel() > n - 400
    assert torch.equal(streams[0], _random.uniform(idx, _random.key(0, 0)))


def test_keys_distinct_over_seeds_and_steps():
    keys = {int(_random.key(s, t)) for s in range(-5, 50) for t in range(200)}
    assert len(keys) == 55 * 200


def test_uniform_same_bits_eager_and_compiled():
    """Compiled runs the int32-limb form, eager the int64 form: they must agree everywhere,
    including indices past 2**32 (taken modulo 2**32) and negative keys."""
    compiled = torch.compile(_random.uniform, dynamic=False)
    idx = torch.cat([torch.arange(5000), torch.tensor(_words(5000, seed=2)),
                     torch.tensor([1 << 32, (1 << 32) + 5, (1 << 40) + 3])])
    for seed, step in [(0, 0), (-1, 3), (2**40, 2**33)]:
        k = _random.key(seed, step)
        assert torch.equal(compiled(idx, k), _random.uniform(idx, k))
    assert torch.equal(_random.uniform(idx[-3:], k), _random.uniform(idx[-3:] & M32, k))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_same_noise_and_codes_on_cuda():
    """The torch references run unchanged on CUDA tensors, eagerly, and draw the same noise."""
    from ccfx.codecs.qsgd import qsgd_encode_reference
    from ccfx.codecs.terngrad import terngrad_encode_reference

    idx = torch.cat([torch.arange(5000), torch.tensor(_words(5000, seed=3))])
    k = _random.key(7, 9)
    assert torch.equal(_random.uniform(idx.cuda(), k.cuda()).cpu(), _random.uniform(idx, k))
    x = torch.randn(3000)
    for block in [256, 7]:
        want = terngrad_encode_reference.eager(x, k, block)
        got = terngrad_encode_reference.eager(x.cuda(), k.cuda(), block)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True))
        q, norms = qsgd_encode_reference.eager(x.cuda(), k.cuda(), block, 127, torch.int8)
        want_q, want_norms = qsgd_encode_reference.eager(x, k, block, 127, torch.int8)
        torch.testing.assert_close(norms.cpu(), want_norms, rtol=1e-6, atol=0)
        assert int((q.cpu() != want_q).sum()) <= 3  # a norm an ulp apart moves a level by one


@pytest.mark.parametrize("spec", ["qsgd", "terngrad"])
def test_new_steps_do_not_recompile(spec, monkeypatch):
    """The key is a tensor argument of the compiled encode: steps 1.. reuse step 0's code."""
    monkeypatch.setenv("CCFX_CODEC_COMPILE", "1")
    x = torch.randn(3000)
    codec = codecs.get(spec)
    first = codec.encode(x)
    with torch._dynamo.config.patch(error_on_recompile=True):
        later = [codec.encode(x) for _ in range(3)]
    assert not torch.equal(first.payload[0], later[0].payload[0])
    eager = codecs.get(spec)
    monkeypatch.setenv("CCFX_CODEC_COMPILE", "0")
    for want in [first, *later]:
        got = eager.encode(x)
        torch.testing.assert_close(got.payload[1], want.payload[1], rtol=1e-6, atol=0)
        if spec == "terngrad":  # absmax scales are exact in any order: same codes
            assert torch.equal(got.payload[0], want.payload[0])
        else:  # a norm one ulp apart can move a level by one
            assert int((got.payload[0] != want.payload[0]).sum()) <= 3


@pytest.mark.parametrize("spec", ["qsgd:levels=4,block=16", "terngrad:block=8"])
def test_fresh_per_call_deterministic_per_seed(spec):
    x = torch.randn(50, 20)
    a, b, other = codecs.get(spec), codecs.get(spec), codecs.get(spec + ",seed=1")
    ya = [a.roundtrip(x) for _ in range(3)]
    assert not torch.equal(ya[0], ya[1])
    assert all(torch.equal(y, b.roundtrip(x)) for y in ya)
    assert not torch.equal(ya[0], other.roundtrip(x))


@pytest.mark.parametrize("spec", ["qsgd", "terngrad"])
def test_more_than_2_32_elements_refused_before_the_step_advances(spec):
    codec = codecs.get(spec)
    huge = torch.zeros(1).expand((1 << 32) + 1)  # no storage behind it
    with pytest.raises(CodecError, match=r"at most 2\*\*32 elements"):
        codec.encode(huge)
    assert int(codec.state_dict()["step"]) == 0
