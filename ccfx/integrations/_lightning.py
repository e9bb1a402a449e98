"""The Lightning callback: ccfx's codec as DDP's comm hook on every device."""

from __future__ import annotations

import warnings

try:  # the standalone package first; the unified ``lightning`` package otherwise
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover (CI installs pytorch-lightning)
    import lightning.pytorch as pl

from typing import Any

from ..errors import CcfxWarning
from . import _checkpoint
from ._ddp import _HookAttacher, find_ddp


class LightningCodecCallback(_HookAttacher, pl.Callback):
    """Registers ccfx's codec (:func:`ccfx.ddp_comm_hook`) on the strategy's DDP model in
    ``on_train_start``, whatever the device::

        trainer = pl.Trainer(strategy="ddp", callbacks=[LightningCodecCallback("int8")])

    Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers hooks only on CUDA devices:
    on CPU it trains uncompressed and says nothing. This callback registers on CPU and CUDA;
    when it finds a ``ddp_comm_hook`` the strategy ignored (not CUDA), it warns. A strategy
    that did register a hook (CUDA) conflicts with this one: :class:`~ccfx.ConfigError` (DDP
    takes one hook; pass ccfx's here, not there). ``state``: the hook's state
    (``ccfx.ledger_of(callback.state)``; ``state_dict()`` for checkpoints). A strategy without
    DDP (one device) gets a :class:`~ccfx.CcfxWarning` and trains uncompressed.

    Checkpoints: the hook's state is this callback's ``state_dict``, in Lightning's ``.ckpt``.
    Rank 0 alone writes that file, and error-feedback residuals are per rank, so
    ``state_dict`` gathers every rank's state to rank 0 (a collective: Lightning builds the
    checkpoint on every rank); a resumed ``fit(ckpt_path=...)`` gives each rank its own back
    (``load_state_dict``, before the hook is registered: the state waits for its buckets).
    Another world size is a :class:`~ccfx.ConfigError`, and so is damaged state (NaN or ±inf,
    unreadable entries), naming the ``.ckpt``.
    """

    def state_dict(self) -> dict[str, Any]:
        return _checkpoint.gathered(self.state)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer  # Lightning restores callbacks after setup: names the file

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ckpt = getattr(getattr(self, "_trainer", None), "ckpt_path", None)
        where = f"{ckpt}, LightningCodecCallback" if ckpt else "LightningCodecCallback"
        _checkpoint.load_gathered(self.state, state_dict, where)

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        ignored = getattr(strategy, "_ddp_comm_hook", None)
        device = getattr(strategy, "root_device", None)
        if ignored is not None and getattr(device, "type", None) != "cuda":
            warnings.warn(
                f"Lightning ignores DDPStrategy(ddp_comm_hook={getattr(ignored, '__name__', ignored)}) "
                f"on {getattr(device, 'type', device)} (it registers comm hooks on CUDA only); "
                f"ccfx's callback registers its own codec {self.state.spec!r} instead",
                CcfxWarning, stacklevel=2)
        self._attach(find_ddp(strategy.model),
                     f"Lightning's strategy {type(strategy).__name__} holds no "
                     "DistributedDataParallel model while several ranks run: "
                     "LightningCodecCallback needs strategy='ddp' (DDPStrategy)")
