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

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..errors import CcfxWarning, ConfigError, optimize_ddp_error
from ..runtime.comm_hook import CommHookState, codec_hook, hook_state_of, plan_of_hook

__all__ = ["HFCodecCallback", "LightningCodecCallback", "find_ddp", "register_codec"]


def _world(process_group=None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def find_ddp(target: Any) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` model behind ``target``: a DDP model; a compiled one
    (``torch.compile(DDP(model))``, as accelerate compiles); a Hugging Face ``Trainer`` during
    ``train()``
    (``trainer.model_wrapped``); a Lightning ``Trainer`` during ``fit()``
    (``trainer.strategy.model``). None when there is no DDP (one process)."""
    seen = 0
    while target is not None and seen < 8:
        seen += 1
        if isinstance(target, DistributedDataParallel):
            return target
        if isinstance(getattr(target, "_orig_mod", None), torch.nn.Module):  # OptimizedModule
            target = target._orig_mod
        elif hasattr(target, "_models") and hasattr(target, "prepare"):  # accelerate.Accelerator
            # it keeps the models it was given, not their DDP wrappers: the caller holds those
            raise ConfigError(
                "ccfx.integrations: pass the model accelerator.prepare() returned (the "
                "DistributedDataParallel one), not the Accelerator: accelerate keeps the "
                "unwrapped model only")
        elif hasattr(target, "model_wrapped"):  # transformers.Trainer
            target = target.model_wrapped
        elif hasattr(target, "strategy") and hasattr(target.strategy, "model"):  # pl.Trainer
            target = target.strategy.model
        else:
            return None
    return None


def register_codec(target: Any, spec: str | CommHookState, process_group=None,
                   collective: str = "all_gather", *, accelerator=None,
                   resume_from: str | None = None) -> CommHookState | None:
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
    """
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
                "trainer.strategy.model in Lightning)")
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


def _compiled_by_ccfx(module: torch.nn.Module) -> bool:
    """Whether ``module`` was compiled with ``backend="ccfx"`` (``torch.compile(module)`` or
    ``module.compile()``), before or after its first call."""
    from types import SimpleNamespace

    from torch._dynamo.eval_frame import _TorchDynamoContext

    from ..backends.compiler import config_of

    if getattr(module, "_compiled_call_impl", None) is None and not hasattr(module,
                                                                               "dynamo_ctx"):
        return False
    if config_of(module) is not None:
        return True
    inner = getattr(module, "_compiled_call_impl", None)  # module.compile(): a closure
    for cell in getattr(inner, "__closure__", None) or ():
        try:
            ctx = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(ctx, _TorchDynamoContext) and config_of(
                SimpleNamespace(dynamo_ctx=ctx)) is not None:
            return True
    return False


def check_compiled_under_ddp(ddp: DistributedDataParallel) -> None:
    """A ConfigError when a module inside ``ddp`` is compiled by ccfx while Dynamo's DDP
    optimizer is on (``torch._dynamo.config.optimize_ddp``, torch's default): Dynamo then
    splits every graph compiled inside DDP's forward at DDP's bucket boundaries and hands ccfx
    the pieces one by one, which breaks ccfx's stages (a model over DDP's 1 MiB first bucket
    fails; a smaller one is one piece and happens to work: refused alike, so that a model
    growing past it does not start failing)."""
    from torch._dynamo.utils import get_optimize_ddp_mode

    if get_optimize_ddp_mode() != "ddp_optimizer":
        return
    compiled = next((name or type(ddp.module).__name__
                     for name, m in ddp.module.named_modules() if _compiled_by_ccfx(m)), None)
    if compiled is None:
        return
    raise optimize_ddp_error(compiled)


def _register(ddp: DistributedDataParallel, state: CommHookState) -> CommHookState:
    existing = hook_state_of(ddp)
    if existing is state:
        return state
    check_compiled_under_ddp(ddp)
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if hooks:
        names = ", ".join(getattr(h, "__qualname__", repr(h)) for h, _ in hooks)
        raise ConfigError(
            f"this DDP model already has a comm hook ({names}) and DDP takes one: register "
            "ccfx's codec instead of it, not beside it (a DDPStrategy(ddp_comm_hook=...) or an "
            "accelerate DistributedDataParallelKwargs(comm_hook=...) registers one on CUDA)")
    ddp.register_comm_hook(state, codec_hook)
    return state


class _HookAttacher:
    """What the framework callbacks share: the hook's state, made at construction (so it can
    be checkpointed or counted before training starts), and attaching it to the DDP model the
    framework built, or saying why not."""

    def __init__(self, spec: str | CommHookState, process_group=None,
                 collective: str = "all_gather"):
        self.state = spec if isinstance(spec, CommHookState) else CommHookState(
            spec, process_group, collective)
        self.ddp_model = None

    def _attach(self, ddp: DistributedDataParallel | None, no_ddp_on_ranks: str) -> None:
        """Register on ``ddp``; without one, a ConfigError on several ranks (``no_ddp_on_ranks``
        says why there is no DDP model), a warning on one process (nothing to average)."""
        if ddp is None:
            if _world(self.state.process_group) > 1:
                raise ConfigError(f"ccfx: {no_ddp_on_ranks}: ccfx's gradient codec cannot be "
                                  "registered")
            warnings.warn(f"ccfx.integrations.{type(self).__name__}: one process, no DDP "
                          f"model: no gradients to average, codec {self.state.spec!r} not "
                          "registered", CcfxWarning, stacklevel=3)
            return
        _register(ddp, self.state)
        self.ddp_model = ddp

    def plan(self):
        """The plan of the hook's buckets (parameters, codec, collective, bytes)."""
        return plan_of_hook(self.state, self.ddp_model)


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
