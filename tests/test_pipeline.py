"""The pipeline on real gloo ranks equals the single-process simulation (issue #9).

For one seed, model, microbatching and codecs, torch's schedules running ccfx's compressed
stages on N ranks and the compiled model called microbatch by microbatch in one process give
the same losses, gradients and parameters after a few SGD steps: bit for bit where the same
kernels run in the same order (the identity codec, int8, PowerSGD all encode and decode the
same tensors in the same order), to float rounding where a sum is split over ranks (a tied
embedding's two partial gradients are all-reduced). The ledgers agree byte for byte.

Starting ranks is what costs, so every scenario of one world size runs in one spawn (the
module-scoped fixtures ``two``, ``three``, ``four``: tests/ranks.py) and each test asserts on what
its scenario returned; the single-process simulations run here, in the test.
Workers: tests/pipeline_workers.py.
"""

import re

import pytest
import torch

from . import pipeline_workers as pw
from .ranks import Shared, raised, run_scenarios, scenario

N_MICRO, STEPS = 4, 3

CASES = [
    # model, ranks, stages, codec, gradient codec, schedule
    ("mlp", 2, 2, "none", None, "Schedule1F1B"),
    ("mlp", 2, 2, "int8", None, "Schedule1F1B"),
    ("mlp", 2, 2, "none", "powersgd:rank=2", "ScheduleGPipe"),  # Optimus-CC's backprop
    ("mlp", 2, 4, "int8", "powersgd:rank=2", "ScheduleInterleaved1F1B"),
    ("skip", 3, 3, "int8", None, "Schedule1F1B"),  # the skip crosses both cuts
    ("skip", 3, 3, "none", "powersgd:rank=2,ef", "ScheduleGPipe"),
    ("gpt", 2, 2, "int8", None, "Schedule1F1B"),  # tied embedding / LM head
    # its (2, 16, 32) activation gradient is a (32, 32) matrix to PowerSGD
    ("llama", 2, 2, "none", "powersgd:rank=2", "Schedule1F1B"),
    ("mlp", 2, 4, "int8", None, "ScheduleZBVZeroBubble"),  # eager stages only
]


IDS = ["-".join(str(v) for v in c if v) for c in CASES]
#: the skip model on 3 ranks: the edges leaving stage 0 go int8 forward / PowerSGD backward,
#: those leaving stage 1 int4 both ways; the default (none) is used nowhere
OVERRIDES = {"stage 0": "int8/powersgd:rank=2", "stage 1": "int4"}
EPILOGUE_SCHEDULES = ["Schedule1F1B", "ScheduleGPipe"]


def _case_scenarios(world: int) -> list[tuple]:
    return [scenario(name, pw.pipeline, m, s, c, g, N_MICRO, STEPS, sch)
            for name, (m, w, s, c, g, sch) in zip(IDS, CASES) if w == world]


@pytest.fixture(scope="module")
def two():
    """The 2-rank cases, the checkpoint, the evaluation; last, the zero-bubble schedule with
    compiled stages, which must fail."""
    return run_scenarios(2, [
        *_case_scenarios(2),
        scenario("resume", pw.resume, "int8:ef", "powersgd:rank=2", N_MICRO),
        scenario("eval", pw.evaluate, "int8", N_MICRO),
        scenario("zero bubble compiled", raised, pw.pipeline, "mlp", 4, "none", None,
                 N_MICRO, 1, "ScheduleZBVZeroBubble", 0.05, "inductor"),
    ], timeout_s=900)


#: In the 3-rank spawn the modules share (tests/ranks.py, ``Shared``).
THREE = Shared(3, [
    *_case_scenarios(3),
    scenario("overrides", pw.pipeline, "skip", 3, "none", None, N_MICRO, STEPS,
             "Schedule1F1B", 0.05, "eager", OVERRIDES),
    scenario("epilogue", pw.epilogue_pairs, N_MICRO, EPILOGUE_SCHEDULES),
], timeout_s=700)


@pytest.fixture(scope="module")
def three(shared_ranks):
    return shared_ranks[THREE]


#: In the 4-rank spawn the modules share (tests/ranks.py, ``Shared``).
FOUR = Shared(4, [
    scenario("pp x dp mlp", pw.pipeline_dp, "mlp", "int8", "none", 2, STEPS),
    scenario("pp x dp gpt", pw.pipeline_dp, "gpt", "int8", "powersgd:rank=2,ef", 2, STEPS),
    scenario("selective", pw.selective_stages, 2, 2),
], timeout_s=700)


@pytest.fixture(scope="module")
def four(shared_ranks):
    return shared_ranks[FOUR]


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("model,world,stages,codec,grad_codec,schedule", CASES, ids=IDS)
def test_the_pipeline_on_real_ranks_equals_the_simulation(request, model, world, stages,
                                                          codec, grad_codec, schedule):
    ref = pw.simulate(model, stages, codec, grad_codec, N_MICRO, STEPS)
    case = IDS[CASES.index((model, world, stages, codec, grad_codec, schedule))]
    ranks = request.getfixturevalue({2: "two", 3: "three"}[world])[case]
    exact = model != "gpt"  # the tied weight's gradient is summed over two ranks
    last = [r for r in ranks if r["losses"]]
    assert len(last) == 1 and len(last[0]["losses"]) == N_MICRO * STEPS
    for a, b in zip(last[0]["losses"], ref["losses"], strict=True):
        assert a == b if exact else abs(a - b) <= 1e-6 * max(1.0, abs(b)), (a, b)
    held = {}
    for r in ranks:
        for name, g in r["grads"].items():
            assert _close(g, ref["grads"][name], exact), (name, (g - ref["grads"][name]).abs().max())
        for name, p in r["params"].items():
            assert _close(p, ref["params"][name], exact), name
            held.setdefault(name, []).append(r["stages"])
    assert set(held) == set(ref["params"]), "every parameter is on some rank"
    if model == "gpt":  # the tied weight is on the first and the last rank, nowhere else
        assert [len(v) for v in held.values()].count(2) == 1
    else:  # each parameter on exactly one rank: no rank holds another stage's parameters
        assert all(len(v) == 1 for v in held.values())
    # each rank's ledger counts a step per schedule step (not the compiling call's one)
    assert [r["ledger_steps"] for r in ranks] == [STEPS] * len(ranks)
    if "ZBV" not in schedule:  # a V schedule's middle hop is local: no bytes on a wire
        for d in ("fwd", "bwd"):
            total = [sum(r["ledger"][d][k] for r in ranks) for k in (0, 1)]
            assert total == list(ref["ledger"][d]), (d, total, ref["ledger"][d])
    for d, spec in (("fwd", codec), ("bwd", grad_codec or codec)):
        raw, wire = (sum(r["ledger"][d][k] for r in ranks) for k in (0, 1))
        assert raw > 0
        assert (wire == raw) if spec == "none" else (wire < 0.6 * raw), (d, spec, wire, raw)


@pytest.mark.slow
def test_zero_bubble_with_compiled_stages_is_a_clear_error(two):
    errors = "\n".join(e for e in two["zero bubble compiled"] if e)  # per rank "Type: message"
    assert "ConfigError" in errors and "lowering='eager'" in errors


def _replica_losses(ranks) -> list[float]:
    """Per step, replica 0's microbatch losses then replica 1's: the simulation's order."""
    last = sorted((r for r in ranks if r["losses"]), key=lambda r: r["dp"])
    return [v for step in range(STEPS) for r in last for v in r["losses"][2 * step:2 * step + 2]]


def _pp_dp(four, model, codec):
    ref = pw.simulate(model, 2, codec, None, 2 * 2, STEPS)  # both replicas' microbatches
    return ref, four[f"pp x dp {model}"]


@pytest.mark.slow
def test_pp_x_dp_uncompressed_gradients_equal_the_simulation_of_the_whole_batch(four):
    ref, ranks = _pp_dp(four, "mlp", "int8")  # gradients uncompressed ("none")
    assert _replica_losses(ranks) == pytest.approx(ref["losses"], rel=1e-6)
    for r in ranks:
        assert r["buckets"][0] == r["buckets"][1] > 0  # gradient bytes, uncompressed
        for name, g in r["grads"].items():
            assert torch.allclose(g, ref["grads"][name], rtol=1e-5, atol=1e-7), name
        for name, p in r["params"].items():
            assert torch.allclose(p, ref["params"][name], rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
def test_pp_x_dp_compressed_gradients_keep_replicas_and_tied_copies_identical(four):
    ref, ranks = _pp_dp(four, "gpt", "int8")  # gradients "powersgd:rank=2,ef"
    by_rank = {r["rank"]: r for r in ranks}
    for a, b in ((0, 2), (1, 3)):  # the two replicas of each stage: the same bits
        assert by_rank[a]["params"].keys() == by_rank[b]["params"].keys()
        for name in by_rank[a]["params"]:
            assert torch.equal(by_rank[a]["params"][name], by_rank[b]["params"][name]), name
    tied = set(by_rank[0]["params"]) & set(by_rank[1]["params"])
    assert len(tied) == 1  # the embedding / LM head, on the first and the last stage
    name = tied.pop()
    assert torch.equal(by_rank[0]["params"][name], by_rank[1]["params"][name])
    for r in ranks:
        raw, wire = r["buckets"]
        assert wire < raw / 2
        # PowerSGD rank 2 is lossy step by step (error feedback repays it later): after 3 SGD
        # steps at lr 0.05 every weight (initialised at std 0.02) is within 1e-2 of the exact
        # run, and the losses within 1%.
        for n, p in r["params"].items():
            assert (p - ref["params"][n]).abs().max() < 1e-2, n
    losses = _replica_losses(ranks)
    assert len(losses) == len(ref["losses"])
    assert losses == pytest.approx(ref["losses"], rel=1e-2)


@pytest.mark.slow
def test_a_checkpoint_of_each_rank_resumes_with_identical_numerics(two):
    # Stateful codecs both ways: int8 with error feedback forward (the residual on the
    # sender), PowerSGD backward (its warm-start Q on the sender of the gradients).
    ranks = two["resume"]
    assert any(r["state_names"] for r in ranks)  # the codec state is in the checkpoint
    assert ranks[0]["state_names"] and ranks[1]["state_names"]
    # named <channel>.<state-name> (ccfx.codecs.state), the channel with the side keeping it
    channel = re.compile(r"ccfx_codec_state\.graph0\.edge\d+\.hop0to1\.(fwd|bwd)\."
                         r"(send|recv)\.\w+$")
    # beside it, what it was made for (ccfx_codec_state.meta.*: the stage, the codecs, ...)
    state = [n for r in ranks for n in r["state_names"] if ".meta." not in n]
    assert state and all(channel.match(n) for n in state), ranks[0]["state_names"]
    assert all("ccfx_codec_state.meta.stage" in r["state_names"] for r in ranks)
    for r in ranks:
        assert r["resumed"] == r["straight"]
        assert r["params_equal"]
    assert len(ranks[1]["straight"]) == 2 * N_MICRO


@pytest.mark.slow
def test_forward_only_eval_equals_the_simulation(two):
    ranks = two["eval"]
    assert ranks[0]["out"] is None  # the output is on the last stage's rank
    assert torch.equal(ranks[1]["out"], pw.simulate_forward("int8", N_MICRO))


@pytest.mark.slow
def test_codec_overrides_reach_the_wire(three):
    ref = pw.simulate("skip", 3, "none", None, N_MICRO, STEPS, overrides=OVERRIDES)
    ranks = three["overrides"]
    assert ranks[2]["losses"] == ref["losses"]
    for r in ranks:
        for name, p in r["params"].items():
            assert torch.equal(p, ref["params"][name]), name
    for d in ("fwd", "bwd"):
        total = [sum(r["ledger"][d][k] for r in ranks) for k in (0, 1)]
        assert total == list(ref["ledger"][d])
        assert total[1] < 0.5 * total[0]  # compressed both ways


@pytest.mark.slow
def test_epilogue_only_compresses_the_cool_down_backward_sends_only(three):
    from ccfx.wire.schedules import epilogue_backwards

    schedules = EPILOGUE_SCHEDULES
    ranks = three["epilogue"]
    for schedule in schedules:
        full, epi = zip(*(r[schedule] for r in ranks))
        assert full[2]["losses"] == pytest.approx(epi[2]["losses"], rel=1e-2)
        for rank in (1, 2):  # the ranks that send gradients back
            raw, wire_full = full[rank]["ledger"]["bwd"]
            raw_epi, wire_epi = epi[rank]["ledger"]["bwd"]
            assert raw_epi == raw and wire_full < raw
            # the cool-down microbatches go int8, the others raw
            k = len(epilogue_backwards(schedule[len("Schedule"):], rank, 3, N_MICRO))
            assert wire_epi == (N_MICRO - k) * raw // N_MICRO + k * wire_full // N_MICRO
            if schedule == "ScheduleGPipe":  # every backward follows every forward
                assert k == N_MICRO and wire_epi == wire_full, schedule
            else:
                assert 0 < k < N_MICRO, schedule


@pytest.mark.slow
def test_selective_stage_compression_given_and_chosen_by_auto(four):
    given, auto = zip(*four["selective"])
    for r in given:  # gradient_codec_stages=[0]: stage 0's replicas compress, stage 1's not
        raw, wire = r["buckets"]
        assert (wire < raw / 2) if r["pp"] == 0 else (wire == raw), (r["pp"], raw, wire)
    by_stage = {}
    for r in auto:
        stages = [d for d in r["decisions"] if d[0].startswith("stage ")]
        assert [d[0] for d in stages] == ["stage 0 gradients", "stage 1 gradients"]
        by_stage.setdefault(r["pp"], set()).add(r["buckets"])
        chosen = {d[0]: d[1] for d in stages}[f"stage {r['pp']} gradients"]
        raw, wire = r["buckets"]
        assert (wire < raw) == (chosen != "none"), (chosen, raw, wire)
    # both replicas of a stage send the same bytes: they agreed on the codec
    assert all(len(v) == 1 for v in by_stage.values())
