"""Local steps (DiLoCo) and their streamed, compressed sync (issue #11).

Multi-rank tests run on gloo ranks on 127.0.0.1, bounded in time: one spawn per world size (the
module-scoped fixtures ``two``, ``three``, ``four``: tests/ranks.py) runs every scenario, and
each test asserts on what one scenario returned. The rest run in this process (world size 1:
each exchange is the codec's round trip)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ccfx

from . import local_steps_workers as w
from . import ranks
from .ranks import scenario

# -- one process --------------------------------------------------------------------------------


def _train(model, opt, steps, rank=0, start=0):
    for i in range(start, start + steps):
        w.loss_of(model, rank, i).backward()
        opt.step()
        opt.zero_grad()


def test_outer_nesterov_step_matches_the_formula_on_one_replica():
    """World size 1, codec none: after H inner steps the outer SGD steps the global parameters
    with pseudo-gradient (global - local), Nesterov momentum, as torch.optim.SGD defines."""
    model = w.mlp(0)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, sync_every=3, outer_lr=0.7, outer_momentum=0.9)
    _train(model, opt, 2)
    assert outer.syncs == 0
    probe = w.mlp(0)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.05)
    _train(probe, probe_opt, 3)
    _train(model, opt, 1, start=2)  # the third step: sync
    assert outer.syncs == 1
    for p, s, local in zip(model.parameters(), start, probe.parameters()):
        delta = s - local.detach()
        # SGD with momentum 0.9 and Nesterov, first step: buf = d; update = d + 0.9 * buf
        expected = s - 0.7 * (delta + 0.9 * delta)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


def test_compiled_model_options_and_ledger_rows():
    """sync_every in torch.compile's options; local_steps reads them before the first call,
    and the compiled model's ledger gets one 'outer' row per fragment."""
    model = w.mlp(0)
    compiled = torch.compile(model, backend="ccfx", options={
        "sync_every": 4, "outer_codec": "int8", "fragments": 2, "lowering": "eager"})
    opt = torch.optim.Adam(compiled.parameters(), lr=0.01)
    outer = ccfx.local_steps(compiled, opt, compress_min_numel=0)
    assert (outer.sync_every, outer.config.outer_codec, len(outer.fragments)) == (4, "int8", 2)
    _train(compiled, opt, 8)
    assert outer.syncs == 4  # two fragments, each every 4 steps, over 8 steps
    ledger = ccfx.ledger_of(compiled)
    rows = ledger.entries("outer")
    assert sorted(r.edge for r in rows) == [0, 1]
    raw, wire = ledger.totals("outer")
    assert raw == outer.raw_bytes and wire == outer.wire_bytes
    assert raw == 2 * sum(p.numel() for p in model.parameters()) * 4
    assert wire < raw / 3  # int8 of fp32 pseudo-gradients: ~1/4 plus scales
    assert "local-steps sync" in str(ledger)


def test_fragments_are_balanced_and_staggered():
    model = w.mlp(0)  # numels 256, 32, 1024, 32, 128, 4
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, sync_every=6, fragments=3)
    names = [f.names for f in outer.fragments]
    assert names == [["0.weight"], ["0.bias", "2.bias", "4.weight", "4.bias"], ["2.weight"]]
    assert [f.offset for f in outer.fragments] == [2, 4, 0]
    pair = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    two = ccfx.local_steps(pair, torch.optim.SGD(pair.parameters(), lr=0.1), sync_every=4,
                           fragments=2)
    assert [f.numel for f in two.fragments] == [64 * 64 + 64, 64 * 64 + 64]


def test_delayed_merge_and_mixing_on_one_replica():
    """τ = 1: the sync started at step t is merged at t + 1 as (1 - α)·global + α·local."""
    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, sync_every=2, fragment_delay=1, fragment_alpha=0.5,
                             outer_lr=1.0, outer_momentum=0.0)
    _train(model, opt, 2)
    frag = outer.fragments[0]
    assert frag.in_flight is not None and frag.in_flight.merge_at == 3 and outer.syncs == 0
    _train(model, opt, 1, start=2)  # step 3: one more local step, then the merge
    assert frag.in_flight is None and outer.syncs == 1
    # Plain SGD gives the replica's parameters at steps 2 and 3 (nothing was merged before).
    probe = w.mlp(0)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.05)
    _train(probe, probe_opt, 2)
    at2 = [p.detach().clone() for p in probe.parameters()]
    _train(probe, probe_opt, 1, start=2)
    at3 = [p.detach().clone() for p in probe.parameters()]
    # outer lr 1, no momentum, codec none: global = its start - (start - at2) = at2; the merge
    # then mixes it half and half with the replica's step-3 parameters.
    for p, g, a2, a3 in zip(model.parameters(), frag.global_, at2, at3):
        torch.testing.assert_close(g, a2, rtol=0, atol=1e-6)
        torch.testing.assert_close(p.detach(), 0.5 * a2 + 0.5 * a3, rtol=0, atol=1e-6)
    outer.close()


def test_bad_options_are_clear_errors():
    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ccfx.ConfigError, match="sync_every"):
        ccfx.local_steps(model, opt)
    with pytest.raises(ccfx.ConfigError, match="choose one"):
        ccfx.Config(sync_every=10, data_parallel=True)
    with pytest.raises(ccfx.ConfigError, match="fragments=8 > sync_every=4"):
        ccfx.Config(sync_every=4, fragments=8)
    with pytest.raises(ccfx.ConfigError, match="fragment_delay"):
        ccfx.Config(sync_every=8, fragments=4, fragment_delay=2)
    with pytest.raises(ccfx.ConfigError, match="not in the optimizer"):
        ccfx.local_steps(model, torch.optim.SGD(list(model.parameters())[:2], lr=0.1),
                         sync_every=2)
    with pytest.raises(ccfx.ConfigError, match="unknown option"):
        ccfx.local_steps(model, opt, sync_evry=2)
    with pytest.raises(ccfx.ConfigError, match="unknown codec 'int9'"):
        ccfx.local_steps(model, opt, sync_every=2, outer_codec="int9")


def test_resume_refuses_other_options():
    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, sync_every=2, outer_codec="int8")
    state = outer.state_dict()
    outer.close()
    other = ccfx.local_steps(model, opt, sync_every=3, outer_codec="int8")
    with pytest.raises(ccfx.ConfigError, match="sync_every"):
        other.load_state_dict(state)


# -- several ranks --------------------------------------------------------------------------------

CODECS = ["none", "bf16", "int8", "int4", "fp8", "topk:ratio=0.1,ef", "powersgd:rank=2"]
RING_CODECS = ["int8", "int4", "fp8", "topk:ratio=0.1,ef"]
#: saved between syncs (step 3) or with a fragment's exchange in flight (step 4)
RESUME = {"sync_every": 4, "fragments": 2, "fragment_delay": 1, "fragment_alpha": 0.5,
          "outer_codec": "topk:ratio=0.2,ef", "compress_min_numel": 0}
STREAMING = {"sync_every": 4, "fragments": 2, "fragment_delay": 1, "outer_codec": "int8",
             "compress_min_numel": 0}


@pytest.fixture(scope="module")
def two():
    """Every 2-rank scenario in one spawn; the stalled replica last (it breaks the group)."""
    return ranks.run_scenarios(2, [
        scenario("h1", w.h1_against_data_parallel, 5),
        scenario("codecs", w.replicas_after_sync, CODECS, 6, {"sync_every": 3}),
        scenario("resume", w.checkpoint_resumes, RESUME, [3, 4], 11),
        scenario("streaming", w.streaming_overlap, STREAMING, 8),
        scenario("stall", w.one_replica_stops, [0, 1]),
    ], timeout_s=500)


#: In the 3-rank spawn the modules share (tests/ranks.py, ``Shared``).
THREE = ranks.Shared(3, [scenario("ring", w.replicas_after_sync, RING_CODECS, 4,
                                 {"sync_every": 2, "outer_collective": "ring"})], timeout_s=240)


@pytest.fixture(scope="module")
def three(shared_ranks):
    return shared_ranks[THREE]


#: In the 4-rank spawn the modules share (tests/ranks.py, ``Shared``).
FOUR = ranks.Shared(4, [scenario("pp x dp", w.pipeline_dp_local_steps, 4, 2)], timeout_s=300)


@pytest.fixture(scope="module")
def four(shared_ranks):
    return shared_ranks[FOUR]


@pytest.mark.slow
def test_h1_outer_sgd_lr1_equals_per_step_data_parallel(two):
    """... and, in the same ranks: compiling with sync_every but never calling local_steps
    warns that the replicas would train apart."""
    out = two["h1"]
    for rank in out:
        assert "no ccfx.local_steps" in rank["warning"]
        assert rank["syncs"] == 5
        for a, b in zip(rank["dp"], rank["local"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for a, b in zip(out[0]["local"], out[1]["local"]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_replicas_bit_identical_after_every_sync_for_every_codec(two):
    out = two["codecs"]
    for spec in CODECS:
        r0, r1 = out[0][spec], out[1][spec]
        assert r0["syncs"] == 2
        for a, b in zip(r0["global"], r1["global"], strict=True):
            assert torch.equal(a, b), spec
        for a, b in zip(r0["local"], r1["local"], strict=True):
            assert torch.equal(a, b), spec
        assert r0["ledger"] == (r0["raw"], r0["wire"])
    raw = out[0]["none"]["raw"]
    assert out[0]["int8"]["wire"] < raw / 3 and out[0]["int4"]["wire"] < raw / 5


@pytest.mark.slow
def test_ring_keeps_replicas_bit_identical_on_three_ranks(three):
    """outer_collective="ring": every hop re-encodes, the reduced chunks' bytes go round, every
    rank decodes the same bytes; "auto" picks the ring at 3 ranks (fewer bytes)."""
    out = three["ring"]
    for spec in RING_CODECS:
        assert out[0][spec]["collectives"] == ["ring"], spec
        for r in out[1:]:
            for a, b in zip(out[0][spec]["global"], r[spec]["global"], strict=True):
                assert torch.equal(a, b), spec
            for a, b in zip(out[0][spec]["local"], r[spec]["local"], strict=True):
                assert torch.equal(a, b), spec
    model = w.mlp(0)
    auto = ccfx.local_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2,
                            outer_codec="int8")
    assert auto.collectives == ["all_gather"]  # one replica: nothing to ring


@pytest.mark.slow
def test_checkpoint_resumes_with_identical_numerics(two):
    """Saved between syncs (step 3) or with a fragment's exchange in flight (step 4: fragment
    1's, started at step 4 with τ = 1), with error-feedback residuals and outer momentum: the
    resumed run equals the uninterrupted one bit for bit."""
    out = two["resume"]
    for rank in out:
        for stop_at, run in rank.items():
            assert run["in_flight"] == (stop_at == 4)
            for a, b in zip(run["straight"], run["resumed"], strict=True):
                assert torch.equal(a, b), stop_at


@pytest.mark.slow
def test_a_stalled_replica_is_an_error_naming_the_fragment_not_a_hang(two):
    """Merged at once (τ = 0) and from the sync thread (τ = 1)."""
    out = two["stall"]
    for delay in (0, 1):
        assert out[1][delay] == "finished"
        message = out[0][delay]
        assert message.startswith("CollectiveError: rank 0: the outer sync of fragment"), message
        assert "started at inner step 2" in message and "collective_timeout_s=3" in message


@pytest.mark.slow
def test_streaming_overlaps_each_fragment_with_inner_steps(two):
    out = two["streaming"]
    for rank in out:
        starts = [e for e in rank["events"] if e[0] == "start"]
        exchanges = [e for e in rank["events"] if e[0] == "exchange"]
        merges = [e for e in rank["events"] if e[0] == "merge"]
        # fragment 0 at steps 2 and 6, fragment 1 at 4 and 8; each merged one step later
        assert [(e[1], e[2]) for e in starts] == [(0, 2), (1, 4), (0, 6), (1, 8)]
        assert [e[1] for e in exchanges] == [0, 1, 0, 1]
        assert all(e[2].startswith("ccfx-outer-sync") for e in exchanges)
        assert [(e[1], e[2], e[3]) for e in merges][:3] == [(0, 3, 2), (1, 5, 4), (0, 7, 6)]
        # greedy balance: fragments differ by at most the largest tensor (32 x 32)
        assert abs(rank["sizes"][0] - rank["sizes"][1]) <= 32 * 32
    for a, b in zip(out[0]["global"], out[1]["global"]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_pipeline_times_data_parallel_syncs_each_stage_over_its_replicas(four):
    out = four["pp x dp"]
    by_stage = {}
    for r in out:
        assert r["buckets"] == 0  # no per-step gradient exchange under local steps
        assert r["syncs"] == 2
        by_stage.setdefault(r["stage"], []).append(r)
    for stage, (a, b) in by_stage.items():
        assert a["replica"] != b["replica"]
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.equal(x, y), stage
        for x, y in zip(a["global"], b["global"], strict=True):
            assert torch.equal(x, y), stage


# -- the planner's side ----------------------------------------------------------------------


def test_predicted_step_falls_with_h_and_streaming_hides_the_link():
    from ccfx.planner import CodecTimer, Link
    from ccfx.planner.local_model import predict_local_steps

    shapes = [(256, 256), (256,), (256, 256), (256,)]
    link = Link(0.01, latency_ms=1.0, shared=True)  # 10 Mbit/s, one medium
    timer = CodecTimer(throughput=1e9)  # fixed 1 GB/s: the comparisons hold at any load

    def predict(**options):
        cfg = ccfx.Config(outer_codec="int8", **options)
        return predict_local_steps(0.05, shapes, 4, link, cfg, timer)

    h10, h50 = predict(sync_every=10), predict(sync_every=50)
    assert h10.compute_s < h50.step_s < h10.step_s
    sync = sum(f.codec_s + f.link_s for f in h10.fragments)
    assert h10.step_s == pytest.approx(0.05 + sync / 10)
    # int8 over a 4-rank ring: 2 (W-1)/W of a quarter of the fp32 bytes, per rank per sync
    raw = sum(math.prod(s) for s in shapes) * 4
    assert h10.bytes_per_step < raw / 10 / 2
    streamed = predict(sync_every=10, fragments=2, fragment_delay=4)
    wait = sum(f.link_s for f in streamed.fragments)
    assert wait > 0 and streamed.step_s < h10.step_s
    for f in streamed.fragments:
        assert f.exposed_s == pytest.approx(f.codec_s + max(0.0, f.link_s - 4 * 0.05))
    assert "exposed" in streamed.explain() and "x the step without communication" in h10.explain()


@pytest.mark.slow
def test_a_dead_replica_on_the_ring_is_named_with_the_outer_sync_fragment_and_step():
    """Three replicas on the ring, rank 2 SIGKILLed after the first sync: each survivor's
    error says which outer sync (fragment, inner step) failed and names rank 2."""
    with pytest.raises(ranks.RankFailed) as e:
        ranks.spawn(w.ring_replica_dies, 3, (2,), timeout_s=240, grace_s=90, pg_timeout_s=60)
    assert "rank 2" in str(e.value)
    for r in (0, 1):
        got = e.value.results[r]
        print(f"local steps on the ring, rank 2 of 3 dies: rank {r}'s named error "
              f"{got.get('since', float('nan')):.1f} s after: {got.get('message', got)}")
        assert got["error"] == "CollectiveError", got
        msg = got["message"]
        assert msg.startswith(f"rank {r}: the outer sync of fragment 0 (started at inner step "
                              "4) failed: "), msg
        assert "ring all-reduce" in msg, msg  # what failed inside it
        assert "Rank 2 (" in msg and "has exited" in msg, msg
        assert got["since"] < 60, got  # gloo's closed connection, not a timeout
