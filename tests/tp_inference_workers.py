"""What each rank runs in tests/test_tp_inference.py (module-level: spawn pickles them by name);
bench/tp_inference.py uses the same model and generation. Every worker returns plain data.

The model is a Hugging Face Llama built from a config (random weights, nothing downloaded),
the same seed on every rank, parallelized with torch's own ``ColwiseParallel`` /
``RowwiseParallel`` per the config's ``base_model_tp_plan`` (q/k/v, gate/up column-wise; o, down
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

VOCAB = 256

#: torch's style for each of the plan's words (the config's base_model_tp_plan)
_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


def llama(hidden: int = 128, layers: int = 2, heads: int = 4, seed: int = 0, max_pos: int = 256):
    """A random-init LlamaForCausalLM in eval mode (eager attention: no SDPA kernel choice
    differs between the sharded and unsharded model)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_pos, attention_dropout=0.0, bos_token_id=0,
        eos_token_id=None, pad_token_id=0, attn_implementation="eager", use_cache=True,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def tensor_parallel(model, world: int):
    """Shard ``model`` over every rank per its config's ``base_model_tp_plan``, with torch's
    styles. Returns the plan used ({module path: style name})."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel

    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for pattern, word in model.config.base_model_tp_plan.items():
        style = _STYLES.get(word)
        if style is None:  # the plan's other words (e.g. "gather"): not in Llama's today
            raise ValueError(f"tp plan word {word!r} for {pattern!r} has no torch style here")
        plan[pattern] = style
    layer_plan = {p.split(".*.", 1)[1]: getattr(parallel, s)() for p, s in plan.items()}
    for layer in model.model.layers:
        parallel.parallelize_module(layer, mesh, layer_plan)
    return plan


def heldout(length: int = 64) -> torch.Tensor:
    """The prompt: the last ``length`` bytes of the corpus (held-out text), one row."""
    from ccfx.models import load_corpus

    text = load_corpus().encode("ascii")[-length:]
    return torch.tensor([list(text)], dtype=torch.long)


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


def generate(rank, world, variant: str, new: int = 32, dynamic=None, tp: bool = True):
    """Greedy tokens of the model under ``variant`` ("eager", "inductor", or a collective codec
    for ``backend="ccfx"``), its perplexity on held-out text, and (ccfx) its plan and ledger."""
    model = llama()
    if tp:
        tensor_parallel(model, world)
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

