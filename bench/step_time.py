"""Steady-state train step time: ccfx (identity codec, stages 4) over plain torch.compile.

One step is forward + backward + AdamW step on the tiny GPT (batch 16, context 64). Each pair
compares ccfx with the plain torch.compile backend that lowers the same way:

    eager     ccfx lowering="eager"     vs  backend="aot_eager"
    inductor  ccfx lowering="inductor"  vs  backend="inductor"

Both models of a pair live in the same process (same initial weights); after warm-up their
timed samples alternate (A B B A A B …) so that drift and noise hit both alike. Each sample
is the mean of ``--inner`` steps; the table shows the medians, their ratio, and the median of
the ratios of adjacent (back-to-back) samples, and the ratio of the fastest samples (the least
disturbed by other load on a shared machine); goal ≤ 1.05.
With the identity codec the only extra work is one copy of each crossing tensor per hop,
forward and backward.

    python -m bench.step_time [--pairs eager inductor] [--repeats 15] [--threads 1]
                              [--json out.json]
"""

from __future__ import annotations

import copy

import torch
from torch._dynamo.utils import counters

from . import common

GOAL = 1.05
PAIRS = {"eager": ("ccfx-eager", "aot_eager"), "inductor": ("ccfx-inductor", "inductor")}


def make_step(model, compiled, idx, targets):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        common.gpt_loss(compiled, idx, targets).backward()
        opt.step()

    return step


def run_pair(pair: str, stages: int, repeats: int, warmup: int, inner: int) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    ccfx_kind, base_kind = PAIRS[pair]
    base_model = common.tiny_gpt()
    ccfx_model = copy.deepcopy(base_model)
    idx, targets = common.gpt_batch()
    steps = {
        ccfx_kind: make_step(ccfx_model, common.compile_model(ccfx_model, ccfx_kind, stages=stages),
                             idx, targets),
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
        r = run_pair(pair, args.stages, args.repeats, args.warmup, args.inner)
        results.append(r)
        print(f"  {pair}: {r['ccfx']} {r['ccfx_s'] * 1e3:.1f} ms, {r['baseline']} "
              f"{r['baseline_s'] * 1e3:.1f} ms", flush=True)

    kw = common.GPT_KW
    print(f"\nsteady-state train step (fwd+bwd+AdamW), tiny GPT ({kw['n_layer']} layers, "
          f"width {kw['n_embd']}, context {kw['block_size']}), batch {common.BATCH}, "
          f"ccfx stages {args.stages} codec none (median of {args.repeats} interleaved samples "
          f"x {args.inner} steps, {torch.get_num_threads()} thread(s); goal <= {GOAL})")
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
        "goal": GOAL, "stages": args.stages, "model": common.GPT_KW, "batch": common.BATCH,
        "repeats": args.repeats, "inner": args.inner, "threads": torch.get_num_threads(),
        "results": results})
    return results


if __name__ == "__main__":
    main()
