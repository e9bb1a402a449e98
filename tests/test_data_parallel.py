"""Data parallel on real gloo ranks (127.0.0.1), bounded in time.

Starting ranks is what costs, so the scenarios run in one spawn per world size (module-scoped
fixtures ``two``, ``four``: tests/ranks.py) and each test asserts on what one scenario
returned; scenarios that break a rank on purpose run last. The goldens run in the shared spawn
too (their graphs name their process group by its fingerprint, whatever the process made
before), and so does the inductor lowering. World size 1 (torch's PowerSGD hook) and the tests
of how a failure itself is reported (a rank that dies, a rank that raises first) spawn their
own ranks. The workers live in tests/dp_workers.py;
they return data, the assertions are here."""

import pytest

import ccfx
from ccfx.runtime.launch import RankFailed, spawn

from . import dp_workers, ranks
from .ranks import scenario

GATHER_AND_SUM = ["none", "fp16", "int8", "sign", "topk:ratio=0.1,ef", "powersgd:rank=4"]
CODECS_ON_FOUR = ["none", "int8", "powersgd:rank=4"]
INDUCTOR_CODECS = ["none", "int8", "powersgd:rank=4"]
GOLDEN = {"int8": "dp_int8_buckets", "powersgd:rank=4": "dp_powersgd_buckets"}
#: collective_timeout_s of the uneven-batch scenario: long beside a recompile on a loaded
#: machine, so a rank that failed before it did not wait for it
UNEVEN_TIMEOUT_S = 40.0


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Every 2-rank scenario in one spawn; those that break a rank on purpose last (the stalled
    rank leaves the default group unusable)."""
    checkpoint = tmp_path_factory.mktemp("dp-checkpoint") / "c"
    return ranks.run_scenarios(2, [
        scenario("codecs", dp_workers.grads_by_codec, GATHER_AND_SUM),
        scenario("codecs inductor", dp_workers.grads_by_codec, INDUCTOR_CODECS, "inductor"),
        scenario("train", dp_workers.train_steps, "powersgd:rank=4,ef", 4),
        scenario("warmup", dp_workers.train_steps, "int8", 4, warmup_steps=2),
        scenario("resume", dp_workers.checkpoint_resume, "powersgd:rank=4,ef", str(checkpoint)),
        scenario("resume warmup", dp_workers.checkpoint_resume, "int8", str(checkpoint) + "w",
                 warmup_steps=4),
        *[scenario(f"golden {codec}", dp_workers.backward_graph, codec) for codec in GOLDEN],
        scenario("mismatched models", dp_workers.mismatched_models),
        scenario("inside ddp", dp_workers.inside_ddp),
        scenario("buffers", dp_workers.bn_buffers, True),
        scenario("buffers per rank", dp_workers.bn_buffers, False),
        scenario("uneven", dp_workers.uneven_last_batch, UNEVEN_TIMEOUT_S),
        scenario("branch", dp_workers.branch_on_one_rank, UNEVEN_TIMEOUT_S),
        scenario("stall", dp_workers.stalls_mid_step, 8.0),
    ], timeout_s=600)


#: In the 4-rank spawn the modules share (tests/ranks.py, ``Shared``).
FOUR = ranks.Shared(4, [scenario("codecs", dp_workers.grads_by_codec, CODECS_ON_FOUR)],
                    timeout_s=300)


@pytest.fixture(scope="module")
def four(shared_ranks):
    return shared_ranks[FOUR]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_codec_averages_like_the_reference_and_ranks_agree_bit_for_bit(world, request):
    codecs = GATHER_AND_SUM if world == 2 else CODECS_ON_FOUR
    results = request.getfixturevalue({2: "two", 4: "four"}[world])["codecs"]
    for codec in codecs:
        per_rank = [r[codec] for r in results]
        assert all(r["same_init"] for r in per_rank), f"{codec}: rank 0's parameters not broadcast"
        assert len({r["digest"] for r in per_rank}) == 1, f"{codec}: ranks' gradients differ"
        # none: DDP's average; fp16: a cast; the others: the reference computes the same codec
        bound = {"none": 1e-6, "fp16": 2e-3}.get(codec, 1e-5)
        assert per_rank[0]["err"] <= bound, (codec, per_rank[0]["err"])
        raw, wire = per_rank[0]["ledger"]
        assert raw > 0 and wire == sum(w for _, _, w in per_rank[0]["buckets"])
        if codec != "none":
            assert wire < raw
    collectives = {c: {b[1] for b in results[0][c]["buckets"] if b[0] != "none"} for c in codecs}
    assert collectives["int8"] == {"all_gather"}
    assert collectives["powersgd:rank=4"] == {"powersgd"}
    if world == 2:
        assert collectives["fp16"] == {"all_reduce"}
        assert collectives["sign"] == {"all_gather"}


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_lowering_matches_ddp_and_agrees_across_ranks(two):
    results = two["codecs inductor"]
    for codec in INDUCTOR_CODECS:
        assert len({r[codec]["digest"] for r in results}) == 1, codec
        assert results[0][codec]["err"] <= (1e-6 if codec == "none" else 1e-5), codec


@pytest.mark.slow
def test_training_keeps_ranks_identical_and_counts_every_step(two):
    results = two["train"]
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["ledger_steps"] == 4
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.slow
def test_warmup_steps_send_uncompressed_then_compress(two):
    results = two["warmup"]
    raw, wire = results[0]["bucket_bytes"]
    # 2 of 4 steps raw, 2 compressed: the per-step average sits between the two
    assert results[0]["params"] == results[1]["params"]
    assert 0.25 * raw < wire < 0.75 * raw


@pytest.mark.slow
def test_checkpoint_resume_is_bit_exact(two):
    results = two["resume"]
    for r in results:
        assert r["state_tensors"] > 0
        assert r["resumed"] == r["straight"]


@pytest.mark.slow
def test_checkpoint_resume_keeps_the_warmup_count_and_refuses_another_rank(two):
    for rank, r in enumerate(two["resume warmup"]):
        # resumed after 3 of 4 warm-up steps: one more uncompressed step, then int8, as the
        # straight run (without the count in codec_state: two more warm-up steps)
        assert r["resumed"] == r["straight"]
        assert r["steps"] == 5
        peers = f"rank: the checkpoint's is {1 - rank}, this run's is {rank}"
        other = "world_size: the checkpoint's is 3, this run's is 2"
        for case, differs in (("peer's", peers), ("other world", other)):
            got = r[case]
            assert got["error"] == "ConfigError", (case, got)
            assert differs in got["message"] and "same number of ranks" in got["message"], got
    for r in two["resume"]:  # powersgd with error feedback: the same refusals
        assert r["peer's"]["error"] == r["other world"]["error"] == "ConfigError"


@pytest.mark.slow
def test_world_size_one_equals_torch_powersgd_hook():
    (result,) = spawn(dp_workers.powersgd_hook_world1, 1, (5,), timeout_s=180)
    # steps 0-1 uncompressed (start_powerSGD_iter=2), 2-4 PowerSGD with error feedback
    assert max(result["rel_errs"]) < 1e-5, result["rel_errs"]


@pytest.mark.slow
def test_ranks_with_different_models_fail_at_compile_with_a_clear_error(two):
    results = two["mismatched models"]
    for r in results:
        assert r["error"] == "ConfigError"
        assert "planned different gradient buckets" in r["message"]


@pytest.mark.slow
def test_a_dead_rank_is_an_error_within_the_timeout_named_by_rank_not_only_by_address():
    """One spawn of 3 ranks, rank 2 exiting after compiling: every survivor (its ring
    neighbour and the rank beyond) fails in bucket 0 within the timeout, not a hang."""
    with pytest.raises(RankFailed) as e:
        spawn(dp_workers.dies_mid_step, 3, (20.0, 2), timeout_s=180, grace_s=60)
    assert "rank 2" in str(e.value)  # the rank that died
    for r in (0, 1):
        survivor = e.value.results[r]
        assert survivor["error"] == "CollectiveError", survivor
        assert f"rank {r} of 3" in survivor["message"], survivor["message"]
        assert "bucket 0" in survivor["message"], survivor["message"]
        # gloo names an address; ccfx names the rank behind it (and keeps the address)
        assert "Rank 2 (" in survivor["message"] and "has exited" in survivor["message"], \
            survivor["message"]
        assert survivor["elapsed"] < 60


@pytest.mark.slow
@pytest.mark.parametrize("how, verb", [("dies", "has exited"), ("frozen", "is stopped")])
def test_a_dead_or_frozen_rank_under_the_comm_hook_is_named_with_the_bucket(how, verb):
    # eager DDP with ccfx.ddp_comm_hook: the hook's error reaches backward()'s caller as it is;
    # a frozen peer is named at collective_timeout_s (3 s), not at the group's timeout
    with pytest.raises(RankFailed) as e:
        spawn(dp_workers.hook_dies_mid_step, 2, (how,), timeout_s=180, grace_s=60)
    survivor = e.value.results[0]
    assert survivor["error"] == "CollectiveError", survivor
    msg = survivor["message"]
    assert "rank 0 of 2: the DDP comm hook's exchange of bucket 0 (int8 via all_gather" in msg, msg
    assert "Rank 1 (" in msg and verb in msg, msg
    assert survivor["since"] < 60, survivor


def test_without_a_process_group_data_parallel_is_world_size_one():
    model = dp_workers.mlp(seed=0)
    compiled = dp_workers.compile_dp(model, "int8")
    dp_workers.loss_fn(compiled(dp_workers.batch(0))).backward()
    plan = ccfx.plan_of(compiled)
    assert plan.data_parallel.world_size == 1 and plan.data_parallel.backend == "none"
    assert "world size 1" in str(plan)
    assert {b.codec for b in plan.buckets} == {"int8", "none"}
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_compiled_model_inside_ddp_with_data_parallel_is_refused(two):
    results = two["inside ddp"]  # DDP(torch.compile(model)): ccfx compiles in DDP's forward
    for result in results:
        assert "DistributedDataParallel" in result and "ddp_comm_hook" in result


@pytest.mark.slow
@pytest.mark.parametrize("codec, name", list(GOLDEN.items()))
def test_golden_backward_issues_each_collective_early_and_waits_late(two, codec, name):
    from pathlib import Path

    from ccfx.testing import assert_golden

    # In the shared spawn, after other scenarios: the graph names its process group by the
    # fingerprint of what the ranks agreed on, never by how many groups the process made.
    result, _ = two[f"golden {codec}"]
    assert_golden(Path(__file__).parent / "golden" / f"{name}.txt", result["text"])
    targets = result["targets"]
    issued = [i for i, t in enumerate(targets) if "all_gather" in t or "all_reduce" in t]
    waits = [i for i, t in enumerate(targets) if "wait_tensor" in t]
    matmuls = [i for i, t in enumerate(targets) if t.startswith("aten.mm")]
    assert result["buckets"] >= 3 and issued and len(waits) == len(issued)
    # the first bucket's collective is issued while backward still has matrix products to do
    # (it overlaps them), and the last waits come after the last collective is issued
    assert any(m > issued[0] for m in matmuls) and waits[-1] > issued[-1]


@pytest.mark.slow
def test_a_stalled_rank_is_an_error_after_the_collective_timeout(two):
    survivor, _ = two["stall"]
    assert survivor["error"] == "CollectiveError", survivor
    assert "rank 0 of 2" in survivor["message"] and "timeout 8 s" in survivor["message"]
    # below half the stalled rank's stay: rank 0 gave up on its own timeout (8 s), it did not
    # wait for rank 1's exit
    assert 6 < survivor["elapsed"] < dp_workers.STALL_S / 2, survivor["elapsed"]


@pytest.mark.slow
def test_buffers_follow_rank_0_as_ddps_default_or_stay_per_rank(two):
    # DDP's broadcast_buffers=True: a forward with grad enabled starts from rank 0's buffers
    r0, r1 = two["buffers"]
    assert r0["buffers"] == r1["buffers"] and r0["rank0"] and r1["rank0"]
    # broadcast_buffers=False: BatchNorm statistics stay each rank's own
    r0, r1 = two["buffers per rank"]
    assert r0["buffers"] != r1["buffers"] and not r1["rank0"]


@pytest.mark.slow
def test_an_uneven_last_batch_names_the_rank_that_recompiled_at_once_on_both_ranks(two):
    waiting, recompiled = two["uneven"]
    why = "rank 1 recompiled graph 0 (as graph 1) because input 0's shape changed (16, 64) -> (5,"
    # the rank that recompiled sees its peer wait in a collective it will not join: at once
    assert recompiled["error"] == "ConfigError", recompiled
    assert why.capitalize() in recompiled["message"], recompiled["message"]
    assert "drop_last=True" in recompiled["message"] and "dynamic=True" in recompiled["message"]
    assert recompiled["elapsed"] < UNEVEN_TIMEOUT_S / 2, recompiled["elapsed"]
    # the waiting rank, blocked in gloo, fails as soon as rank 1 shuts its connections of the
    # group (not when collective_timeout_s ends gloo's wait), and says why
    assert waiting["error"] == "CollectiveError", waiting
    assert "Connection closed by peer" in waiting["message"], waiting["message"]
    assert "Timed out" not in waiting["message"], waiting["message"]
    assert waiting["elapsed"] < UNEVEN_TIMEOUT_S / 2, waiting["elapsed"]
    assert why.capitalize() in waiting["message"], waiting["message"]
    assert "Rank 1 gave up first" in waiting["message"]


@pytest.mark.slow
def test_a_branch_one_rank_alone_takes_names_dynamos_failed_guard_at_once(two):
    waiting, recompiled = two["branch"]
    why = "Rank 1 recompiled graph 0 (as graph 1) because Dynamo's guard failed:"
    assert recompiled["error"] == "ConfigError", recompiled
    assert why in recompiled["message"] and "doubled" in recompiled["message"], recompiled
    assert waiting["error"] == "CollectiveError", waiting
    assert why in waiting["message"] and "Connection closed by peer" in waiting["message"], \
        waiting["message"]
    assert waiting["elapsed"] < UNEVEN_TIMEOUT_S / 2, waiting["elapsed"]


@pytest.mark.slow
def test_the_rank_that_failed_first_is_reported_as_the_cause():
    # Rank 0's collective fails *because* rank 1 raised and tore its group down; rank 0's
    # error may reach the parent first, but the report must lead with rank 1's.
    with pytest.raises(RankFailed) as e:
        spawn(dp_workers.one_rank_raises, 2, (), timeout_s=120, grace_s=30, pg_timeout_s=20)
    text = str(e.value)
    assert text.startswith("rank 1 of 2 failed first"), text[:400]
    assert "ValueError: the first error, on rank 1" in text
