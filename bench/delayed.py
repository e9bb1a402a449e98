"""Delayed data parallel with CD-SGD's correction (``ccfx.delayed_comm_hook``) beside the
synchronous compressed hook (``ccfx.ddp_comm_hook``), same codec: loss over seeds, step time
on a shaped link.

The tiny GPT (ccfx.models, the demo's shape) in eager DDP on 2 gloo ranks, each rank its own
stream of the embedded corpus (batch 8 per rank), AdamW 3e-3. Variants, all with ``--codec``
(int8 by default):

  sync        ccfx.ddp_comm_hook(codec): each bucket averaged inside the backward
  delayed     ccfx.delayed_comm_hook(codec, correct_every=K): each bucket's exchange overlaps
              the next step, its average applied one step late; every K-th step the residual
              travels exact (fp32)
  delayed-nc  the same without correction
  delayed-dc  delayed with DC-ASGD-a's compensation as well (``compensate=LAM``, 1000: λ·lr = 3)
  delayed-nc-dc  the compensation without correction

1. ``--part loss``: unshaped (127.0.0.1), per seed one spawn training every variant from the
   seed's initialisation on the same batches, ``--steps`` steps. The final loss is the mean
   training loss of the last 10 steps, averaged over the ranks (bench/convergence's method);
   reported per variant as mean ± std over the seeds and the paired difference against sync.
2. ``--part time``: 2 ranks in one namespace shaped to ``--rate`` Mbit/s (bench/shaped.py), one
   spawn for every variant: each rank builds all of them, warms each up, then times blocks of
   K steps (one correction per block) in the order A B C C B A ...; a block of a delayed
   variant ends once its last exchange has landed (``state.drain()``), so no transfer spills
   into the next block's time. Step time: the slowest rank's total over its blocks divided by
   the steps; "x sync" is sync's step time over the variant's (above 1: faster). Wire bytes: the
   ledger's per step (fp32 at corrections included).

    python -m bench.delayed                              # both parts: 3 seeds x 200 steps, 100 Mbit/s
    python -m bench.delayed --part time --rate 100 --blocks 4
    python -m bench.delayed --quick                      # a minute-sized look at both
"""

from __future__ import annotations

import statistics
import sys
import time

from bench import common

VARIANTS = ("sync", "delayed", "delayed-nc", "delayed-dc", "delayed-nc-dc")
LAM = 1000.0  # delayed-dc's compensate
LR, BATCH, LAST = 3e-3, 8, 10


# ---------------------------------------------------------------------------------------------
# What one rank runs.


def _log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


def _model(variant: str, seed: int, codec: str, k: int, vocab: int):
    """The DDP tiny GPT with the variant's hook, its hook state and its optimizer."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ccfx

    if variant == "sync":
        state, hook = ccfx.ddp_comm_hook(codec)
    elif variant.startswith("delayed") and variant in VARIANTS:
        state, hook = ccfx.delayed_comm_hook(
            codec, correct_every=None if "-nc" in variant else k,
            compensate=LAM if variant.endswith("-dc") else None)
    else:
        raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
    model = DDP(common.tiny_gpt(seed, vocab_size=vocab))
    model.register_comm_hook(state, hook)
    return model, state, torch.optim.AdamW(model.parameters(), lr=LR)


def _stream(seed: int, rank: int):
    """(this rank's endless training batches, the vocabulary size)."""
    from ccfx.models import CharTokenizer, batches, load_corpus

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    return (batches(tokenizer.encode(text), BATCH, common.GPT_KW["block_size"], seed * 1000 + rank),
            tokenizer.vocab_size)


def _step(model, opt, batch) -> float:
    loss = common.gpt_loss(model, *batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def loss_rank(rank: int, world: int, *, seed: int, steps: int, codec: str, k: int,
              variants: list[str]) -> dict:
    """Every variant from the seed's initialisation on the same batches: its losses."""
    out = {}
    for v in variants:
        data, vocab = _stream(seed, rank)
        model, _, opt = _model(v, seed, codec, k, vocab)
        losses = []
        for i in range(steps):
            losses.append(_step(model, opt, next(data)))
            if i % 50 == 0:
                _log(rank, f"{v} seed {seed} step {i}: loss {losses[-1]:.4f}")
        out[v] = losses
    return out


def time_rank(rank: int, world: int, *, codec: str, k: int, blocks: int, warmup: int,
              variants: list[str]) -> dict:
    """Per variant: the wall time of each timed block of ``k`` steps, and wire bytes per step."""
    import torch.distributed as dist

    data, vocab = _stream(0, rank)
    runs = {v: _model(v, 0, codec, k, vocab) for v in variants}
    for v, (model, state, opt) in runs.items():
        for _ in range(warmup):
            _step(model, opt, next(data))
        getattr(state, "drain", lambda: None)()
        state.ledger.reset()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for b in range(blocks):
        for v in (variants if b % 2 == 0 else variants[::-1]):
            model, state, opt = runs[v]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                _step(model, opt, next(data))
            getattr(state, "drain", lambda: None)()
            times[v].append(time.perf_counter() - t0)
            _log(rank, f"block {b} {v}: {times[v][-1] / k:.3f} s/step")
    wire = {v: runs[v][1].ledger.totals("bucket")[1] / (blocks * k) for v in variants}
    return {"times": times, "wire_bytes": wire}


# ---------------------------------------------------------------------------------------------
# The parent.


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_loss(a) -> dict[str, list[float]]:
    """Per variant, each seed's final loss (mean of the last 10 steps, over the ranks)."""
    from bench.shaped import run_ranks

    finals: dict[str, list[float]] = {v: [] for v in a.variants}
    for seed in a.seeds:
        t0 = time.perf_counter()
        ranks = run_ranks("bench.delayed", "loss_rank", 2,
                          {"seed": seed, "steps": a.steps, "codec": a.codec, "k": a.k,
                           "variants": a.variants}, netns=None, timeout_s=3600, stall_s=600)
        for v in a.variants:
            finals[v].append(statistics.mean(statistics.mean(r[v][-LAST:]) for r in ranks))
        _say(f"seed {seed}: {({v: round(f[-1], 4) for v, f in finals.items()})} "
             f"({time.perf_counter() - t0:.0f} s)")
    return finals


def loss_table(finals: dict[str, list[float]]) -> str:
    base = finals.get("sync")
    rows = []
    for v, xs in finals.items():
        std = statistics.stdev(xs) if len(xs) > 1 else 0.0
        paired = "" if base is None else \
            f"{100 * statistics.mean((x - b) / b for x, b in zip(xs, base)):+.2f} %"
        rows.append([v, f"{statistics.mean(xs):.4f} ± {std:.4f}",
                     " ".join(f"{x:.4f}" for x in xs), paired])
    return common.table(rows, ["variant", "final loss", "per seed", "vs sync (paired)"])


def run_time(a) -> dict:
    from bench.shaped import run_ranks, shaped_namespace

    with shaped_namespace(a.rate) as ns:
        ranks = run_ranks("bench.delayed", "time_rank", 2,
                          {"codec": a.codec, "k": a.k, "blocks": a.blocks, "warmup": a.warmup,
                           "variants": a.variants}, netns=ns, timeout_s=3600, stall_s=600)
    steps = a.blocks * a.k
    step_s = {v: max(sum(r["times"][v]) for r in ranks) / steps for v in a.variants}
    return {"step_s": step_s, "wire_bytes": ranks[0]["wire_bytes"]}


def time_table(res: dict) -> str:
    base = res["step_s"].get("sync")
    rows = [[v, f"{s:.3f}", "" if base is None else f"{base / s:.2f}x",
             f"{res['wire_bytes'][v] / 1e6:.2f}"] for v, s in res["step_s"].items()]
    return common.table(rows, ["variant", "step s", "x sync", "wire MB/step"])


def _parser():
    ap = common.parser(__doc__)
    ap.add_argument("--part", choices=["loss", "time", "both"], default="both")
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--k", type=int, default=10, help="correct_every of 'delayed' (default 10)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s of the shaped link")
    ap.add_argument("--blocks", type=int, default=4, help="timed blocks of K steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 seeds x 30 steps, 2 blocks")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.quick:
        a.seeds, a.steps, a.blocks = a.seeds[:2], 30, 2
    results: dict = {"args": vars(a)}
    if a.part in ("loss", "both"):
        finals = run_loss(a)
        results["loss"] = finals
        print(f"\nfinal loss, tiny GPT, 2 ranks, {a.codec}, K={a.k}, {a.steps} steps\n")
        print(loss_table(finals))
    if a.part in ("time", "both"):
        res = run_time(a)
        results["time"] = res
        print(f"\nstep time at {a.rate:g} Mbit/s, 2 ranks, {a.codec}, K={a.k}\n")
        print(time_table(res))
    common.write_json(a.json, "delayed", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
