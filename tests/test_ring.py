"""The re-encoding ring all-reduce (ccfx.wire.ring) and its exchange, on 3 and 4 gloo ranks.

Starting ranks is what costs here (each imports torch), so one spawn of 4 ranks (a
module-scoped fixture) runs every eager case on all 4 and on the 3 ranks of a subgroup (ranks
1, 2, 3: group ranks are not global ranks there), and the tests assert on parts of what the
ranks returned; the 3-rank spawn the modules share (tests/ranks.py, ``Shared``) trains through
the compiled backward. Workers are in
tests/ring_workers.py.

Error bounds. A blockwise codec's encode errs by at most half a step: ``absmax / 254`` for int8
(``absmax / 127`` steps, round to nearest), ``absmax / 14`` for int4, and for fp8 (e4m3, three
mantissa bits) ``|v| / 16 ≤ absmax / 16``. On the ring, hop ``h`` of the reduce-scatter encodes a
sum of ``h + 1`` ranks' values (absmax ≤ ``(h + 1) A``, ``A`` the largest input magnitude) and
the owner encodes the mean once (absmax ≤ ``A``), so the mean's error is at most
``A · e · (Σ_{h<W-1} (h + 1) / W + 1) = A · e · (W + 1) / 2`` with ``e`` the codec's half step
(1/254, 1/14, 1/16); the tests allow 10 % on top for the second-order terms (the error of one
hop is inside the next hop's absmax).
"""

from __future__ import annotations

import pytest
import torch

from ccfx.errors import ConfigError
from ccfx.runtime.launch import spawn

from . import ring_workers
from .ranks import Shared, scenario

SPECS = ["none", "int8", "int4", "fp8", "topk:ratio=0.1,ef", "sign", "qsgd"]
HALF_STEP = {"int8": 1 / 254, "int4": 1 / 14, "fp8": 1 / 16}


def sizes(world: int) -> list[int]:
    """1, W-1 (fewer elements than ranks), 7 (inside one block), 997 (a prime: a partial last
    block); int8 and fp8 also at 4096 (whole blocks: 4 per chunk at W = 4)."""
    return [1, world - 1, 7, 997]


def cases(world: int) -> list[tuple[str, int]]:
    return [(spec, n) for spec in SPECS for n in sizes(world)] + [("int8", 4096), ("fp8", 4096)]


@pytest.fixture(scope="module")
def spawned():
    """What each of 4 ranks returned from ``ring_workers.suite``."""
    return spawn(ring_workers.suite, 4, ({3: cases(3), 4: cases(4)},), timeout_s=150)


@pytest.fixture(params=[3, 4], ids=["world3", "world4"])
def ranks(request, spawned):
    """(W, per rank of the ring: its cases' results)."""
    world = request.param
    return world, [{"cases": r[world]} for r in spawned if world in r]


# -- on ranks -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_rank_ends_with_the_same_bits(ranks):
    world, results = ranks
    for case in cases(world):
        rows = [r["cases"][case] for r in results]
        assert len({row["digest"] for row in rows}) == 1, (world, case)
        assert rows[0]["shape"] == (case[1],) and rows[0]["dtype"] == "torch.float32", case


@pytest.mark.slow
def test_none_is_the_fp32_mean(ranks):
    world, results = ranks
    for n in sizes(world):
        assert results[0]["cases"][("none", n)]["max_err"] <= 1e-6, (world, n)


@pytest.mark.slow
def test_lossy_codecs_stay_within_the_ring_bound(ranks):
    world, results = ranks
    for spec, e in HALF_STEP.items():
        for n in [*sizes(world), *([4096] if spec != "int4" else [])]:
            row = results[0]["cases"][(spec, n)]
            bound = 1.1 * row["absmax"] * e * (world + 1) / 2 + 1e-6
            assert row["max_err"] <= bound, (world, spec, n, row["max_err"], bound)
            # the all-gather quantises each rank's values once: at most A e
            assert row["gather"]["max_err"] <= row["absmax"] * e + 1e-6, (spec, n)
    # int8 on whole blocks: a re-encoding ring loses more than the all-gather, by less than 3x
    row = results[0]["cases"][("int8", 4096)]
    assert row["rel_l2"] < 3 * row["gather"]["rel_l2"] and row["rel_l2"] < 0.02, row
    # qsgd is stochastic (errs by up to a level, unbiased): ~0.05 relative for one round trip
    assert results[0]["cases"][("qsgd", 997)]["rel_l2"] < 0.2


@pytest.mark.slow
def test_a_single_element_passes_every_codec_exactly_enough(ranks):
    # one element is its block's absmax: int8/int4/fp8/sign/qsgd send it exactly, topk keeps it
    world, results = ranks
    for spec in SPECS:
        assert results[0]["cases"][(spec, 1)]["max_err"] <= 1e-6, (world, spec)


@pytest.mark.slow
def test_error_feedback_updates_the_residual_and_reduces_the_accumulated_error(spawned):
    results = spawned
    for r in results:
        ef, plain = r["ef"]["ef"], r["ef"]["plain"]
        assert ef["residual_norm"] > 0 and plain["residual_norm"] == 0
        # first call: nothing to feed back yet; then what topk dropped is sent later
        assert ef["accumulated"][0] == pytest.approx(plain["accumulated"][0])
        assert ef["accumulated"][1] < plain["accumulated"][1]
        assert ef["accumulated"][2] < plain["accumulated"][2]
        assert len(set(ef["digests"])) == 3 and len(set(plain["digests"])) == 1
    assert len({tuple(r["ef"]["ef"]["digests"]) for r in results}) == 1


@pytest.mark.slow
def test_a_stalled_peer_is_an_error_naming_rank_hop_and_peer(spawned):
    for rank in (0, 1, 2):  # rank 3 never joins
        got = spawned[rank]["stall"]
        assert got["error"] == "CollectiveError", got
        message = got["message"]
        assert message.startswith(f"rank {rank} ") and "hop " in message, message
        assert "group timeout 2 s" in message, message
        assert ("waiting for rank" in message or "sending to rank" in message), message
        assert 1.5 < got["elapsed"] < 30, got["elapsed"]


@pytest.mark.slow
def test_the_op_passes_opcheck_and_is_the_round_trip_on_one_rank(spawned):
    assert all(r["alone"]["single_residual_exact"] for r in spawned)


#: In the 3-rank spawn the modules share (tests/ranks.py, ``Shared``).
THREE = Shared(3, [scenario("compiled training", ring_workers.compiled_ring_training, 2)],
               timeout_s=240)


@pytest.fixture(scope="module")
def three(shared_ranks):
    return shared_ranks[THREE]


@pytest.mark.slow
def test_compiled_data_parallel_backward_on_the_ring_keeps_ranks_identical(three):
    world = 3
    results = three["compiled training"]
    assert len({tuple(r["digests"]) for r in results}) == 1
    assert len({r["params"] for r in results}) == 1
    buckets = results[0]["buckets"]
    assert ("int8", "ring") in [(c, k) for c, k, _ in buckets], buckets
    # the second step's gradients (the first's reference would need rank 0's parameters)
    (err,), (scale,) = results[0]["errors"], results[0]["scales"]
    assert err <= 1.1 * scale * (world + 1) / 2 / 254, (err, scale)


# -- without ranks ---------------------------------------------------------------------------------


def test_chunks_are_even_whole_blocks_adding_up():
    from ccfx.wire.ring import chunk_sizes

    assert chunk_sizes(4096, 4, 256) == [1024] * 4
    assert chunk_sizes(997, 4, 256) == [256, 256, 256, 229]
    assert chunk_sizes(997, 3, 1) == [333, 332, 332]
    assert chunk_sizes(7, 3, 256) == [7, 0, 0]
    assert chunk_sizes(2, 3, 1) == [1, 1, 0]
    assert chunk_sizes(0, 3, 256) == [0, 0, 0]
    for n in (1, 2, 3, 7, 255, 256, 257, 997, 5000):
        for w in (1, 2, 3, 4, 7):
            got = chunk_sizes(n, w, 256)
            filled = [s for s in got if s]
            assert sum(got) == n and len(got) == w and got[:len(filled)] == filled
            assert all(s % 256 == 0 for s in filled[:-1]), (n, w, got)
            assert max(filled) - min(filled[:-1] or filled) <= 256, (n, w, got)


def test_the_ring_sends_fewer_bytes_than_the_all_gather_receives():
    from ccfx import codecs
    from ccfx.wire.ring import gather_wire_bytes, ring_wire_bytes

    payload = codecs.prototype("int8").wire_bytes((4096,), torch.float32)  # 4096 + 16 * 4
    assert gather_wire_bytes(4096, "int8", torch.float32, 4) == 3 * payload
    assert ring_wire_bytes(4096, "int8", torch.float32, 4) == 2 * 3 * payload // 4
    for spec in ("int8", "int4", "fp8", "sign", "qsgd", "topk:ratio=0.1,ef"):
        for n in (997, 4096, 100_000):
            assert ring_wire_bytes(n, spec, torch.float32, 4) < \
                gather_wire_bytes(n, spec, torch.float32, 4), (spec, n)
    assert ring_wire_bytes(4096, "int8", torch.float32, 1) == 0
    # uneven chunks: each rank skips two chunks, the max is the bottleneck
    per_rank = [ring_wire_bytes(997, "int8", torch.float32, 4, rank=r) for r in range(4)]
    assert max(per_rank) == ring_wire_bytes(997, "int8", torch.float32, 4)


def test_codecs_that_need_state_to_decode_are_refused_with_the_way_out():
    from ccfx.wire.ring import ring_all_reduce, ring_codec

    for spec in ("randomk:ratio=0.1", "randomk:ratio=0.1,ef", "powersgd:rank=2"):
        with pytest.raises(ConfigError, match="all_gather") as e:
            ring_codec(spec)
        assert spec.split(":")[0] in str(e.value)
    with pytest.raises(ConfigError, match="randomk"):
        ring_all_reduce(torch.randn(10), "randomk:ratio=0.5")  # no process group: world 1
    assert ring_codec("qsgd").inner.name == "qsgd"  # its step counter is encode-only
    assert ring_codec("topk:ratio=0.1,ef").error_feedback


def test_exchange_for_picks_the_ring_only_for_non_summable_codecs():
    from ccfx.wire.exchange import (
        AllReduceExchange,
        BucketLayout,
        GatherExchange,
        PowerSGDExchange,
        RingExchange,
        exchange_for,
    )

    layout = BucketLayout(((16, 8), (8,)), torch.float32)
    assert type(exchange_for(layout, "int8")) is GatherExchange
    assert type(exchange_for(layout, "int8", "ring")) is RingExchange
    assert type(exchange_for(layout, "topk:ratio=0.1,ef", "ring")) is RingExchange
    assert type(exchange_for(layout, "fp16", "ring")) is AllReduceExchange
    assert type(exchange_for(layout, "randomk:ratio=0.1", "ring")) is AllReduceExchange
    assert type(exchange_for(layout, "powersgd:rank=2", "ring")) is PowerSGDExchange
    ring = exchange_for(layout, "int8", "ring")
    assert ring.collective == "ring" and ring.wire_bytes() == exchange_for(layout, "int8").wire_bytes()
    with pytest.raises(ConfigError, match="choose_collective"):
        exchange_for(layout, "int8", "auto")


def test_world_size_one_is_the_codecs_round_trip():
    from ccfx.codecs import ops
    from ccfx.wire.comm import LocalComm
    from ccfx.wire.exchange import BucketLayout, exchange_for

    layout = BucketLayout(((16, 8), (8,)), torch.float32)
    grads = [torch.randn(16, 8), torch.randn(8)]
    for spec in ("int8", "fp8", "sign"):
        gathered = exchange_for(layout, spec).run(grads, {}, LocalComm())
        ringed = exchange_for(layout, spec, "ring").run(grads, {}, LocalComm())
        assert all(torch.equal(a, b) for a, b in zip(gathered, ringed)), spec
    ex = exchange_for(layout, "topk:ratio=0.1,ef", "ring")
    state = ex.init_state()
    (out_w, out_b) = ex.run(grads, state, LocalComm())
    flat, out = torch.cat([g.reshape(-1) for g in grads]), torch.cat([out_w.reshape(-1), out_b])
    assert torch.equal(state["residual"], flat - out) and state["residual"].any()
    # and the eager function without a process group agrees
    from ccfx.wire.ring import ring_all_reduce

    st = ops.init_state("topk:ratio=0.1,ef", (136,), torch.float32)
    assert torch.equal(ring_all_reduce(flat, "topk:ratio=0.1,ef", None, st), out)


def test_choose_collective():
    from ccfx.wire.link import Link, choose_collective

    f32 = torch.float32
    # no link: by bytes, the ring from 3 ranks on; never for 2 (same bytes, one more rounding)
    assert choose_collective("int8", 1 << 20, f32, 2) == "all_gather"
    assert choose_collective("int8", 1 << 20, f32, 3) == "ring"
    assert choose_collective("int8", 1 << 20, f32, 8) == "ring"
    # summable codecs all-reduce, codecs the ring refuses keep the all-gather
    assert choose_collective("fp16", 1 << 20, f32, 8) == "all_gather"
    assert choose_collective("powersgd:rank=4", 1 << 20, f32, 8) == "all_gather"
    # a slow link: bytes dominate; a tiny tensor over a high-latency link: 2(W-1) hops lose
    slow = Link(0.1, latency_ms=1.0)
    assert choose_collective("int8", 1 << 20, f32, 4, slow) == "ring"
    far = Link(10.0, latency_ms=50.0)
    assert choose_collective("int8", 1024, f32, 4, far) == "all_gather"
    assert choose_collective("int8", 1 << 28, f32, 4, far) == "ring"
    # decode time favours the ring: with it, a borderline case flips
    edge = Link(10.0, latency_ms=1.0)
    n = next(n for n in (1 << k for k in range(8, 26))
             if choose_collective("int8", n, f32, 4, edge) == "ring")
    assert choose_collective("int8", n // 2, f32, 4, edge) == "all_gather"
    assert choose_collective("int8", n // 2, f32, 4, edge, decode_s=0.01) == "ring"
