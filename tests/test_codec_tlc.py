"""``tlc`` (3LC): the lossless stage (base-3^5 packing, zero runs) inverts exactly; the
quantizer's values, scale and error bound; the variable payload (capacity, used bytes) and what
a compiled plan says about it; on 2 real ranks (the shared 2-rank spawn, workers in
tests/tlc_workers.py), the eager all-gather that sends only the used bytes."""

import pytest
import torch

import ccfx
from ccfx import codecs
from ccfx.codecs import tlc
from ccfx.errors import CodecError, ConfigError
from ccfx.wire.comm import LocalComm
from ccfx.wire.exchange import BucketLayout, exchange_for
from ccfx.wire.link import choose_collective

from . import ranks
from . import tlc_workers as workers
from .ranks import scenario

#: In the 2-rank spawn the modules share (tests/ranks.py, ``Shared``).
TWO = ranks.Shared(2, [scenario("gather used", workers.gather_used),
                       scenario("ddp ledger", workers.ddp_ledger)], timeout_s=200)


@pytest.fixture(scope="module")
def two(shared_ranks):
    return shared_ranks[TWO]


def _ternary(n, zeros=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(-1, 2, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < zeros, 0, v)


def _roundtrip(v):
    codes, used = tlc.pack_ternary(v)
    assert codes.dtype == torch.uint8 and used == codes.numel()
    assert used <= -(-v.numel() // 5)  # never longer than the packed bytes
    back = tlc.unpack_ternary(codes, v.numel())
    assert back.dtype == torch.int8 and torch.equal(back, v.to(torch.int8))
    return codes


@pytest.mark.parametrize("n", [1, 2, 4, 5, 6, 7, 99, 1001, 4099])
@pytest.mark.parametrize("zeros", [0.0, 0.5, 0.97])
def test_pack_unpack_is_bit_exact_on_random_ternary(n, zeros):
    _roundtrip(_ternary(n, zeros, seed=n))


def test_all_zero_and_no_zero_inputs():
    assert _roundtrip(torch.zeros(0, dtype=torch.int64)).numel() == 0
    assert _roundtrip(torch.zeros(3, dtype=torch.int64)).tolist() == [0]  # one group: a literal
    assert _roundtrip(torch.zeros(5 * 14, dtype=torch.int64)).tolist() == [255]
    ones = torch.ones(23, dtype=torch.int64)
    assert _roundtrip(ones).tolist() == [121] * 4 + [1 + 3 + 9]  # 1+3+9+27+81; 3 left over
    minus = -torch.ones(10, dtype=torch.int64)
    assert _roundtrip(minus).tolist() == [242, 242]  # digit 2 everywhere: 3**5 - 1


def test_digits_and_bytes_are_as_documented():
    """Digit 0, 1, 2 for 0, +1, -1; byte = sum digit_i * 3**i over five values."""
    v = torch.tensor([1, -1, 0, 0, 1, 0, 0, 0, 0, 0, -1])
    assert tlc.pack_ternary(v)[0].tolist() == [1 + 2 * 3 + 81, 0, 2]


@pytest.mark.parametrize("run, pieces", [
    (1, [0]), (2, [243]), (13, [254]), (14, [255]), (15, [255, 0]), (16, [255, 243]),
    (28, [255, 255]), (29, [255, 255, 0]), (30, [255, 255, 243]), (43, [255, 255, 255, 0]), (45, [255, 255, 255, 244]),
])
def test_zero_runs_across_the_maximum_run_length(run, pieces):
    """A run of zero bytes is cut into pieces of at most 14; a piece of one stays a literal 0."""
    groups = torch.tensor([7] + [0] * run + [9, 0], dtype=torch.uint8)
    assert tlc.zero_runs(groups).tolist() == [7, *pieces, 9, 0]
    assert torch.equal(tlc.expand_runs(tlc.zero_runs(groups), groups.numel()).to(torch.uint8),
                       groups)
    v = torch.cat([torch.ones(5), torch.zeros(5 * run), -torch.ones(3)]).long()
    _roundtrip(v)


def test_a_damaged_payload_is_named():
    codes, _ = tlc.pack_ternary(torch.zeros(100, dtype=torch.int64))
    with pytest.raises(CodecError, match="expands to 14 bytes, not the 20"):
        tlc.unpack_ternary(codes[:1], 100)


def test_values_scale_and_error_bound():
    x = torch.randn(1003, dtype=torch.float64)
    codec = codecs.get("tlc")
    enc = codec.encode(x)
    scales = enc.payload[1]
    assert scales.tolist() == [float(x.abs().max().float())]
    y = codec.decode(enc)
    s = scales.double()[0]
    assert set(torch.unique(y / s).tolist()) == {-1.0, 0.0, 1.0}
    assert torch.equal(y / s, torch.round(x.float() / scales[0]).double())
    assert (y - x).abs().max() <= s / 2 + 1e-7


def test_sparsity_sends_more_zeros_and_blocks_scale_apart():
    x = torch.randn(4096)
    dense, sparse = codecs.get("tlc"), codecs.get("tlc:sparsity=1.9")
    assert (sparse.roundtrip(x) == 0).sum() > (dense.roundtrip(x) == 0).sum()
    a, b = dense.encode(x), sparse.encode(x)
    assert sparse.used_bytes(b.payload) < dense.used_bytes(a.payload)
    blocked = codecs.get("tlc:block=1000")
    x[:1000] *= 100
    enc = blocked.encode(x)
    assert enc.payload[1].shape == (5,)
    assert enc.payload[1][0] == x[:1000].abs().max() and enc.payload[1][1] == x[1000:2000].abs().max()


def test_capacity_used_length_and_padding():
    x = torch.zeros(1000)
    x[::97] = 1.0
    codec = codecs.get("tlc")
    enc = codec.encode(x)
    codes, _, used = enc.payload
    assert codec.wire_bytes((1000,), torch.float32) == 200 + 4 + 4 == enc.nbytes
    assert codec.variable and codec.used_elements(enc.payload) == int(used[0]) < 200
    assert codec.used_bytes(enc.payload) == int(used[0]) + 8
    assert codes[int(used[0]):].eq(0).all()
    torch.testing.assert_close(codec.decode(enc), x, rtol=0, atol=0)


def test_error_feedback_carries_what_rounding_dropped():
    codec = codecs.get("tlc:ef")
    assert codec.spec == "tlc:ef" and codec.variable
    xs = [torch.randn(300) for _ in range(6)]
    sent = sum(codec.roundtrip(x) for x in xs)
    torch.testing.assert_close(sent + codec.state_dict()["residual"], sum(xs))


def test_nonfinite_block_decodes_to_nan_and_others_stay():
    x = torch.randn(20)
    x[3] = float("inf")
    y = codecs.get("tlc:block=10").roundtrip(x)
    assert y[:10].isnan().all() and y[10:].isfinite().all()


@pytest.mark.parametrize("spec, match", [("tlc:sparsity=2", r"\[1, 2\)"),
                                         ("tlc:sparsity=0.5", "multiplier"),
                                         ("tlc:block=-1", "block must be 0")])
def test_bad_parameters_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        codecs.get(spec)


def test_local_exchange_sends_and_counts_the_capacity():
    """Without a process group (and traced) a bucket's payload keeps its static shape."""
    layout = BucketLayout(((40, 25), (7,)), torch.float32)
    ex = exchange_for(layout, "tlc:ef")
    grads = [torch.randn(40, 25), torch.randn(7)]
    out = ex.run(grads, ex.init_state(), LocalComm())
    assert ex.sent_bytes() == ex.wire_bytes() == 202 + 4 + 4
    codec = codecs.get("tlc")
    torch.testing.assert_close(layout.flat(out), codec.roundtrip(layout.flat(grads)))


def test_the_ring_refuses_it_and_auto_picks_the_all_gather():
    """Every ring hop would send the whole capacity: a ConfigError naming the fix."""
    layout = BucketLayout(((1000,),), torch.float32)
    with pytest.raises(ConfigError, match="size depends on the data.*collective='all_gather'"):
        exchange_for(layout, "tlc:ef", "ring")
    assert choose_collective("tlc:ef", 10**6, torch.float32, world=8) == "all_gather"
    assert choose_collective("int8", 10**6, torch.float32, world=8) == "ring"


def test_a_compiled_plan_says_the_capacity_travels():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend=ccfx.backend(stages=2, activation_codec="tlc",
                                                          lowering="eager"))
    with pytest.warns(ccfx.CcfxWarning, match="data-dependent size, but this path sends"):
        compiled(torch.randn(8, 16)).sum().backward()
    notes = [n for n in ccfx.plan_of(compiled).graphs[0].notes if "tlc" in n]
    assert [n.split(":")[0] for n in notes] == ["graph 0 edge 0 (stage 0 -> 1, forward)",
                                                "graph 0 edge 0 (stage 0 -> 1, backward)"]
    assert all("fixed capacity (34 B)" in n for n in notes)  # ceil(8 * 16 / 5) + 4 + 4
    assert ccfx.ledger_of(compiled).totals() == (2 * 8 * 16 * 4, 2 * 34)


@pytest.mark.slow
def test_ranks_send_only_the_used_bytes_and_agree_bit_for_bit(two):
    """Lengths first (4 B), then the codes cut to the longest rank's, scale and length whole:
    the mean is each rank's own round trip averaged in rank order, on both ranks."""
    r0, r1 = two["gather used"]
    assert r0 == r1  # the same sums and the same bytes counted on both ranks
    for row in r0:
        assert row["equal"]
        assert row["used"][1] < row["used"][0] < 1212  # ceil(6057 / 5): rank 1 is sparser
        assert row["sent"] == 4 + max(row["used"]) + 4 + 4 < row["capacity"] == 1212 + 8


@pytest.mark.slow
def test_ddp_comm_hook_ledger_counts_the_bytes_sent_not_the_capacity(two):
    for r in two["ddp ledger"]:
        assert r["same"]
        assert r["raw"] == 2 * 25864 * 4  # the MLP's fp32 gradients, two steps
        assert 0 < r["wire"] < r["capacity"] / 2
