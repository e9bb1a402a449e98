"""ccfx's Lightning callback on CUDA (scripts/gpu_check.sh, step "lightning").

On CUDA, Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers comm hooks itself (on CPU it
ignores them: what tests/test_integrations.py covers on 2 gloo ranks). This script runs the
README's Lightning route on one device, where that difference lives (one process: Lightning's
DDP of world size 1, NCCL on CUDA; a real DDP model, so the hook runs on every bucket):

* ``callback``: ``LightningCodecCallback("int8")`` alone registers ccfx's hook on the CUDA DDP
  model; the hook ran once per optimizer step (its state's step count) and the ledger counts
  fewer bytes on the wire than raw; the loss falls.
* ``strategy hook too``: ``DDPStrategy(ddp_comm_hook=fp16_compress_hook)`` with the callback.
  On CUDA Lightning registers the fp16 hook, and the callback must refuse with a ConfigError
  saying the model already has one; on CPU Lightning ignores it, and the callback must warn and
  register its own.

``--device cpu`` runs the same on the CPU (gloo): how this script is checked without a GPU.
Needs pytorch-lightning; without it, exit status 3 with the reason. One line
per check, "PASS ..." or "FAIL ...", and exit status 1 if any failed.

    python scripts/gpu_lightning_callback.py                 # cuda:0, nccl
    python scripts/gpu_lightning_callback.py --device cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
import warnings

import torch
from torch import nn


def _module(pl):
    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
            self.losses: list[float] = []
            self.trained_on = ""  # read during training: Lightning moves the module back to the CPU after fit

        def training_step(self, batch, _):
            x, y = batch
            self.trained_on = str(x.device)
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regressor()


def _data(steps: int):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randn(32 * steps, 64, generator=g)
    y = x[:, :8].sum(dim=1, keepdim=True) / 4
    return DataLoader(TensorDataset(x, y), batch_size=32)


def _fit(pl, device: str, steps: int, strategy_hook: bool):
    from pytorch_lightning.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from ccfx.integrations import LightningCodecCallback

    callback = LightningCodecCallback("int8")
    module = _module(pl)
    kw = {"ddp_comm_hook": fp16_compress_hook} if strategy_hook else {}
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=steps,
        max_epochs=1, strategy=DDPStrategy(process_group_backend="nccl" if device == "cuda"
                                           else "gloo", **kw),
        callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=tempfile.mkdtemp(prefix="ccfx-lightning-"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, _data(steps))
    return callback, module, [str(w.message) for w in seen]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    try:
        import pytorch_lightning as pl
    except ImportError:
        print("SKIP: pytorch-lightning is not installed")
        return 3
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: --device cuda, but torch sees no CUDA device")
        return 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import ccfx

    failed = 0

    def check(name: str, ok: bool, detail: str) -> None:
        nonlocal failed
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        failed += not ok

    # 1. the callback alone
    try:
        callback, module, _ = _fit(pl, args.device, args.steps, strategy_hook=False)
        state = callback.state
        raw, wire = ccfx.ledger_of(state).totals("bucket")
        on = module.trained_on
        check("callback registers on the DDP model",
              callback.ddp_model is not None and on.startswith(args.device),
              f"DDP model trained on {on}")
        check("the hook ran once per step", state.steps == args.steps,
              f"{state.steps} hook steps for {args.steps} optimizer steps")
        check("the ledger counts fewer wire bytes than raw", 0 < wire < raw,
              f"raw {raw} B, wire {wire} B")
        first, last = sum(module.losses[:3]) / 3, sum(module.losses[-3:]) / 3
        check("the loss falls", last < first, f"mean of the first 3 steps {first:.4f}, of the "
              f"last 3 {last:.4f}")
    except Exception:  # noqa: BLE001 (reported as a failed check; the next case still runs)
        check("callback alone", False, traceback.format_exc())

    # 2. the strategy's own hook beside the callback
    try:
        callback, _, seen = _fit(pl, args.device, 2, strategy_hook=True)
        if args.device == "cuda":
            check("a strategy hook beside the callback is refused", False,
                  "trained without the expected ConfigError")
        else:
            said = [m for m in seen if "Lightning ignores DDPStrategy(ddp_comm_hook=" in m]
            check("CPU: the ignored strategy hook is named", bool(said) and callback.state.steps
                  == 2, said[0] if said else f"warnings: {seen}")
    except ccfx.ConfigError as e:
        ok = args.device == "cuda" and "already has a comm hook" in str(e)
        check("a strategy hook beside the callback is refused", ok, str(e).splitlines()[0])
    except Exception:  # noqa: BLE001
        check("strategy hook too", False, traceback.format_exc())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
