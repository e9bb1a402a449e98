"""FSDP2 where users launch it: Accelerate's FSDP2 plugin and Lightning's ModelParallelStrategy,
the real packages, 2 gloo ranks, each recipe of ``examples/`` under its launcher.

- Lightning: ``python examples/lightning_fsdp2.py`` (Lightning starts the second rank), the
  module sharding itself in ``configure_model`` and registering ccfx's codecs there.
- Accelerate: its FSDP path is for GPUs only (``AcceleratorState`` sets ``DistributedType.FSDP``
  for ``MULTI_GPU``, ``MULTI_XPU``, ... never ``MULTI_CPU``; ``accelerate launch`` refuses
  ``--cpu`` with ``--use_fsdp``). On CPU the recipe runs under torchrun with the state
  switched to FSDP after accelerate built it (``tests/fsdp2_launchers_workers.py``), so that
  accelerate's own ``prepare`` shards the model (its auto-wrap policy picking the blocks)
  and ccfx's codecs train what it returned. As a user runs it on CPU, accelerate hands back
  DDP and ``register_codec`` says why, naming the fix: tested in this process, on a DDP
  model.

The runs reuse ``test_examples``'s launcher helpers (eager lowering, a free port, a timeout).
Each asserts on the line the example prints at its end: every rank's codecs counted every
step, the collectives' wire/raw below int8's quarter (int8 gathers, int4 reduce-scatters:
measured 0.213), the loss fell.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .test_examples import EXAMPLES, STEPS, _env, _free_port, _loss, _number, _run, _summary

WORKERS = Path(__file__).resolve().parent / "fsdp2_launchers_workers.py"


def _torchrun(script: Path, tmp_path: Path, check: bool = True):
    """``torchrun --nproc-per-node 2 <script> --steps STEPS``: its stdout, or (``check``
    False) the finished process."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(_free_port()), str(script), "--steps", STEPS]
    if check:
        return _run(argv, tmp_path)
    return subprocess.run(argv, cwd=tmp_path, env=_env(), timeout=240, capture_output=True,
                          text=True, check=False)


def _trained(line: str) -> None:
    """Every rank's codecs counted every step, the bytes shrank, the loss fell."""
    assert f"steps counted per rank [{STEPS}, {STEPS}]" in line, line
    assert _number(line, "collective wire/raw") < 0.25, line  # int8 gathers, int4:ef scatters
    first, last = _loss(line)
    assert last < first, line


@pytest.mark.slow
def test_lightning_model_parallel_strategy_trains_with_codecs_registered_in_configure_model(
        tmp_path):
    pytest.importorskip("pytorch_lightning")
    out = _run([sys.executable, str(EXAMPLES / "lightning_fsdp2.py"), "--steps", STEPS],
               tmp_path)
    line = _summary(out, "lightning_fsdp2")
    assert f"2 ranks, {STEPS} steps" in line, line
    _trained(line)
    for module in ("root", "blocks.0", "blocks.1"):  # the plan lists each FSDP module
        assert f" {module} " in out, out[-3000:]


@pytest.mark.slow
def test_accelerate_fsdp2_plugin_shards_the_blocks_and_trains_with_codecs(tmp_path):
    pytest.importorskip("accelerate")
    line = _summary(_torchrun(WORKERS, tmp_path), "accelerate_fsdp2")
    assert f"2 ranks, {STEPS} steps, 3 FSDP modules" in line, line  # 2 Blocks and the root
    _trained(line)


def test_a_codec_per_kind_on_accelerates_cpu_ddp_model_says_why(one_rank_group):
    """On CPU accelerate ignores the FSDP plugin and ``prepare`` hands back DDP; a codec per
    kind on that model is a ConfigError naming accelerate's CPU path and the two ways that
    shard on CPU (``examples/accelerate_fsdp2.py`` run as a user runs it ends here)."""
    pytest.importorskip("accelerate")
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ccfx
    from ccfx.integrations import register_codec

    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    with pytest.raises(ccfx.ConfigError, match=r"DistributedDataParallel model .*accelerate "
                                               r"ignores the plugin on CPU.*lightning_fsdp2"):
        register_codec(model, {"all_gather": "int8", "reduce_scatter": "int4:ef"})
