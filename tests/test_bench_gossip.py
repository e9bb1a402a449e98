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
                        "--timeout", "300", "--json", str(out)]) == 0
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
    assert all(r["step_s"] > 0 for r in rows.values())  # each variant's step, timed


def test_gossip_bench_on_two_shaped_nodes_reports_measured_steps(tmp_path, capsys):
    """--two-nodes: one rank per node (2 ranks), the link between them shaped; the table adds
    the measured step, and int8 data parallel, which crosses the link, is slower than ranks
    that never communicate."""
    out = tmp_path / "gossip.json"
    assert gossip.main(["--world", "2", "--steps", "6", "--seeds", "1", "--batch", "2",
                        "--variants", "dp-int8", "no-comm", "--two-nodes", "20",
                        "--timeout", "300", "--json", str(out)]) == 0
    assert "measured ms/step, 2 nodes @20 Mbit" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["two_nodes_mbit"] == 20
    step = {r["variant"]: r["step_s"] for r in data["summary"]}
    assert step["dp-int8"] > step["no-comm"] > 0
