"""A Megatron tensor-parallel plan derived from a plain transformer's traced data flow
(ccfx/backends/tp_derive.py): the planner searches tensor parallelism with it when asked, and
says when it did not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ccfx
from ccfx.backends.plan_parallel import model_facts, plan_parallel
from ccfx.models.tiny_gpt import GPTConfig, TinyGPT


class _Attention(nn.Module):
    """LLaMA's attention: separate q, k, v projections, then o."""

    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, d))


class _SwiGLU(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(d, 3 * d), \
            nn.Linear(3 * d, d)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class _LlamaBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = nn.RMSNorm(d), _Attention(d), nn.RMSNorm(d), \
            _SwiGLU(d)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class _Llama(nn.Module):
    def __init__(self, d: int = 32, layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(100, d)
        self.layers = nn.ModuleList(_LlamaBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, 100)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _gpt():
    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=4, n_head=4, n_embd=32)
    idx = torch.zeros(8, 16, dtype=torch.long)
    return TinyGPT(cfg), (idx, idx)


def test_a_gpt_block_pairs_qkv_with_its_projection_and_the_mlp_up_with_down():
    assert model_facts(*_gpt()).derived_tp_plan == (
        ("blocks.*.attn.proj", "rowwise"), ("blocks.*.attn.qkv", "colwise"),
        ("blocks.*.mlp.fc", "colwise"), ("blocks.*.mlp.proj", "rowwise"))


def test_a_llama_block_pairs_q_k_v_with_o_and_gate_up_with_down():
    facts = model_facts(_Llama(), (torch.zeros(2, 8, dtype=torch.long),))
    assert dict(facts.derived_tp_plan) == {
        "layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
        "layers.*.attn.v": "colwise", "layers.*.attn.o": "rowwise",
        "layers.*.mlp.gate": "colwise", "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise"}
    assert facts.tp_plan is None  # derived, not declared


@pytest.mark.parametrize("blocks", [
    [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)],  # nothing closes a pair
    [nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8), nn.Linear(8, 16))
     for _ in range(3)],  # the second linear does not give the width back
])
def test_blocks_without_a_complete_megatron_pairing_derive_no_plan(blocks):
    model = nn.Sequential(*blocks)
    assert model_facts(model, (torch.zeros(4, 16),)).derived_tp_plan is None


def test_the_search_says_which_plan_it_used_and_when_it_searched_none():
    model, inputs = _gpt()
    cluster = ccfx.Cluster.nodes(2, 2, intra=(800, 0.01), inter=(10, 0.05), memory="8GiB",
                                 flops=1e12)
    skipped = plan_parallel(model, inputs, cluster)
    assert all(p.layout.tp == 1 for p in skipped.ranked)
    assert "tensor parallel not searched: the model declares no plan" in skipped.explain()
    assert "blocks.*.attn.qkv colwise" in skipped.explain()
    searched = plan_parallel(model, inputs, cluster, tensor_parallel=True)
    assert any(p.layout.tp == 2 for p in searched.ranked)
    assert "searched with the Megatron plan derived" in searched.explain()
