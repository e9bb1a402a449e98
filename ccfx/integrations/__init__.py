"""ccfx where you already train: Hugging Face Trainer, Accelerate and Lightning.

These frameworks wrap the model in ``DistributedDataParallel`` themselves, so ccfx joins in as
DDP's communication hook (:func:`ccfx.ddp_comm_hook`): DDP keeps its buckets and its
overlap, and each bucket is averaged through a ccfx codec. What a user writes::

    # Hugging Face Trainer (one line after building the Trainer)
    ccfx.integrations.register_codec(trainer, "powersgd:rank=4,ef")
    # Accelerate, without the Trainer: the model accelerator.prepare returned
    model, opt, data = accelerator.prepare(model, opt, data)
    ccfx.integrations.register_codec(model, "powersgd:rank=4,ef")
    # Lightning (on CPU too, where DDPStrategy(ddp_comm_hook=...) is ignored)
    pl.Trainer(strategy="ddp", callbacks=[ccfx.integrations.LightningCodecCallback("int8")])

A model sharded with torch's FSDP2 (``fully_shard``) takes the same call, with one codec or a
codec per collective kind (:mod:`._fsdp2`): ``register_codec(model, {"all_gather": "int8",
"reduce_scatter": "int4:ef"})``.

Then ``ccfx.ledger_of(ddp_model)`` / ``ccfx.plan_of(ddp_model)`` (or ``ccfx.ledger_of(state)``
with the state :func:`register_codec` returned) count the bytes per bucket per step.

Checkpoints: the hook's state is per rank (error-feedback residuals), and goes where each
framework lets every rank's state be saved and restored (see :mod:`._checkpoint`): a file per
rank in the Hugging Face Trainer's ``checkpoint-<step>`` folder and in Accelerate's
``save_state`` folder (``register_codec(model, spec, accelerator=accelerator)``), every rank's
state gathered into Lightning's ``.ckpt`` by the callback's ``state_dict``.

Pipeline stages and activation codecs are a compile of the model itself, before the framework
sees it: ``model.compile(backend="ccfx", options={...})``. Under DDP that needs
``torch._dynamo.config.optimize_ddp = False`` (:func:`check_compiled_under_ddp` says why). Frameworks that take only a backend
*name* do not work: accelerate accepts only the names of its ``DynamoBackend`` enum
(``TrainingArguments(torch_compile_backend="ccfx")`` raises accelerate's ``ValueError: 'CCFX'
is not a valid DynamoBackend`` inside ``Trainer(...)``, before any ccfx code runs), and it would
compile ``DDP(model)`` with no options.

This package sits at the top of ccfx's layers (beside ``backends``): it imports
:mod:`ccfx.runtime`, nothing in ccfx imports it. transformers and Lightning are imported only
when their callback is asked for.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import CcfxWarning, ConfigError
from ..runtime.comm_hook import CommHookState, hook_state_of, plan_of_hook
from ..runtime.fsdp2_comms import FSDP2Codecs
from . import _fsdp2, _launchers
from ._ddp import _register, _world, find_ddp
from ._ddp import check_compiled_under_ddp as check_compiled_under_ddp  # its public home

__all__ = ["HFCodecCallback", "LightningCodecCallback", "find_ddp", "register_codec"]


def register_codec(target: Any, spec: str | dict[str, str] | CommHookState,
                   process_group=None, collective: str = "all_gather", *, accelerator=None,
                   resume_from: str | None = None, replicate=None,
                   options: dict | None = None) -> CommHookState | FSDP2Codecs | None:
    """Average the gradients of ``target``'s DDP model through the codec ``spec``
    (``"powersgd:rank=4,ef"``, ``"int8"``, ``"fp16"``, ...): DDP's comm hook becomes ccfx's
    (:func:`ccfx.ddp_comm_hook`). Returns the hook's state: its ``ledger`` counts bytes per
    bucket per step, ``state_dict()`` belongs in the checkpoint.

    ``target``: a DDP model (or ``torch.compile(DDP(model))``), such as the model
    ``accelerator.prepare`` returned; a Hugging Face ``Trainer`` (before ``train()``: the hook is registered
    at train begin by an :class:`HFCodecCallback` added to it, since the Trainer makes its DDP
    model inside ``train()``). ``spec`` may be a :class:`~ccfx.runtime.comm_hook.CommHookState`
    (a resumed one). Registering the same state twice is a no-op; a DDP model that already has
    another comm hook is a :class:`~ccfx.ConfigError` (DDP takes one).

    With one process there is nothing to average: a :class:`~ccfx.CcfxWarning`, and None
    (the same script runs on 1 and N processes). A model that is not DDP-wrapped while
    several ranks run is a :class:`~ccfx.ConfigError`: its gradients would not be averaged.

    Checkpoints (the hook's state: PowerSGD's Q, error-feedback residuals, the step counter;
    per rank, in ``ccfx_comm_hook_rank<rank>.pt`` in the checkpoint folder):

    * a Hugging Face Trainer: saved at every checkpoint and restored by
      ``train(resume_from_checkpoint=...)`` (see :class:`HFCodecCallback`; ``resume_from``
      names the folder when it is outside ``output_dir``);
    * Accelerate: pass ``accelerator=``; ``accelerator.save_state(folder)`` /
      ``load_state(folder)`` then save and restore it, on every rank (through accelerate's
      ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``: an object given to
      ``register_for_checkpointing`` is saved by the main process only, and residuals are per
      rank).

    A model sharded with torch's FSDP2 (``fully_shard``, eager or compiled) takes one spec for
    every collective or a dict by kind, ``{"all_gather": "int8", "reduce_scatter": "int4:ef"}``
    (a missing kind: ``"none"``), or ``"auto"`` priced on the link of ``options=``; HSDP:
    ``fully_shard`` over ``mesh["shard"]`` and ``replicate=mesh["replicate"]`` compresses the
    replicas' all-reduce (the ``"all_reduce"`` kind). Returns an
    :class:`~ccfx.runtime.fsdp2_codecs.FSDP2Codecs` (``save(folder)`` on every rank,
    ``resume_from=folder`` to resume); see docs/guides/frameworks.md and
    :mod:`ccfx.integrations._fsdp2` for what is refused.
    """
    _launchers.check_kinds_fit(target, spec)  # FSDP2's kinds on DDP (accelerate on CPU)
    fsdp2_only = replicate is not None or options is not None
    if isinstance(spec, dict) or fsdp2_only or (not isinstance(spec, CommHookState)
                                                and _fsdp2.holds_fsdp(target)):
        return _fsdp2.register(target, spec, process_group, replicate=replicate,
                               accelerator=accelerator, resume_from=resume_from,
                               options=options)
    state = spec if isinstance(spec, CommHookState) else CommHookState(spec, process_group,
                                                                         collective)
    if _is_hf_trainer(target):
        from ._hf import HFCodecCallback

        target.add_callback(HFCodecCallback(state, trainer=target, resume_from=resume_from))
        return state
    if accelerator is not None:
        _checkpoint_with(accelerator, state)
    ddp = find_ddp(target)
    if ddp is None:
        if _world(state.process_group) > 1:
            raise ConfigError(
                f"ccfx.integrations.register_codec: {type(target).__name__} is not (and holds "
                "no) DistributedDataParallel model while "
                f"{_world(state.process_group)} ranks run: pass the DDP model "
                "(what accelerator.prepare returned, a Hugging Face Trainer, "
                "trainer.strategy.model in Lightning) or a model sharded with torch's "
                f"fully_shard; got {_fsdp2.describe(target)}")
        warnings.warn(f"ccfx.integrations.register_codec: one process, no DDP model in "
                      f"{type(target).__name__}: no gradients to average, codec "
                      f"{state.spec!r} not registered", CcfxWarning, stacklevel=2)
        return None
    return _register(ddp, state)


def _checkpoint_with(accelerator, state: CommHookState) -> None:
    """``accelerator.save_state`` / ``load_state`` save and restore ``state``, every rank its
    own file (the pre-hooks run on every process and are handed the folder)."""
    from . import _checkpoint

    if getattr(state, "_ccfx_accelerator", None) is accelerator:
        return  # registered already (register_codec called again with the same state)
    state._ccfx_accelerator = accelerator

    def save(_models, _weights, folder):
        if _world(state.process_group) > 1:  # one process: no hook, nothing to save
            _checkpoint.save_file(state, folder)

    def load(_models, folder):
        if not _checkpoint.load_file(state, folder) and _world(state.process_group) > 1:
            warnings.warn(f"ccfx: no {_checkpoint.file_name(state)} in {folder}: ccfx's codec "
                          f"{state.spec!r} starts from fresh state", CcfxWarning, stacklevel=2)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def _is_hf_trainer(target: Any) -> bool:
    return hasattr(target, "add_callback") and hasattr(target, "model_wrapped")


def plan(target: Any):
    """The plan of the ccfx hook on ``target``'s DDP model (see :func:`register_codec` for
    what ``target`` may be): ``ccfx.plan_of(ddp_model)``, reachable through a framework."""
    ddp = find_ddp(target)
    state = hook_state_of(ddp) if ddp is not None else None
    if state is None:
        raise ConfigError(f"no ccfx comm hook on {type(target).__name__}'s DDP model")
    return plan_of_hook(state, ddp)


def __getattr__(name: str):
    # the callbacks subclass the frameworks' classes: imported when asked for
    if name == "HFCodecCallback":
        from ._hf import HFCodecCallback

        return HFCodecCallback
    if name == "LightningCodecCallback":
        from ._lightning import LightningCodecCallback

        return LightningCodecCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
