"""Models and data that ship with ccfx: the tiny GPT and its embedded corpus (no download)."""

from .corpus import CharTokenizer, batches, load_corpus
from .tiny_gpt import MLP, Block, CausalSelfAttention, GPTConfig, TinyGPT

__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "CharTokenizer",
    "GPTConfig",
    "TinyGPT",
    "batches",
    "load_corpus",
]
