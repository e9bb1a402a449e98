"""bench/local_steps.py's loss part on 2 ranks, a few steps: the table has its rows, the JSON
its fields, and local steps put fewer bytes per step on the wire than DDP."""

import json
import math

import pytest

from bench import local_steps

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # 2 ranks (bench.shaped)


def test_local_steps_bench_loss_part_rows_json_and_bytes(tmp_path, capsys):
    out = tmp_path / "local_steps.json"
    assert local_steps.main(["--part", "loss", "--world", "2", "--steps", "8",
                             "--variants", "ddp", "H4-int8", "H4-int8-s",
                             "--json", str(out)]) == 0
    table = capsys.readouterr().out.split("variant", 1)[1]
    for row in ("ddp", "H4-int8 ", "H4-int8-s"):
        assert row in table
    assert "P=2 τ=1 α=0.5" in table and "x fewer B than DDP" in table and "fails" not in table

    data = json.loads(out.read_text())
    assert data["bench"] == "local_steps" and data["world"] == 2
    rows = {r["variant"]: r for r in data["loss"]["rows"]}
    assert set(rows) == {"ddp", "H4-int8", "H4-int8-s"}
    for r in rows.values():
        assert r["status"] == "ok"
        assert math.isfinite(r["eval_global"]) and math.isfinite(r["train_last"])
        assert len(r["train_losses"]) == 8
    ddp, plain, streamed = rows["ddp"], rows["H4-int8"], rows["H4-int8-s"]
    assert ddp["bytes_per_step"] == 4 * ddp["params"]
    assert 0 < plain["bytes_per_step"] < ddp["bytes_per_step"] / 4  # every 4th step, in int8
    assert plain["syncs"] == 2 and streamed["syncs"] == 4  # 2 fragments, each every 4 steps
    assert streamed["fragments"] == 2 and streamed["delay"] == 1
    assert plain["eval_global"] == pytest.approx(plain["eval_rank0"])  # synced at the end
