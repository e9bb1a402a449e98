"""Shared helpers of the benchmarks: timing, the tiny GPT, tables and JSON output.

Timing uses ``time.perf_counter``: warm-up calls first, then the median of N repeats.
Ratios are always against a baseline measured in the same run, on the same machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

# ---------------------------------------------------------------------------------------------
# The model: ccfx's tiny GPT (the demo's), or a local minimal stack if it is not there.

try:  # the name the demo and the tests use
    from ccfx.models.tiny_gpt import GPTConfig
    from ccfx.models.tiny_gpt import TinyGPT as GPT
except ImportError:  # pragma: no cover - older/newer layouts
    try:
        from ccfx.models.tiny_gpt import GPT, GPTConfig
    except ImportError:
        GPT = GPTConfig = None

# The demo's shape: 4 layers, width 256, 4 heads, context 64 (about 3.2 M parameters).
GPT_KW = {"vocab_size": 96, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256}
BATCH = 16


class _Block(nn.Module):
    """Pre-LN transformer block (fallback when ccfx.models.tiny_gpt is missing)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class _FallbackGPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def tiny_gpt(seed: int = 0, **overrides) -> nn.Module:
    """The tiny GPT (ccfx.models.tiny_gpt if present), seeded, dropout 0."""
    kw = {**GPT_KW, **overrides}
    torch.manual_seed(seed)
    if GPT is not None:
        return GPT(GPTConfig(**kw))
    return _FallbackGPT(**kw)


def gpt_batch(batch: int = BATCH, seed: int = 1, **overrides):
    """(idx, targets) of shape (batch, block_size), random tokens."""
    kw = {**GPT_KW, **overrides}
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, kw["vocab_size"], (batch, kw["block_size"] + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def gpt_loss(model, idx, targets):
    out = model(idx, targets)
    return out[1] if isinstance(out, tuple) else out


def compile_model(model: nn.Module, kind: str, *, stages: int = 4, codec: str = "none",
                  **options):
    """``kind``: "eager" (no compile), "aot_eager", "inductor", "ccfx-eager", "ccfx-inductor"."""
    if kind == "eager":
        return model
    if kind in ("aot_eager", "inductor"):
        return torch.compile(model, backend=kind)
    if kind.startswith("ccfx-"):
        return torch.compile(model, backend="ccfx", options={
            "stages": stages, "activation_codec": codec, "lowering": kind[len("ccfx-"):],
            **options})
    raise ValueError(f"unknown kind {kind!r}")


# ---------------------------------------------------------------------------------------------
# Timing.


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` calls (seconds)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 2,
                      inner: int = 1) -> dict[str, list[float]]:
    """Time several callables in turn (A B A B …) so that drift and noise hit them alike.

    Each sample is the mean of ``inner`` back-to-back calls. Returns the samples per name.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        # Alternate the order too, so neither always runs first.
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            samples[name].append((time.perf_counter() - t) / inner)
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------------------------------
# Output.


def machine() -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def table(rows: list[list], header: list[str]) -> str:
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def fmt(r):
        return "  ".join(c.rjust(w) for c, w in zip(r, widths))

    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths]), *map(fmt, cells[1:])])


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.strip().splitlines()[1:]))
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    return ap


def write_json(path: str | None, name: str, results: dict) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"bench": name, "machine": machine(), **results}, f, indent=2)
    print(f"wrote {path}")


def quiet() -> None:
    """Silence the warnings benchmarks do not act on (deprecations, fewer-stage notes)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
