"""A pipeline that goes wrong fails with an error that says what and where, in bounded time
(issue #9). Two gloo ranks; the default group's timeout is 20 s here. The cases where each rank
catches its error run in one spawn (the module-scoped fixture ``broken``: tests/ranks.py); a
rank that dies spawns its own."""

import pytest

from ccfx.errors import ConfigError
from ccfx.runtime.launch import RankFailed, spawn
from ccfx.runtime.pipeline import stage_indices

from . import pipeline_workers as pw
from .ranks import run_scenarios, scenario

SPAWN = {"grace_s": 60, "pg_timeout_s": 20}
#: the changed shape last: the first rank refuses it and closes the stages' group
CAUGHT = ["few_microbatches", "plan_mismatch", "shape_change"]


def _run(case):
    return spawn(pw.broken, 2, (case,), timeout_s=180, **SPAWN)


@pytest.fixture(scope="module")
def broken():
    return run_scenarios(2, [scenario(case, pw.broken, case) for case in CAUGHT],
                         timeout_s=300, **SPAWN)


@pytest.mark.slow
def test_fewer_microbatches_than_stages_is_a_config_error_on_every_rank(broken):
    for r in broken["few_microbatches"]:
        assert r["error"] == "ConfigError", r
        assert "1 microbatches for 2 stages" in r["message"] and "n_microbatches >= 2" in r["message"]


@pytest.mark.slow
def test_ranks_with_different_codecs_fail_when_the_stages_are_built(broken):
    for r in broken["plan_mismatch"]:
        assert r["error"] == "ConfigError", r
        assert "planned different stages" in r["message"]


@pytest.mark.slow
def test_a_changed_microbatch_shape_names_the_shapes_and_the_peer_fails_at_once(broken):
    first, last = broken["shape_change"]
    assert first["error"] == "ConfigError", first
    assert "[(7, 32)]" in first["message"] and "[(8, 32)]" in first["message"]
    # the last rank, blocked on a receive, fails when the first rank shuts its connections of
    # the stages' group (collective_timeout_s is 20 s here: gloo's wait did not run out)
    assert "Connection closed by peer" in last["message"], last
    assert "Timed out" not in last["message"] and last["elapsed"] < 10, last
    # the waiting rank says what it awaited, from whom, and why that rank stopped sending
    assert last["error"] == "CollectiveError", last
    assert "microbatch" in last["message"] and "(rank 0)" in last["message"], last["message"]
    assert "Rank 0 gave up first: stage 0 (rank 0): a microbatch of shapes [(7, 32)]" in \
        last["message"], last["message"]  # the recorded reason as text, not a JSON string


@pytest.mark.slow
def test_a_rank_that_dies_mid_training_is_an_error_not_a_hang():
    with pytest.raises(RankFailed) as e:
        _run("dies")
    text = str(e.value)
    assert "rank 1" in text and "code 3" in text
    survivor = e.value.results[0]
    assert survivor["error"] is not None and survivor["elapsed"] < 60
    # a ccfx error naming this rank, the peer stage and rank, and what was awaited
    assert survivor["error"] == "CollectiveError", survivor
    msg = survivor["message"]
    assert msg.startswith("rank 0: a pipeline transfer failed"), msg
    assert "stage 1 (rank 1)" in msg and "of microbatch" in msg, msg
    # named as exited every time: gloo sees the dead rank's sockets close a moment before its
    # process is gone, and the blame waits for that moment instead of calling it silent
    assert "Rank 1 (" in msg and "has exited" in msg, msg


@pytest.mark.slow
def test_a_frozen_rank_fails_its_peer_after_collective_timeout_s():
    # rank 1 stops itself (SIGSTOP) mid-training; the pipeline's group has
    # collective_timeout_s=8 (the default group's is 20 s here, 30 minutes under torchrun)
    with pytest.raises(RankFailed) as e:
        _run("frozen")
    survivor = e.value.results[0]
    assert survivor["error"] == "CollectiveError", survivor
    msg = survivor["message"]
    assert "stage 1 (rank 1)" in msg and "of microbatch" in msg, msg
    assert 6 < survivor["elapsed"] < 18, survivor["elapsed"]


@pytest.mark.slow
def test_a_dead_replica_fails_sync_grads_naming_the_bucket_and_the_rank():
    # PP x DP, one stage per replica: rank 1 exits after a step; rank 0's sync_grads exchange
    # over the replicas is a ccfx error, not gloo's alone
    with pytest.raises(RankFailed) as e:
        spawn(pw.replica_dies, 2, (), timeout_s=180, **SPAWN)
    survivor = e.value.results[0]
    assert survivor["error"] == "CollectiveError", survivor
    msg = survivor["message"]
    assert msg.startswith("rank 0 (replica 0 of 2): ccfx.sync_grads: the data-parallel exchange "
                          "of stage 0's bucket 0"), msg
    assert "Rank 1 (" in msg and "has exited" in msg, msg


def test_stage_placement_checks_the_world_size():
    assert stage_indices(1, 2, 4) == [1, 3]
    assert stage_indices(1, 2, 4, "v") == [1, 2]
    with pytest.raises(ConfigError, match="cannot share evenly"):
        stage_indices(0, 3, 4)
    with pytest.raises(ConfigError, match="2 stages per rank"):
        stage_indices(0, 2, 2, "v")
