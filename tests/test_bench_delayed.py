"""bench/delayed.py's helpers and tables (the benchmark itself runs ranks: not under pytest)."""

import pytest

from bench import delayed


def test_the_loss_table_pairs_each_seed_with_syncs():
    table = delayed.loss_table({"sync": [2.0, 4.0], "delayed": [2.02, 4.0]})
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert "+0.00 %" in rows["sync"]
    assert "+0.50 %" in rows["delayed"]  # (1 % + 0 %) / 2, seed by seed
    assert "3.0100 ± 1.4001" in rows["delayed"]  # mean ± sample std over the seeds


def test_the_time_table_divides_syncs_step_by_each_variants():
    table = delayed.time_table({"step_s": {"sync": 1.0, "delayed": 0.8},
                                "wire_bytes": {"sync": 3.25e6, "delayed": 4.2e6}})
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert rows["sync"][1:] == ["1.000", "1.00x", "3.25"]
    assert rows["delayed"][1:] == ["0.800", "1.25x", "4.20"]


def test_quick_shrinks_both_parts():
    a = delayed._parser().parse_args(["--quick"])
    assert a.quick and a.k == 10 and a.variants == list(delayed.VARIANTS)


def test_an_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown variant 'async'"):
        delayed._model("async", 0, "int8", 10, 96)
