"""bench/lossless_pack.py, a few steps: its table has every row, its JSON the per-step ratios,
and each ratio is the gradients' fp32 bytes over the bytes tlc's payloads use."""

import json

from bench import lossless_pack
from ccfx import codecs


def test_a_few_steps_give_rows_ratios_and_json(tmp_path, capsys):
    out = tmp_path / "pack.json"
    assert lossless_pack.main(["--steps", "3", "--variants", "none", "tlc:ef",
                               "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"python -m bench.lossless_pack --steps 3 --variants none tlc:ef --json {out}"
    assert [line.split()[:2] for line in lines[3:7]] == [
        ["gpt", "none"], ["gpt", "tlc:ef"], ["resnet", "none"], ["resnet", "tlc:ef"]]
    data = json.loads(out.read_text())
    assert data["bench"] == "lossless_pack"
    rows = {(r["model"], r["spec"]): r for r in data["results"]}
    assert set(rows) == {("gpt", "none"), ("gpt", "tlc:ef"), ("resnet", "none"),
                         ("resnet", "tlc:ef")}
    assert rows["gpt", "none"]["ratios"] == [] and len(rows["gpt", "none"]["losses"]) == 3
    for model in ("gpt", "resnet"):
        r = rows[model, "tlc:ef"]
        assert len(r["ratios"]) == 3 and len(r["zero_share"]) == 3
        # at least packing's 5 values a byte (fp32: 20x) less the per-tensor scale and length
        assert all(15 < x < 4 * r["params"] / 8 for x in r["ratios"])
        assert r["losses"][0] == rows[model, "none"]["losses"][0]  # same start, same batch


def test_the_lossless_stage_is_what_the_ratio_counts():
    """One step by hand: the ratio's bytes are the codec's used bytes, tensor by tensor."""
    net, _opt, step_loss = lossless_pack.setup("resnet", seed=0)
    step_loss(0).backward()
    params = list(net.parameters())

    expect = sum(codecs.get("tlc").used_bytes(codecs.get("tlc").encode(p.grad).payload)
                 for p in params)
    coders = [codecs.get("tlc:ef") for _ in params]
    raw, used, zeros = lossless_pack.compress_grads(params, coders)
    assert raw == 4 * sum(p.numel() for p in params) and used == expect
    assert zeros == sum(int((p.grad == 0).sum()) for p in params)
