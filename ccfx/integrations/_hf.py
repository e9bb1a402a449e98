"""The Hugging Face Trainer callback: ccfx's codec as the comm hook of ``trainer.model_wrapped``."""

from __future__ import annotations

import os
import warnings

from transformers import TrainerCallback

from ..errors import CcfxWarning, ConfigError
from ..runtime.comm_hook import CommHookState
from . import _checkpoint
from ._ddp import _HookAttacher, _world, find_ddp


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

    Checkpoints: at every save (``on_save``) each rank writes its hook state to
    ``<output_dir>/checkpoint-<step>/ccfx_comm_hook_rank<rank>.pt`` (the Trainer's own files
    are rank 0's; this one is per rank, since an error-feedback residual is). A run resumed
    with ``trainer.train(resume_from_checkpoint=...)`` restores it at train begin: a
    ``TrainerCallback`` is not told the folder, so it is looked for at ``resume_from`` (given
    here), ``args.resume_from_checkpoint``, then ``<output_dir>/checkpoint-<step resumed at>``
    (where ``resume_from_checkpoint=True`` and a path into ``output_dir`` point). Not found: a
    :class:`~ccfx.CcfxWarning`, and the codec starts fresh. Found but damaged (unreadable, NaN
    or ±inf state): a :class:`~ccfx.ConfigError` naming the file. (The Trainer's own
    ``ExportableState`` callbacks go to ``trainer_state.json``, written by rank 0 only, as
    JSON: no place for per-rank tensors.)
    """

    def __init__(self, spec: str | CommHookState, process_group=None,
                 collective: str = "all_gather", *, trainer=None, resume_from: str | None = None):
        super().__init__(spec, process_group, collective)
        self.trainer = trainer
        self.resume_from = resume_from
        #: the file this rank's state was restored from at train begin, if any
        self.restored_from: str | None = None

    def on_save(self, args, state, control, **kwargs):
        if self.ddp_model is None:  # one process: nothing registered, nothing to save
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        _checkpoint.save_file(self.state, folder)

    def _restore(self, args, state) -> None:
        if state.global_step == 0:  # a fresh run
            return
        candidates = [self.resume_from, args.resume_from_checkpoint
                      if isinstance(args.resume_from_checkpoint, str) else None,
                      os.path.join(args.output_dir, f"checkpoint-{state.global_step}")]
        for folder in filter(None, candidates):
            if _checkpoint.load_file(self.state, folder):
                self.restored_from = os.path.join(folder, _checkpoint.file_name(self.state))
                return
        warnings.warn(
            f"ccfx: the Trainer resumed at step {state.global_step}, but no "
            f"{_checkpoint.file_name(self.state)} was found in "
            f"{', '.join(filter(None, candidates))}: ccfx's codec {self.state.spec!r} starts "
            "from fresh state (error-feedback residuals, PowerSGD Q). A checkpoint outside "
            "output_dir: pass its folder, register_codec(trainer, spec, resume_from=folder)",
            CcfxWarning, stacklevel=2)

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
        if self.ddp_model is not None:
            self._restore(args, state)
