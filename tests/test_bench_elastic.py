"""bench/elastic.py's accounting, without processes: where a kill lands in the sync interval,
the split of one kill's time, and the table's ratios (goodput against the same
implementation's failure-free run, bytes against raw and torchft's DiLoCo)."""

import pytest

from bench import elastic


def test_kill_lands_at_the_phase_of_the_median_sync_interval():
    rows = [{"time": t} for t in (0.0, 1.0, 2.0, 3.5, 4.5)]  # gaps 1, 1, 1.5, 1
    assert elastic._phase_delay(rows, {"kill_phase": 0.5}) == pytest.approx(0.5)
    assert elastic._phase_delay(rows, {"kill_phase": 0.0}) == 0.0
    assert elastic._phase_delay([], {}) == pytest.approx(0.25)  # no interval yet: 0.5 s


def test_split_of_one_kill_adds_up_to_kill_to_first_commit():
    kill = {"name": "r1", "time": 100.0, "rows_before": 2, "phases_before": 1}
    rows = {"r1": [{"committed": True, "time": 98.0}, {"committed": True, "time": 99.6},
                   {"committed": True, "time": 104.0, "seconds": 1.25, "quorum_s": 1.0}]}
    phases = [{}, {"started": 100.2, "imported": 102.0, "data": 102.1, "model": 102.2,
                   "joined": 104.0}]
    split = elastic._split(kill, rows["r1"][2], phases, rows)
    assert split["since_commit_s"] == pytest.approx(0.4)
    assert split["spawn"] == pytest.approx(0.2) and split["imports"] == pytest.approx(1.8)
    assert split["join"] == pytest.approx(1.8) and split["join_sync"] == 1.25
    assert split["join_quorum"] == 1.0
    parts = ("spawn", "imports", "data", "model", "join", "to_commit")
    assert sum(split[p] for p in parts) == pytest.approx(split["total"]) == pytest.approx(4.0)


def _row(run, goodput, per_sync, wire=1, raw=4):
    return {"run": run, "codec": "x", "kills": 0, "syncs": 10, "uncommitted": 0,
            "wall_s": 10.0, "useful_steps": 100, "goodput": goodput, "first_commit_s": [],
            "lo_bytes_per_sync": per_sync, "wire": wire, "raw": raw, "held_out": 2.5}


def test_table_compares_each_run_with_its_own_free_run_and_bytes_with_torchft():
    rows = [_row("free", 10.0, 1e6), _row("failures", 8.0, 1e6), _row("raw", 3.0, 4e6),
            _row("tf_free", 4.0, 5e6, wire=None), _row("tf_failures", 2.0, 5e6, wire=None),
            _row("ckpt", 5.0, 1e6)]
    lines = {line.split(" | ")[0][2:]: line for line in elastic.table(rows).splitlines()[2:]}
    assert "| 80% |" in lines["failures"] and "| 50% |" in lines["ckpt"]
    assert "| 50% |" in lines["tf_failures"]  # against tf_free, not ccfx's free
    assert "| 4.00x | 5.00x |" in lines["free"]  # fewer bytes than raw, than torchft
    assert "| 0.250 |" in lines["free"] and "| – |" in lines["tf_free"]
