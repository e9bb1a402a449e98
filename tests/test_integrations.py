"""ccfx where users already train (ccfx.integrations), with the real frameworks: the Hugging
Face Trainer, Accelerate (``accelerator.prepare``) and Lightning.

The 2-rank routes run in ONE spawn of 2 gloo ranks (the module fixture ``two``; workers in
tests/integrations_workers.py); each asserts: the loss falls, ccfx ran (its ledger counts
bytes, fewer than raw), the ranks' parameters are bit-equal, and gradients were synchronized
exactly once (the hook ran once per bucket per optimizer step; Accelerate also compares the
gradients with the exact mean of the ranks' local ones). The 1-process Trainer route (stages
and codecs from ``CCFX_OPTIONS``) and accelerate's refusal of ``torch_compile_backend="ccfx"``
run in this process.

A framework that is not installed skips its tests with the reason; CI installs ``.[dev]``,
which has them all.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

import ccfx

from . import integrations_workers as w
from . import ranks
from .ranks import scenario

HAS = {name: importlib.util.find_spec(name) is not None
       for name in ("transformers", "accelerate", "pytorch_lightning")}
SPEC_HF, SPEC_ACCELERATE, SPEC_LIGHTNING = "powersgd:rank=4,ef", "int8", "int8"
STEPS_HF, STEPS_ACCELERATE, STEPS_LIGHTNING = 6, 30, 20
#: resumes: (steps, saved at); Lightning: steps per epoch, 2 epochs, saved after the first
STEPS_RESUME_HF, SAVE_AT_HF = 4, 2
STEPS_RESUME_ACCELERATE, SAVE_AT_ACCELERATE = 10, 5
PER_EPOCH_LIGHTNING = 4


def _needs(*names: str) -> None:
    for name in names:
        if not HAS[name]:
            pytest.skip(f"{name} is not installed (pip install -e '.[dev]' installs transformers, "
                        "accelerate and pytorch-lightning): its ccfx.integrations route is not "
                        "tested here")


@pytest.fixture(scope="module")
def two():
    """Every 2-rank route, one spawn (~40 s on 2 busy cores, most of it importing the three
    frameworks in the ranks)."""
    runs = []
    if HAS["transformers"] and HAS["accelerate"]:
        # one GPT-2 block: compiling it is most of this scenario's time (2 blocks: twice that)
        runs.append(scenario("trainer", w.hf_trainer, SPEC_HF, STEPS_HF, True, 1))
        runs.append(scenario("trainer_resume", w.hf_trainer_resume, SPEC_HF, STEPS_RESUME_HF,
                             SAVE_AT_HF))
    if HAS["accelerate"]:
        runs.append(scenario("accelerate", w.accelerate_loop, SPEC_ACCELERATE, STEPS_ACCELERATE))
        runs.append(scenario("accelerate_resume", w.accelerate_resume, "powersgd:rank=2,ef",
                             STEPS_RESUME_ACCELERATE, SAVE_AT_ACCELERATE))
    if HAS["pytorch_lightning"]:
        runs.append(scenario("lightning", w.lightning_fit, SPEC_LIGHTNING, STEPS_LIGHTNING, True))
        runs.append(scenario("lightning_resume", w.lightning_resume, "int8:ef",
                             PER_EPOCH_LIGHTNING, 2))
    runs.append(scenario("checkpoint_refusals", w.checkpoint_refusals))
    runs.append(scenario("compiled_under_ddp_optimizer", w.compiled_under_ddp_optimizer))
    if not runs:
        pytest.skip("none of transformers, accelerate, pytorch-lightning is installed")
    return ranks.run_scenarios(2, runs, timeout_s=300, env={"TRANSFORMERS_VERBOSITY": "error"})


def _falls(losses: list[float], by: float) -> None:
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < (1 - by) * first, f"the loss did not fall by {by:.0%}: {losses}"


def _counted(ledger: dict, steps: int) -> None:
    """ccfx ran, and every gradient went through its hook exactly once per optimizer step: the
    hook saw as many last buckets as steps, and its buckets' raw bytes add up to the model's
    gradients times the steps (a bucket reduced twice, or skipped, would not; DDP may regroup
    its buckets after the first step, so the count is by bytes, not per bucket index)."""
    assert ledger["steps"] == ledger["hook_steps"] == steps, ledger
    assert ledger["raw"] == steps * ledger["grad_bytes"], ledger
    assert 0 < ledger["wire"] < ledger["raw"], ledger


# -- Hugging Face Trainer, 2 ranks: register_codec(trainer, spec) --------------------------------


@pytest.mark.slow
def test_trainer_two_ranks_compiled_stages_and_codec_hook(two):
    """GPT-2 compiled by ccfx with 2 stages and int8 activations
    (``model.compile(backend="ccfx", options=...)``, ``optimize_ddp=False``), then a 2-process
    Trainer with ccfx's codec on DDP's buckets (``register_codec(trainer, spec)``): the ledgers
    count both the cut edges and the buckets, the loss falls, the ranks stay bit-equal."""
    _needs("transformers", "accelerate")
    r0, r1 = two["trainer"]
    for r in (r0, r1):
        # the model's graph has its 2 stages; the loss graph (a break) is left whole
        assert r["graphs"] == [2, 1], r["graphs"]
        compiled = r["compiled"]
        for direction in ("fwd", "bwd"):
            raw, wire = compiled[direction]
            assert 0 < wire < raw / 3, compiled  # int8 on the cut edges, both ways
        assert r["wrapped_is_ddp"] and r["global_step"] == STEPS_HF
        _counted(r["ledger"], STEPS_HF)
        assert r["ledger_of_ddp_is_state"]  # ccfx.ledger_of(trainer.model_wrapped)
        # GPT-2 of one block: its 61.9 KiB of gradients, PowerSGD rank 4 -> 12.4 KiB (0.200)
        assert r["ledger"]["wire"] / r["ledger"]["raw"] < 0.25
        assert r["buckets"] >= 1 and "powersgd" in r["plan"] and "world size 2" in r["plan"]
        # counting sequences, lr 3e-3: 3.90 -> 3.72 in 6 steps, the means of the first and
        # last 3 falling 3.0 % (measured; the Trainer logs the mean over the ranks)
        _falls(r["losses"], 0.02)
    assert r0["digest"] == r1["digest"], "the ranks' parameters differ"


# -- Accelerate, 2 ranks: register_codec(prepared_model, spec) ------------------------------------


@pytest.mark.slow
def test_accelerate_two_ranks_codec_hook_averages_once(two):
    _needs("accelerate")
    r0, r1 = two["accelerate"]
    for r in (r0, r1):
        _counted(r["ledger"], STEPS_ACCELERATE)
        assert len(r["ledger"]["calls"]) == 2  # DDP's 2 buckets, each counted
        assert "fc1.weight" in r["plan"]  # the plan names the buckets' parameters
        assert r["ledger_of_ddp_is_state"] and "int8" in r["plan"] and "all_gather" in r["plan"]
        # int8 (blockwise) on 2.6 k gradients: wire 0.254 of raw
        assert r["ledger"]["wire"] / r["ledger"]["raw"] < 0.3
        # Averaged once: within int8's error of the exact mean (measured at most 2.0 % over the
        # 30 steps' parameters); a rank's own gradient is far from it (the bound separates the
        # two), and a sum instead of a mean, once or twice, would be off by 100 % or more.
        assert r["max_rel_error"] < 0.1 < r["min_local_spread"], r
        _falls(r["losses"], 0.3)  # 1.89 -> 0.64 over 30 steps (measured)
        assert r["register_again"] is None  # the same state twice: a no-op
        assert r["compiled_ddp_found"]  # torch.compile(DDP(model)): the DDP inside
        assert r["second_hook"]["error"] == "ConfigError"
        assert "already has a comm hook" in r["second_hook"]["message"]
        assert r["accelerator"]["error"] == "ConfigError"
        assert "accelerator.prepare() returned" in r["accelerator"]["message"]
    assert r0["digest"] == r1["digest"], "the ranks' parameters differ"


# -- Lightning, 2 ranks on CPU: LightningCodecCallback + compiled stages in the module ------------


@pytest.mark.slow
def test_lightning_two_ranks_callback_registers_on_cpu(two):
    _needs("pytorch_lightning")
    r0, r1 = two["lightning"]
    for r in (r0, r1):
        assert r["global_step"] == STEPS_LIGHTNING
        _counted(r["ledger"], STEPS_LIGHTNING)
        assert r["ledger_of_ddp_is_state"]
        # the strategy's own ddp_comm_hook is ignored on CPU: the callback says so
        assert any("Lightning ignores DDPStrategy(ddp_comm_hook=fp16_compress_hook)" in m
                   for m in r["warnings"]), r["warnings"]
        _falls(r["losses"], 0.2)
    assert r0["digest"] == r1["digest"], "the ranks' parameters differ"


@pytest.mark.slow
def test_lightning_module_with_compiled_stages(two):
    """The LightningModule's network compiled by ccfx with 2 stages, int8 both ways: the
    activations crossed the cut through the codec on every step, inside DDP."""
    _needs("pytorch_lightning")
    for r in two["lightning"]:
        compiled = r["compiled"]
        assert compiled["stages"] == 2
        for direction in ("fwd", "bwd"):
            raw, wire = compiled[direction]
            assert 0 < wire < raw / 3, compiled  # int8: a quarter of fp32, plus scales


# -- checkpoints: the hook's state saved and resumed through each framework ----------------------


def _resumed(r: dict, steps: int) -> None:
    """The hook state the fresh run restored is the one the first run had when it saved (same
    steps, buckets, bits; not empty), and the resumed run ended bit-equal to the uninterrupted
    one, parameters and hook state."""
    assert r["restored_equals_saved"], (r["saved"], r["restored"])
    assert r["restored"]["steps"] == steps and r["restored"]["nonzero"] >= 1, r["restored"]
    assert r["final_states_equal"]
    first, resumed = r["digests"]
    assert first == resumed, "the resumed run is not bit-equal to the uninterrupted one"


@pytest.mark.slow
def test_trainer_checkpoint_holds_the_hook_state_and_resumes_bit_equal(two):
    """``save_strategy="steps"``: every rank writes its own ``ccfx_comm_hook_rank<r>.pt`` into
    ``checkpoint-<step>``; ``train(resume_from_checkpoint=...)`` in a fresh Trainer (other
    initial weights) restores it (PowerSGD's Q and error-feedback residuals) and ends bit-equal
    to the uninterrupted run (``ddp_find_unused_parameters=True``: DDP's buckets never change,
    so the restored state fits from the first step)."""
    _needs("transformers", "accelerate")
    r0, r1 = two["trainer_resume"]
    for rank, r in enumerate((r0, r1)):
        assert {"ccfx_comm_hook_rank0.pt", "ccfx_comm_hook_rank1.pt"} <= set(r["files"])
        assert r["restored_from"] == f"ccfx_comm_hook_rank{rank}.pt"
        _resumed(r, SAVE_AT_HF)
        assert r["steps_b"] == STEPS_RESUME_HF
        assert r["losses"][0] == r["losses"][1]  # the steps after the resume too
    assert r0["digests"] == r1["digests"]


@pytest.mark.slow
def test_accelerate_save_state_holds_the_hook_state_and_resumes_bit_equal(two):
    """``register_codec(model, spec, accelerator=accelerator)``: ``save_state`` writes every
    rank's hook state, ``load_state`` in a new Accelerator restores it, and the continued run
    is bit-equal to the uninterrupted one; the same resume without ccfx's state is not (the
    state matters: PowerSGD+EF restarted from zero takes other steps)."""
    _needs("accelerate")
    r0, r1 = two["accelerate_resume"]
    for r in (r0, r1):
        assert r["files"] == ["ccfx_comm_hook_rank0.pt", "ccfx_comm_hook_rank1.pt"]
        _resumed(r, SAVE_AT_ACCELERATE)
        assert r["fresh_restored"]["steps"] == 0
        assert r["digest_without_state"] != r["digests"][1]
    assert r0["digests"] == r1["digests"]


@pytest.mark.slow
def test_lightning_ckpt_holds_every_ranks_hook_state_and_resumes_bit_equal(two):
    """The callback's ``state_dict`` gathers every rank's state into the ``.ckpt`` that rank 0
    writes; ``fit(ckpt_path=...)`` with a fresh Trainer, module and callback gives each rank
    its own back and ends bit-equal (saved at an epoch's end: Lightning restarts a plain
    DataLoader's epoch when resumed inside it)."""
    _needs("pytorch_lightning")
    r0, r1 = two["lightning_resume"]
    for r in (r0, r1):
        assert r["ranks_in_ckpt"] == [0, 1] and r["world_in_ckpt"] == 2
        _resumed(r, PER_EPOCH_LIGHTNING)
        assert r["global_steps"] == [2 * PER_EPOCH_LIGHTNING] * 2
    assert r0["digests"] == r1["digests"]


@pytest.mark.slow
def test_hook_state_of_another_world_or_rank_is_refused(two):
    for rank, r in enumerate(two["checkpoint_refusals"]):
        for case in ("world", "gathered_world"):
            assert r[case]["error"] == "ConfigError"
            assert "saved by 3 rank(s), and 2 run now" in r[case]["message"]
            assert "Resume on as many ranks" in r[case]["message"]
        assert r["rank"]["error"] == "ConfigError"
        assert f"this is rank {rank}: each rank loads its own" in r["rank"]["message"]


@pytest.mark.slow
def test_ccfx_compiled_module_under_ddp_optimizer_is_refused(two):
    """Dynamo's DDP optimizer would hand ccfx a compiled model's graph in bucket-sized pieces:
    register_codec refuses, naming the setting that works, and registers once it is set; a
    DDP model with nothing compiled by ccfx is not concerned."""
    for r in two["compiled_under_ddp_optimizer"]:
        assert r["refused"]["error"] == "ConfigError"
        message = r["refused"]["message"]
        assert "'fc1' is compiled by ccfx" in message
        assert "torch._dynamo.config.optimize_ddp = False" in message
        assert r["registered"]
        assert r["plain"] is None, r["plain"]


# -- Hugging Face Trainer, 1 process: stages and codecs from CCFX_OPTIONS ------------------------


class TinyRegressor(torch.nn.Module):
    """What the Trainer needs of a model: keyword inputs, a dict with ``loss``."""

    def __init__(self):
        super().__init__()
        self.net = w.MLP()

    def forward(self, x, labels=None):
        out = self.net(x)
        loss = None if labels is None else torch.nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


@pytest.fixture
def isolated_frameworks(tmp_path):
    """The Trainer in this process: the environment and accelerate's process-wide state put
    back afterwards (TrainingArguments and accelerate write both)."""
    saved = dict(os.environ)
    threads = torch.get_num_threads()
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)
    torch.set_num_threads(threads)
    if HAS["accelerate"]:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _one_process_trainer(folder: Path, model, steps: int, **kw):
    from transformers import Trainer

    data = [{"x": x, "labels": y} for s in range(steps)
            for x, y in zip(*w._regression_batch(0, s, n=16), strict=True)]
    return Trainer(model=model, args=w._training_args(str(folder), steps, **kw),
                   train_dataset=data)


def test_trainer_one_process_stages_and_codecs_from_ccfx_options(isolated_frameworks):
    """``model.compile(backend="ccfx")`` before the Trainer, the options from ``CCFX_OPTIONS``
    (what a launcher can set): the Trainer trains the compiled model, the plan has the stages
    and says where the options came from, the ledger counts the activations' bytes. The same
    script's ``register_codec(trainer, ...)`` warns on one process and trains on."""
    _needs("transformers", "accelerate")
    os.environ["CCFX_OPTIONS"] = json.dumps(w.STAGES)
    torch.manual_seed(0)
    model = TinyRegressor()
    model.compile(backend="ccfx")
    trainer = _one_process_trainer(isolated_frameworks, model, steps=12)
    from ccfx import integrations

    state = integrations.register_codec(trainer, "int8")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    assert any(issubclass(x.category, ccfx.CcfxWarning) and "one process" in str(x.message)
               for x in seen), [str(x.message) for x in seen]
    assert state.steps == 0  # nothing registered: no DDP on one process
    plan = ccfx.plan_of(model)
    assert plan.num_stages == 2 and plan.option_sources["stages"] == "environment"
    raw, wire = ccfx.ledger_of(model).totals("fwd")
    assert 0 < wire < raw / 3
    assert ccfx.ledger_of(model).steps == 12
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    _falls(losses, 0.2)


def test_accelerate_one_process_stages_and_codecs(isolated_frameworks):
    """Accelerate without the Trainer, one process: the model compiled by ccfx with stages
    before ``accelerator.prepare`` trains through its cut (the ledger counts the activations'
    bytes every step, int8 both ways); the same script's ``register_codec`` warns and trains on
    (no DDP on one process)."""
    _needs("accelerate")
    from accelerate import Accelerator

    from ccfx import integrations

    torch.manual_seed(0)
    model = w.MLP()
    model.compile(backend="ccfx", options=w.STAGES)
    accelerator = Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)  # as the 2-rank Accelerate scenario
    prepared, opt = accelerator.prepare(model, opt)
    with pytest.warns(ccfx.CcfxWarning, match="one process"):
        assert integrations.register_codec(prepared, "int8", accelerator=accelerator) is None
    losses = []
    for step in range(STEPS_ACCELERATE):
        x, y = w._regression_batch(0, step)
        loss = torch.nn.functional.mse_loss(prepared(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert ccfx.plan_of(model).num_stages == 2
    ledger = ccfx.ledger_of(model)
    assert ledger.steps == STEPS_ACCELERATE
    for direction in ("fwd", "bwd"):
        raw, wire = ledger.totals(direction)
        assert 0 < wire < raw / 3, (direction, raw, wire)
    _falls(losses, 0.3)  # measured 1.80 -> 0.71 (means of the first and last 3 steps)


def test_trainer_torch_compile_backend_ccfx_is_refused_by_accelerate(isolated_frameworks):
    """``TrainingArguments(torch_compile_backend="ccfx")`` cannot work: accelerate checks the
    name against its own ``DynamoBackend`` enum inside ``Trainer(...)``, before any ccfx code
    runs (and would compile ``DDP(model)`` with no options). The documented route is
    ``model.compile(backend="ccfx", options=...)`` before the Trainer (the test above). This
    test pins accelerate's behaviour: if it ever accepts the name, the docs change."""
    _needs("transformers", "accelerate")
    with pytest.raises(ValueError, match="'CCFX' is not a valid DynamoBackend"):
        _one_process_trainer(isolated_frameworks, TinyRegressor(), steps=1,
                             torch_compile_backend="ccfx")


# -- without frameworks ---------------------------------------------------------------------------


def test_register_codec_on_one_process_warns_and_returns_none():
    from ccfx import integrations

    with pytest.warns(ccfx.CcfxWarning, match="one process"):
        assert integrations.register_codec(torch.nn.Linear(2, 2), "int8") is None
    with pytest.raises(ccfx.ConfigError, match="codec"):
        integrations.register_codec(torch.nn.Linear(2, 2), "int9")


def test_nothing_in_ccfx_imports_the_integrations():
    """ccfx.integrations is the top layer: it imports the runtime, nothing imports it."""
    from .test_layers import MODULES, ROOT, _imports, _under

    bad = []
    for module, path in sorted(MODULES.items()):
        if _under(module, "ccfx.integrations"):
            continue
        for imp in _imports(module, path, MODULES):
            if _under(imp.target, "ccfx.integrations"):
                bad.append(f"{path.relative_to(ROOT)}:{imp.line}: {imp.written}")
    assert not bad, bad


def test_hook_state_file_round_trip_and_trainer_resume_lookup(tmp_path):
    """One process: a state saved to a folder loads into a fresh one (steps, spec); the
    Trainer callback looks for its file at ``resume_from``, then
    ``<output_dir>/checkpoint-<step>``, and warns (fresh state) when neither has it."""
    _needs("transformers")
    from types import SimpleNamespace

    from ccfx.integrations import HFCodecCallback, _checkpoint
    from ccfx.runtime.comm_hook import CommHookState

    saved = CommHookState("powersgd:rank=2,ef")
    saved.steps = 7
    path = _checkpoint.save_file(saved, str(tmp_path / "elsewhere"))
    assert path.endswith("ccfx_comm_hook_rank0.pt")
    fresh = CommHookState("powersgd:rank=2,ef")
    assert _checkpoint.load_file(fresh, str(tmp_path / "elsewhere")) and fresh.steps == 7
    assert not _checkpoint.load_file(fresh, str(tmp_path / "nothing"))
    with pytest.raises(ccfx.ConfigError, match="for codec"):
        _checkpoint.load_file(CommHookState("int8"), str(tmp_path / "elsewhere"))

    args = SimpleNamespace(output_dir=str(tmp_path / "out"), resume_from_checkpoint=None)
    resumed = SimpleNamespace(global_step=7)
    callback = HFCodecCallback("powersgd:rank=2,ef", resume_from=str(tmp_path / "elsewhere"))
    callback._restore(args, resumed)
    assert callback.state.steps == 7 and callback.restored_from == path
    _checkpoint.save_file(saved, str(tmp_path / "out" / "checkpoint-7"))
    callback = HFCodecCallback("powersgd:rank=2,ef")
    callback._restore(args, resumed)
    assert callback.restored_from.endswith("out/checkpoint-7/ccfx_comm_hook_rank0.pt")
    callback = HFCodecCallback("powersgd:rank=2,ef")
    with pytest.warns(ccfx.CcfxWarning, match="resumed at step 8, but no ccfx_comm_hook_rank0"):
        callback._restore(args, SimpleNamespace(global_step=8))
    assert callback.state.steps == 0 and callback.restored_from is None
    callback._restore(args, SimpleNamespace(global_step=0))  # a fresh run: nothing looked for


# -- a damaged hook state through each framework's loader: a ConfigError naming the file ---------


SPEC_DAMAGED = "powersgd:rank=4,ef"


def _hook_entry(poison: float | None = None) -> dict:
    """A one-process hook state file's contents (``_checkpoint.entry``) holding bucket 0's
    PowerSGD Q and residual; ``poison``: one value of the residual."""
    from ccfx.integrations import _checkpoint
    from ccfx.runtime.comm_hook import CommHookState

    seeded = torch.Generator().manual_seed(0)
    state = CommHookState(SPEC_DAMAGED)
    state.load_state_dict({"spec": SPEC_DAMAGED, "steps": 3,
                           "buckets": {0: {"shapes": ((8, 16),), "dtype": torch.float32}},
                           "state": {"ddp.bucket0.q0000": torch.randn(16, 4, generator=seeded),
                                     "ddp.bucket0.residual0000": torch.randn(
                                         8, 16, generator=seeded)}})
    saved = _checkpoint.entry(state)
    if poison is not None:  # damaged after it was written (the loader refuses to take it)
        saved["hook"]["state"]["ddp.bucket0.residual0000"][2, 3] = poison
    return saved


def _damaged_files(folder: Path) -> dict[str, Path]:
    """``ccfx_comm_hook_rank0.pt`` in a folder per damage: NaN, +inf, truncated bytes."""
    files = {}
    for name, poison in (("nan", float("nan")), ("inf", float("inf"))):
        (folder / name).mkdir(parents=True)
        files[name] = folder / name / "ccfx_comm_hook_rank0.pt"
        torch.save(_hook_entry(poison), files[name])
    (folder / "truncated").mkdir()
    files["truncated"] = folder / "truncated" / "ccfx_comm_hook_rank0.pt"
    torch.save(_hook_entry(), files["truncated"])
    files["truncated"].write_bytes(files["truncated"].read_bytes()[:300])
    return files


#: what each damage's ConfigError says after the file's path
DAMAGE = {"nan": r"holds NaN or ±inf.*ddp\.bucket0 .*residual0000 holds 1 NaN and 0 ±inf",
          "inf": r"holds NaN or ±inf.*ddp\.bucket0 .*residual0000 holds 0 NaN and 1 ±inf",
          "truncated": r"cannot be read \(\w+: .*\): the file is damaged"}


def test_trainer_resume_refuses_a_damaged_hook_state_file_naming_it(tmp_path):
    """The Trainer callback's restore (``train(resume_from_checkpoint=...)``) reads this rank's
    file: NaN, ±inf or unreadable bytes are a ConfigError naming the file and the fix, not a
    NaN loss from the first step or a pickle error."""
    _needs("transformers")
    from types import SimpleNamespace

    from ccfx.integrations import HFCodecCallback

    args = SimpleNamespace(output_dir=str(tmp_path / "out"), resume_from_checkpoint=None)
    for damage, path in _damaged_files(tmp_path).items():
        callback = HFCodecCallback(SPEC_DAMAGED, resume_from=str(path.parent))
        with pytest.raises(ccfx.ConfigError, match=rf"(?s)^{re.escape(str(path))}: .*"
                           rf"{DAMAGE[damage]}.*Resume from an earlier checkpoint"):
            callback._restore(args, SimpleNamespace(global_step=3))
        assert callback.state.steps == 0 and callback.restored_from is None


def test_accelerate_load_state_refuses_a_damaged_hook_state_file_naming_it(isolated_frameworks):
    """``register_codec(model, spec, accelerator=...)``: ``accelerator.load_state(folder)``
    reads this rank's file in its pre-hook, before accelerate's own files: a damaged one is a
    ConfigError naming it; a good one loads bit-exact."""
    _needs("accelerate")
    from accelerate import Accelerator

    from ccfx import integrations
    from ccfx.runtime.comm_hook import CommHookState

    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(w.MLP())
    state = CommHookState(SPEC_DAMAGED)
    with pytest.warns(ccfx.CcfxWarning, match="one process"):
        integrations.register_codec(prepared, state, accelerator=accelerator)
    for damage, path in _damaged_files(isolated_frameworks / "damaged").items():
        with pytest.raises(ccfx.ConfigError,
                           match=rf"(?s)^{re.escape(str(path))}: .*{DAMAGE[damage]}"):
            accelerator.load_state(str(path.parent))
        assert state.steps == 0
    good = isolated_frameworks / "good"
    good.mkdir()
    torch.save(_hook_entry(), good / "ccfx_comm_hook_rank0.pt")
    accelerator.save_state(str(good))  # accelerate's own files beside ccfx's
    accelerator.load_state(str(good))
    saved, restored = _hook_entry()["hook"]["state"], state.state_dict()["state"]
    assert sorted(restored) == sorted(saved) and state.steps == 3
    assert all(torch.equal(t, saved[k]) for k, t in restored.items())


def test_lightning_resume_refuses_a_damaged_hook_state_naming_the_ckpt(tmp_path):
    """``fit(ckpt_path=...)`` gives the callback its entry of the ``.ckpt``: a good one loads
    bit-exact, a residual holding NaN is a ConfigError naming the ``.ckpt`` and the channel."""
    _needs("pytorch_lightning")
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ccfx.integrations import LightningCodecCallback, _checkpoint

    x, y = w._regression_batch(0, 0)
    data = DataLoader(TensorDataset(x, y), batch_size=16)

    def fit(ckpt_path=None, steps=2):
        callback = LightningCodecCallback(SPEC_DAMAGED)
        if ckpt_path is None:  # a one-process run has no buckets: give it a state to save
            _checkpoint.load_entry(callback.state, _hook_entry(), "test")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                             callbacks=[callback], enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(w._lightning_module(compiled=False), data, ckpt_path=ckpt_path)
        return trainer, callback

    trainer, _ = fit()
    good = tmp_path / "good.ckpt"
    trainer.save_checkpoint(good)
    _, resumed = fit(good, steps=3)
    saved, restored = _hook_entry()["hook"]["state"], resumed.state.state_dict()["state"]
    assert sorted(restored) == sorted(saved) and resumed.state.steps == 3
    assert all(torch.equal(t, saved[k]) for k, t in restored.items())
    ckpt = torch.load(good, weights_only=False)
    entry = next(v for k, v in ckpt["callbacks"].items() if "LightningCodecCallback" in k)
    entry["ranks"][0]["hook"]["state"]["ddp.bucket0.residual0000"][2, 3] = float("nan")
    bad = tmp_path / "bad.ckpt"
    torch.save(ckpt, bad)
    with pytest.raises(ccfx.ConfigError, match=rf"(?s)^{re.escape(str(bad))}, "
                       rf"LightningCodecCallback: .*{DAMAGE['nan']}"):
        fit(bad, steps=3)
