"""torchtitan's own FSDP2 (its `parallelize_llama`), its collectives compressed by ccfx.

    torchrun --nproc-per-node 2 examples/torchtitan_fsdp2.py          # gloo on CPU
    # on GPUs, torchtitan's trainer with this file as its config module:
    PYTHONPATH=examples torchrun --nproc-per-node 8 -m torchtitan.train \
        --module torchtitan_fsdp2 --config llama3_debugmodel_ccfx

torchtitan 0.3.0 builds the model, then calls its ModelSpec's `parallelize_fn` (tensor
parallel, activation checkpointing, compile, then `fully_shard` on every block). Its model
converters rewrite the model's *config*, before any FSDP module exists, so the hook point is
`parallelize_fn`: `with_ccfx` wraps it, and the one added line is
`ccfx.integrations.register_codec(model, codecs)` after torchtitan's parallelize.

torchtitan's trainer does not start on CPU (it picks CUDA when no accelerator is found:
torchtitan/tools/utils.py:55, then `torch.cuda.set_device` at torchtitan/trainer.py:301), and
torch 2.13's FlexAttention, its debug model's attention, has no backward on CPU. So on CPU
this script runs torchtitan's `parallelize_llama` on its debug model and trains it in a small
loop, with two stand-ins (`cpu_stand_ins`): CPU meshes, and the debug model's attention as
causal SDPA (the same mask here: every row is one document).
"""

import argparse
import contextlib
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ccfx
import ccfx.integrations

#: ZeRO++'s shape: int8 weight gathers, int4 gradient reduce-scatters with error feedback
CODECS = {"all_gather": "int8", "reduce_scatter": "int4:ef"}


def with_ccfx(parallelize_fn, codecs=CODECS):
    """torchtitan's ``parallelize_fn``, then ccfx's comms on every FSDP module it made."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, **kwargs):
        model = parallelize_fn(model, **kwargs)
        ccfx.integrations.register_codec(model, codecs)       # the one added line
        return model

    return parallelize


def llama3_debugmodel_ccfx():
    """torchtitan's ``llama3_debugmodel`` config with ccfx's comms (``--config`` of
    ``torchtitan.train``; ``--module torchtitan_fsdp2`` with ``examples/`` on PYTHONPATH)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec.parallelize_fn = with_ccfx(config.model_spec.parallelize_fn)
    return config


def _causal_sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                 kernel_options):
    """FlexAttention's call, as causal SDPA (CPU: FlexAttention has no backward there)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=enable_gqa), None


@contextlib.contextmanager
def cpu_stand_ins():
    """CPU only, undone on exit: torchtitan's meshes on CPU (it names CUDA when no
    accelerator is found) and its FlexAttention as causal SDPA."""
    from torchtitan.distributed import parallel_dims
    from torchtitan.models.common.attention import FlexAttention

    saved = parallel_dims.device_type, FlexAttention.__dict__["_compiled_flex_attn"]
    parallel_dims.device_type = "cpu"
    FlexAttention._compiled_flex_attn = staticmethod(_causal_sdpa)
    try:
        yield
    finally:
        parallel_dims.device_type, FlexAttention._compiled_flex_attn = saved


def debug_model(world: int, parallelize_fn=None, layers: int | None = None):
    """torchtitan's llama3 debug model (its first ``layers`` blocks), built on the meta
    device, parallelized by ``parallelize_fn`` (torchtitan's ``parallelize_llama``) with its
    trainer's defaults (bf16 gathers, fp32 reduce-scatters), then initialized by torchtitan
    on CPU. Call inside :func:`cpu_stand_ins`."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    if layers is not None:
        spec.model.layers = spec.model.layers[:layers]
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor",
                                    data_parallel_shard_degree=world)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model.build()
    model = (parallelize_fn or spec.parallelize_fn)(
        model, parallel_dims=ParallelDims.from_config(parallelism, world),
        training=TrainingConfig(), parallelism=parallelism, compile_config=CompileConfig(),
        ac_config=None, dump_folder="/tmp")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def causal_mask(batch: int, seq: int):
    """The BlockMask torchtitan's FlexAttention expects (the stand-in ignores it), built
    eagerly: torchtitan compiles its own."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: q >= kv, batch, None, seq, seq, device="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.environ.setdefault("CCFX_CODEC_COMPILE", "0")  # eager codecs: no inductor compile per shape
    from torchtitan.models.llama3 import parallelize_llama

    with cpu_stand_ins():
        model = debug_model(dist.get_world_size(), with_ccfx(parallelize_llama), layers=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(rank))
        positions, mask = torch.arange(32).repeat(2, 1), causal_mask(2, 32)
        losses = []
        for _ in range(args.steps):
            logits = model(tokens[:, :-1], positions, mask)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            (loss / dist.get_world_size()).backward()  # torchtitan's FSDP sums: it scales the loss
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())

    if rank == 0:
        print(ccfx.plan_of(model))
        raw, wire = ccfx.ledger_of(model).totals("collective")
        print(f"torchtitan_fsdp2: {dist.get_world_size()} ranks, {args.steps} steps, "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, collective wire/raw {wire / raw:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
