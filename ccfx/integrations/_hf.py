"""The Hugging Face Trainer callback: ccfx's codec as the comm hook of ``trainer.model_wrapped``."""

from __future__ import annotations

import warnings

from transformers import TrainerCallback

from ..errors import CcfxWarning, ConfigError
from ..runtime.comm_hook import CommHookState


class HFCodecCallback(TrainerCallback):
    """Registers ccfx's codec (:func:`ccfx.ddp_comm_hook`) on the Trainer's DDP model at train
    begin: the Trainer makes ``trainer.model_wrapped`` (``DDP(model)``, by accelerate) inside
    ``train()``, and a ``TrainerCallback`` event is handed the unwrapped model only, so the
    callback keeps the Trainer. The one line::

        ccfx.integrations.register_codec(trainer, "powersgd:rank=4,ef")

    adds it; ``trainer.add_callback(HFCodecCallback("int8", trainer=trainer))`` is the same.
    ``state`` (a :class:`~ccfx.runtime.comm_hook.CommHookState`) exists from construction:
    ``ccfx.ledger_of(callback.state)`` counts bytes per bucket per step, ``state_dict()``
    checkpoints PowerSGD's Q and error-feedback residuals. With one process there is no DDP
    model: a :class:`~ccfx.CcfxWarning`, training goes on uncompressed.
    """

    def __init__(self, spec: str | CommHookState, process_group=None,
                 collective: str = "all_gather", *, trainer=None):
        self.state = spec if isinstance(spec, CommHookState) else CommHookState(
            spec, process_group, collective)
        self.trainer = trainer
        self.ddp_model = None

    def on_train_begin(self, args, state, control, **kwargs):
        from . import _register, _world, find_ddp

        if self.trainer is None and _world(self.state.process_group) > 1:
            raise ConfigError(
                "HFCodecCallback needs the Trainer: its events are handed the unwrapped model, "
                "not the DDP model it registers on. Use ccfx.integrations.register_codec(trainer, "
                "spec) after Trainer(...), or HFCodecCallback(spec, trainer=trainer)")
        ddp = find_ddp(self.trainer.model_wrapped) if self.trainer is not None else None
        if ddp is None:
            if _world(self.state.process_group) > 1:
                raise ConfigError(
                    f"ccfx: the Trainer's model ({type(kwargs.get('model')).__name__}) is "
                    "not DDP-wrapped while several ranks run (DeepSpeed / FSDP take no DDP comm "
                    "hook): ccfx's gradient codec cannot be registered")
            warnings.warn(f"ccfx.integrations.HFCodecCallback: one process, no DDP model: no "
                          f"gradients to average, codec {self.state.spec!r} not registered",
                          CcfxWarning, stacklevel=2)
            return
        _register(ddp, self.state)
        self.ddp_model = ddp

    def plan(self):
        """The plan of the hook's buckets (``ccfx.plan_of(trainer.model_wrapped)``)."""
        from ..runtime.comm_hook import plan_of_hook

        return plan_of_hook(self.state, self.ddp_model)
