"""Adaptive compression (``ccfx.ddp_comm_hook("adaptive:light=...,heavy=...")``, ACCORDION's
rule per bucket) against the two fixed codecs it switches between: steps and modelled time to a
target loss, over seeds.

The tiny GPT (ccfx.models, the demo's shape) in eager DDP on 2 gloo ranks over 127.0.0.1
(``bucket_cap_mb=4``: 4 buckets), each rank its own stream of the embedded corpus (batch 8 per
rank), AdamW 3e-3. Variants: ``light`` (``--light``, int8 by default), ``heavy`` (``--heavy``,
topk:ratio=0.01,ef) and ``adaptive`` (both, ``eta`` / ``every``). Per seed one spawn trains
every variant from the seed's initialisation on the same batches.

Steps to target: bench/convergence's method: the smoothed loss (trailing mean of ``--smooth``
steps, averaged over the ranks) first at or under the target; the target, per seed, light's
smoothed loss at ``--target-at`` of its run. A run that never reaches it counts as ``--steps``
(">" in the table).

Time to target is modelled, not measured on a shaped link: per step, the variant's median
step time on loopback (the slowest rank's; compute, encode, decode; the median drops the first
steps' codec compiles, and the 2-core machine is shared, so it is still noisy) plus what the
step's payload costs on a link of ``--rate`` Mbit/s with ``--latency-ms`` per bucket exchange
(the all-gather receives the peer's payload: (W-1) x the ledger's wire bytes of the step).
Summed over the steps to target; mean ± std over seeds.

    python -m bench.adaptive                         # 3 seeds x 150 steps, 100 Mbit/s
    python -m bench.adaptive --seeds 0 --steps 40 --every 5
"""

from __future__ import annotations

import statistics
import sys
import time

from bench import common
from bench.convergence import smoothed, steps_to_target

VARIANTS = ("light", "heavy", "adaptive")
LR, BATCH, BUCKET_MB = 3e-3, 8, 4


def spec_of(variant: str, light: str, heavy: str, eta: float, every: int) -> str:
    if variant == "light":
        return light
    if variant == "heavy":
        return heavy
    if variant == "adaptive":
        return f"adaptive:light={light},heavy={heavy},eta={eta},every={every}"
    raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")


def _train(rank: int, seed: int, steps: int, spec: str) -> dict:
    """One variant's run on this rank: per step loss, wall seconds, wire bytes; switches."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ccfx
    from bench.delayed import _step, _stream

    data, vocab = _stream(seed, rank)
    model = DDP(common.tiny_gpt(seed, vocab_size=vocab), bucket_cap_mb=BUCKET_MB)
    state, hook = ccfx.ddp_comm_hook(spec)
    model.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, wall, wire = [], [], []
    for i in range(steps):
        before = state.ledger.totals("bucket")[1]
        t0 = time.perf_counter()
        losses.append(_step(model, opt, next(data)))
        wall.append(time.perf_counter() - t0)
        wire.append(state.ledger.totals("bucket")[1] - before)
        if i % 50 == 0:
            common.log(rank, f"{spec} seed {seed} step {i}: loss {losses[-1]:.4f}")
    return {"losses": losses, "wall": wall, "wire": wire, "buckets": len(state.buckets),
            "switches": [(s.bucket, s.step, s.new) for s in state.ledger.switches]}


def loss_rank(rank: int, world: int, *, seed: int, steps: int, variants: list[str],
              light: str, heavy: str, eta: float, every: int) -> dict:
    return {v: _train(rank, seed, steps, spec_of(v, light, heavy, eta, every))
            for v in variants}


def modelled_s(wall: list[float], wire: list[float], steps: int, *, rate_mbit: float,
               latency_ms: float, buckets: int, world: int = 2) -> float:
    """The first ``steps`` steps' modelled time: the median step time plus the link's (module
    docstring)."""
    per_byte = 8 / (rate_mbit * 1e6)
    compute = statistics.median(wall)
    return sum(compute + (world - 1) * b * per_byte + buckets * latency_ms / 1e3
               for b in wire[:steps])


def seed_result(ranks: list[dict], variants: list[str], a) -> dict:
    """Per variant of one seed: steps and modelled seconds to light's target, switches."""
    out = {}
    mean_losses = {v: [statistics.mean(x) for x in zip(*(r[v]["losses"] for r in ranks))]
                   for v in variants}
    ref = mean_losses.get("light", mean_losses[variants[0]])
    target = smoothed(ref, a.smooth)[max(a.smooth, round(a.target_at * len(ref))) - 1]
    for v in variants:
        reached = steps_to_target(mean_losses[v], target, a.smooth)
        n = reached or len(ref)
        wall = [max(x) for x in zip(*(r[v]["wall"] for r in ranks))]
        out[v] = {"steps": n, "reached": reached is not None, "target": target,
                  "time_s": modelled_s(wall, ranks[0][v]["wire"], n, rate_mbit=a.rate,
                                       latency_ms=a.latency_ms,
                                       buckets=ranks[0][v]["buckets"]),
                  "wire_mb": sum(ranks[0][v]["wire"][:n]) / n / 1e6,
                  "switches": ranks[0][v]["switches"],
                  "ranks_agree": all(r[v]["switches"] == ranks[0][v]["switches"]
                                     for r in ranks)}
    return out


def table(per_seed: list[dict], variants: list[str]) -> str:
    rows = []
    for v in variants:
        runs = [s[v] for s in per_seed]
        steps = [r["steps"] for r in runs]
        secs = [r["time_s"] for r in runs]
        mark = "" if all(r["reached"] for r in runs) else ">"
        std = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
        rows.append([v, f"{mark}{statistics.mean(steps):.1f} ± {std(steps):.1f}",
                     " ".join(str(s) for s in steps),
                     f"{statistics.mean(secs):.1f} ± {std(secs):.1f}",
                     f"{statistics.mean(r['wire_mb'] for r in runs):.3f}"])
    return common.table(rows, ["variant", "steps to target", "per seed", "modelled s",
                               "wire MB/step"])


def switch_lines(per_seed: list[dict], seeds: list[int]) -> list[str]:
    lines = []
    for seed, s in zip(seeds, per_seed):
        r = s.get("adaptive")
        if r is None:
            continue
        sw = ", ".join(f"b{b}@{step}->{new}" for b, step, new in r["switches"]) or "none"
        lines.append(f"seed {seed}: switches (bucket@first step->codec): {sw}; "
                     f"ranks agree: {r['ranks_agree']}")
    return lines


def _parser():
    ap = common.parser(__doc__)
    ap.add_argument("--light", default="int8")
    ap.add_argument("--heavy", default="topk:ratio=0.01,ef")
    ap.add_argument("--eta", type=float, default=0.5)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--smooth", type=int, default=10)
    ap.add_argument("--target-at", type=float, default=0.8)
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s of the modelled link")
    ap.add_argument("--latency-ms", type=float, default=1.0)
    return ap


def main(argv: list[str] | None = None) -> int:
    from bench.shaped import run_ranks

    a = _parser().parse_args(argv)
    per_seed = []
    for seed in a.seeds:
        t0 = time.perf_counter()
        ranks = run_ranks("bench.adaptive", "loss_rank", 2,
                          {"seed": seed, "steps": a.steps, "variants": a.variants,
                           "light": a.light, "heavy": a.heavy, "eta": a.eta,
                           "every": a.every}, netns=None, timeout_s=3600, stall_s=600)
        per_seed.append(seed_result(ranks, a.variants, a))
        print(f"seed {seed} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)
    print(f"\ntiny GPT, 2 gloo ranks, {a.steps} steps, light={a.light}, heavy={a.heavy}, "
          f"eta={a.eta}, every={a.every}; modelled link {a.rate:g} Mbit/s, "
          f"{a.latency_ms:g} ms\n")
    print(table(per_seed, a.variants))
    print("\n".join(switch_lines(per_seed, a.seeds)))
    common.write_json(a.json, "adaptive", {"args": vars(a), "per_seed": per_seed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
