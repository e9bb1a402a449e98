"""Accelerate without the Trainer: ccfx's codec on the model `accelerator.prepare` returned.

    accelerate launch --num_processes 2 examples/accelerate_dp.py   # or:
    torchrun --nproc-per-node 2 examples/accelerate_dp.py           # 2 CPU processes (gloo)

`accelerator.prepare` wraps the model in DistributedDataParallel; ccfx joins as DDP's comm hook
(one line), so each gradient bucket is averaged through int8. `save_state` / `load_state` carry
the hook's per-rank state when it has one (error feedback, PowerSGD).
"""

import argparse
import hashlib

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ccfx
from ccfx.integrations import register_codec


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 256), nn.Linear(256, 8)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(16 * args.steps * accelerator.num_processes, 32,
                    generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x[:, :8] * 0.5), batch_size=16)   # sharded by prepare

    model, opt, data = accelerator.prepare(model, opt, data)
    hook = register_codec(model, "int8", accelerator=accelerator)   # the one line

    losses = []
    for x, y in data:                          # the training loop, as usual
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    if accelerator.num_processes == 1:         # no DDP on one process: a warning, uncompressed
        print(f"accelerate_dp: 1 process, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        return
    unwrapped = accelerator.unwrap_model(model)
    fingerprint = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                          for p in unwrapped.parameters())).hexdigest()
    every = gather_object([fingerprint])   # one per rank
    equal = len(every) == accelerator.num_processes and len(set(every)) == 1
    if accelerator.is_main_process:
        print(ccfx.plan_of(model))             # DDP's buckets: parameters, codec, bytes
        print(ccfx.ledger_of(model))           # bytes per gradient bucket per step, raw -> wire
        raw, wire = ccfx.ledger_of(model).totals("bucket")
        print(f"accelerate_dp: {accelerator.num_processes} ranks, {len(losses)} steps "
              f"(the hook ran {hook.steps}), loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"gradient wire/raw {wire / raw:.3f}, ranks equal: {equal}")
    accelerator.wait_for_everyone()
    accelerator.end_training()                 # tears the process group down


if __name__ == "__main__":
    main()
