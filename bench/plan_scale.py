"""How long ``ccfx.plan_parallel`` takes at cluster scale, and what it answers.

Cases (``--cases``), each a GPT built on the meta device (nothing allocated) and a described
cluster of 80 GiB devices at 4e14 FLOP/s (an H100's dense bf16 rate as training reaches it):

* ``7b-64``: a 7.5 B GPT (36 blocks, width 4096, 32 heads, 64 sequences of 512 per step) on
  64 devices, 8 nodes of 8, NVLink (2400 Gbit/s) inside a node and 100 Gbit/s between;
* ``65b-1024``: a 65 B GPT (80 blocks, width 8192, 64 heads, 1,024 sequences of 4,096, bf16)
  on 1,024 devices, 128 nodes of 8, 400 Gbit/s between nodes;
* ``tiny-4``: ccfx's tiny GPT on 2 nodes of 2 (seconds: what the tests run).

Per case: the search's seconds (the model's facts apart), the layouts searched, fit, refused
and pruned, and the chosen layout with its predicted step and peak memory.

    python -m bench.plan_scale                       # 7b-64 and 65b-1024
"""

from __future__ import annotations

import time

import torch

from bench import common

#: name -> (vocabulary, blocks, width, heads, sequence, the step's sequences, nodes, devices
#: per node, Gbit/s between nodes)
CASES = {
    "7b-64": (50304, 36, 4096, 32, 512, 64, 8, 8, 100),
    "65b-1024": (50304, 80, 8192, 64, 4096, 1024, 128, 8, 400),
    "tiny-4": (96, 4, 64, 4, 64, 16, 2, 2, 1),
}


def case(name: str):
    """(model on meta in bf16, its example inputs, the cluster) of case ``name``."""
    import ccfx
    from ccfx.models.tiny_gpt import GPTConfig, TinyGPT

    vocab, layers, width, heads, seq, batch, nodes, per, inter = CASES[name]
    config = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads,
                       n_embd=width)
    with torch.device("meta"):
        model = TinyGPT(config).to(torch.bfloat16)
        idx = torch.zeros(batch, config.block_size, dtype=torch.long)
    cluster = ccfx.Cluster.nodes(nodes, per, intra=(2400, 0.005), inter=(inter, 0.02),
                                 memory="80GiB", flops=4e14)
    return model, (idx, idx), cluster


def plan_case(name: str) -> dict:
    """Plan case ``name``: the search's seconds and the answer, as a table row's fields."""
    from ccfx.backends.plan_parallel import plan_parallel

    model, inputs, cluster = case(name)
    t0 = time.perf_counter()
    plan = plan_parallel(model, inputs, cluster)
    best = plan.chosen
    return {"case": name, "total_s": time.perf_counter() - t0, "search_s": plan.search_s,
            "searched": len(plan.ranked) + len(plan.refused) + len(plan.pruned),
            "fit": len(plan.ranked), "refused": len(plan.refused), "pruned": len(plan.pruned),
            "chosen": best.layout.describe(), "step_s": best.step_s,
            "peak_gib": best.peak_memory_bytes / 2 ** 30}


def rows(results: list[dict]) -> list[list[str]]:
    return [[r["case"], f"{r['search_s']:.1f}", f"{r['total_s']:.1f}",
             f"{r['searched']} / {r['fit']} / {r['refused']} / {r['pruned']}", r["chosen"],
             f"{r['step_s']:.3g}", f"{r['peak_gib']:.1f}"] for r in results]


HEADER = ["case", "search s", "total s", "searched / fit / refused / pruned", "chosen",
          "step s", "peak GiB"]


def main(argv=None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["7b-64", "65b-1024"])
    a = ap.parse_args(argv)
    results = []
    for name in a.cases:
        print(f"[plan] {name} ...", flush=True)
        results.append(plan_case(name))
    print(common.table(rows(results), HEADER))
    common.write_json(a.json, "plan_scale", {"results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
