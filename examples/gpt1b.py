"""A 1.4 B-parameter GPT (24 blocks, width 2048, 16 heads, sequence 2048, GPT-2's vocabulary)
for ``ccfx plan``, built on the meta device: the planner reads shapes only, so nothing is
allocated. bf16 parameters and activations; the step's batch is 512 sequences.

    ccfx plan --cluster examples/cluster64.toml --model examples/gpt1b.py:gpt_1b
"""

import torch

from ccfx.models.tiny_gpt import GPTConfig, TinyGPT


def gpt_1b(batch: int = 512):
    config = GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)
    with torch.device("meta"):
        model = TinyGPT(config).to(torch.bfloat16)
        idx = torch.zeros(batch, config.block_size, dtype=torch.long)
    return model, (idx, idx)


def gpt_1b_big_batch():
    """The same GPT with 2048 sequences per step: without a pipeline or recomputation a
    replica's activations no longer fit in 80 GiB (``ccfx plan`` lists those as refused)."""
    return gpt_1b(batch=2048)
