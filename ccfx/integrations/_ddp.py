"""What the framework integrations share: finding the DDP model behind what a framework hands
over, refusing a ccfx-compiled module under Dynamo's DDP optimizer, and registering the hook.

``ccfx.integrations`` (``register_codec``) and its two callbacks (``_hf``, ``_lightning``) all
import it, so the callbacks need not import the package that imports them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import _torch_compat as tc
from ..errors import CcfxWarning, ConfigError, optimize_ddp_error
from ..runtime.comm_hook import CommHookState, codec_hook, hook_state_of, plan_of_hook


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
        if tc.orig_module(target) is not None:  # OptimizedModule
            target = tc.orig_module(target)
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


def _compiled_by_ccfx(module: torch.nn.Module) -> bool:
    """Whether ``module`` was compiled with ``backend="ccfx"`` (``torch.compile(module)`` or
    ``module.compile()``), before or after its first call."""
    from types import SimpleNamespace

    from ..backends.compiler import config_of

    if tc.compiled_call_impl(module) is None and not hasattr(module, "dynamo_ctx"):
        return False
    if config_of(module) is not None:
        return True
    inner = tc.compiled_call_impl(module)  # module.compile(): a closure
    for cell in getattr(inner, "__closure__", None) or ():
        try:
            ctx = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(ctx, tc.DynamoContext) and config_of(
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
    if tc.get_optimize_ddp_mode() != "ddp_optimizer":
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
    hooks = tc.ddp_comm_hooks(ddp)
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
