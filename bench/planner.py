"""Is the planner right? Predicted against measured step times, and ``auto`` against every
fixed choice, on the shaped loopback (bench/shaped.py) at each rate.

For each model, stage count and rate:

1. **predict**: the model compiled at the microbatch shape, its stages timed one by one on this
   process (``ccfx.backends.profile.profile_stages``, inductor lowering, 1 thread), the link as given
   (shaped: the tc rate; unshaped: measured by ``ccfx.planner.probe_link`` between two ranks),
   the codecs' encode/decode timed at each tensor's size; the 1F1B step simulated
   (``ccfx.planner.schedule``) for each fixed variant, then the tied-weight sum and the
   optimizer step (timed on each stage's parameters, the bench's optimizer). When the ranks
   outnumber the cores, each stage's compute is scaled by ranks / cores (they share them);
2. **measure**: the same variants as real gloo ranks (``bench.pipeline.train_rank``), plus
   ``ccfx-auto``, which plans inside the ranks at compile time (compute from FLOPs, since
   nothing has run yet) and is told the same link;
3. **print**: per variant the predicted and measured s/step and the error, then whether
   ``auto`` was never slower than uncompressed and within 10 % of the best fixed variant
   measured in the same run: the best among those ``auto`` may choose (codecs within the
   default loss budget, ``ccfx.planner.candidates``: int4 and PowerSGD activation gradients
   are not), and the best of all.

    python -m bench.planner                                      # mlp4 and gpt, 2 stages
    python -m bench.planner --models mlp10 --stages 4 --rates 10 100 1000 none
"""

from __future__ import annotations

import os
import statistics
import sys

from bench import common
from bench.pipeline import CODECS, MODELS, make_model, run_variant
from bench.shaped import ShapingUnavailable, exit_cleanly_on_sigterm, run_ranks, shaped_namespace

FIXED = ("ccfx-none", "ccfx-int8", "ccfx-int4", "ccfx-int8-psgd")
AUTO_WITHIN = 0.10  # the bar: auto within 10 % of the best fixed choice
NOISE = 0.05  # "never slower than uncompressed", up to this machine's run-to-run noise


def probe_rank(rank: int, world_size: int) -> dict:
    """Run inside the namespace: the link between two gloo ranks, measured."""
    from ccfx.planner.probe import probe_link

    link = probe_link(shared=True)
    return {"gbps": link.gbps, "latency_ms": link.latency_ms}


def measured_link(rate: float | None) -> tuple[float, float]:
    """(Gbit/s, ms) the planner is given: the tc rate, or unshaped the probe's answer."""
    if rate is not None:
        return rate / 1000, 0.05
    with shaped_namespace(None) as ns:
        out = run_ranks("bench.planner", "probe_rank", 2, {}, netns=ns, timeout_s=120)
    return out[0]["gbps"], out[0]["latency_ms"]


def predictions(model: str, stages: int, gbps: float, latency_ms: float) -> dict[str, float]:
    """Predicted s/step of every fixed variant (see the module docstring)."""
    import torch

    import ccfx
    from ccfx.backends.profile import profile_stages
    from ccfx.planner import Link, PipelineModel, StageCompute, edges_from_plan

    torch.set_num_threads(1)
    spec = MODELS[model]
    example = _example(model)
    compiled = torch.compile(make_model(model), backend="ccfx", fullgraph=True,
                             options={"stages": stages, "lowering": "inductor"})
    compiled(example)
    scale = max(1.0, stages / (os.cpu_count() or 1))
    compute = [StageCompute(c.forward_s * scale, c.backward_s * scale, c.source)
               for c in profile_stages(compiled, example)]
    from ccfx.planner.pipeline_model import shared_from_plan

    plan = ccfx.plan_of(compiled)
    from ccfx.backends.profile import optimizer_seconds

    tail = optimizer_seconds(compiled, lambda ps: (torch.optim.AdamW(ps, lr=3e-3)
                                                   if model == "gpt" else
                                                   torch.optim.SGD(ps, lr=0.01)))
    pm = PipelineModel(compute, edges_from_plan(plan), Link(gbps, latency_ms, shared=True),
                       microbatches=spec["micro"], shared=shared_from_plan(plan),
                       tail_s=[t * scale for t in tail])
    out = {}
    for variant in FIXED:
        fwd, bwd = CODECS[variant]
        out[variant] = pm.predict({e.index: (fwd, bwd) for e in pm.edges}).step_s
    return out


def _example(model: str):
    from bench.pipeline import data

    batch = data(model, 1)[0][0]
    return batch.chunk(MODELS[model]["micro"])[0]


def admissible(variant: str) -> bool:
    """Whether ``auto`` may pick this variant's codecs under the default error budget."""
    import ccfx
    from ccfx.planner.candidates import candidates

    cfg = ccfx.Config()
    fwd, bwd = CODECS[variant]
    return (ccfx.codecs.canonical(fwd) in candidates("activation", cfg)
            and ccfx.codecs.canonical(bwd) in candidates("activation_grad", cfg))


def check_auto(rows: dict[str, dict]) -> list[str]:
    auto = rows.get("ccfx-auto")
    fixed = {v: r for v, r in rows.items() if v in FIXED and r["status"] == "ok"}
    if not auto or auto["status"] != "ok" or "ccfx-none" not in fixed:
        return ["auto: not measured"]
    got, none = auto["step_s"], fixed["ccfx-none"]["step_s"]
    out = [f"auto chose {', '.join(f'{w}: {c}' for w, c in auto['chosen']) or 'nothing'}",
           (f"auto vs uncompressed: {got:.3f} vs {none:.3f} s "
            f"({'ok' if got <= none * (1 + NOISE) else 'SLOWER'})")]
    allowed = {v: r for v, r in fixed.items() if admissible(v)}
    for label, pool in (("within the loss budget", allowed), ("of all", fixed)):
        best_v = min(pool, key=lambda v: pool[v]["step_s"])
        best = pool[best_v]["step_s"]
        verdict = "ok" if got <= best * (1 + AUTO_WITHIN) else "MISSED"
        out.append(f"auto vs the best fixed choice {label} ({best_v}, {best:.3f} s): "
                   f"{got / best - 1:+.1%} ({verdict})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--rates", nargs="+", default=["10", "100", "1000", "none"])
    ap.add_argument("--models", nargs="+", default=["mlp4", "gpt"], choices=list(MODELS))
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=[*FIXED, "ccfx-auto"],
                    choices=[*FIXED, "ccfx-auto"])
    a = ap.parse_args(argv)
    exit_cleanly_on_sigterm()
    rates = [None if r.lower() in ("none", "unshaped") else float(r) for r in a.rates]
    results = []
    try:
        for model in a.models:
            for stages in a.stages:
                for rate in rates:
                    results.append(_one(model, stages, rate, a))
    except ShapingUnavailable as e:
        print(f"cannot shape the network: {e}", file=sys.stderr)
        return 2
    errors = [abs(r["error"]) for res in results for r in res["rows"] if "error" in r]
    if errors:
        print(f"\nprediction error over {len(errors)} runs: median {statistics.median(errors):.0%}, "
              f"max {max(errors):.0%}; within 25 %: {sum(e <= 0.25 for e in errors)} of "
              f"{len(errors)}")
    common.write_json(a.json, "planner", {"results": results})
    return 0


def _one(model: str, stages: int, rate: float | None, a) -> dict:
    gbps, latency = measured_link(rate)
    label = "unshaped" if rate is None else f"{rate:g} Mbit/s"
    print(f"[{model}, {stages} stages, {label}] link {gbps:.4g} Gbit/s, {latency:.3g} ms",
          file=sys.stderr, flush=True)
    predicted = predictions(model, stages, gbps, latency)
    rows = {}
    for v in a.variants:
        r = run_variant(model, v, stages, rate, a.steps, "inductor")
        rows[v] = r
        print(f"    {v}: {r['status']} " + (f"{r['step_s']:.3f} s/step" if r["status"] == "ok"
                                            else r["reason"]), file=sys.stderr, flush=True)
    cells, out_rows = [], []
    for v, r in rows.items():
        p = predicted.get(v)
        if r["status"] != "ok":
            cells.append([v, f"{p:.3f}" if p else "-", r["status"], "-", "-"])
            continue
        err = (p - r["step_s"]) / r["step_s"] if p else None
        cells.append([v, f"{p:.3f}" if p else "(planned in the ranks)", f"{r['step_s']:.3f}",
                      f"{err:+.0%}" if err is not None else "-",
                      f"{r['wire_bytes'] / 1e6:.2f}"])
        out_rows.append({"variant": v, "measured_s": r["step_s"], "predicted_s": p,
                         **({"error": err} if err is not None else {}),
                         "chosen": r.get("chosen", [])})
    print(f"\n{model}, {stages} stages, 1F1B, {MODELS[model]['micro']} microbatches, {label} "
          f"(planner told {gbps:.4g} Gbit/s, {latency:.3g} ms, one shared medium)")
    print(common.table(cells, ["variant", "predicted s/step", "measured s/step", "error",
                               "wire MB/step"]))
    verdict = check_auto(rows)
    print("\n".join(verdict), flush=True)
    return {"model": model, "stages": stages, "rate_mbit": rate, "link_gbps": gbps,
            "rows": out_rows, "auto": verdict}


if __name__ == "__main__":
    sys.exit(main())
