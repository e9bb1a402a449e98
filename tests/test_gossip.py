"""Compressed gossip (CHOCO-SGD): neighbours only, no all-reduce (issue #39).

The invariants of the gossip step on 3 gloo ranks (one shared spawn, tests/ranks.py), a dead
neighbour in a spawn of its own, and the topology, byte count and bad input in this process."""

from __future__ import annotations

import itertools

import pytest
import torch

import ccfx
from ccfx.runtime.gossip import gossip_codec, gossip_wire_bytes, neighbours, torus_shape

from . import gossip_workers as w
from . import ranks
from .ranks import scenario

EPS = torch.finfo(torch.float32).eps

# -- one process --------------------------------------------------------------------------------


def test_ring_and_torus_neighbours_are_symmetric_and_regular():
    """W must be symmetric (j a neighbour of i ⇔ i of j) with one degree for all (regular):
    then uniform weights 1/(d+1) are doubly stochastic and the gossip keeps the mean."""
    assert neighbours(0, 5, "ring") == [1, 4]
    assert neighbours(1, 2, "ring") == [0]  # two ranks: one neighbour, both sides
    assert torus_shape(12) == (3, 4) and torus_shape(4) == (2, 2)
    assert neighbours(5, 12, "torus") == [1, 4, 6, 9]  # row 1, column 1 of 3 × 4
    assert neighbours(0, 12, "torus") == [1, 3, 4, 8]  # wrapping both ways
    assert neighbours(0, 6, "torus") == [1, 2, 3]  # 2 × 3: up and down are one rank
    for world, topology in [(5, "ring"), (12, "torus"), (6, "torus"), (9, "torus")]:
        near = {r: neighbours(r, world, topology) for r in range(world)}
        assert len({len(n) for n in near.values()}) == 1, near
        assert all(i in near[j] for i in near for j in near[i]), near


def test_wire_bytes_are_the_payload_to_each_neighbour():
    n = 10_000
    topk = ccfx.codecs.prototype("topk:ratio=0.05").wire_bytes((n,), torch.float32)
    assert topk == 500 * (4 + 4)  # values and int32 indices
    assert gossip_wire_bytes(n, "topk:ratio=0.05", 4) == 2 * topk
    assert gossip_wire_bytes(n, "topk:ratio=0.05", 2) == topk
    assert gossip_wire_bytes(n, "none", 16, "torus") == 4 * 4 * n


@pytest.mark.parametrize("options, words", [
    ({"topology": "mesh"}, "unknown gossip topology 'mesh'"),
    ({"gamma": 0.0}, "gamma=0.0 is outside (0, 1]"),
    ({"gamma": 1.5}, "gamma=1.5 is outside (0, 1]"),
    ({"every": 0}, "every=0"),
])
def test_bad_options_are_config_errors(options, words):
    with pytest.raises(ccfx.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ccfx.gossip(w.Vector(4), **options)


def test_world_one_without_a_process_group_is_a_config_error():
    with pytest.raises(ccfx.ConfigError, match="gossip needs a process group"):
        ccfx.gossip(w.Vector(4))


@pytest.mark.parametrize("spec, words", [
    ("topk:ratio=0.01,ef", "CHOCO keeps its own error memory"),
    ("powersgd:rank=2", "PowerSGD"),
    ("tlc", "size depends on the data"),
    ("randomk:ratio=0.1", "its decode keeps state (decode_step)"),
])
def test_codecs_gossip_cannot_use_are_config_errors(spec, words):
    with pytest.raises(ccfx.ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        gossip_codec(spec)
    assert gossip_codec("int8").name == "int8" and gossip_codec("qsgd").name == "qsgd"


def test_a_torus_that_does_not_factor_is_a_config_error():
    with pytest.raises(ccfx.ConfigError, match="5 ranks do not factor"):
        torus_shape(5)
    with pytest.raises(ccfx.ConfigError, match=r"torus shape \(2, 3\) does not fit 8 ranks"):
        neighbours(0, 8, "torus", (2, 3))


# -- three ranks on a ring ----------------------------------------------------------------------

THREE = ranks.Shared(3, [
    scenario("exact", w.exact_average, 64),
    scenario("mean", w.mean_kept, 256, "topk:ratio=0.25", 0.4, 5),
    scenario("quadratic", w.quadratic, 256, "topk:ratio=0.1", 0.3, 120, 20),
    scenario("world one", w.world_one),
], timeout_s=240)


@pytest.fixture(scope="module")
def three(shared_ranks):
    return shared_ranks[THREE]


@pytest.mark.slow
def test_identity_codec_and_gamma_one_average_a_ring_of_three_in_one_step(three):
    """On a ring of 3 every rank neighbours both others, w = 1/3. With Q = identity the new
    public copies are x̂_j = x̂_j⁰ + (x_j − x̂_j⁰) = x_j, so with γ = 1
    x_i + Σ_j (x̂_j − x̂_i)/3 = x_i − x̂_i + mean_j x̂_j = mean_j x_j: exact averaging, up to
    the rounding of a handful of fp32 operations on values ≤ max|x| (bound: 8 ulps of it)."""
    rows = three["exact"]
    mean = sum(r["before"] for r in rows) / 3
    bound = 8 * EPS * float(max(r["before"].abs().max() for r in rows))
    for r, row in enumerate(rows):
        assert row["neighbours"] == [j for j in range(3) if j != r]
        assert float((row["after"] - mean).abs().max()) <= bound, r
        assert not torch.allclose(row["before"], mean, atol=1e-2)  # it did move
        assert row["steps"] == 1 and row["sent"] == 2 * 64 * 4  # fp32 payload to 2 neighbours
    # the public copies every rank keeps of every rank (itself included) are bit-identical
    assert rows[0]["public"] == rows[1]["public"] == rows[2]["public"]


@pytest.mark.slow
def test_the_gossip_step_keeps_the_mean_of_the_ranks(three):
    """W doubly stochastic: Σ_i Σ_j w_ij (x̂_j − x̂_i) = 0, so with topk (biased) the mean over
    ranks after each step equals the mean before, to fp32 rounding (8 ulps of max|x|), while
    the ranks move together."""
    row = three["mean"][0]
    bound = 8 * EPS * row["scale"]
    for before, after in itertools.pairwise(row["means"]):
        assert float((after - before).abs().max()) <= bound
    first, last = row["consensus"]
    assert last < first / 10


@pytest.mark.slow
def test_compressed_gossip_pulls_sgd_ranks_together_on_a_quadratic(three):
    """SGD on ½||x − b_i||² with a different b_i per rank: alone each rank would go to its b_i
    (consensus error ≈ that of the b_i, ~2); gossip through topk 10 % shrinks the consensus
    error step after step towards a floor set by lr/γ, and the mean model heads for the
    optimum of Σ_i f_i, the mean of the b_i."""
    row = three["quadratic"][0]
    errors = row["consensus"]
    assert errors[0] > 1 and row["consensus_of_targets"] > 1
    assert all(b <= a * 1.01 for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < row["consensus_of_targets"] / 50, errors
    # gossip keeps the mean, and f_i's gradients are linear: the mean model takes plain SGD
    # steps on the mean objective, closing its distance to the optimum by 1 − lr = 0.95 a step
    assert row["to_optimum"] < 0.01  # 0.95 ** 120 ≈ 0.002 of a start ~1.2 away
    assert row["steps"] == row["calls"] == 120  # every optimizer step gossiped (the hook)
    k = 26  # topk 10 % of 256
    assert row["sent"] == 120 * 2 * k * (4 + 4)


@pytest.mark.slow
def test_a_group_of_one_rank_is_a_config_error(three):
    for got in three["world one"]:
        assert got.startswith("ConfigError: gossip needs at least 2 ranks"), got


@pytest.mark.slow
def test_a_dead_neighbour_is_named():
    """Ring of 3, rank 2 SIGKILLed after one gossip step: both survivors neighbour it, and
    their next step is a CollectiveError naming neighbour rank 2, which has exited."""
    with pytest.raises(ranks.RankFailed) as e:
        ranks.spawn(w.neighbour_dies, 3, (2,), timeout_s=180, grace_s=60, pg_timeout_s=60)
    for r in (0, 1):
        got = e.value.results[r]
        assert got["error"] == "CollectiveError", got
        msg = got["message"]
        print(f"gossip, rank 2 of 3 dies: rank {r}'s error: {msg}")
        assert msg.startswith(f"rank {r}: gossip step 2 (ring, 'int8') failed "), msg
        assert "neighbour rank 2" in msg and "Rank 2 (" in msg and "has exited" in msg, msg
