"""``ccfx run``: torchrun starts the ranks, each trains its stage; the output and the traces."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # torchrun starts 2 ranks


def test_ccfx_run_trains_the_tiny_gpt_on_two_stages_and_writes_a_trace_per_rank(tmp_path):
    trace = tmp_path / "trace.json"
    out = subprocess.run(
        [sys.executable, "-m", "ccfx.cli", "run", "--nproc", "2", "--stages", "2",
         "--codec", "int8", "--grad-codec", "powersgd:rank=4", "--steps", "2",
         "--batch-size", "8", "--microbatches", "2", "--timeout", "120", "--trace", str(trace)],
        capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, out.stdout
    assert "0->1 fwd" in steps[0] and "0->1 bwd" in steps[0] and "loss" in steps[0]
    assert "int8 forward, powersgd:rank=4 backward" in out.stdout  # the plan (as written), rank 0
    for rank, (sends, receives) in enumerate([("fwd", "bwd"), ("bwd", "fwd")]):
        events = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any(n.startswith(f"ccfx encode {sends}") for n in names), rank
        assert any(n.startswith(f"ccfx decode {receives} mb1") for n in names), rank
        assert f"ccfx stage {rank} forward mb1" in names


def test_ccfx_run_with_auto_codecs_probes_the_link_and_explains_its_choices():
    out = subprocess.run(
        [sys.executable, "-m", "ccfx.cli", "run", "--nproc", "2", "--stages", "2",
         "--codec", "auto", "--steps", "1", "--batch-size", "8", "--microbatches", "2",
         "--timeout", "120"],
        capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "predicted step" in out.stdout and "edge 0 forward" in out.stdout, out.stdout
    assert "why:" in out.stdout
    assert "Gbit/s" in out.stdout  # the probed link, as the planner was told
