"""bench/adaptive.py's helpers and table (the benchmark itself runs ranks: not under pytest)."""

import pytest

from bench import adaptive


def test_each_variant_is_a_spec_the_hook_takes():
    assert adaptive.spec_of("light", "int8", "sign", 0.5, 10) == "int8"
    assert adaptive.spec_of("heavy", "int8", "sign", 0.5, 10) == "sign"
    assert adaptive.spec_of("adaptive", "int8", "sign", 0.5, 10) == \
        "adaptive:light=int8,heavy=sign,eta=0.5,every=10"
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        adaptive.spec_of("fast", "int8", "sign", 0.5, 10)


def test_the_modelled_time_adds_the_links_cost_to_the_median_step():
    # median 0.5 s; 1e6 bytes at 8 Mbit/s is 1 s; 2 buckets x 10 ms
    got = adaptive.modelled_s([0.4, 0.5, 9.0], [1e6, 0.0, 5e6], 2, rate_mbit=8,
                              latency_ms=10, buckets=2)
    assert got == pytest.approx((0.5 + 1 + 0.02) + (0.5 + 0 + 0.02))


def _rank(losses, wire, switches=()):
    return {"losses": losses, "wall": [1.0] * len(losses), "wire": wire, "buckets": 1,
            "switches": list(switches)}


def test_steps_to_target_use_lights_smoothed_loss_as_the_target():
    a = adaptive._parser().parse_args(["--smooth", "1", "--target-at", "0.5"])
    light = [4.0, 3.0, 2.0, 1.0]  # the target: step 2's loss, 3.0
    ranks = [{"light": _rank(light, [8.0] * 4), "adaptive": _rank(
        [3.5, 2.9, 2.0, 1.0], [8.0, 1.0, 1.0, 1.0], [(0, 1, "sign")])}] * 2
    got = adaptive.seed_result(ranks, ["light", "adaptive"], a)
    assert got["light"]["steps"] == 2 and got["adaptive"]["steps"] == 2
    assert got["adaptive"]["wire_mb"] == pytest.approx(4.5e-6)
    assert got["adaptive"]["ranks_agree"] and got["adaptive"]["switches"] == [(0, 1, "sign")]
    table = adaptive.table([got], ["light", "adaptive"])
    assert "2.0 ± 0.0" in table.splitlines()[2]
    assert adaptive.switch_lines([got], [7]) == [
        "seed 7: switches (bucket@first step->codec): b0@1->sign; ranks agree: True"]
