"""Steady-state train step time: ccfx (stages 4, a codec on every cut) over plain torch.compile.

One step is forward + backward + AdamW step on the tiny GPT (batch 16, context 64; ``--model
gpt2-small``: GPT-2's 124 M at batch 2, context 256). Each pair
compares ccfx with the plain torch.compile backend that lowers the same way:

    eager             ccfx lowering="eager"                        vs  backend="aot_eager"
    inductor          ccfx lowering="inductor"                     vs  backend="inductor"
    inductor-opaque   ccfx lowering="inductor", fuse_codecs=False  vs  backend="inductor"

``inductor`` gives each cut's codec to inductor as plain ops it fuses with its neighbours
(``fuse_codecs``, the default); ``inductor-opaque`` keeps every cut an opaque custom op: their
difference is what fusion saves.

Both models of a pair live in the same process (same initial weights); after warm-up their
timed samples alternate (A B B A A B …) so that drift and noise hit both alike. Each sample
is the mean of ``--inner`` steps; the table shows the medians, their ratio, and the median of
the ratios of adjacent (back-to-back) samples, and the ratio of the fastest samples (the least
disturbed by other load on a shared machine); goal ≤ 1.05.
With the identity codec (``--codec none``, the default) the only extra work is one copy of
each crossing tensor per hop, forward and backward; ``--codec int8`` adds its round trip.

    python -m bench.step_time [--pairs eager inductor inductor-opaque] [--codec int8]
                              [--repeats 15] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import copy

import torch
from torch._dynamo.utils import counters

from . import common

GOAL = 1.05
#: --model: the tiny GPT is the demo's shape; gpt2-small is GPT-2's 124 M (12 layers, width
#: 768, its vocabulary), at context 256 and batch 2 to keep a CPU step near a second.
MODELS = {"tiny": ({}, common.BATCH),
          "gpt2-small": ({"vocab_size": 50257, "block_size": 256, "n_layer": 12, "n_head": 12,
                          "n_embd": 768}, 2)}
PAIRS = {"eager": ("ccfx-eager", "aot_eager"), "inductor": ("ccfx-inductor", "inductor"),
         "inductor-opaque": ("ccfx-inductor", "inductor")}


def make_step(model, compiled, idx, targets):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        common.gpt_loss(compiled, idx, targets).backward()
        opt.step()

    return step


def run_pair(pair: str, stages: int, repeats: int, warmup: int, inner: int,
             codec: str = "none", model: str = "tiny") -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    ccfx_kind, base_kind = PAIRS[pair]
    shape, batch = MODELS[model]
    base_model = common.tiny_gpt(**shape)
    ccfx_model = copy.deepcopy(base_model)
    idx, targets = common.gpt_batch(batch, **shape)
    fuse = {"fuse_codecs": False} if pair == "inductor-opaque" else {}
    compiled = common.compile_model(ccfx_model, ccfx_kind, stages=stages, codec=codec, **fuse)
    steps = {
        ccfx_kind: make_step(ccfx_model, compiled, idx, targets),
        base_kind: make_step(base_model, common.compile_model(base_model, base_kind), idx, targets),
    }
    for fn in steps.values():  # compile (first call) outside the timed region
        fn()
    graphs = counters["stats"]["unique_graphs"]
    samples = common.interleaved_times(steps, repeats=repeats, warmup=warmup, inner=inner)
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled while timing"
    t_ccfx, t_base = common.median(samples[ccfx_kind]), common.median(samples[base_kind])
    # Adjacent samples ran back to back: their ratio cancels slow drift of the machine's load.
    paired = [a / b for a, b in zip(samples[ccfx_kind], samples[base_kind])]
    return {
        "pair": pair, "ccfx": ccfx_kind, "baseline": base_kind, "ccfx_s": t_ccfx,
        "baseline_s": t_base, "ratio": t_ccfx / t_base, "paired_ratio": common.median(paired),
        "min_ratio": min(samples[ccfx_kind]) / min(samples[base_kind]), "samples": samples,
    }


def main(argv=None):
    ap = common.parser(__doc__)
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--codec", default="none", help="the codec on every cut, both directions")
    ap.add_argument("--model", default="tiny", choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=15, help="timed samples per model")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per model after compile")
    ap.add_argument("--inner", type=int, default=2, help="steps per sample")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args(argv)
    common.quiet()
    if args.threads:
        torch.set_num_threads(args.threads)

    results = []
    for pair in args.pairs:
        r = run_pair(pair, args.stages, args.repeats, args.warmup, args.inner, args.codec,
                     args.model)
        results.append(r)
        print(f"  {pair}: {r['ccfx']} {r['ccfx_s'] * 1e3:.1f} ms, {r['baseline']} "
              f"{r['baseline_s'] * 1e3:.1f} ms", flush=True)

    shape, batch = MODELS[args.model]
    kw = {**common.GPT_KW, **shape}
    print(f"\nsteady-state train step (fwd+bwd+AdamW), {args.model} GPT ({kw['n_layer']} "
          f"layers, width {kw['n_embd']}, context {kw['block_size']}), batch {batch}, ccfx "
          f"stages {args.stages} codec {args.codec} (median of {args.repeats} interleaved "
          f"samples x {args.inner} steps, {torch.get_num_threads()} thread(s); goal <= {GOAL})")
    rows = []
    for r in results:
        spread = [s for xs in r["samples"].values() for s in xs]
        rows.append([r["pair"], f"{r['ccfx']}", f"{r['ccfx_s'] * 1e3:.1f}", r["baseline"],
                     f"{r['baseline_s'] * 1e3:.1f}", f"{r['ratio']:.3f}",
                     f"{r['paired_ratio']:.3f}", f"{r['min_ratio']:.3f}",
                     f"{min(spread) * 1e3:.0f}-{max(spread) * 1e3:.0f}",
                     "ok" if r["ratio"] <= GOAL else "OVER"])
    print(common.table(rows, ["lowering", "ccfx", "ms/step", "baseline", "ms/step", "ratio",
                              "paired", "min/min",
                              "range ms", f"<= {GOAL}"]))
    common.write_json(args.json, "step_time", {
        "goal": GOAL, "stages": args.stages, "codec": args.codec, "model": kw, "batch": batch,
        "repeats": args.repeats, "inner": args.inner, "threads": torch.get_num_threads(),
        "results": results})
    return results


if __name__ == "__main__":
    main()
