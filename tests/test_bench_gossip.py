"""bench/gossip.py on 2 ranks, a few steps: every variant has its row and JSON fields, and the
gossip sends no more bytes per step than int8 data parallel (the equal-bytes topk ratio)."""

import json
import math

import pytest

from bench import gossip

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # starts 2 ranks


def test_gossip_bench_rows_json_and_equal_bytes(tmp_path, capsys):
    out = tmp_path / "gossip.json"
    assert gossip.main(["--world", "2", "--steps", "4", "--seeds", "1", "--batch", "2",
                        "--json", str(out)]) == 0
    table = capsys.readouterr().out.split("variant", 1)[1]
    for v in gossip.VARIANTS:
        assert v in table
    data = json.loads(out.read_text())
    assert data["bench"] == "gossip" and data["world"] == 2
    rows = {r["variant"]: r for r in data["summary"]}
    assert set(rows) == set(gossip.VARIANTS)
    for r in rows.values():
        assert math.isfinite(r["eval_mean"]) and math.isfinite(r["eval_rank0"])
    dp, topk = rows["dp-int8"]["bytes_per_step"], rows["gossip-topk"]["bytes_per_step"]
    assert 0.99 * dp <= topk <= dp  # equal bytes, within one 1e-5 step of the ratio
    assert rows["dp-fp32"]["consensus"] == rows["dp-int8"]["consensus"] == 0.0
    assert rows["gossip-topk"]["consensus"] > 0 and rows["no-comm"]["bytes_per_step"] == 0
