"""Compile time: ccfx (stages 4, inductor lowering) over plain torch.compile with inductor.

Compile time is the wall time of the first call, forward + backward (Dynamo, ccfx's passes,
aot_autograd, inductor for the forward and then the backward graph), on the tiny GPT (batch 16,
context 64). Every measurement runs in a fresh subprocess with a fresh, empty
TORCHINDUCTOR_CACHE_DIR and the FX-graph and AOT-autograd caches off, so each one compiles
from nothing; imports happen before the clock starts. The two kinds alternate (A B B A …) and
the table shows the median of each, their ratio, and the median ratio of the two runs of each
repeat (back to back, so slow load drift cancels); goal ≤ 1.5. ``--pairs eager`` adds ccfx
with eager lowering over backend="aot_eager".

    python -m bench.compile_time [--repeats 3] [--pairs inductor eager] [--json out.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from . import common

GOAL = 1.5
PAIRS = {"inductor": ("ccfx-inductor", "inductor"), "eager": ("ccfx-eager", "aot_eager")}


def child(kind: str, stages: int) -> None:
    """Runs in the subprocess: compile + first fwd/bwd, then one more step; prints JSON."""
    common.quiet()
    import ccfx  # noqa: F401  (imported before the clock, like torch)

    model = common.tiny_gpt()
    idx, targets = common.gpt_batch()
    compiled = common.compile_model(model, kind, stages=stages)
    t0 = time.perf_counter()
    common.gpt_loss(compiled, idx, targets).backward()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    common.gpt_loss(compiled, idx, targets).backward()
    second = time.perf_counter() - t0
    print("CCFX_BENCH " + json.dumps({"kind": kind, "first_s": first, "second_s": second}))


def measure(kind: str, stages: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="ccfx-inductor-cache-") as cache:
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
            "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "bench.compile_time", "--child", kind, "--stages", str(stages)],
            check=False, env=env, capture_output=True, text=True, timeout=timeout,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    for line in proc.stdout.splitlines():
        if line.startswith("CCFX_BENCH "):
            return json.loads(line[len("CCFX_BENCH "):])
    raise RuntimeError(f"{kind} child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def main(argv=None):
    ap = common.parser(__doc__)
    ap.add_argument("--pairs", nargs="+", default=["inductor"], choices=list(PAIRS))
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="subprocesses per kind")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per subprocess")
    ap.add_argument("--child", help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.stages)

    results = []
    for pair in args.pairs:
        kinds = PAIRS[pair]
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for r in range(args.repeats):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                m = measure(kind, args.stages, args.timeout)
                runs[kind].append(m)
                print(f"  {kind}: first call {m['first_s']:.1f} s (next {m['second_s']:.2f} s)",
                      flush=True)
        med = {k: common.median([m["first_s"] for m in v]) for k, v in runs.items()}
        # The two runs of one repeat ran back to back: their ratio cancels slow load drift.
        paired = [a["first_s"] / b["first_s"] for a, b in zip(runs[kinds[0]], runs[kinds[1]])]
        results.append({"pair": pair, "ccfx": kinds[0], "baseline": kinds[1],
                        "ccfx_s": med[kinds[0]], "baseline_s": med[kinds[1]],
                        "ratio": med[kinds[0]] / med[kinds[1]],
                        "paired_ratio": common.median(paired), "runs": runs})

    kw = common.GPT_KW
    print(f"\ncompile time (first forward+backward, fresh process and caches), tiny GPT "
          f"({kw['n_layer']} layers, width {kw['n_embd']}, context {kw['block_size']}), "
          f"batch {common.BATCH}, ccfx stages {args.stages} "
          f"(median of {args.repeats}; goal <= {GOAL})")
    rows = [[r["pair"], r["ccfx"], f"{r['ccfx_s']:.1f}", r["baseline"], f"{r['baseline_s']:.1f}",
             f"{r['ratio']:.2f}", f"{r['paired_ratio']:.2f}",
             "ok" if r["ratio"] <= GOAL else "OVER"] for r in results]
    print(common.table(rows, ["lowering", "ccfx", "s", "baseline", "s", "ratio", "paired",
                              f"<= {GOAL}"]))
    common.write_json(args.json, "compile_time", {
        "goal": GOAL, "stages": args.stages, "model": common.GPT_KW, "batch": common.BATCH,
        "repeats": args.repeats, "results": results})
    return results


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
