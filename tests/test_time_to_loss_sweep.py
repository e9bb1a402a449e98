"""bench/time_to_loss_sweep.py: one set of loss runs priced on a grid (links, latencies,
microbatch counts, the speedrun's shape with scaled compute); its pieces on constructed models
(exact) and a smoke run on the small GPT."""

import json

import pytest
import torch

from bench import time_to_loss_sweep as sweep
from ccfx.planner import Link
from ccfx.planner.codec_cost import CodecCost
from ccfx.planner.pipeline_model import EdgeTraffic, PipelineModel, StageCompute


class _Timer:
    """int8 a quarter of the bytes, 1 ms to encode and 2 ms to decode (deterministic)."""

    def cost(self, spec, shape, dtype):
        raw = 4
        for d in shape:
            raw *= int(d)
        if spec == "none":
            return CodecCost(spec, 0.0, 0.0, raw, raw)
        return CodecCost(spec, 1e-3, 2e-3, raw, raw // 4)


def _model(stages: int = 4) -> PipelineModel:
    edges = [EdgeTraffic(i, f"x{i}", (64, 1024), torch.float32, ((i, i + 1),))
             for i in range(stages - 1)]
    return PipelineModel([StageCompute(0.02, 0.04)] * stages, edges, Link(0.1, 1.0),
                         schedule="GPipe", microbatches=2, timer=_Timer(),
                         tail_s=[0.01] * stages)


def test_priced_scales_every_on_device_second_and_keeps_the_link():
    pm = _model()
    p = sweep.priced(pm, 0.05, 20.0, "1F1B", scale=0.5)
    assert [c.forward_s for c in p.compute] == [0.01] * 4
    assert [c.backward_s for c in p.compute] == [0.02] * 4
    assert p.tail_s == [0.005] * 4
    assert p.cost(pm.edges[0], "int8").encode_s == pytest.approx(0.5e-3)
    assert p.cost(pm.edges[0], "int8").decode_s == pytest.approx(1e-3)
    assert p.cost(pm.edges[0], "int8").wire_bytes == pm.cost(pm.edges[0], "int8").wire_bytes
    assert p.links[0] == Link(0.05, 20.0) and p.schedule == "1F1B"
    # scale 1 is the model itself on the new link
    same = sweep.priced(pm, 0.1, 1.0, "GPipe")
    assert same.predict({}).step_s == pytest.approx(pm.predict({}).step_s)


def test_the_crossing_is_where_the_best_fixed_codec_reaches_the_ratio():
    pm = _model()
    point = sweep.Point("loss-run batch", 1.0, "GPipe", 2)
    summary = {"none": {"multiplier": 1.0}, "int8": {"multiplier": 1.1}}
    for ratio in (1.0, 1.62):
        g = sweep.crossing(pm, point, ["none", "int8"], summary, ratio)
        assert g is not None
        p = sweep.priced(pm, g, 1.0, "GPipe")
        got = 100.0 * p.predict({}).step_s / (110.0 * p.predict(
            {i: ("int8", "int8") for i in range(3)}).step_s)
        assert got == pytest.approx(ratio, rel=1e-3)
    # a codec needing 5x the steps never pays, however slow the link
    assert sweep.crossing(pm, point, ["none", "int8"],
                          {"none": {"multiplier": 1.0}, "int8": {"multiplier": 5.0}},
                          1.0) is None


def test_a_profile_survives_its_json():
    pm = _model()
    back = sweep.profile_from_json(json.loads(json.dumps(sweep.profile_to_json(pm))))
    assert back.compute == pm.compute and back.edges == pm.edges and back.tail_s == pm.tail_s
    assert back.microbatches == pm.microbatches


def test_runs_of_several_files_merge_once_and_other_settings_are_refused(tmp_path):
    run = {"variant": "none", "seed": 0, "options": {"stages": 8}, "losses": [1.0]}
    base = {"model": {"n_layer": 8}, "steps": 300, "batch_size": 16, "lr": 3e-3}
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps({**base, "runs": [run]}))
    b.write_text(json.dumps({**base, "runs": [run, {**run, "seed": 1}],
                             "profiles": {"x|2": {}}}))
    c.write_text(json.dumps({**base, "steps": 200, "runs": [run]}))
    merged = sweep.load_runs([str(a), str(b)])
    assert [r["seed"] for r in merged["runs"]] == [0, 1] and "x|2" in merged["profiles"]
    with pytest.raises(SystemExit, match="steps 200"):
        sweep.load_runs([str(a), str(c)])


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_sweep_on_the_small_gpt(tmp_path, capsys):
    from bench import time_to_loss

    # loss runs as bench.time_to_loss writes them (synthetic curves: the sweep only prices)
    slopes = {"none": 0.10, "bf16": 0.095, "int8": 0.09}
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps({
        "model": time_to_loss.MODELS["small"], "steps": 16, "batch_size": 16, "lr": 3e-3,
        "smooth": 4, "target_at": 0.5,
        "runs": [{"variant": n, "seed": 0, "options": time_to_loss.options(*time_to_loss.FIXED[n]),
                  "losses": [5.0 - k * i for i in range(16)]} for n, k in slopes.items()]}))
    out = tmp_path / "swept.json"
    assert sweep.main(["--reuse", str(runs), "--gbps", "0.02", "--latency-ms", "50",
                       "--microbatches", "2", "--speedrun", "--compute-scale", "0.01",
                       "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "best fixed codec over none" in printed
    result = json.loads(out.read_text())
    labels = {r["label"] for r in result["grid"]}
    assert len(result["grid"]) == len(labels) and len(labels) == 1 + 1  # 1 mb count + 1 scale
    for r in result["grid"]:
        cells = r["cells"]
        assert set(cells) == {"none", "bf16", "int8", "auto"}
        assert cells["none"]["speedup"] == 1.0
        for c in cells.values():
            assert c["T_s"] == pytest.approx(
                result["summary"]["none"]["steps_mean"] * c["multiplier"] * c["step_s"])
    # the speedrun shape: 64 microbatches of 8192 tokens, 1F1B; less compute, shorter step
    speedrun = [r for r in result["grid"] if r["point"]["shape"] == "speedrun tokens"]
    assert {r["point"]["microbatches"] for r in speedrun} == {64}
    assert all(e[2][:2] == [512, 16] for e in result["profiles"]["speedrun tokens|64"]["edges"])
    # one scale priced in the grid (each speedrun row's auto plan and crossing cost seconds);
    # the same stored profile priced here at scale 1 is the slower step
    assert [r["point"]["scale"] for r in speedrun] == [0.01]
    pm = sweep.profile_from_json(result["profiles"]["speedrun tokens|64"])
    for r in speedrun:
        fast = r["cells"]["none"]["step_s"]
        assert fast == pytest.approx(
            sweep.priced(pm, r["gbps"], 50.0, "1F1B", 0.01).predict({}).step_s)
        assert fast < sweep.priced(pm, r["gbps"], 50.0, "1F1B", 1).predict({}).step_s
    # a second sweep over its own output reuses the stored profile: the same steps, no timing
    again = tmp_path / "again.json"
    assert sweep.main(["--reuse", str(out), "--gbps", "0.02", "--latency-ms", "50",
                       "--microbatches", "2", "--json", str(again)]) == 0
    assert "loss-run batch, 2 mb: profile reused" in capsys.readouterr().err
    second = json.loads(again.read_text())
    assert [r["cells"]["none"]["step_s"] for r in second["grid"]] == \
        [r["cells"]["none"]["step_s"] for r in result["grid"]
         if r["point"]["shape"] == "loss-run batch"]


def test_the_band_multiplier_is_the_mean_over_targets_of_the_step_ratios():
    from bench import convergence

    none = [10.0 - 0.1 * i for i in range(100)]  # smoothed over 1: the loss itself
    half = [10.0 - 0.05 * i for i in range(100)]  # half the speed: reaches none's at 2x
    runs = [{"variant": "none", "seed": 0, "losses": none},
            {"variant": "slow", "seed": 0, "losses": half},
            {"variant": "slow", "seed": 1, "losses": half}]  # no none on seed 1: left out
    got = convergence.band_multipliers(runs, fractions=(0.2, 0.4), window=1)
    assert got[("none", 0)] == 1.0
    # targets at steps 20 and 40 of none: loss 8.1 and 6.1, slow reaches them at 39 and 79
    assert got[("slow", 0)] == pytest.approx((39 / 20 + 79 / 40) / 2)
    assert ("slow", 1) not in got
    # a target never reached counts the run's length
    flat = {"variant": "flat", "seed": 0, "losses": [10.0] * 100}
    assert convergence.band_multipliers([runs[0], flat], fractions=(0.5,), window=1)[
        ("flat", 0)] == 100 / 50
