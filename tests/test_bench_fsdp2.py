"""bench/fsdp2.py: its tables on made-up rank results (ratios against plain FSDP2, a failed
variant as a note, the seeds' paired difference, memory ratios), the formula's accounting,
and a smoke run on 2 unshaped ranks with the tiny GPT (the ledger equals the formula; the
loss part's table)."""

import json
import math

import pytest
import torch

from bench import fsdp2


def _ok(variant, step_s, wire=None):
    return {"variant": variant, "status": "ok", "step_s": step_s, "wire_bytes": wire,
            "loss": 4.5}


def test_time_table_ratios_against_plain_fsdp2_and_failures_as_notes():
    rows = [_ok("fsdp2", 16.0), _ok("fsdp2-ccfx", 4.0, 2**20),
            {"variant": "ccfx-shard", "status": "fails", "reason": "gloo: size mismatch"}]
    cells = fsdp2.time_table(rows, "tiny", 2)
    assert cells[-1] == ["(1) ccfx-shard fails: gloo: size mismatch"]
    by = {c[0]: c for c in cells[:-1]}
    # columns: variant, s/step, x fsdp2, wire MiB (ledger), formula MiB, loss
    assert by["fsdp2-ccfx"][1:4] == ["4.000", "4.00", "1.00"]
    assert by["fsdp2"][2:4] == ["1.00", "-"] and by["fsdp2"][4].startswith("(")
    assert by["ccfx-shard"][1] == "fails (1)"


def test_auto_has_no_formula_ahead_and_its_prediction_note_sets_step_beside_step():
    auto = {**_ok("fsdp2-auto", 4.0, 2**20), "comm_s": 3.0,
            "predicted": {"chosen_s": 2.5, "uncompressed_s": 12.0}}
    assert fsdp2.time_table([auto], "tiny", 2)[0][4] == "-"
    note = fsdp2.prediction_note(auto)
    # compute measured (4.0 - 3.0 s), collectives predicted (2.5 s): 3.5 s against 4.0 s
    assert "predicted step 3.500 s against 4.000 s measured: -12.5%" in note, note
    assert fsdp2.prediction_note(_ok("fsdp2-ccfx", 4.0)) == ""


def test_time_table_without_a_baseline_shows_a_dash():
    cells = fsdp2.time_table([_ok("fsdp2-ccfx", 4.0)], "tiny", 2)
    assert cells == [["fsdp2-ccfx", "4.000", "-", "-", cells[0][4], "4.5000"]]


def test_loss_table_pairs_each_seed_with_plain_fsdp2():
    losses = {"fsdp2": {"0": 2.0, "1": 4.0}, "fsdp2-ccfx": {"0": 2.02, "1": 3.96}}
    rows = {r[0]: r for r in fsdp2.loss_table(losses)}
    assert rows["fsdp2"][3] == "-"
    assert rows["fsdp2-ccfx"][3] == "+0.00% (max +1.00%)"  # +1 % and -1 %: mean 0
    assert rows["fsdp2-ccfx"][1] == "2.0200 3.9600"
    # HSDP with ccfx pairs with torch's HSDP, not with plain FSDP2
    hsdp = {r[0]: r for r in fsdp2.loss_table({**losses, "hsdp": {"0": 1.0, "1": 1.0},
                                                 "hsdp-ccfx": {"0": 1.01, "1": 1.01}})}
    assert hsdp["hsdp"][3] == "-" and hsdp["hsdp-ccfx"][3] == "+1.00% (max +1.00%)"


def test_memory_table_largest_rank_ratios_and_a_tracker_failure():
    mib = 2**20

    def rank(peak, rss, state=0):
        return {"peak": peak, "rss_growth": rss, "codec_state": state}

    runs = {"fsdp2": [rank({"Total": 100 * mib}, 200 * mib), rank({"Total": 110 * mib}, 200 * mib)],
            "fsdp2-ccfx": [rank({"Total": 121 * mib}, 300 * mib, 8 * mib),
                           rank({"error": "RuntimeError: no"}, 250 * mib, 8 * mib)],
            "ccfx-shard": [rank(None, 400 * mib, 8 * mib)]}
    rows = {r[0]: r for r in fsdp2.memory_table(runs)}
    assert rows["fsdp2"][1:] == ["110.0 (1.00)", "200.0 (1.00)", "0.0"]
    assert rows["fsdp2-ccfx"][1:] == ["RuntimeError: no", "300.0 (1.50)", "8.0"]
    assert rows["ccfx-shard"][1:] == ["-", "400.0 (2.00)", "8.0"]


@pytest.mark.parametrize("world", [2, 4])
def test_the_formula_gathers_blocks_twice_the_root_once_and_compresses(world):
    raw = fsdp2.formula_bytes("fsdp2", "tiny", world)
    params = fsdp2.num_parameters("tiny")
    root = sum(shard for name, shard, _ in fsdp2.buffers("tiny", world) if name == "root")
    # ring convention: each collective sends (W-1)/W of its whole buffer from each rank
    assert raw == pytest.approx((3 * params - world * root) * 4 * (world - 1) / world)
    assert raw / fsdp2.formula_bytes("fsdp2-ccfx", "tiny", world) > 4  # int8 and int4


def test_hsdp_with_ccfx_compresses_only_the_replicas_all_reduce():
    from ccfx.wire.collectives import CollectiveCall, CompressedCollective

    plain = fsdp2.formula_bytes("hsdp", "tiny", 4)
    coded = fsdp2.formula_bytes("hsdp-ccfx", "tiny", 4)
    saved = 0
    for _, shard, _ in fsdp2.buffers("tiny", 2):  # shard groups of 2, 2 replicas
        call = CollectiveCall("all_reduce", (shard,), torch.float32, 2, "avg")
        saved += (CompressedCollective(call, "none").wire_bytes()
                  - CompressedCollective(call, fsdp2.HSDP_CODECS["all_reduce"]).wire_bytes())
    assert plain - coded == saved > 0
    cells = fsdp2.time_table([_ok("hsdp", 9.0), _ok("hsdp-ccfx", 3.0, coded)], "tiny", 4)
    assert cells[0][2:5] == ["1.00", "-", f"({plain / 2**20:.2f})"]
    assert cells[1][2:5] == ["3.00", f"{coded / 2**20:.2f}", f"{coded / 2**20:.2f}"]


def test_unknown_models_and_variants_are_named():
    with pytest.raises(ValueError, match="gpt12m"):
        fsdp2.make_model("gpt7b", 0)
    with pytest.raises(ValueError, match="fsdp2-ccfx"):
        fsdp2.build("fsdp3", "tiny", 0, 1)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_fsdp2_with_ccfx_codecs_puts_the_formulas_bytes_on_the_wire():
    from bench.shaped import run_ranks

    ranks = run_ranks("bench.fsdp2", "time_rank", 2,
                      {"variant": "fsdp2-ccfx", "model": "tiny", "steps": 1, "warmup": 1},
                      netns=None, timeout_s=600, stall_s=300)  # the codecs compile at first
    assert all(math.isfinite(loss) for r in ranks for loss in r["losses"])
    assert ranks[0]["wire_bytes"] == fsdp2.formula_bytes("fsdp2-ccfx", "tiny", 2)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_loss_part_trains_both_fsdp2_variants_from_one_start(tmp_path, capsys):
    out = tmp_path / "fsdp2.json"
    assert fsdp2.main(["--part", "loss", "--model", "tiny", "--steps", "2", "--seeds", "0",
                       "--variants", "fsdp2", "fsdp2-ccfx", "--json", str(out)]) == 0
    assert "paired vs plain" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["bench"] == "fsdp2" and data["model"] == "tiny"
    plain, coded = data["loss"]["fsdp2"]["0"], data["loss"]["fsdp2-ccfx"]["0"]
    assert math.isfinite(plain) and abs(coded / plain - 1) < 0.05  # 2 steps from one start
