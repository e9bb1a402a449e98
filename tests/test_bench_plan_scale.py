"""bench/plan_scale.py: its cases build and plan, and its table reads the plan."""

import json

from bench import plan_scale


def test_a_small_case_plans_and_its_row_reads_the_plan(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert plan_scale.main(["--cases", "tiny-4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tiny-4" in printed and "searched / fit / refused / pruned" in printed
    (row,) = json.loads(out.read_text())["results"]
    assert row["searched"] == row["fit"] + row["refused"] + row["pruned"] and row["fit"] >= 1
    assert 0 < row["search_s"] <= row["total_s"] and row["step_s"] > 0
    assert row["chosen"].startswith("pp=")


def test_the_large_cases_describe_the_clusters_of_the_issue():
    model, (idx, _), cluster = plan_scale.case("7b-64")
    assert cluster.world == 64 and idx.shape == (64, 512) and idx.device.type == "meta"
    assert 7.3e9 < sum(p.numel() for p in model.parameters()) < 7.8e9  # the issue's "7.5 B"
    model, (idx, _), cluster = plan_scale.case("65b-1024")
    assert cluster.world == 1024 and idx.shape == (1024, 4096)
    assert 6.4e10 < sum(p.numel() for p in model.parameters()) < 6.7e10
