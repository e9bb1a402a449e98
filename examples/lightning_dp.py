"""Lightning with ccfx's codec on DDP's gradient buckets, on CPU and CUDA alike.

    python examples/lightning_dp.py            # Lightning starts the second process itself

`LightningCodecCallback` registers ccfx's codec as DDP's comm hook when training starts (on CPU
too, where Lightning's own `DDPStrategy(ddp_comm_hook=...)` is ignored), so each gradient
bucket is averaged through int8. The network inside the LightningModule is compiled by ccfx
with 2 stages and int8 on the cut (optional).
"""

import argparse
import hashlib

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ccfx
from ccfx.integrations import LightningCodecCallback


class Net(nn.Module):
    """A module class of your own: torch 2.13 does not capture `nn.Sequential.compile()`."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 256), nn.Linear(256, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.net.compile(backend="ccfx", options={"stages": 2, "activation_codec": "int8"})
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch._dynamo.config.optimize_ddp = False  # a ccfx-compiled module under DDP needs this
    x = torch.randn(2 * 32 * args.steps, 32, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=32)
    codec = LightningCodecCallback("int8")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[codec],
                         max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = Lit()
    trainer.fit(module, data)

    fingerprint = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                          for p in module.parameters())).hexdigest()
    every = [None] * trainer.world_size
    torch.distributed.all_gather_object(every, fingerprint)
    if trainer.global_rank == 0:
        print(codec.plan())                    # DDP's buckets: parameters, codec, bytes
        print(ccfx.ledger_of(codec.state))     # bytes per gradient bucket per step
        print(ccfx.ledger_of(module.net))      # the activations' bytes across the cut
        raw, wire = ccfx.ledger_of(codec.state).totals("bucket")
        act_raw, act_wire = ccfx.ledger_of(module.net).totals()
        losses = module.losses
        print(f"lightning_dp: {trainer.world_size} ranks, {trainer.global_step} steps "
              f"(the hook ran {codec.state.steps}), loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"gradient wire/raw {wire / raw:.3f}, activations wire/raw "
              f"{act_wire / act_raw:.3f}, ranks equal: {len(set(every)) == 1}")
    # Lightning leaves its process group up: leave together, then tear it down.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
