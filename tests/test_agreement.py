"""One agreement mechanism, keyed by what is agreed (``ccfx.wire.agree``), on 2 gloo ranks.

A model compiled on one rank only (an eval copy, a rank-0-only evaluation that recompiles the
training model) publishes other fingerprints and never shifts the keys, groups or broadcasts
the training waits on; ranks that truly diverge fail with a ConfigError naming both
fingerprints and what differs, within seconds. One spawn (tests/ranks.py); the diverging
scenarios last. Its own spawn, not the 2-rank one the modules share (``ranks.Shared``): that
one runs the modules in name order, this one's first, and its diverging scenarios make ranks
give up at agreements on purpose (what a rank gave up on stays in the store, where later
agreements' waits read it): they stay last, with no other module's scenarios after them."""

import re

import pytest

from ccfx.wire import agree

from . import agreement_workers as w
from .ranks import run_scenarios, scenario


@pytest.fixture(scope="module")
def two():
    return run_scenarios(2, [
        scenario("normal", w.train),
        scenario("eval copy first", w.train, "eval copy first"),
        scenario("normal, dropout", w.train, "none", 0.2),
        scenario("eval mid-training", w.train, "eval mid-training", 0.2),
        scenario("pipeline", w.pipeline_auto, False),
        scenario("pipeline, extra model on rank 0", w.pipeline_auto, True),
        scenario("diverged", w.diverged),
        scenario("met again", w.met_again),
    ], timeout_s=500)


def _same_run(results, reference):
    (r0, r1), (n0, n1) = results, reference
    assert r0["params"] == r1["params"]  # bit-equal across ranks
    assert r0["params"] == n0["params"] and r1["params"] == n1["params"]  # as without it
    assert r0["losses"] == n0["losses"] and r1["losses"] == n1["losses"]


@pytest.mark.slow
def test_an_eval_copy_compiled_first_on_rank_0_does_not_disturb_training(two):
    _same_run(two["eval copy first"], two["normal"])


@pytest.mark.slow
def test_a_rank_0_only_evaluation_mid_training_keeps_training_bit_equal(two):
    _same_run(two["eval mid-training"], two["normal, dropout"])
    r0, r1 = two["eval mid-training"]
    assert r0["graphs"] > r1["graphs"]  # rank 0 really compiled the evaluation on its own


@pytest.mark.slow
def test_pipeline_auto_choice_is_the_training_models_after_an_extra_compile_on_rank_0(two):
    r0, r1 = two["pipeline, extra model on rank 0"]
    assert r0["choice"] and r1["choice"] == r0["choice"]
    assert r0["choice"] == two["pipeline"][0]["choice"]  # the same question, the same answer
    assert (r0["stages"], r1["stages"]) == ([0], [1])


@pytest.mark.slow
def test_ranks_with_different_options_fail_within_seconds_naming_both_fingerprints(two):
    r0, r1 = two["diverged"]
    prints = []
    for r in (r0, r1):
        assert r["error"] == "ConfigError", r
        assert r["elapsed"] < 60, r  # compile time included; the verdict itself is a poll
        assert "planned different gradient buckets" in r["message"]
        assert "gradient_codec" in r["message"]  # what differs
        found = re.findall(r"fingerprint ([0-9a-f]{16})|has ([0-9a-f]{16})", r["message"])
        prints.append({a or b for a, b in found})
    assert len(prints[0]) == 2 and prints[0] == prints[1]


@pytest.mark.slow
def test_a_verdict_on_one_wait_does_not_fail_a_later_wait_at_the_same_agreement(two):
    # the same description reached again (a retried build, the next scenario in one process)
    for r in two["met again"]:
        assert r["first"]["error"] == "ConfigError", r
        assert r["second"]["error"] is None, r["second"]
    assert two["met again"][0]["second"]["value"] == two["met again"][1]["second"]["value"]


def test_fingerprints_are_canonical_and_diffs_name_the_paths():
    a = {"options": {"gradient_codec": "int8", "bucket_mb": 25}, "code": "x"}
    b = {"code": "x", "options": {"bucket_mb": 25, "gradient_codec": "int8"}}
    assert agree.fingerprint(a) == agree.fingerprint(b) and len(agree.fingerprint(a)) == 16
    c = {"code": "x", "options": {"bucket_mb": 25, "gradient_codec": "none"}}
    assert agree.diff(a, c) == ['options.gradient_codec ("int8" vs "none")']
    assert agree.group_name("w", a, (0, 1)) != agree.group_name("w", a, (0, 2))


def test_without_a_process_group_nothing_waits():
    assert agree.from_rank0("q", {"x": 1}, lambda: 42, timeout_s=1) == 42
    assert agree.group("g", {"x": 1}, timeout_s=1) is None
    assert agree.meet("m", {"x": 1}, timeout_s=1) == agree.fingerprint(
        {"what": "m", "ranks": [0], "desc": {"x": 1}})
