"""Tensor-parallel inference on a bandwidth-limited link: a Hugging Face Llama with torch's TP
plan, generating with the KV cache, with and without ccfx's compressed all-reduces.

The model is a ``LlamaForCausalLM`` built from a config (random weights, nothing downloaded; 4
layers, hidden 512, 8 heads, MLP 1024, byte vocabulary 256), the same seed on every rank,
parallelized with torch's ``ColwiseParallel`` / ``RowwiseParallel`` per the config's
``base_model_tp_plan`` (q/k/v, gate/up column-wise; o, down row-wise): 2 all-reduces per layer
per forward. The prompt is the last 512 bytes of the corpus; greedy decoding with a
``DynamicCache``, a manual loop of forward calls (prefill, then one token per call), which
compiles to three graphs (prefill, decode, decode with the cache length dynamic).

Variants (the same seed, model and prompt on every rank):

* ``inductor``: ``model.compile()`` (inductor), uncompressed: the baseline;
* ``ccfx-none``: ``backend="ccfx"``, ``collective_codec="none"``;
* ``ccfx-int8``, ``ccfx-fp8``: ``collective_codec`` set to that codec;
* ``ccfx-auto``: ``collective_codec="auto"`` planned for the shaped link (``link_gbps``,
  ``link_shared``): the planner prices each graph's all-reduces (prefill's and decode's apart)
  and compresses only where it predicts a gain.

Each variant runs on 2 (``--world``) ranks inside a fresh network namespace whose loopback is
limited with tc tbf (bench/shaped.py; root): ``--warmup`` untimed generations (default 2:
under ccfx int8 the second generation still recompiles three small graphs, measured: 61 calls
captured, then none), a barrier, then ``--repeats`` timed generations of ``--new`` tokens. TTFT is the prefill call up
to its first token; decode tokens/s counts the calls after it; each is the slowest rank's mean.
"x inductor" is the baseline's time over the variant's (TTFT) or the variant's rate over the
baseline's (decode), in the same run. "agree" is how many of the first 32 greedy tokens equal
the baseline's (up to the first difference).

    python -m bench.tp_inference                           # 100 and 1000 Mbit/s, 2 ranks
    python -m bench.tp_inference --rates 100 --variants inductor ccfx-int8
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter

import torch

from bench import common
from bench.shaped import (
    RankFailed,
    RankTimeout,
    ShapingUnavailable,
    exit_cleanly_on_sigterm,
    run_ranks,
    shaped_namespace,
)

VOCAB = 256
HIDDEN, LAYERS, HEADS, MLP = 512, 4, 8, 1024
PROMPT, NEW = 512, 32
CODECS = {"ccfx-none": "none", "ccfx-int8": "int8", "ccfx-fp8": "fp8", "ccfx-auto": "auto"}
VARIANTS = ("inductor", *CODECS)

#: torch's style for each word of a config's base_model_tp_plan
_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


# ---------------------------------------------------------------------------------------------
# The model, its TP plan, the prompt (tests/tp_inference_workers.py uses these too).


def llama(hidden: int = HIDDEN, layers: int = LAYERS, heads: int = HEADS, mlp: int | None = None,
          seed: int = 0, max_pos: int = 1024):
    """A random-init LlamaForCausalLM in eval mode (eager attention: the same kernels sharded
    and unsharded)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_pos, attention_dropout=0.0, bos_token_id=0,
        eos_token_id=None, pad_token_id=0, attn_implementation="eager", use_cache=True,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def tensor_parallel(model, world: int) -> dict[str, str]:
    """Shard ``model`` over every rank per its config's ``base_model_tp_plan`` (patterns
    ``layers.*.<path>``), with torch's styles. Returns the plan used ({pattern: style})."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel

    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for pattern, word in model.config.base_model_tp_plan.items():
        if word not in _STYLES or ".*." not in pattern:
            raise ValueError(f"tp plan entry {pattern!r}: {word!r} has no torch style here")
        plan[pattern] = _STYLES[word]
    layer_plan = {p.split(".*.", 1)[1]: getattr(parallel, s)() for p, s in plan.items()}
    for layer in model.model.layers:
        parallel.parallelize_module(layer, mesh, layer_plan)
    return plan


def heldout(length: int) -> torch.Tensor:
    """The last ``length`` bytes of the corpus (held-out text) as one row of tokens."""
    from ccfx.models import load_corpus

    text = load_corpus().encode("ascii")[-length:]
    return torch.tensor([list(text)], dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# What one rank runs.


def _log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


@torch.no_grad()
def _generate(model, ids: torch.Tensor, new: int) -> tuple[list[int], float, float]:
    """Greedy tokens, seconds to the first token, seconds of the decode calls after it."""
    from transformers import DynamicCache

    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [int(nxt)]
    t1 = time.perf_counter()
    pos = ids.shape[1]
    while len(tokens) < new:
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True,
                    cache_position=torch.tensor([pos]))
        pos += 1
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
    return tokens, t1 - t0, time.perf_counter() - t1


def _wire(model) -> tuple[float, float] | None:
    import ccfx
    from ccfx.errors import ConfigError

    try:
        raw, wire = ccfx.ledger_of(model).totals()[:2]
    except ConfigError:  # compiled by another backend
        return None
    return float(raw), float(wire)


def _options(variant: str, rate: float | None) -> dict:
    out = {"collective_codec": CODECS[variant]}
    if CODECS[variant] == "auto":  # planned for the link it runs on (unshaped: 10 Gbit/s)
        out.update(link_gbps=(rate or 10_000.0) / 1000, link_shared=True)
    return out


def _chosen(model) -> list[tuple[str, str]] | None:
    """(graph part, codec) of every collective, per compiled graph (None: not ccfx)."""
    import ccfx

    try:
        plan = ccfx.plan_of(model)
    except Exception:  # noqa: BLE001 (another backend)
        return None
    return [(f"graph {c.graph} {c.part}", c.codec) for c in plan.collectives]


def time_rank(rank: int, world: int, *, variant: str, new: int = NEW, prompt: int = PROMPT,
              repeats: int = 2, warmup: int = 2, rate: float | None = None) -> dict:
    import torch.distributed as dist

    model = llama()
    tensor_parallel(model, world)
    if variant == "inductor":
        model.compile()
    else:
        model.compile(backend="ccfx", options=_options(variant, rate))
    ids = heldout(prompt)
    for i in range(warmup):  # compiles prefill and both decode graphs (and recompiles)
        t = time.perf_counter()
        tokens, _, _ = _generate(model, ids, new)
        _log(rank, f"warm-up generation {i}: {time.perf_counter() - t:.1f} s")
    before = _wire(model)
    dist.barrier()
    ttft, decode = [], []
    for i in range(repeats):
        got, a, b = _generate(model, ids, new)
        ttft.append(a)
        decode.append((new - 1) / b)
        _log(rank, f"timed generation {i}: TTFT {a:.3f} s, decode {decode[-1]:.1f} tok/s")
        if got != tokens:
            raise RuntimeError(f"greedy tokens changed between runs: {tokens} then {got}")
    after = _wire(model)
    per_gen = None if before is None else [(y - x) / repeats for x, y in zip(before, after)]
    return {"tokens": tokens, "ttft": ttft, "decode": decode, "bytes": per_gen,
            "chosen": _chosen(model)}


# ---------------------------------------------------------------------------------------------
# The parent.


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_time(variant: str, world: int, rate: float | None, new: int, repeats: int,
             warmup: int, threads: int) -> dict:
    env = common.CACHE_OFF
    t0 = time.perf_counter()
    try:
        with shaped_namespace(rate) as ns:
            ranks = run_ranks("bench.tp_inference", "time_rank", world,
                              {"variant": variant, "new": new, "repeats": repeats,
                               "warmup": warmup, "rate": rate}, netns=ns,
                              timeout_s=900, threads_per_rank=threads, env=env, stall_s=300)
    except (RankFailed, RankTimeout) as e:
        return {"variant": variant, "status": "fails", "reason": e.reason,
                "wall_s": time.perf_counter() - t0}
    if ranks[0]["tokens"] != ranks[1]["tokens"]:
        return {"variant": variant, "status": "fails", "reason": "the ranks' tokens differ"}
    return {"variant": variant, "status": "ok", "tokens": ranks[0]["tokens"],
            "ttft_s": max(statistics.mean(r["ttft"]) for r in ranks),
            "decode_tps": min(statistics.mean(r["decode"]) for r in ranks),
            "bytes": ranks[0]["bytes"], "chosen": ranks[0].get("chosen"),
            "wall_s": time.perf_counter() - t0}


def agree(a: list[int], b: list[int], first: int = 32) -> int:
    n = 0
    for x, y in zip(a[:first], b[:first]):
        if x != y:
            break
        n += 1
    return n


def time_table(rows: list[dict]) -> tuple[list[list[str]], list[str]]:
    base = next((r for r in rows if r["variant"] == "inductor" and r["status"] == "ok"), None)
    out, notes = [], []
    for r in rows:
        if r["status"] != "ok":
            notes.append(f"({len(notes) + 1}) {r['variant']} {r['status']}: {r['reason']}")
            out.append([r["variant"], f"{r['status']} ({len(notes)})", "", "", "", "", ""])
            continue
        x_ttft = f"{base['ttft_s'] / r['ttft_s']:.2f}" if base else "-"
        x_dec = f"{r['decode_tps'] / base['decode_tps']:.2f}" if base else "-"
        n = f"{agree(r['tokens'], base['tokens'])}/32" if base else "-"
        wire = "-" if r["bytes"] is None else f"{r['bytes'][1] / 2**20:.2f}"
        out.append([r["variant"], f"{r['ttft_s']:.3f}", x_ttft, f"{r['decode_tps']:.1f}",
                    x_dec, wire, n])
        if CODECS.get(r["variant"]) == "auto" and r.get("chosen"):
            by_graph: dict[str, list[str]] = {}
            for where, codec in r["chosen"]:
                by_graph.setdefault(where, []).append(codec)
            notes.append(f"{r['variant']} chose: " + "; ".join(
                f"{where}: " + ", ".join(f"{n} {c}" for c, n in
                                         sorted(Counter(codecs).items()))
                for where, codecs in by_graph.items()))
    return out, notes


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--rates", nargs="+", default=["100", "1000"],
                    help="link rates in Mbit/s ('none': unshaped)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--new", type=int, default=NEW, help="tokens generated per run")
    ap.add_argument("--repeats", type=int, default=2, help="timed generations per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed generations first")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = ap.parse_args(argv)
    exit_cleanly_on_sigterm()
    params = sum(p.numel() for p in llama().parameters())
    print(f"Llama: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, MLP {MLP}, "
          f"{params / 1e6:.1f} M parameters; {a.world} TP ranks; prompt {PROMPT} tokens, "
          f"{a.new} greedy tokens with the KV cache")
    results: dict = {"params": params, "world": a.world, "tables": []}
    rates = [None if r.lower() in ("none", "unshaped") else float(r) for r in a.rates]
    try:
        for rate in rates:
            label = "unshaped" if rate is None else f"{rate:g} Mbit/s"
            rows = []
            for v in a.variants:
                _progress(f"[{label}] {v} ...")
                row = run_time(v, a.world, rate, a.new, a.repeats, a.warmup, a.threads)
                _progress(f"    {row['status']}" + (
                    f" TTFT {row['ttft_s']:.3f} s, {row['decode_tps']:.1f} tok/s"
                    if row["status"] == "ok" else f": {row['reason']}"))
                rows.append(row)
            print(f"\n{label}, {a.world} ranks, {a.repeats} timed generations after {a.warmup} "
                  "warm-up")
            cells, notes = time_table(rows)
            print(common.table(cells, ["variant", "TTFT s", "x inductor", "decode tok/s",
                                       "x inductor", "wire MiB/gen/rank", "agree"]))
            print("\n".join(notes), flush=True)
            results["tables"].append({"rate_mbit": rate, "rows": rows})
    except ShapingUnavailable as e:
        print(f"cannot shape the network: {e}", file=sys.stderr)
        return 2
    common.write_json(a.json, "tp_inference", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
