"""bench/convergence.py on a tiny model: the table has its rows, the losses are finite, a
lossy codec puts fewer bytes on the wire than none, and every run has its steps to the target
(none's multiplier over itself is 1)."""

import json
import math

import pytest

from bench import convergence

pytestmark = pytest.mark.usefixtures("one_thread")


def test_convergence_table_rows_losses_and_wire(tmp_path, capsys):
    out = tmp_path / "convergence.json"
    assert convergence.main(["--model", "small", "--steps", "4", "--seeds", "0",
                             "--variants", "none", "int8", "--smooth", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    table = printed.split("variant", 1)[1]
    assert "none / none" in table and "int8 / int8" in table and "steps x" in table

    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "int8"}
    assert all(math.isfinite(loss) for r in rows.values() for loss in r["losses"])
    assert rows["none"]["vs_none"] == 0
    assert rows["int8"]["cut_wire"] < rows["none"]["cut_wire"] == rows["none"]["cut_raw"] > 0

    runs = json.loads(out.read_text())["runs"]
    none = next(r for r in runs if r["variant"] == "none")
    assert none["steps"] <= 2 and none["multiplier"] == 1.0  # target: its own step 2
    assert all(r["target"] == none["target"] for r in runs)
    assert rows["none"]["multiplier"] == 1.0 and rows["int8"]["steps_mean"] >= 2
