"""Every recipe in examples/ runs as its first comment says, and prints what it claims.

Each example is run the way a user runs it: ``python examples/x.py``, ``torchrun
--nproc-per-node 2 examples/x.py`` (2 gloo ranks on 127.0.0.1, a free port), Lightning's own
launcher, a torchft lighthouse and its replicas, ``bash examples/plan.sh``. Every run is
bounded by a timeout and kept tiny (``--steps``). The assertions read the one line each example
prints at its end (``name: ... figures ...``): the ledger's wire/raw ratio, the loss, the hook's
step count, whether the ranks' parameters are equal.

Here the examples' compiled graphs run eagerly (``CCFX_OPTIONS`` sets ``lowering="eager"``; the
options a script passes still win): inductor compiling every rank's graphs to C++ would cost
more than the runs themselves, and the lowering is tested on its own elsewhere. Multi-process
examples are ``slow``; they share the multi-rank worker under ``-n 2`` (tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = {"CCFX_OPTIONS": '{"lowering": "eager"}', "TRANSFORMERS_VERBOSITY": "error",
       "OMP_NUM_THREADS": "1", "CCFX_CODEC_COMPILE": "auto",
       # a rank that aborts (SIGABRT, SIGSEGV) prints every Python thread's stack first
       "PYTHONFAULTHANDLER": "1"}
#: steps for the multi-process examples: enough for the loss to move and a few syncs
STEPS = "6"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**more: str) -> dict:
    """The user's environment, the examples' settings, and this interpreter's bin/ first on
    PATH (so ``ccfx`` and ``torchft_lighthouse`` are this venv's)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, **ENV, "PATH": path, **more}


def _run(argv: list[str], cwd: Path, timeout_s: float = 240) -> str:
    """Run ``argv`` as a user does; its stdout (the test fails with its stderr's tail)."""
    out = subprocess.run(argv, cwd=cwd, env=_env(), timeout=timeout_s, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, (f"{argv} exited {out.returncode}:\n{out.stderr[-3000:]}\n"
                                 f"stdout's tail:\n{out.stdout[-1500:]}")
    return out.stdout


def _torchrun(script: str, tmp_path: Path, *args: str) -> str:
    """``torchrun --nproc-per-node 2 examples/<script>`` on 127.0.0.1 and a free port."""
    return _run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                 "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(_free_port()), str(EXAMPLES / script), *args], tmp_path)


def _summary(stdout: str, name: str) -> str:
    """The line the example prints at its end, ``<name>: ...``."""
    lines = [line for line in stdout.splitlines() if line.startswith(f"{name}: ")]
    assert len(lines) == 1, stdout[-3000:]
    return lines[0]


def _number(line: str, label: str) -> float:
    """The figure after ``label`` in a summary line (``wire/raw 0.254``: label "wire/raw")."""
    found = re.search(rf"{re.escape(label)} (-?[0-9.]+)", line)
    assert found, (label, line)
    return float(found.group(1))


def _loss(line: str) -> tuple[float, float]:
    first, last = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", line).groups()
    return float(first), float(last)


# -- one process ------------------------------------------------------------------------------


def test_quickstart_simulates_four_stages_with_int8_cuts(tmp_path):
    out = _run([sys.executable, str(EXAMPLES / "quickstart.py"), "--steps", "8"], tmp_path)
    assert "4 stage(s)" in out and "int8" in out  # the plan
    assert "ccfx ledger: 8 step(s)" in out
    line = _summary(out, "quickstart")
    first, last = _loss(line)
    assert last < first, line
    assert 0.25 < _number(line, "wire/raw") < 0.26, line  # int8: a quarter, plus scales


def test_plan_sh_chooses_a_layout_for_the_1b_gpt(tmp_path):
    out = _run(["bash", str(EXAMPLES / "plan.sh")], tmp_path)
    assert "1.42 B parameters" in out and "64 devices in 8 node(s)" in out, out
    assert re.search(r"^chosen: pp=\d+ dp=\d+", out, re.MULTILINE), out
    assert "runners-up:" in out


# -- torchrun, 2 ranks --------------------------------------------------------------------------


@pytest.mark.slow
def test_delayed_dp_overlaps_the_exchange_and_keeps_ranks_equal(tmp_path):
    line = _summary(_torchrun("delayed_dp.py", tmp_path, "--steps", STEPS), "delayed_dp")
    assert "2 ranks, 6 steps" in line and "ranks equal: True" in line, line
    assert "in flight after saving 0" in line, line
    # int8 (a quarter) at 5 steps of 6, the exact fp32 correction at the 5th
    assert 0.35 < _number(line, "gradient wire/raw") < 0.4, line
    first, last = _loss(line)
    assert last < first, line


@pytest.mark.slow
def test_data_parallel_compresses_gradient_buckets_and_keeps_ranks_equal(tmp_path):
    line = _summary(_torchrun("data_parallel.py", tmp_path, "--steps", STEPS), "data_parallel")
    assert "2 ranks" in line and "ranks equal: True" in line, line
    assert _number(line, "gradient wire/raw") < 0.1, line  # PowerSGD rank 4 on 256x256
    first, last = _loss(line)
    assert last < first, line


@pytest.mark.slow
def test_shard_holds_half_the_parameters_and_compresses_its_collectives(tmp_path):
    line = _summary(_torchrun("shard.py", tmp_path, "--steps", STEPS), "shard")
    assert "rank 0 holds 0.50 of the parameters" in line, line
    assert _number(line, "collective wire/raw") < 0.3, line  # int8 gathers, int4 scatters
    first, last = _loss(line)
    assert last < first, line


@pytest.mark.slow
def test_fsdp2_compresses_torch_s_own_gathers_and_reduce_scatters(tmp_path):
    line = _summary(_torchrun("fsdp2.py", tmp_path, "--steps", STEPS), "fsdp2")
    assert "2 ranks" in line, line
    assert _number(line, "collective wire/raw") < 0.3, line  # int8 gathers, int4 scatters
    first, last = _loss(line)
    assert last < first, line


@pytest.mark.slow
def test_fsdp2_hsdp_compresses_the_replicas_all_reduce_and_resumes_its_state(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    line = _summary(_torchrun("fsdp2_hsdp.py", tmp_path, "--steps", STEPS, "--save", ckpt),
                    "fsdp2_hsdp")
    assert "2 replicas x 1" in line and "replicas equal: True" in line, line
    assert 0.25 < _number(line, "collective wire/raw") < 0.3, line  # int8 of fp32
    _, saved_last = _loss(line)
    line = _summary(_torchrun("fsdp2_hsdp.py", tmp_path, "--steps", "2", "--resume", ckpt),
                    "fsdp2_hsdp")
    assert "resumed from" in line and "replicas equal: True" in line, line
    first, _ = _loss(line)
    assert first < saved_last, line  # it went on from the checkpoint, not from scratch


@pytest.mark.slow
def test_tensor_parallel_compresses_the_all_reduce_and_keeps_ranks_equal(tmp_path):
    line = _summary(_torchrun("tensor_parallel.py", tmp_path, "--steps", STEPS),
                    "tensor_parallel")
    assert "ranks equal: True" in line, line
    assert 0.25 < _number(line, "collective wire/raw") < 0.26, line


@pytest.mark.slow
def test_pipeline_runs_one_stage_per_rank_with_compressed_sends(tmp_path):
    line = _summary(_torchrun("pipeline.py", tmp_path, "--steps", STEPS), "pipeline")
    assert "2 stages on 2 ranks" in line, line
    assert 0.25 < _number(line, "wire/raw forward") < 0.26, line  # int8
    assert _number(line, "backward") < 0.3, line  # PowerSGD rank 4 on 16x256
    first, last = _loss(line)
    assert last < first, line


@pytest.mark.slow
def test_hf_trainer_registers_the_codec_in_each_rank(tmp_path):
    """The Trainer's DDP with ccfx's hook, around a model compiled with 2 stages."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    line = _summary(_torchrun("hf_trainer.py", tmp_path, "--steps", STEPS), "hf_trainer")
    assert f"2 ranks, {STEPS} steps (the hook ran {STEPS})" in line, line
    assert "ranks equal: True" in line, line
    assert _number(line, "gradient wire/raw") < 0.3, line
    assert 0.25 < _number(line, "activations wire/raw") < 0.26, line


@pytest.mark.slow
def test_accelerate_registers_the_codec_on_the_prepared_model(tmp_path):
    pytest.importorskip("accelerate")
    line = _summary(_torchrun("accelerate_dp.py", tmp_path, "--steps", STEPS), "accelerate_dp")
    assert f"2 ranks, {STEPS} steps (the hook ran {STEPS})" in line, line
    assert "ranks equal: True" in line, line
    assert 0.25 < _number(line, "gradient wire/raw") < 0.26, line  # int8


@pytest.mark.slow
def test_local_steps_sync_compressed_and_leave_equal_global_parameters(tmp_path):
    line = _summary(_torchrun("local_steps.py", tmp_path, "--steps", "10"), "local_steps")
    assert "2 replicas, 10 steps, a sync every 5" in line, line
    assert "global parameters equal: True" in line, line
    assert _number(line, "sync wire/raw") < 0.3, line  # int8 (biases raw)


@pytest.mark.slow
def test_gossip_sends_a_tenth_to_its_neighbour_and_keeps_ranks_close(tmp_path):
    line = _summary(_torchrun("gossip.py", tmp_path, "--steps", STEPS), "gossip")
    assert "2 ranks on a ring, 6 steps, neighbours [1]" in line, line
    assert _number(line, "sent/raw per neighbour") == 0.2, line  # topk 10 %: values + indices
    assert 0 < _number(line, "consensus") < 0.01, line


# -- other launchers ----------------------------------------------------------------------------


@pytest.mark.slow
def test_lightning_launches_its_second_rank_and_each_registers(tmp_path):
    """One ``python examples/lightning_dp.py``: Lightning runs the script again for rank 1."""
    pytest.importorskip("pytorch_lightning")
    out = _run([sys.executable, str(EXAMPLES / "lightning_dp.py"), "--steps", STEPS], tmp_path)
    line = _summary(out, "lightning_dp")
    assert f"2 ranks, {STEPS} steps (the hook ran {STEPS})" in line, line
    assert "ranks equal: True" in line, line
    assert 0.25 < _number(line, "gradient wire/raw") < 0.26, line
    assert 0.25 < _number(line, "activations wire/raw") < 0.26, line


def _lighthouse(port: int) -> subprocess.Popen:
    """``torchft_lighthouse --min_replicas 1 ...`` as the example's comment starts it."""
    return subprocess.Popen(
        ["torchft_lighthouse", "--min_replicas", "1", "--join_timeout_ms", "1000",
         "--heartbeat_timeout_ms", "3000", "--bind", f"127.0.0.1:{port}"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class _Replica:
    """``REPLICA_ID=<name> TORCHFT_LIGHTHOUSE=... python examples/fault_tolerance.py``, its
    printed lines read as they come (a thread), its stderr kept in a file for failures."""

    def __init__(self, name: str, port: int, folder: Path):
        env = _env(REPLICA_ID=name, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
                   MASTER_ADDR="127.0.0.1")
        self.stderr = folder / f"replica{name}.{time.monotonic_ns()}.err"
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(EXAMPLES / "fault_tolerance.py"), "--steps", "100000"],
                cwd=folder, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, pattern: str, after: int = 0, timeout_s: float = 180) -> int:
        """The index of the first line from ``after`` on that matches ``pattern``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i in range(after, len(self.lines)):
                if re.search(pattern, self.lines[i]):
                    return i
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        pytest.fail(f"no line {pattern!r} (exit {self.proc.poll()}):\n"
                    + "\n".join(self.lines[-20:]) + "\n" + self.stderr.read_text()[-3000:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.mark.slow
def test_fault_tolerance_survivor_trains_on_and_a_restarted_replica_heals(tmp_path):
    """The example's comment, played out: a lighthouse (``--min_replicas 1``) and two replicas
    sync together; one is SIGKILLed, the survivor goes on committing alone; the killed one,
    started again, heals from the survivor. Each step is seen in the rows of
    ``outer.elastic.history`` the replicas print."""
    pytest.importorskip("torchft")
    port = _free_port()
    lighthouse = _lighthouse(port)
    replicas = []
    try:
        replicas += [_Replica("0", port, tmp_path), _Replica("1", port, tmp_path)]
        survivor, victim = replicas
        survivor.wait_for(r"replicas 2, committed True")
        victim.kill()
        killed = len(survivor.lines)
        survivor.wait_for(r"replicas 1, committed True", after=killed, timeout_s=60)
        replicas.append(_Replica("1", port, tmp_path))
        healed = replicas[-1].wait_for(r"healed True", timeout_s=120)
        replicas[-1].wait_for(r"replicas 2, committed True", after=healed, timeout_s=60)
    finally:
        for r in replicas:
            r.kill()
        lighthouse.kill()
        lighthouse.wait()
