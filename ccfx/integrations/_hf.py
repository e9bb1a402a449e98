"""The Hugging Face Trainer callback: ccfx's codec as the comm hook of ``trainer.model_wrapped``."""

from __future__ import annotations

from transformers import TrainerCallback

from ..errors import ConfigError
from ..runtime.comm_hook import CommHookState
from . import _HookAttacher, _world, find_ddp


class HFCodecCallback(_HookAttacher, TrainerCallback):
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
        super().__init__(spec, process_group, collective)
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None and _world(self.state.process_group) > 1:
            raise ConfigError(
                "HFCodecCallback needs the Trainer: its events are handed the unwrapped model, "
                "not the DDP model it registers on. Use ccfx.integrations.register_codec(trainer, "
                "spec) after Trainer(...), or HFCodecCallback(spec, trainer=trainer)")
        ddp = find_ddp(self.trainer.model_wrapped) if self.trainer is not None else None
        self._attach(ddp, f"the Trainer's model ({type(kwargs.get('model')).__name__}) is not "
                          "DDP-wrapped while several ranks run (DeepSpeed / FSDP take no DDP "
                          "comm hook)")
