"""Time to a target loss (issue 19 item 4): steps to a target on synthetic loss curves, the
steps-multiplier table (loading, errors, the model of a mixed choice), ``auto`` minimising
T = multiplier x step under ``objective="time_to_loss"``, and a smoke run of the bench."""

import json

import pytest
import torch

import ccfx
from bench import convergence
from ccfx.errors import ConfigError
from ccfx.planner import Link
from ccfx.planner.auto import choose_pipeline_codecs
from ccfx.planner.candidates import candidates
from ccfx.planner.codec_cost import CodecCost
from ccfx.planner.pipeline_model import EdgeTraffic, PipelineModel, StageCompute
from ccfx.planner.steps_model import StepsModel, for_config, role_table
from ccfx.steps_table import DEFAULT, ROLES, StepsTable, load

from . import toy_models as models

# ---------------------------------------------------------------------------------------------
# Steps to a target on synthetic curves: exact.


def test_smoothed_is_the_trailing_mean_from_a_full_window():
    assert convergence.smoothed([1.0, 2.0, 3.0, 4.0], 2) == [None, 1.5, 2.5, 3.5]
    assert convergence.smoothed([5.0, 3.0], 1) == [5.0, 3.0]
    with pytest.raises(ValueError, match="window"):
        convergence.smoothed([1.0], 0)


def test_steps_to_target_is_the_first_smoothed_step_at_or_under_it():
    losses = [10.0 - i for i in range(10)]  # smoothed over 3 at step s (s >= 3): 12 - s
    assert convergence.steps_to_target(losses, 6.0, window=3) == 6
    assert convergence.steps_to_target(losses, 5.5, window=3) == 7
    assert convergence.steps_to_target(losses, 9.0, window=3) == 3  # not before a full window
    assert convergence.steps_to_target(losses, 0.0, window=3) is None
    # a single low loss does not reach a target its window's mean does not
    spiky = [5.0, 5.0, 0.0, 5.0, 5.0, 5.0]
    assert convergence.steps_to_target(spiky, 3.0, window=3) is None
    assert convergence.steps_to_target(spiky, 3.4, window=3) == 3


def test_the_target_is_the_reference_runs_smoothed_loss_at_a_fraction():
    losses = [10.0 - i for i in range(10)]
    assert convergence.target_of(losses, 0.5, window=3) == 7.0  # step 5: 12 - 5
    assert convergence.target_of(losses, 0.1, window=3) == 9.0  # never before the window
    with pytest.raises(ValueError, match="fraction"):
        convergence.target_of(losses, 0.0, window=3)
    with pytest.raises(ValueError, match="fewer than"):
        convergence.target_of(losses[:2], 0.5, window=3)


def test_multipliers_are_paired_by_seed_and_an_unreached_target_is_a_lower_bound():
    n = 20
    runs = [
        # none: smoothed over 2 at step s = 21.5 - s; target at step 10: 11.5, reached at 10
        {"variant": "none", "seed": 0, "losses": [20.0 - i for i in range(n)]},
        # half as fast: 20 - (s - 1.5) / 2 <= 11.5 first at s = 19
        {"variant": "slow", "seed": 0, "losses": [20.0 - i / 2 for i in range(n)]},
        {"variant": "flat", "seed": 0, "losses": [20.0] * n},
        # seed 1: none twice as fast as seed 0's; "slow" as fast as none there
        {"variant": "none", "seed": 1, "losses": [20.0 - 2 * i for i in range(n)]},
        {"variant": "slow", "seed": 1, "losses": [20.0 - 2 * i for i in range(n)]},
    ]
    convergence.add_steps_to_target(runs, at=0.5, window=2)
    by = {(r["variant"], r["seed"]): r for r in runs}
    assert by["none", 0]["target"] == 11.5 and by["none", 0]["steps"] == 10
    assert by["slow", 0]["steps"] == 19 and by["slow", 0]["multiplier"] == pytest.approx(1.9)
    assert by["flat", 0]["steps"] is None and by["flat", 0]["multiplier"] == 2.0
    assert by["none", 1]["multiplier"] == 1.0 and by["slow", 1]["multiplier"] == 1.0
    slow = convergence.steps_summary([by["slow", 0], by["slow", 1]])
    assert slow["multiplier"] == pytest.approx(1.45) and slow["unreached"] == 0
    flat = convergence.steps_summary([by["flat", 0]])
    assert flat["unreached"] == 1 and flat["steps_mean"] == n
    assert convergence.steps_cells({**flat, "steps_std": None})[1].startswith(">")
    # one fixed target for every seed
    convergence.add_steps_to_target(runs, target=15.0, window=2)
    assert by["none", 0]["steps"] == 7 and by["slow", 0]["steps"] == 12


# ---------------------------------------------------------------------------------------------
# The table: loading and errors.


def test_the_shipped_table_is_the_default_and_names_its_measurement():
    assert load(None) is DEFAULT
    assert set(DEFAULT.multipliers) <= set(ROLES) and DEFAULT.source
    assert all(m > 0 for row in DEFAULT.multipliers.values() for m in row.values())
    assert DEFAULT.of("activation", "none") == 1.0


def test_a_table_loads_from_a_dict_json_text_or_the_benchs_file(tmp_path):
    given = {"activation": {"int8": 1.05}, "activation_grad": {"powersgd:rank=16": 1.2}}
    table = load(given)
    assert table.of("activation", "int8") == 1.05
    assert table.of("activation_grad", "powersgd:rank=16") == 1.2
    assert table.of("activation_grad", "int8") is None  # not measured for that role
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"multipliers": given, "source": "bench run X"}))
    assert load(str(path)).multipliers == table.multipliers
    assert load(str(path)).source == "bench run X"
    assert load(json.dumps(given)).multipliers == table.multipliers
    config = ccfx.Config(objective="time_to_loss", steps_multipliers=str(path))
    # kept as canonical JSON: the same whichever form gave it, and a round trip
    again = ccfx.Config(objective="time_to_loss",
                        steps_multipliers={"multipliers": given, "source": "bench run X"})
    assert config.steps_multipliers == again.steps_multipliers
    assert ccfx.Config.from_options(config.to_dict()) == config


@pytest.mark.parametrize("given,match", [
    ({"weights": {"int8": 1.1}}, "unknown role 'weights'"),
    ({"activation": {"int8": -1}}, "positive number"),
    ({"activation": {"int8": True}}, "positive number"),
    ({"activation": {"int8": float("nan")}}, "positive number"),
    ({"activation": {"int9": 1.1}}, "'int9' is not a codec spec"),
    ({"activation": 1.1}, "codec spec → multiplier"),
    (3, "give the path"),
    ("/nonexistent/m.json", "cannot read"),
    ("{not json", "file path or a dict"),
])
def test_a_bad_table_is_a_config_error_naming_the_problem(given, match):
    with pytest.raises(ConfigError, match=match):
        load(given)
    with pytest.raises(ConfigError, match=match):
        ccfx.Config(objective="time_to_loss", steps_multipliers=given)


def test_a_file_that_is_not_json_and_a_bad_objective(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("int8 = 1.1")
    with pytest.raises(ConfigError, match="is not JSON"):
        load(str(path))
    with pytest.raises(ConfigError, match="objective='time' is not valid"):
        ccfx.Config(objective="time")
    assert for_config(ccfx.Config(), []) is None  # the step objective prices no steps


def test_the_roles_share_of_a_variant_measured_both_ways():
    table = role_table({"int8": ("int8", "int8", 1.2), "lep": ("none", "int4:ef", 1.1),
                        "bf16": ("bf16", "bf16", 0.9), "mixed": ("int8", "int4:ef", 3.0)})
    assert table["activation"] == {"int8": 1.1, "bf16": 0.95}
    assert table["activation_grad"] == {"int8": 1.1, "int4:ef": 1.1, "bf16": 0.95}


def _edges(n: int = 4) -> list[EdgeTraffic]:
    ids = EdgeTraffic(0, "targets", (2, 8), torch.int64, ((0, 1),), requires_grad=False)
    return [ids] + [EdgeTraffic(i, f"x{i}", (2, 8, 16), torch.float32, ((i - 1, i),))
                    for i in range(1, n + 1)]


def test_a_mixed_choice_pays_each_roles_excess_by_its_share_of_edges():
    table = StepsTable.from_dict({"activation": {"int8": 1.2, "bf16": 0.9},
                                  "activation_grad": {"int8": 1.2, "int4:ef": 1.4}})
    m = StepsModel(table, _edges(4))
    assert m({}) == 1.0
    assert m({i: ("int8", "int8") for i in range(5)}) == pytest.approx(1.4)  # 0.2 + 0.2
    assert m({1: ("int8", "none")}) == pytest.approx(1.05)  # 1 of 4 float edges
    assert m({1: ("none", "int4:ef"), 2: ("none", "int4:ef")}) == pytest.approx(1.2)
    assert m({i: ("bf16", "none") for i in range(1, 5)}) == 1.0  # under 1 counts as 1
    assert m({i: ("fp16", "fp16") for i in range(1, 5)}) == 1.0  # not in the table: fixed
    assert m({0: ("int8", "int8")}) == 1.0  # the integer edge is no role's


def test_under_time_to_loss_the_pipeline_pool_is_the_tables_without_a_loss_budget():
    table = {"activation": {"int4": 1.1}, "activation_grad": {"int4": 1.1, "int8": 1.0}}
    config = ccfx.Config(objective="time_to_loss", steps_multipliers=table)
    assert candidates("activation", config, steps=True) == ["none", "int4"]  # int4: +11 % loss
    assert candidates("activation_grad", config, steps=True) == ["none", "int4", "int8"]
    # other roles and callers (buckets, collectives) keep the loss budget
    assert candidates("activation", config) == candidates("activation", ccfx.Config())
    assert "int4" not in candidates("activation", config)
    extra = config.replace(auto_candidates=("fp8",))
    with pytest.raises(ConfigError, match="'fp8' has no steps multiplier for activation"):
        candidates("activation", extra, steps=True)


# ---------------------------------------------------------------------------------------------
# auto refuses a faster step that costs more steps than it saves.


class _Timer:
    """Fixed codec costs: int8 a quarter of the bytes, no codec time (deterministic)."""

    def cost(self, spec, shape, dtype):
        raw = 1
        for d in shape:
            raw *= int(d)
        raw *= dtype.itemsize
        wire = raw if spec == "none" or not dtype.is_floating_point else raw // 4
        return CodecCost(spec, 0.0, 0.0, raw, wire)


def _constructed_model() -> PipelineModel:
    """Two stages, one 1 MB activation on a 10 Mbit/s link: int8 makes the step ~3x faster."""
    edge = EdgeTraffic(0, "x", (256, 1024), torch.float32, ((0, 1),))
    return PipelineModel([StageCompute(0.01, 0.02)] * 2, [edge], Link(0.01, 0.0),
                         schedule="GPipe", microbatches=1, timer=_Timer())


def _choose(model, multiplier: float | None):
    objective = "step" if multiplier is None else "time_to_loss"
    table = {"activation": {"int8": multiplier or 1.0},
             "activation_grad": {"int8": multiplier or 1.0}}
    config = ccfx.Config(objective=objective, steps_multipliers=table)

    def pool(edge, direction):
        return candidates("activation" if direction == "fwd" else "activation_grad", config,
                          steps=True)

    return choose_pipeline_codecs(model, pool, min_gain=0.1,
                                  steps_multiplier=for_config(config, model.edges))


def test_time_to_loss_refuses_a_faster_step_that_needs_too_many_more_steps():
    model = _constructed_model()
    none_s = model.predict({}).step_s
    int8_s = model.predict({0: ("int8", "int8")}).step_s
    assert int8_s < none_s / 2.5  # the step alone: int8 wins by far
    assert _choose(model, None).choice[0] == ("int8", "int8")
    # each role's multiplier 2.5: m = 1 + 1.5 + 1.5 = 4, T = 4 x int8's step > none's
    refused = _choose(model, 2.5)
    assert refused.choice[0] == ("none", "none")
    assert 4 * int8_s > none_s
    # the tables hold T: int8's entry is its step times its multiplier
    table = dict(refused.decisions[0].candidates)
    assert table["int8"] > table["none"]
    # a small multiplier keeps it
    assert _choose(model, 1.05).choice[0] == ("int8", "int8")


def test_the_reasons_say_the_figures_are_times_to_the_loss():
    decided = _choose(_constructed_model(), 2.5)
    assert all("steps multiplier x the predicted step" in d.reason for d in decided.decisions)
    assert all("steps multiplier" not in d.reason
               for d in _choose(_constructed_model(), None).decisions)


def test_a_codec_every_hop_needs_together_survives_the_edge_by_edge_descent():
    """8 stages, 7 equal hops on a slow link: int8 everywhere makes the step ~4x faster, but
    one hop alone saves less than min_gain; the descent keeps it hop by hop (it used to fall
    back to none one hop at a time)."""
    edges = [EdgeTraffic(i, f"x{i}", (256, 1024), torch.float32, ((i, i + 1),))
             for i in range(7)]
    model = PipelineModel([StageCompute(0.01, 0.02)] * 8, edges, Link(0.01, 0.0),
                          schedule="GPipe", microbatches=1, timer=_Timer())
    everywhere = {i: ("int8", "int8") for i in range(7)}
    none_s = model.predict({}).step_s
    assert model.predict(everywhere).step_s < none_s / 3
    one = model.predict({0: ("int8", "int8")}).step_s
    assert one > none_s * (1 - 0.2)  # a hop alone: under min_gain
    decided = choose_pipeline_codecs(model, lambda e, d: ["none", "int8"], min_gain=0.2)
    assert decided.choice == everywhere


def test_compiling_with_time_to_loss_follows_the_table():
    """The compile-time path (plan_edges): the same model and link, int8 chosen under the step
    objective and refused when the table says it needs 5x the steps."""
    torch.manual_seed(0)
    model = models.two_layer_mlp(256, 512)
    x = torch.randn(32, 256)
    chosen = {}
    for name, extra in (("step", {}), ("ttl", {"objective": "time_to_loss",
                                               "steps_multipliers": {
                                                   "activation": {"int8": 3.0},
                                                   "activation_grad": {"int8": 3.0}}})):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ccfx", fullgraph=True, options={
            "stages": 2, "activation_codec": "auto", "link_gbps": 0.001, "lowering": "eager",
            "auto_candidates": ["int8"], **extra})
        compiled(x)
        chosen[name] = {d.chosen for d in ccfx.plan_of(compiled).graphs[0].decisions}
    assert chosen["step"] != {"none"}
    assert chosen["ttl"] == {"none"}


# ---------------------------------------------------------------------------------------------
# The bench, tiny.


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_time_to_loss_bench_on_a_tiny_model(tmp_path, capsys):
    from bench import time_to_loss

    out, table = tmp_path / "ttl.json", tmp_path / "m.json"
    assert time_to_loss.main(["--model", "small", "--steps", "16", "--smooth", "4",
                              "--seeds", "0", "--variants", "none", "int8", "--repeats", "1",
                              "--json", str(out), "--table", str(table)]) == 0
    printed = capsys.readouterr().out
    assert "every boundary 200 Mbit/s" in printed and "goal auto" in printed
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["tables"]["200Mbit/s"]}
    assert set(rows) == {"none", "int8", "auto", "auto-step"}
    assert rows["none"]["speedup"] == 1.0 and rows["none"]["multiplier"] == 1.0
    for r in rows.values():
        assert r["T_s"] == pytest.approx(r["steps_mean"] * r["step_s"]) and r["step_s"] > 0
    # the table it wrote is one steps_multipliers reads
    assert load(str(table)).of("activation", "int8") == result["table"]["activation"]["int8"]
    # --reuse takes the runs of a previous --json instead of training them again
    again = tmp_path / "again.json"
    assert time_to_loss.main(["--model", "small", "--steps", "16", "--smooth", "4",
                              "--seeds", "0", "--variants", "none", "int8", "--repeats", "1",
                              "--reuse", str(out), "--json", str(again)]) == 0
    assert "reused" in capsys.readouterr().err
    first, second = (json.loads(p.read_text())["runs"] for p in (out, again))
    assert [r["losses"] for r in second] == [r["losses"] for r in first]
