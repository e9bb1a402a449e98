"""bench/common.py's step loops, which every bench's warm-up, training and timed steps use, and
its timed steps on ranks: one rank's loop (in this process, a process group of one) and the
row a variant's ranks make (made-up rank results)."""

import time

import pytest
import torch

from bench import common
from ccfx.errors import ConfigError

# a gloo process group of this one rank (timed_steps meets the others at a barrier)
from .test_codec_powersgd_reference import single_rank_group  # noqa: F401


@pytest.mark.usefixtures("single_rank_group")
def test_timed_steps_warms_up_then_times_and_counts_the_ledger(capsys):
    """Warm-up losses count, times only the timed steps; the ccfx ledger's bytes per timed
    step (int8 on one cut edge: the warm-up's bytes left out); the log says each step."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="ccfx", options={
        "stages": 2, "activation_codec": "int8", "lowering": "eager"})
    x = torch.randn(4, 8)

    def step():
        loss = compiled(x).square().mean()
        loss.backward()
        return loss.item()

    out = common.timed_steps(0, step, steps=3, warmup=2, compiled=compiled,
                             after_warmup=lambda: {"seen": True})
    assert len(out["losses"]) == 5 and len(out["times"]) == 3 and out["seen"]
    # forward activation and its gradient each step: 4x8 fp32 -> int8 codes and one scale
    per_step = common.ledger_bytes(compiled) / 5
    assert out["wire_bytes"] == pytest.approx(per_step) and 0 < per_step < 2 * 4 * 8 * 4
    assert "predicted" in out
    log = capsys.readouterr().out
    assert "[rank 0] warm-up step 1: loss" in log and "[rank 0] timed step 2: loss" in log


@pytest.mark.usefixtures("single_rank_group")
def test_timed_steps_takes_a_wire_function_and_skips_on_a_config_error():
    out = common.timed_steps(0, lambda: 1.0, steps=2, warmup=1, wire=lambda: 42.0, digits=5)
    assert out["wire_bytes"] == 42.0 and "predicted" not in out

    def bad():
        raise ConfigError("collective_codec: no codec 'int9'\nmore")

    assert common.timed_steps(0, bad, steps=1) == {
        "skipped": "ccfx rejects the options: collective_codec: no codec 'int9'"}
    with pytest.raises(ValueError):
        common.timed_steps(0, lambda: float("x"), steps=1)


def test_a_variants_row_is_its_slowest_ranks_mean_step():
    ranks = [{"times": [1.0, 3.0], "losses": [5.0, 4.0], "wire_bytes": 10.0,
              "predicted": {"chosen_s": 1.5}, "graphs": {"graphs": 2}},
             {"times": [2.5, 2.5], "losses": [5.0, 3.0], "wire_bytes": 11.0}]
    row = common.step_row("ccfx-int8", ranks, 9.0)
    assert row == {"variant": "ccfx-int8", "status": "ok", "step_s": 2.5, "wire_bytes": 10.0,
                   "loss": 4.0, "graphs": {"graphs": 2}, "predicted": {"chosen_s": 1.5},
                   "wall_s": 9.0}
    assert "graphs" not in common.step_row("x", ranks[1:], 1.0)


def test_not_ccfx_has_no_ledger_and_no_prediction():
    model = torch.nn.Linear(2, 2)
    assert common.ledger_bytes(model) is None and common.predicted(model) is None


def test_step_loops_say_each_step_and_time_only_the_step():
    said = []
    assert common.run_steps(lambda i: 2 * i, 3, say=lambda i, r: said.append((i, r))) == [0, 2, 4]
    assert said == [(0, 0), (1, 2), (2, 4)]
    results, times = common.time_steps(
        lambda b: b + 1, 2, prepare=lambda i: (time.sleep(0.05), 10 * i)[1],
        say=lambda i, r, s: said.append((i, r)))
    assert results == [1, 11] and said[-2:] == [(0, 1), (1, 11)]
    assert len(times) == 2 and all(0 <= t < 0.05 for t in times)  # prepare is off the clock


def test_a_steps_time_is_its_slowest_ranks():
    assert common.slowest_per_step([[1.0, 5.0], [2.0, 3.0]]) == [2.0, 5.0]
