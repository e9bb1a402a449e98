"""ccfx.ddp_comm_hook on eager DDP, on real gloo ranks (127.0.0.1). The 2-rank scenarios run
in the 2-rank spawn the modules share, the 3-rank ring in the 3-rank one (``ranks.Shared``,
tests/ranks.py).
The workers live in tests/comm_hook_workers.py; they return data, the assertions are here."""

import pytest
import torch

import ccfx
from ccfx.runtime.comm_hook import CommHookState

from . import comm_hook_workers as workers
from . import ranks
from .ranks import scenario

SPECS = ["none", "fp16", "int8", "topk:ratio=0.1,ef", "powersgd:rank=4"]
#: against the reference (tests/comm_hook_workers.py:_reference): fp16 is a cast of the mean
BOUND = {"none": 1e-6, "fp16": 2e-3}


def _two(tmp_path_factory):
    folder = tmp_path_factory.mktemp("comm-hook")
    return [
        scenario("codecs", workers.one_step_per_codec, SPECS),
        scenario("train", workers.train_steps, "powersgd:rank=4,ef", 4),
        scenario("resume fixed", workers.checkpoint_resume, "powersgd:rank=4,ef",
                 str(folder / "fixed"), {"find_unused_parameters": True}),
        scenario("resume rebuilt", workers.checkpoint_resume, "powersgd:rank=4,ef",
                 str(folder / "rebuilt"), {}),
    ]


#: In the 2-rank spawn the modules share (tests/ranks.py, ``Shared``).
TWO = ranks.Shared(2, _two, timeout_s=400)


@pytest.fixture(scope="module")
def two(shared_ranks):
    return shared_ranks[TWO]


@pytest.mark.slow
def test_every_codec_averages_like_the_reference_and_ranks_agree_bit_for_bit(two):
    results = two["codecs"]
    for spec in SPECS:
        per_rank = [r[spec] for r in results]
        assert len({r["digest"] for r in per_rank}) == 1, f"{spec}: ranks' gradients differ"
        r = per_rank[0]
        assert r["buckets"] >= 2, r["buckets"]
        assert r["grads_are_results"], f"{spec}: DDP's gradients are not the hook's results"
        assert r["err_vs_reference"] <= BOUND.get(spec, 1e-5), (spec, r["err_vs_reference"])
        assert r["steps"] == 1
    assert results[0]["none"]["err_vs_ddp"] <= 1e-6  # the identity codec is plain DDP


@pytest.mark.slow
def test_training_keeps_ranks_identical_through_ddps_bucket_rebuild(two):
    results = two["train"]
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["steps"] == 4
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    # one bucket in DDP's first iteration, then its rebuilt small ones: state follows them
    assert len(results[0]["buckets"]) >= 2


#: In the 3-rank spawn the modules share (tests/ranks.py, ``Shared``).
THREE = ranks.Shared(3, [scenario("ring", workers.train_steps, "int8", 3, "ring")],
                     timeout_s=180)


@pytest.fixture(scope="module")
def three(shared_ranks):
    return shared_ranks[THREE]


@pytest.mark.slow
def test_ring_collective_keeps_three_ranks_identical(three):
    results = three["ring"]
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]
    assert "ring" in results[0]["collectives"]  # biases' small buckets may all-reduce raw
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.slow
def test_checkpoint_resume_is_bit_exact_with_fixed_buckets(two):
    results = two["resume fixed"]
    for r in results:
        assert r["saved_buckets"] >= 2
        assert r["resumed"] == r["straight"]
        assert r["steps"] == 5
        assert r["warnings"] == []


@pytest.mark.slow
def test_resume_across_ddps_bucket_rebuild_warns_and_ranks_still_agree(two):
    results = two["resume rebuilt"]
    assert results[0]["resumed"] == results[1]["resumed"]
    for r in results:
        assert len(r["warnings"]) == 1 and "find_unused_parameters=True" in r["warnings"][0]


@pytest.mark.parametrize("spec", ["int9", "int8:blok=64", "topk:ratio=abc", ""])
def test_a_bad_spec_fails_when_the_hook_is_made(spec):
    with pytest.raises(ccfx.ConfigError):
        ccfx.ddp_comm_hook(spec)


def test_the_spec_error_lists_the_codecs():
    with pytest.raises(ccfx.ConfigError, match="available: .*int8.*powersgd"):
        ccfx.ddp_comm_hook("int9")


def test_loaded_state_not_used_yet_is_saved_again():
    state, _ = ccfx.ddp_comm_hook("powersgd:ef")
    saved = {"spec": "powersgd:rank=4,ef", "steps": 7,
             "buckets": {0: {"shapes": ((8, 16),), "dtype": torch.float32,
                             "state": {"q0000": torch.randn(16, 4),
                                       "residual0000": torch.randn(8, 16)}}}}
    state.load_state_dict(saved)
    again = state.state_dict()
    assert again["steps"] == 7
    for name, t in saved["buckets"][0]["state"].items():  # the earlier layout, loaded
        assert torch.equal(again["state"][f"ddp.bucket0.{name}"], t)  # saved as ccfx names it


def test_state_for_another_codec_is_refused():
    state = CommHookState("int8")
    with pytest.raises(ccfx.ConfigError, match="checkpoint's spec"):
        state.load_state_dict({"spec": "powersgd", "steps": 0, "buckets": {}})
