"""bench/sharded_dp.py's tables, on made-up rank results (no ranks, no model run): the ratios
against both baselines, a failed variant as a note, and the memory ratios with codec state and
a MemTracker failure shown, not dropped."""

import pytest

from bench import sharded_dp


def _ok(variant, step_s, wire=None):
    return {"variant": variant, "status": "ok", "step_s": step_s, "wire_bytes": wire,
            "loss": 4.5}


def test_time_table_ratios_against_both_baselines_and_failures_as_notes():
    rows = [_ok("fsdp2", 16.0), _ok("ccfx-none", 8.0, 3 * 2**20), _ok("ccfx-int8", 4.0, 2**20),
            {"variant": "ccfx-zero++", "status": "fails", "reason": "gloo: size mismatch"}]
    cells, notes = sharded_dp.time_table(rows)
    by = {c[0]: c for c in cells}
    # columns: variant, s/step, x fsdp2, x ccfx-none, wire MiB, loss
    assert by["ccfx-int8"][1:5] == ["4.000", "4.00", "2.00", "1.00"]
    assert by["fsdp2"][2:5] == ["1.00", "0.50", "-"]
    assert by["ccfx-zero++"][1] == "fails (1)"
    assert notes == ["(1) ccfx-zero++ fails: gloo: size mismatch"]


def test_time_table_without_fsdp2_uses_its_eager_row_or_a_dash():
    cells, _ = sharded_dp.time_table([_ok("fsdp2-eager", 10.0), _ok("ccfx-none", 5.0)])
    assert cells[1][2] == "2.00"
    cells, _ = sharded_dp.time_table([_ok("ccfx-none", 5.0)])
    assert cells[0][2] == "-" and cells[0][3] == "1.00"


def _mem(params, grads, opt, total=None, act=0, state=0, how="eager"):
    row = {"how": how, "counted": {"params": params, "grads": grads, "optimizer": opt},
           "codec_state": state}
    if total is not None:
        row["peak"] = {"Total": total, "ACT": act}
    return row


def test_memory_table_ratios_codec_state_and_largest_rank():
    mib = 2**20
    ranks = [{"unsharded": _mem(100 * mib, 100 * mib, 200 * mib, total=500 * mib, act=100 * mib),
              "ccfx-zero++": _mem(50 * mib, 50 * mib, 100 * mib, state=100 * mib,
                                  how="compiled"),
              "ccfx-eager": _mem(50 * mib, 50 * mib, 100 * mib, total=300 * mib,
                                 act=100 * mib)},
             {"unsharded": _mem(100 * mib, 100 * mib, 200 * mib, total=500 * mib, act=100 * mib),
              "ccfx-zero++": _mem(50 * mib, 50 * mib, 100 * mib, state=100 * mib,
                                  how="compiled"),
              # the larger rank sets the row
              "ccfx-eager": _mem(52 * mib, 50 * mib, 100 * mib, total=320 * mib,
                                 act=100 * mib)}]
    rows, header = sharded_dp.memory_table(ranks, world=2)
    assert len(header) == len(rows[0]) == 7
    by = {r[0]: r for r in rows}
    assert by["ccfx-zero++"][2:5] == ["200.0 (0.500)", "1.00", "300.0 (0.750)"]
    assert by["ccfx-zero++"][5:] == ["-", "-"]
    assert by["ccfx-eager"][2] == "202.0 (0.505)"
    assert by["ccfx-eager"][5:] == ["320.0 (0.640)", "220.0 (0.550)"]


def test_memory_table_shows_a_memtracker_failure():
    mib = 2**20
    whole = _mem(mib, mib, 2 * mib, total=5 * mib, act=mib)
    broken = {**_mem(mib, mib, mib), "tracker_error": "RuntimeError: no"}
    rows, _ = sharded_dp.memory_table([{"unsharded": whole, "fsdp2-eager": broken}], world=1)
    assert rows[1][5] == "MemTracker: RuntimeError: no"


@pytest.mark.parametrize("world", [2, 4])
def test_link_seconds_grow_with_the_ranks_on_one_shared_loopback(world):
    bits = 3 * (world - 1) * sharded_dp.num_parameters() * 4 * 8
    assert sharded_dp._link_s(world, 100) == pytest.approx(bits / 100e6)
    assert sharded_dp._link_s(world, None) == 0.0


def test_bucket_table_ratios_against_the_per_parameter_twin():
    def row(variant, step_s, messages):
        return {**_ok(variant, step_s), "graphs": {"graphs": 1, "breaks": 0,
                                                   "messages": messages}}

    rows = [row("ccfx-none-unbucketed", 16.0, 131.0), row("ccfx-none", 15.0, 18.0),
            row("ccfx-int8-unbucketed", 5.0, 131.0), row("ccfx-int8", 4.0, 18.0)]
    cells, notes = sharded_dp.bucket_table(rows)
    by = {c[0]: c for c in cells}
    # columns: variant, collectives/step, s/step, x fewer collectives, x faster, loss
    assert by["ccfx-int8"][1:5] == ["18", "4.000", "7.3", "1.25"]
    assert by["ccfx-none-unbucketed"][3:5] == ["-", "-"]
    assert len(sharded_dp.BUCKET_HEADER) == len(cells[0]) == 6 and notes == []
