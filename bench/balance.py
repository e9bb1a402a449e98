"""Partition balance on a uniform transformer stack: the slowest stage's cost over the ideal.

A stack of L identical pre-LN transformer blocks (the tiny GPT's ``Block``: width 256, 4 heads,
sequence 64, batch 16) is compiled with ``backend="ccfx"`` for each number of stages S; the
plan's ``GraphPlan.imbalance`` is max(stage cost) / (total cost / S) under ``balance="flops"``
(1.0 is perfect; goal ≤ 1.10). The partitioner may trade a little balance for a cut with fewer
crossing bytes (within 5 % of a stage's ideal cost).

    python -m bench.balance [--layers 8 12 16] [--stages 2 4 8] [--balance flops] [--json out.json]
"""

from __future__ import annotations

import torch
from torch import nn

import ccfx

from . import common

GOAL = 1.10


def stack(layers: int) -> nn.Module:
    from ccfx.models.tiny_gpt import Block, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(**common.GPT_KW)
    return nn.Sequential(*(Block(cfg) for _ in range(layers)))


def measure(layers: int, stages: int, balance: str) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    model = stack(layers)
    compiled = torch.compile(model, backend="ccfx", options={
        "stages": stages, "balance": balance, "lowering": "eager"})
    x = torch.randn(common.BATCH, common.GPT_KW["block_size"], common.GPT_KW["n_embd"])
    with torch.no_grad():
        compiled(x)
    plan = ccfx.plan_of(compiled)
    (g,) = plan.graphs
    return {
        "layers": layers, "stages": stages, "num_stages": g.num_stages, "balance": balance,
        "imbalance": g.imbalance, "stage_costs": [s.cost for s in g.stages],
        "cut_edges": len(g.edges), "notes": g.notes,
    }


def main(argv=None):
    ap = common.parser(__doc__)
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 12, 16])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--balance", nargs="+", default=["flops"],
                    choices=["flops", "params", "memory"])
    args = ap.parse_args(argv)
    common.quiet()

    results = []
    for balance in args.balance:
        for layers in args.layers:
            for stages in args.stages:
                r = measure(layers, stages, balance)
                results.append(r)
                print(f"  {balance} L={layers} S={stages}: imbalance {r['imbalance']:.3f}",
                      flush=True)

    kw = common.GPT_KW
    print(f"\npartition balance, uniform stack of tiny-GPT blocks (width {kw['n_embd']}, "
          f"{kw['n_head']} heads, sequence {kw['block_size']}, batch {common.BATCH}); "
          f"goal <= {GOAL}")
    rows = []
    for r in results:
        costs = r["stage_costs"]
        spread = f"{min(costs) / max(costs):.2f}" if max(costs) else "-"
        rows.append([r["balance"], r["layers"], r["stages"], r["num_stages"],
                     f"{r['imbalance']:.3f}", spread, r["cut_edges"],
                     "ok" if r["imbalance"] <= GOAL else "OVER"])
    print(common.table(rows, ["balance", "blocks", "stages", "got", "max/ideal", "min/max",
                              "cut edges", f"<= {GOAL}"]))
    worst = max(r["imbalance"] for r in results)
    print(f"worst imbalance {worst:.3f}")
    common.write_json(args.json, "balance", {"goal": GOAL, "model": common.GPT_KW,
                                             "batch": common.BATCH, "results": results})
    return results


if __name__ == "__main__":
    main()
