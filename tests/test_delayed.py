"""ccfx.delayed_comm_hook (delayed data parallel with CD-SGD's correction) on eager DDP, on real
gloo ranks (127.0.0.1). The 2-rank scenarios run in the 2-rank spawn the modules share
(``ranks.Shared``); the dead peer in a spawn of its own. Workers: tests/delayed_workers.py.

The invariants (ccfx/runtime/delayed.py): every step applies the exchange of the step before
(zeros at step 0), the same bits on every rank; with codec ``none`` that is the synchronous
hook's gradient of step t-1, bit for bit; with a correction every k steps, once step c+1 (c a
correction step) has applied its gradient, the applied gradients sum to the exact means of
steps 0..c: bit for bit where every sum is exact (integer gradients, topk keeps values as they
are), to fp32 rounding otherwise."""

import pytest
import torch

import ccfx
from ccfx.runtime.delayed import DelayedHookState, compensated
from ccfx.runtime.launch import RankFailed, spawn

from . import delayed_workers as workers
from . import ranks
from .ranks import scenario

K = 3  # correct_every in the scenarios: corrections at steps 2, 5, ...; exact again at 3, 6
LAM = 20.0  # compensate (DC-ASGD-a's λ) in the scenarios: SGD at lr 0.05, so λ · lr = 1


def _two(tmp_path_factory):
    folder = tmp_path_factory.mktemp("delayed")
    return [
        scenario("none", workers.shifted, "none", None, 5),
        scenario("none corrected", workers.shifted, "none", K, 7),
        scenario("int8 corrected", workers.shifted, "int8", K, 5),
        scenario("topk window", workers.window_sums, "topk:ratio=0.25", K, 8),
        scenario("int8 ef window", workers.window_sums, "int8:ef", K, 8, integer=False),
        scenario("topk uncorrected", workers.window_sums, "topk:ratio=0.25", None, 8),
        scenario("train", workers.train_identical, "topk:ratio=0.1,ef", K, 5),
        scenario("resume fixed", workers.checkpoint_resume, "int8:ef", 2, str(folder / "fixed"),
                 {"find_unused_parameters": True}),
        scenario("resume rebuilt", workers.checkpoint_resume, "int8:ef", 2,
                 str(folder / "rebuilt"), {}),
        scenario("compensated", workers.compensation, LAM, 4),
        scenario("resume compensated", workers.checkpoint_resume, "int8:ef", 2,
                 str(folder / "compensated"), {"find_unused_parameters": True}, compensate=LAM),
    ]


#: In the 2-rank spawn the modules share (tests/ranks.py, ``Shared``).
TWO = ranks.Shared(2, _two, timeout_s=400)


@pytest.fixture(scope="module")
def two(shared_ranks):
    return shared_ranks[TWO]


@pytest.mark.slow
def test_with_none_each_step_applies_the_synchronous_hooks_previous_gradient(two):
    for r in two["none"]:
        assert r["step0_zero"]  # nothing has arrived at step 0: zeros, on every rank
        assert r["equal"] == [True] * 4  # steps 1..4 apply steps 0..3 of the synchronous hook
        assert r["steps"] == 5 and r["in_flight"] > 0  # step 4's exchange still travels
        assert r["found"]  # ccfx.ledger_of(ddp_model) finds the delayed hook's state
    assert two["none"][0]["digests"] == two["none"][1]["digests"]


@pytest.mark.slow
def test_a_correction_with_none_carries_only_rounding(two):
    # steps 1..6 apply steps 0..5; steps 3 and 6 apply the corrections of steps 2 and 5, which
    # send the step's gradient plus the window's rounding (mean of sums vs sum of means)
    for r in two["none corrected"]:
        assert r["equal"] == [True, True, False, True, True, False], r["err"]
        assert max(r["err"]) <= 1e-6 * r["scale"]
    assert two["none corrected"][0]["digests"] == two["none corrected"][1]["digests"]


@pytest.mark.slow
def test_a_lossy_codec_is_exact_only_outside_the_steps_it_compresses(two):
    r0, r1 = two["int8 corrected"]
    assert r0["digests"] == r1["digests"]  # the ranks apply the same bits
    # int8 with error feedback off: steps 1, 2 apply the int8 averages of steps 0, 1 (the
    # synchronous int8 hook's, exactly); step 3 the exact correction instead of step 2's int8
    assert r0["equal"] == [True, True, False, True]
    assert 0 < r0["err"][2] <= 0.05 * r0["scale"]


@pytest.mark.slow
def test_the_correction_makes_the_applied_sum_exact_bit_for_bit(two):
    # gap[t-1] = sum of applied[0..t] - sum of exact[0..t-1]: zero at t = 3, 6 (after the
    # corrections of steps 2, 5), the compression's debt elsewhere
    for r in two["topk window"]:
        assert r["zero"] == [False, False, True, False, False, True, False], r["gap"]
    # without correction the debt is never paid back at once
    assert not any(two["topk uncorrected"][0]["zero"])


@pytest.mark.slow
def test_the_correction_with_error_feedback_is_exact_to_rounding(two):
    for r in two["int8 ef window"]:
        gap = r["gap"]
        assert gap[2] <= 1e-6 * r["scale"] and gap[5] <= 1e-6 * r["scale"], gap
        assert min(gap[0], gap[1], gap[3], gap[4], gap[6]) > 1e-4 * r["scale"], gap


@pytest.mark.slow
def test_training_keeps_ranks_identical_through_ddps_bucket_rebuild(two):
    r0, r1 = two["train"]
    assert r0["grads"] == r1["grads"] and r0["params"] == r1["params"]
    assert r0["steps"] == 5
    raw, wire = r0["bytes"]
    assert 0 < wire < raw  # topk between corrections, fp32 at the correction


@pytest.mark.slow
def test_checkpoint_drains_and_resumes_bit_exact_with_fixed_buckets(two):
    for r in two["resume fixed"]:
        assert r["in_flight"] == 0  # state_dict() waited for the exchanges in flight
        assert {"stale", "owed", "residual"} <= set(r["names"])
        assert r["delayed"] == {"delay": 1, "correct_every": 2}
        assert r["resumed"] == r["straight"]
        assert r["warnings"] == []


@pytest.mark.slow
def test_resume_across_ddps_bucket_rebuild_warns_and_ranks_still_agree(two):
    r0, r1 = two["resume rebuilt"]
    assert r0["resumed"] == r1["resumed"]
    dropped = [w for w in r0["warnings"] if w.startswith("ccfx.delayed_comm_hook")]
    assert len(dropped) == 1 and "find_unused_parameters=True" in dropped[0]


@pytest.mark.slow
def test_compensation_moves_each_average_to_the_weights_it_is_applied_at(two):
    r0, r1 = two["compensated"]
    assert r0["digests"] == r1["digests"] and r0["params"] == r1["params"]  # same bits
    # step 1 follows step 0's zeros, so the weights had not moved: nothing to compensate;
    # steps 2 and 3 apply DC-ASGD-a's formula, a compensation well above rounding
    assert r0["size"][0] == 0.0 and min(r0["size"][1:]) > 1e-3 * r0["scale"], r0["size"]
    assert max(r0["err"]) <= 1e-5 * r0["scale"], r0["err"]


@pytest.mark.slow
def test_a_compensated_checkpoint_resumes_bit_exact(two):
    for r in two["resume compensated"]:
        assert {"stale", "owed", "prev", "mean_sq"} <= set(r["names"])
        assert r["resumed"] == r["straight"] and r["warnings"] == []


@pytest.mark.slow
def test_a_dead_peer_is_a_named_collective_error():
    with pytest.raises(RankFailed) as e:
        spawn(workers.dies_mid_run, 2, (), timeout_s=180, grace_s=60)
    survivor = e.value.results[0]
    assert survivor["error"] == "CollectiveError", survivor
    msg = survivor["message"]
    assert "rank 0 of 2: the DDP comm hook's exchange of bucket 0 (int8 via all_gather" in msg
    assert "Rank 1 (" in msg and "has exited" in msg, msg


# -- bad input, in this process -----------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -2, 1.5, True, "10"])
def test_correct_every_must_be_a_positive_integer(k):
    with pytest.raises(ccfx.ConfigError, match=r"correct_every=.*integer >= 1"):
        ccfx.delayed_comm_hook("int8", correct_every=k)


@pytest.mark.parametrize("lam", [0, -1.0, float("nan"), True, "1000"])
def test_compensate_must_be_a_positive_number(lam):
    with pytest.raises(ccfx.ConfigError, match=r"compensate=.*positive number"):
        ccfx.delayed_comm_hook("int8", compensate=lam)


def test_compensated_is_dc_asgd_a_in_fp32():
    g = torch.tensor([2.0, -1.0, 0.5], dtype=torch.bfloat16)
    w, prev = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.5, 1.5, 1.0])
    v = torch.tensor([4.0, 1.0, 0.25])
    out = compensated(g, w, prev, v, 0.5)
    # g + 0.5 · g² · (w − prev) / sqrt(v) = 2 + 0.5·4·0.5/2, −1 + 0.5·1·(−0.5)/1, 0.5 + 0
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [2.5, -1.25, 0.5]
    g32 = g.float()
    assert compensated(g32, w, prev, v, 0.5).tolist() == [2.5, -1.25, 0.5]
    assert g32.tolist() == [2.0, -1.0, 0.5]  # the average itself is left as it arrived


@pytest.mark.parametrize("spec, why", [("powersgd:rank=4,ef", "PowerSGD's second all-reduce"),
                                       ("tlc", "variable payload length")])
def test_a_codec_that_cannot_be_delayed_is_refused(spec, why):
    with pytest.raises(ccfx.ConfigError, match=why) as e:
        ccfx.delayed_comm_hook(spec)
    assert "ccfx.ddp_comm_hook(" in str(e.value)  # the synchronous hook is the fix


def test_a_bad_spec_fails_when_the_hook_is_made():
    with pytest.raises(ccfx.ConfigError, match="unknown codec"):
        ccfx.delayed_comm_hook("int9")


def test_a_checkpoint_with_another_correct_every_is_refused():
    saved = DelayedHookState("int8", correct_every=4).state_dict()
    assert saved["delayed"] == {"delay": 1, "correct_every": 4} and saved["state"] == {}
    with pytest.raises(ccfx.ConfigError, match="correct_every=4"):
        DelayedHookState("int8", correct_every=8).load_state_dict(saved)


def test_a_checkpoint_with_a_non_finite_stale_gradient_is_refused():
    saved = DelayedHookState("int8").state_dict()
    saved["buckets"] = {0: {"shapes": ((2,),), "dtype": torch.float32}}
    saved["state"] = {"ddp.bucket0.stale": torch.tensor([1.0, float("nan")])}
    with pytest.raises(ccfx.ConfigError, match="ddp.bucket0"):
        DelayedHookState("int8").load_state_dict(saved)
