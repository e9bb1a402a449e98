"""The main job's driver: run_demo's structure on a tiny model, and one real ccfx run."""

import argparse
import math

import pytest

from ccfx.demo import DemoResult, add_arguments, format_demo, run_demo, write_demo_report
from ccfx.models import GPTConfig

TINY = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_run_demo_structure_with_injected_compile():
    result = run_demo(steps=4, batch_size=2, model_config=TINY, compile_fn=lambda m: m,
                      progress=False)
    assert isinstance(result, DemoResult)
    assert result.options == {"stages": 4, "activation_codec": "int8", "lowering": "eager"}
    for run in (result.baseline, result.compressed):
        assert len(run.losses) == len(run.step_times) == 4
        assert all(math.isfinite(v) for v in run.losses)
        assert run.total_s > 0 and run.final_loss(2) > 0
    # Same init, same batches, nothing compressed: the two runs are the same computation.
    assert result.baseline.losses == result.compressed.losses
    assert result.compiled.lm_head.weight is result.compiled.tok_emb.weight
    assert result.tokens_per_step == 2 * TINY.block_size
    assert 20_000 < result.num_parameters < 40_000


def test_run_demo_with_ccfx_backend(tmp_path):
    result = run_demo(steps=2, stages=2, batch_size=2, model_config=TINY, progress=False)
    assert all(math.isfinite(v) for v in result.baseline.losses + result.compressed.losses)
    # int8 on the cuts changes the numbers a little, not a lot.
    assert abs(result.compressed.losses[-1] - result.baseline.losses[-1]) < 0.05
    report = format_demo(result)
    assert "ccfx plan" in report and "int8" in report
    assert "on the wire" in report and "baseline" in report
    # Per-step wire bytes come from the ledger: int8 sends about a quarter of the raw bytes.
    comp = result.compressed
    assert len(comp.wire_bytes) == 2 and all(0 < w < r / 3 for w, r in zip(comp.wire_bytes,
                                                                         comp.raw_bytes))
    assert result.baseline.wire_bytes == []  # the eager baseline has no ledger
    html = write_demo_report(result, tmp_path / "demo.html").read_text()
    assert "<svg" in html and "ccfx demo" in html and result.compressed.name in html


def test_bad_baseline_is_rejected():
    with pytest.raises(ValueError, match="baseline"):
        run_demo(steps=1, model_config=TINY, baseline="nope", progress=False)


def test_cli_arguments_default_to_the_main_job():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.stages, args.codec, args.lowering, args.baseline) == (4, "int8", "eager", "eager")
    assert args.progress
    assert not parser.parse_args(["--no-progress"]).progress


def test_ccfx_help_is_whole_sentences(capsys):
    from ccfx import cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "this\n" not in text and not text.rstrip().endswith("this")
    assert "torch.compile backend for compressed distributed training." in text
    assert "ccfx <command> --help" in text


def test_each_demo_writes_its_own_report_file():
    from ccfx.demo import DP_REPORT, REPORT, report_path

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert report_path(parser.parse_args([])) == REPORT
    assert report_path(parser.parse_args(["--dp", "2"])) == DP_REPORT != REPORT
    assert report_path(parser.parse_args(["--dp", "2", "--report", "x.html"])) == "x.html"
    assert report_path(parser.parse_args(["--report", ""])) == ""


def test_a_data_parallel_report_headline_shows_the_gradient_buckets_and_their_saving():
    import re

    from ccfx.plan import Bucket, DataParallelInfo, GraphPlan, Plan, Stage
    from ccfx.viz.report import report_html

    buckets = [Bucket(graph=0, index=0, params=["b"], numel=64, dtype="torch.float32",
                      codec="none", collective="all_reduce", raw_bytes=256, wire_bytes=256),
               Bucket(graph=0, index=1, params=["w"], numel=1 << 20, dtype="torch.float32",
                      codec="powersgd:ef", collective="powersgd", raw_bytes=4 << 20,
                      wire_bytes=64 << 10)]
    stage = Stage(graph=0, index=0, nodes=["x"], cost=1.0, cost_expr="1", flops=1,
                  param_bytes=4 << 20)
    graph = GraphPlan(index=0, requested_stages=1, num_stages=1, balance="flops",
                      stages=[stage], edges=[], shared=[], buckets=buckets)
    plan = Plan({"activation_codec": "none"}, [graph],
                data_parallel=DataParallelInfo(2, "gloo", "powersgd:ef"))
    page = report_html(plan, wire_per_step={"uncompressed (none)": [4 << 20] * 3,
                                            "powersgd:ef": [64 << 10] * 3})
    cards = re.search(r'<div class="cards">(.*?)</div></div>', page).group(1)
    assert "gradient buckets (compressed / all)" in cards and "1 / 2" in cards
    assert "4.0 MiB → 64.2 KiB" in cards and "63.8×" in cards
    assert "64× less" in cards
    assert "cut edges" not in cards and "stages" not in cards


def test_the_dp_demo_prints_the_gradient_codec_as_given(monkeypatch):
    """The plan comes from rank 0's process; the parent prints it with the spec as given."""
    import ccfx.runtime.launch
    from ccfx.demo_dp import format_dp_demo, run_dp_demo
    from ccfx.plan import DataParallelInfo, Plan

    spec = "qsgd:seed=0,block=256,ef"  # canonical: qsgd:ef; written this way in no other test
    plan = Plan({"activation_codec": "none"}, [],
                data_parallel=DataParallelInfo(2, "gloo", "qsgd:ef")).to_json()

    def fake_spawn(fn, world, args, **kw):
        run = {"losses": [1.0], "times": [0.1], "raw": [8], "wire": [2], "plan": plan,
               "params": 10, "eval": 0.0}
        return [[dict(run, name=name) for name in ("uncompressed (none)", spec)]] * world

    monkeypatch.setattr(ccfx.runtime.launch, "spawn", fake_spawn)
    result = run_dp_demo(world=2, steps=1, codec=spec)
    assert f"gradient codec {spec}, world size 2 (gloo)" in format_dp_demo(result)
