"""The Hugging Face Trainer with ccfx's codec on DDP's gradient buckets.

    torchrun --nproc-per-node 2 examples/hf_trainer.py           # 2 CPU processes (gloo)
    torchrun --nproc-per-node 8 examples/hf_trainer.py           # 8 GPUs (NCCL), unchanged
    python examples/hf_trainer.py                                # 1 process: no DDP, a warning

The Trainer wraps the model in DistributedDataParallel itself; ccfx joins as DDP's comm hook
(one line after building the Trainer), so each gradient bucket is averaged through a codec.
Compiling the model with stages first (optional) adds the activation codec on the cut.
"""

import argparse
import hashlib
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

import ccfx
from ccfx.integrations import register_codec


class Regressor(nn.Module):
    """What the Trainer needs of a model: keyword inputs, a dict with ``loss``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 256), nn.Linear(256, 8)

    def forward(self, x, labels=None):
        out = self.fc2(nn.functional.gelu(self.fc1(x)))
        loss = None if labels is None else nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Regressor()
    x = torch.randn(16 * args.steps * 2, 32, generator=torch.Generator().manual_seed(1))
    data = [{"x": a, "labels": a[:8] * 0.5} for a in x]

    # Optional: 2 pipeline stages with int8 on the cut, compiled before the Trainer sees it.
    model.compile(backend="ccfx", options={"stages": 2, "activation_codec": "int8"})
    torch._dynamo.config.optimize_ddp = False  # a ccfx-compiled model under DDP needs this

    on_gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as folder:
        training = TrainingArguments(
            output_dir=folder, max_steps=args.steps, per_device_train_batch_size=16,
            learning_rate=1e-2, report_to=[], save_strategy="no", disable_tqdm=True,
            use_cpu=not on_gpu,                # True without GPUs: DDP on gloo; GPUs: NCCL
            logging_steps=1)
        trainer = Trainer(model=model, args=training, train_dataset=data)
        hook = register_codec(trainer, "powersgd:rank=4,ef")   # the one line
        trainer.train()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if not dist.is_initialized():              # one process: trained, uncompressed
        print(f"hf_trainer: 1 process, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        return
    fingerprint = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                          for p in model.parameters())).hexdigest()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, fingerprint)
    if dist.get_rank() == 0:
        print(ccfx.plan_of(trainer.model_wrapped))     # DDP's buckets: parameters, codec, bytes
        print(ccfx.ledger_of(trainer.model_wrapped))   # bytes per gradient bucket per step
        print(ccfx.ledger_of(model))                   # the activations' bytes across the cut
        raw, wire = ccfx.ledger_of(trainer.model_wrapped).totals("bucket")
        act_raw, act_wire = ccfx.ledger_of(model).totals()
        print(f"hf_trainer: {len(every)} ranks, {trainer.state.global_step} steps "
              f"(the hook ran {hook.steps}), loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"gradient wire/raw {wire / raw:.3f}, activations wire/raw "
              f"{act_wire / act_raw:.3f}, ranks equal: {len(set(every)) == 1}")
    dist.barrier()                             # leave together, then tear the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
