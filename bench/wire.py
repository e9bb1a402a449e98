"""int8 wire bytes over raw bytes on fp32 activations: the exact formula beside the ledger.

For an fp32 tensor of n elements, blockwise int8 sends one int8 per element and one fp32 scale
per block: wire / raw = (n + 4 * ceil(n / block)) / (4 * n), which tends to (1 + 4 / block) / 4.
The tiny GPT (stages 4, eager lowering) runs one training step with ``int8:block=B``; the ratio
is read from ccfx's ledger (what the cut ops actually reported), forward and backward, over the
float32 edges (integer edges are sent as they are).

    python -m bench.wire [--blocks 64 128 256] [--json out.json]
"""

from __future__ import annotations

import math

import ccfx

from . import common


def formula(n: int, block: int) -> float:
    return (n + 4 * math.ceil(n / block)) / (4 * n)


def measure(block: int, stages: int) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    model = common.tiny_gpt()
    compiled = common.compile_model(model, "ccfx-eager", stages=stages, codec=f"int8:block={block}")
    idx, targets = common.gpt_batch()
    common.gpt_loss(compiled, idx, targets).backward()

    plan, ledger = ccfx.plan_of(compiled), ccfx.ledger_of(compiled)
    edges = {(e.graph, e.index): e for e in plan.edges}
    float_edges = [e for e in plan.edges if e.dtype == "torch.float32"]
    sums = {"fwd": [0, 0], "bwd": [0, 0]}
    exact = {"fwd": [0, 0], "bwd": [0, 0]}
    for c in ledger.entries():
        e = edges[(c.graph, c.edge)]
        if e.dtype != "torch.float32":
            continue
        n = c.raw_bytes // c.calls // 4
        sums[c.direction][0] += c.raw_bytes
        sums[c.direction][1] += c.wire_bytes
        exact[c.direction][0] += c.raw_bytes
        exact[c.direction][1] += c.calls * (n + 4 * math.ceil(n / block))
    sizes = sorted({math.prod(e.shape) for e in float_edges})
    return {
        "block": block,
        "edge_sizes": sizes,
        "formula": {str(n): formula(n, block) for n in sizes},
        "limit": (1 + 4 / block) / 4,
        "ledger_fwd": sums["fwd"][1] / sums["fwd"][0],
        "ledger_bwd": sums["bwd"][1] / sums["bwd"][0],
        "formula_fwd": exact["fwd"][1] / exact["fwd"][0],
        "formula_bwd": exact["bwd"][1] / exact["bwd"][0],
        "num_float_edges": len(float_edges),
    }


def main(argv=None):
    ap = common.parser(__doc__)
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--stages", type=int, default=4)
    args = ap.parse_args(argv)
    common.quiet()

    results = [measure(b, args.stages) for b in args.blocks]
    print("int8 wire/raw on fp32 activations: (n + 4*ceil(n/block)) / (4n)")
    kw = common.GPT_KW
    print(f"tiny GPT ({kw['n_layer']} layers, width {kw['n_embd']}, context {kw['block_size']}), "
          f"batch {common.BATCH}, stages {args.stages}; "
          f"float32 edge sizes n = {results[0]['edge_sizes']}")
    rows = [[r["block"], f"{r['limit']:.4f}", f"{r['formula_fwd']:.4f}", f"{r['ledger_fwd']:.4f}",
             f"{r['formula_bwd']:.4f}", f"{r['ledger_bwd']:.4f}"] for r in results]
    print(common.table(rows, ["block", "(1+4/block)/4", "formula fwd", "ledger fwd",
                              "formula bwd", "ledger bwd"]))
    for r in results:
        for d in ("fwd", "bwd"):
            assert math.isclose(r[f"ledger_{d}"], r[f"formula_{d}"], rel_tol=1e-12), r
    common.write_json(args.json, "wire", {"stages": args.stages, "model": common.GPT_KW,
                                          "batch": common.BATCH, "results": results})
    return results


if __name__ == "__main__":
    main()
