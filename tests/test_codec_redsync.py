"""``redsync``: a cut estimated from a seeded sample, adjusted on the count (RedSync's trimmed
top-k). What it sends is exactly what reaches the cut; the count lands within ``TOLERANCE`` of
the target whatever the distribution; the sample is a function of (seed, step); the achieved
density is the codec's state, per channel under compile; with ``ef`` it is error feedback."""

import math

import pytest
import torch

from ccfx import codecs
from ccfx.codecs import ops, redsync
from ccfx.codecs._random import key
from ccfx.codecs.redsync import TOLERANCE, densities, first_rank, next_rank, sample_positions

from . import toy_models as models
from .util import compile_ccfx, loss_of

# Odd sizes over redsync.SAMPLE (32767): the sampled path, strata of uneven length.
SIZES = [100_003, 333_331]


def _gaussian(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _heavy(n, seed=0):
    """Cauchy magnitudes over ~9 decades, and a log-normal cubed: heavy tails both."""
    g = torch.Generator().manual_seed(seed)
    cauchy = torch.tan(math.pi * (torch.rand(n, generator=g) - 0.5))
    return torch.where(torch.rand(n, generator=g) < 0.5, cauchy,
                       torch.randn(n, generator=g).exp().pow(3) * torch.randn(n, generator=g))


def _parts(enc):
    values, idx, count = enc.payload
    return values, idx.long(), int(count)


def test_decode_keeps_exactly_the_entries_that_reach_the_cut():
    x = _gaussian(SIZES[0])
    codec = codecs.get("redsync:density=0.01")
    enc = codec.encode(x)
    values, idx, count = _parts(enc)
    sent = idx[:count]
    assert torch.equal(sent, sent.unique())  # ascending, distinct
    assert torch.equal(values[:count], x[sent])
    # the padding: value 0 at index 0, which decodes to nothing
    assert not values[count:].any() and not idx[count:].any()
    y = codec.decode(enc)
    kept = torch.zeros(x.numel(), dtype=torch.bool)
    kept[sent] = True
    assert torch.equal(y[kept], x[kept]) and not y[~kept].any()
    # a threshold, not a pick: every entry at least as large as the smallest sent is sent
    assert torch.equal(kept, x.abs() >= x[sent].abs().min())


@pytest.mark.parametrize("make", [_gaussian, _heavy], ids=["gaussian", "heavy-tailed"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_achieved_density_within_tolerance(make, n, density):
    """The count is within TOLERANCE (10 %) of k at every step, and the achieved density the
    state reports is that count over n."""
    x = make(n)
    codec = codecs.get(f"redsync:density={density}")
    k = math.ceil(density * n)
    counts = []
    for _ in range(12):
        count = _parts(codec.encode(x))[2]
        assert abs(count - k) <= TOLERANCE * k, (count, k)
        assert float(codec.state_dict()["density"]) == count / n
        counts.append(count)
    got = redsync.achieved(codec.state_dict())
    assert got["steps"] == 12
    assert got["mean"] == pytest.approx(sum(counts) / 12 / n, rel=1e-12)
    assert len(set(counts)) > 1  # a fresh sample each step


def test_a_tensor_within_one_sample_sends_exactly_k():
    """Up to SAMPLE entries the sample is the tensor: the k largest, as topk sends them."""
    x = _gaussian(1001)
    _, idx, count = _parts(codecs.get("redsync:density=0.05").encode(x))
    want = torch.topk(x.abs(), 51).indices.sort().values
    assert count == 51 and torch.equal(idx[:count], want)


def test_same_seed_and_step_same_payload_on_reruns():
    x = _heavy(SIZES[1])
    a, b = codecs.get("redsync:seed=3"), codecs.get("redsync:seed=3")
    other = codecs.get("redsync:seed=4")
    differ = 0
    for _ in range(3):
        pa, pb, pc = (_parts(codec.encode(x)) for codec in (a, b, other))
        assert pa[2] == pb[2] and torch.equal(pa[1], pb[1]) and torch.equal(pa[0], pb[0])
        differ += pa[2] != pc[2]
    assert differ  # another seed draws other samples
    n = SIZES[1]
    assert torch.equal(sample_positions(n, 97, key(3, 2)), sample_positions(n, 97, key(3, 2)))
    assert not torch.equal(sample_positions(n, 97, key(3, 2)), sample_positions(n, 97, key(3, 1)))
    assert not torch.equal(sample_positions(n, 97, key(3, 2)), sample_positions(n, 97, key(4, 2)))
    # the step is state: restored, the next payload is the same again
    saved = {k: v.clone() for k, v in a.state_dict().items()}
    first = _parts(a.encode(x))
    a.load_state_dict(saved)
    assert torch.equal(_parts(a.encode(x))[1], first[1])


def test_sample_positions_one_per_stratum():
    n, m = 1_000_003, 32767
    pos = sample_positions(n, m, key(0, 0))
    bounds = torch.arange(m + 1) * n // m
    assert torch.all(pos >= bounds[:-1]) and torch.all(pos < bounds[1:])


def test_the_search_steps():
    # the first cut lets a little more than k through: 3 sigma of the sample count above it
    assert first_rank(10_000, 1_000_000, 32767) == math.ceil(327.68 + 3 * math.sqrt(327.68))
    assert first_rank(51, 1001, 1001) == 51  # the sample is the tensor: exactly k
    # secant to k inside the bracket, bisection outside it, None once the ranks are adjacent
    assert next_rank(400, 1200, 1000, 0, 400) == 333
    assert next_rank(400, 100, 1000, 400, 500) == 450
    assert next_rank(28, 880, 1000, 28, 29) is None


def test_ties_and_zeros():
    """Zeros are never sent; ties past the capacity keep the largest, then the first ones."""
    n = 200_003
    z = torch.zeros(n)
    z[::100] = 1.0 + torch.arange(len(range(0, n, 100))) / n  # 1 % nonzero: fewer than k
    values, idx, count = _parts(codecs.get("redsync:density=0.02").encode(z))
    assert count == len(range(0, n, 100)) and torch.equal(idx[:count], torch.arange(0, n, 100))
    q = torch.arange(n) % 7 - 3.0  # ties everywhere: 2/7 of the entries at magnitude 3
    codec = codecs.get("redsync:density=0.01")
    values, idx, count = _parts(codec.encode(q))
    capacity = math.ceil(1.25 * math.ceil(0.01 * n))
    assert count == capacity == values.numel()
    assert torch.equal(idx, (q.abs() == 3).nonzero().view(-1)[:capacity])
    assert _parts(codec.encode(torch.zeros(n)))[2] == 0


def test_nonfinite_entries_are_sent():
    x = _gaussian(SIZES[0])
    x[[5, 77, 100]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    y = codecs.get("redsync").roundtrip(x)
    assert y[5].isnan() and y[77] == float("inf") and y[100] == -float("inf")


def test_wire_bytes_count_the_capacity():
    codec = codecs.get("redsync:density=0.01,margin=2")
    assert codec.wire_bytes((4096, 4096), torch.float32) == 2 * 167773 * 8 + 4
    assert codecs.get("redsync").wire_bytes((300,), torch.float16) == 4 * 6 + 4  # min(n, 4)
    assert codecs.get("redsync:density=1").wire_bytes((7,), torch.float32) == 7 * 8 + 4


@pytest.mark.parametrize("bad", ["redsync:density=0", "redsync:density=1.5", "redsync:margin=0.9"])
def test_bad_parameters_are_config_errors(bad):
    from ccfx.errors import ConfigError

    with pytest.raises(ConfigError, match="density|margin"):
        codecs.get(bad)


@pytest.mark.parametrize("spec", ["redsync:density=0.1", "redsync:density=0.1,ef"])
@pytest.mark.parametrize("shape", [(37, 5), (40_011,)])
def test_opcheck(spec, shape):
    x = _gaussian(math.prod(shape)).view(shape)
    state = ops.init_state(spec, x.shape, x.dtype)
    torch.library.opcheck(torch.ops.ccfx_codecs.encode, (x, spec, state))
    payload, new = torch.ops.ccfx_codecs.encode(x, spec, state)
    torch.library.opcheck(torch.ops.ccfx_codecs.decode, (payload, spec, list(shape), x.dtype, new))
    # the op with its state threaded through is the object API, step after step
    codec = codecs.get(spec)
    for _ in range(2):
        payload, state = torch.ops.ccfx_codecs.encode(x, spec, state)
        assert torch.equal(payload[1], codec.encode(x).payload[1])


def test_with_ef_it_is_error_feedback():
    """c = x + e; send redsync(c); e = c - decode: nothing is lost, only delayed."""
    xs = [_gaussian(50_021, seed) for seed in range(3)]
    fed, plain = codecs.get("redsync:density=0.05,ef"), codecs.get("redsync:density=0.05")
    residual = torch.zeros(50_021)
    sent = torch.zeros(50_021)
    for x in xs:
        y = fed.roundtrip(x)
        want = plain.roundtrip(x + residual)  # same seed, same step: the same sample
        assert torch.equal(y, want)
        residual = x + residual - want
        assert torch.equal(fed.state_dict()["residual"], residual)
        sent += y
    torch.testing.assert_close(sent + residual, sum(xs), rtol=0, atol=1e-5)


def test_achieved_density_per_channel_in_the_codec_state():
    """Compiled, each cut edge's redsync state reports its density: ccfx.codec_state."""
    import ccfx

    model = models.MLP(depth=4)
    compiled, _ = compile_ccfx(model, stages=2, activation_codec="redsync:density=0.1,ef")
    for i in range(2):
        loss_of(compiled(torch.randn(4, 32, generator=torch.Generator().manual_seed(i))))\
            .backward()
    report = densities(ccfx.codec_state(compiled).state_dict())
    assert report and all(c.startswith("graph0.edge") for c in report), report
    for channel, got in report.items():
        # 128 activations, well within one sample: exactly ceil(0.1 * 128) = 13 sent
        assert got == {"last": 13 / 128, "steps": 2, "mean": 13 / 128}, channel
