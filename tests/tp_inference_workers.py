"""What each rank runs in tests/test_tp_inference.py (module-level: spawn pickles them by name);
every worker returns plain data.

The model is a Hugging Face Llama built from a config (random weights, nothing downloaded;
bench/tp_inference.py's builder, smaller), the same seed on every rank, parallelized with
torch's own ``ColwiseParallel`` / ``RowwiseParallel`` per the config's ``base_model_tp_plan`` (q/k/v, gate/up column-wise; o, down
row-wise): each decoder layer's two row-wise projections end in an all-reduce, which ccfx's
``collective_codec`` replaces in the compiled inference graphs (no input requires grad).

Tokens are bytes (vocabulary 256): the held-out text of ``ccfx.models.load_corpus`` encodes
as its ASCII codes.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

import ccfx
from bench import tp_inference as tp

VOCAB = tp.VOCAB


def llama():
    """The test's model: 2 layers, hidden 128, 4 heads (bench/tp_inference.py's, smaller)."""
    return tp.llama(hidden=128, layers=2, heads=4, max_pos=256)


def heldout(length: int = 64) -> torch.Tensor:
    """The prompt: the last ``length`` bytes of the corpus (held-out text), one row."""
    return tp.heldout(length)


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new: int) -> tuple[list[int], float, torch.Tensor]:
    """Greedy decoding with the KV cache: a manual loop (prefill, then one token per call with
    ``past_key_values``), so the calls compile to a prefill graph and a decode graph (the
    decode graph is compiled twice: once static, then with the cache length dynamic, Dynamo's
    automatic dynamic shapes). Returns the tokens and the prompt's perplexity from the prefill's
    logits (the prompt is held-out text: no extra graph), and the prefill's last logits."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = out.logits[0].float()
    ppl = math.exp(float(F.cross_entropy(logits[:-1], ids[0, 1:])))
    tokens = []
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    pos = ids.shape[1]
    for _ in range(new):
        tokens.append(int(nxt))
        if len(tokens) == new:
            break
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True,
                    cache_position=torch.tensor([pos]))
        pos += 1
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return tokens, ppl, logits[-1].clone()


def compile_ccfx(model, codec: str, dynamic=None):
    model.compile(backend="ccfx", dynamic=dynamic,
                  options={"lowering": "eager", "collective_codec": codec})
    return model


def generate(rank, world, variant: str, new: int = 32, dynamic=None, sharded: bool = True):
    """Greedy tokens of the model under ``variant`` ("eager", "inductor", or a collective codec
    for ``backend="ccfx"``), its perplexity on held-out text, and (ccfx) its plan and ledger."""
    model = llama()
    if sharded:
        tp.tensor_parallel(model, world)
    if variant == "inductor":
        model.compile(dynamic=dynamic)
    elif variant != "eager":
        compile_ccfx(model, variant, dynamic)
    tokens, ppl, last = greedy(model, heldout(), new)
    out = {"tokens": tokens, "ppl": ppl, "last_logits": last}
    if variant not in ("eager", "inductor"):
        plan = ccfx.plan_of(model)
        out["collectives"] = [dataclasses.asdict(c) for c in plan.collectives]
        out["ledger"] = [(e.graph, e.edge, e.calls, e.raw_bytes, e.wire_bytes)
                         for e in ccfx.ledger_of(model).entries("collective")]
    return out

