"""How long ``ccfx.plan_parallel`` takes at cluster scale, and what it answers.

Cases (``--cases``), each a GPT built on the meta device (nothing allocated) and a described
cluster of 80 GiB devices at 4e14 FLOP/s (an H100's dense bf16 rate as training reaches it):

* ``7b-64``: a 7.5 B GPT (36 blocks, width 4096, 32 heads, 64 sequences of 512 per step) on
  64 devices, 8 nodes of 8, NVLink (2400 Gbit/s) inside a node and 100 Gbit/s between;
* ``65b-1024``: a 65 B GPT (80 blocks, width 8192, 64 heads, 1,024 sequences of 4,096, bf16)
  on 1,024 devices, 128 nodes of 8, 400 Gbit/s between nodes;
* ``tiny-4``: ccfx's tiny GPT on 2 nodes of 2 (seconds: what the tests run).

Per case: the search's seconds (the model's facts apart; and the process's CPU seconds in it,
which other jobs on a shared machine stretch less than the wall clock), the layouts searched,
fit, refused and pruned, and the chosen layout with its predicted step and peak memory.
``--tensor-parallel`` searches tensor parallelism too (``plan_parallel(...,
tensor_parallel=True)``: the GPT declares no plan, so its Megatron plan is derived from its
traced data flow); ``--megatron`` then also prices Megatron-LM's published layout for its
76 B GPT on 1,024 A100s (TP 8, PP 4, DP 32) on the 65 B case's cluster, for a side by side,
its memory with sequence parallelism (as the search prices TP) and without (as it ran).

    python -m bench.plan_scale                       # 7b-64 and 65b-1024
    python -m bench.plan_scale --tensor-parallel --megatron
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


def plan_case(name: str, tensor_parallel: bool | None = None, megatron: bool = False) -> dict:
    """Plan case ``name``: the search's seconds and the answer, as a table row's fields;
    ``megatron``: also Megatron-LM's layout's rank and step among those priced."""
    from ccfx.backends.plan_parallel import model_facts, plan_parallel

    model, inputs, cluster = case(name)
    t0 = time.perf_counter()
    facts = model_facts(model, inputs)
    cpu0 = time.process_time()
    plan = plan_parallel(facts, None, cluster, tensor_parallel=tensor_parallel)
    cpu = time.process_time() - cpu0
    best = plan.chosen
    row = {"case": name + ("+tp" if tensor_parallel else ""),
           "total_s": time.perf_counter() - t0, "search_s": plan.search_s, "search_cpu_s": cpu,
           "searched": len(plan.ranked) + len(plan.refused) + len(plan.pruned),
           "fit": len(plan.ranked), "refused": len(plan.refused), "pruned": len(plan.pruned),
           "chosen": best.layout.describe(), "step_s": best.step_s,
           "peak_gib": best.peak_memory_bytes / 2 ** 30}
    if megatron and cluster.world == MEGATRON["tp"] * MEGATRON["pp"] * MEGATRON["dp"]:
        row["megatron"] = megatron_row(plan)
    return row


#: Megatron-LM's layout for its 76.1 B GPT on 1,024 A100s (Narayanan et al., SC'21, Table 1):
#: tensor 8 inside a node, pipeline 4, data 32; 140 TFLOP/s per GPU, 45 % of the A100's peak.
MEGATRON = {"tp": 8, "pp": 4, "dp": 32, "tflops_per_gpu": 140, "of_peak": 0.45}


def megatron_row(plan) -> dict | None:
    """Where the searched layouts put Megatron's degrees (the fastest of its placements and
    microbatch counts): its step, its rank among the fitting layouts, its peak memory with
    sequence parallelism (as searched) and without (as Megatron-LM ran it in 2021)."""
    from dataclasses import replace

    from ccfx.planner.layout import predict_layout

    ranked = list(plan.ranked)
    mine = [p for p in ranked if (p.layout.tp, p.layout.pp, p.layout.dp) ==
            (MEGATRON["tp"], MEGATRON["pp"], MEGATRON["dp"])]
    if not mine:
        return None
    p = min(mine, key=lambda q: q.step_s)
    alone = predict_layout(plan.facts, plan.cluster, replace(p.layout, sequence_parallel=False))
    return {"layout": p.layout.describe(), "step_s": p.step_s, "rank": ranked.index(p) + 1,
            "of": len(ranked), "peak_gib": p.peak_memory_bytes / 2 ** 30,
            "peak_gib_without_sp": alone.peak_memory_bytes / 2 ** 30}


def rows(results: list[dict]) -> list[list[str]]:
    return [[r["case"], f"{r['search_s']:.1f}", f"{r['search_cpu_s']:.1f}",
             f"{r['total_s']:.1f}",
             f"{r['searched']} / {r['fit']} / {r['refused']} / {r['pruned']}", r["chosen"],
             f"{r['step_s']:.3g}", f"{r['peak_gib']:.1f}"] for r in results]


HEADER = ["case", "search s", "search CPU s", "total s", "searched / fit / refused / pruned",
          "chosen", "step s", "peak GiB"]


def main(argv=None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["7b-64", "65b-1024"])
    ap.add_argument("--tensor-parallel", action="store_true",
                    help="search tensor parallelism too (the GPT's derived Megatron plan)")
    ap.add_argument("--megatron", action="store_true",
                    help="also price Megatron-LM's TP 8 x PP 4 x DP 32 among the layouts")
    a = ap.parse_args(argv)
    results = []
    for name in a.cases:
        print(f"[plan] {name} ...", flush=True)
        results.append(plan_case(name, True if a.tensor_parallel else None, a.megatron))
    print(common.table(rows(results), HEADER))
    for r in results:
        if "megatron" in r and r["megatron"] is None:
            print(f"{r['case']}: Megatron-LM's TP 8 x PP 4 x DP 32 was not simulated (pruned: "
                  "its lower bound already lost to the fastest found)")
        m = r.get("megatron")
        if m:
            print(f"{r['case']}: Megatron-LM's TP 8 x PP 4 x DP 32 priced {m['step_s']:.3g} s "
                  f"({m['layout']}), {m['step_s'] / r['step_s'] - 1:+.1%} against the chosen, "
                  f"rank {m['rank']} of {m['of']} fitting, peak {m['peak_gib']:.1f} GiB "
                  f"({m['peak_gib_without_sp']:.1f} GiB without sequence parallelism)")
    common.write_json(a.json, "plan_scale", {"results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
