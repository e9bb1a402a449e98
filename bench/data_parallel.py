"""Data-parallel step time on a bandwidth-limited link (tc tbf): torch DDP beside ccfx.

torch DDP (plain, fp16 hook, PowerSGD hook) beside ccfx's compressed gradient buckets, at each
rate and world size.

Every variant runs as real gloo ranks (OS processes) inside a fresh network namespace whose
loopback is limited with tc tbf (bench/shaped.py; needs root and iproute2). The model is a
10.5 M-parameter MLP (10 x Linear(1024, 1024), ReLU between, He init), batch 32 per rank, MSE
against a fixed random target, SGD lr 0.01; each rank's data is seeded by its rank.

Per variant: 2 warm-up steps (they include compiling), then N timed steps; every rank times
its steps after a barrier, and the step time is the largest over ranks of the mean step.
Ratios are against DDP and DDP + fp16 hook measured in the same run, in the same table:
"xDDP" is DDP's step time over the variant's (above 1: faster). Wire bytes are the payload a
rank hands to its collectives per step (a ring all-reduce puts 2(w-1)/w of that on the socket).

Variants: ddp, ddp-fp16, ddp-powersgd (torch's powerSGD_hook, rank 4; allowed to fail: it
aborts on gloo), ccfx-none, ccfx-fp16, ccfx-powersgd, ccfx-int8, ccfx-topk (the model compiled
with backend="ccfx", data_parallel=True, no DDP wrapper; skipped with the reason while ccfx
rejects the option; ccfx-auto: gradient_codec="auto", the planner told the tc rate, or the
loopback's probed rate unshaped, its choice and predicted step printed under the table), and
two references without any communication: no-comm (one process, the
plain eager step) and no-comm-all (every rank runs the eager step on its own, no gradient sync:
the same CPU sharing as the ranks, which matters when ranks outnumber cores).

    python -m bench.data_parallel                                  # rates 100 1000, 2 ranks
    python -m bench.data_parallel --rates 100 --world 2 4 --variants ddp ddp-fp16 no-comm
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import time

from bench import common
from bench.shaped import ShapingUnavailable, exit_cleanly_on_sigterm

WIDTH, DEPTH, BATCH, LR = 1024, 10, 32, 0.01
CCFX_CODECS = {"ccfx-none": "none", "ccfx-fp16": "fp16", "ccfx-powersgd": "powersgd:rank=4",
               "ccfx-int8": "int8", "ccfx-topk": "topk:ratio=0.01,ef", "ccfx-auto": "auto"}
DDP_VARIANTS = ("ddp", "ddp-fp16", "ddp-powersgd")
REFERENCES = ("no-comm", "no-comm-all")
VARIANTS = (*DDP_VARIANTS, *CCFX_CODECS, *REFERENCES)
POWERSGD_RANK = 4


# ---------------------------------------------------------------------------------------------
# What one rank runs (imported by bench.shaped's worker inside the namespace).


def make_model(seed: int = 0, width: int = WIDTH, depth: int = DEPTH):
    """The MLP, identical on every rank (same seed). He init (zero biases) keeps the signal
    alive through 10 ReLU layers, so the loss falls visibly within a few steps (with PyTorch's
    default init it moves in the 5th digit) and codecs' effect on training shows in it."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        lin = nn.Linear(width, width)
        nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")
        nn.init.zeros_(lin.bias)
        layers += [lin] if i == depth - 1 else [lin, nn.ReLU()]
    return nn.Sequential(*layers)


def rank_batch(rank: int, seed: int = 0, batch: int = BATCH, width: int = WIDTH):
    """This rank's fixed (input, target): seeded by rank, so ranks see different data and the
    averaged gradient differs from each rank's own."""
    import torch

    g = torch.Generator().manual_seed(1000 + 1000 * seed + rank)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def ccfx_options(codec: str, lowering: str = "inductor", link_gbps: float = 1.0) -> dict:
    """The torch.compile options of a ccfx variant (the link: for ``auto`` only; the shaped
    loopback is one medium every rank's bytes cross)."""
    extra = ({"link_gbps": link_gbps, "link_shared": True} if codec == "auto" else {})
    return {"data_parallel": True, "gradient_codec": codec, "bucket_mb": 25,
            "lowering": lowering, **extra}


def ccfx_wire_bytes(compiled) -> float:
    """Bytes per step this rank put into ccfx's gradient collectives, from its ledger (the
    bucket channel: every backward records each bucket's payload)."""
    import ccfx

    return float(ccfx.ledger_of(compiled).per_step("bucket")[1])


def _wrap(variant: str, model, lowering: str, link_gbps: float | None = None):
    """(the callable to train, a function giving its wire bytes per step or None)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    if variant in REFERENCES:
        return model, lambda: 0.0
    if variant in CCFX_CODECS:
        if variant == "ccfx-auto" and link_gbps is None:
            from ccfx.planner import probe_link

            link_gbps = probe_link(shared=True).gbps
        options = ccfx_options(CCFX_CODECS[variant], lowering, link_gbps or 1.0)
        compiled = torch.compile(model, backend="ccfx", options=options)
        object.__setattr__(model, "_ccfx_compiled", compiled)  # not a submodule: a reference
        return compiled, lambda: ccfx_wire_bytes(compiled)
    ddp = DDP(model)
    if variant == "ddp-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(None, fp16_compress_hook)
    elif variant == "ddp-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                   start_powerSGD_iter=2)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    return ddp, lambda: None


def train_rank(rank: int, world_size: int, *, variant: str, steps: int, warmup: int = 2,
               seed: int = 0, lowering: str = "inductor", link_gbps: float | None = None) -> dict:
    """One rank of one variant: warm up, barrier, time ``steps`` steps
    (:func:`bench.common.timed_steps`). Returns the per-step times, every step's loss, and the
    wire bytes per step when the variant counts them."""
    import torch
    from torch import nn

    model = make_model(seed)
    x, y = rank_batch(rank, seed)
    try:
        net, wire = _wrap(variant, model, lowering, link_gbps)
    except Exception as e:
        if _is_config_error(e):
            return {"skipped": f"ccfx rejects the options: {e}"}
        raise
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _log(rank, f"{variant} ready; warm-up ({warmup} steps, the first compiles)")

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    out = common.timed_steps(rank, step, steps=steps, warmup=warmup, wire=wire, digits=5)
    compiled = getattr(model, "_ccfx_compiled", None)
    if variant == "ccfx-auto" and compiled is not None and "skipped" not in out:
        import ccfx

        g = ccfx.plan_of(compiled).graphs[0]
        out["chosen"] = [(d.what, d.chosen) for d in g.decisions]
        if g.prediction is not None:
            out["predicted"] = [g.prediction.uncompressed_s, g.prediction.chosen_s]
    return out


_log = common.log


def _is_config_error(e: BaseException) -> bool:
    try:
        from ccfx.errors import ConfigError
    except ImportError:
        return False
    return isinstance(e, ConfigError)


# ---------------------------------------------------------------------------------------------
# What the parent computes.


def ccfx_unavailable(variant: str, lowering: str) -> str | None:
    """Why a ccfx variant cannot run here (ccfx missing, or its Config rejects the options),
    checked before any rank starts; None when it can."""
    try:
        import ccfx
    except ImportError as e:
        return f"ccfx does not import: {e}"
    try:
        ccfx.Config.from_options(ccfx_options(CCFX_CODECS[variant], lowering))
    except ccfx.ConfigError as e:
        return f"ccfx rejects the options: {e}"
    return None


def ddp_wire_bytes(variant: str) -> float:
    """The payload a DDP rank all-reduces per step: every gradient in fp32 (plain), in fp16
    (fp16 hook), or PowerSGD's P and Q of rank r for each matrix worth compressing plus the
    vectors uncompressed (what powerSGD_hook does once compression has started)."""
    shapes = _param_shapes()
    numel = sum(math.prod(s) for s in shapes)
    if variant == "ddp":
        return 4.0 * numel
    if variant == "ddp-fp16":
        return 2.0 * numel
    total = 0
    for s in shapes:
        n, m = (s[0], math.prod(s[1:])) if len(s) > 1 else (s[0], 1)
        compress = len(s) > 1 and n * m >= 2 * POWERSGD_RANK * (n + m)  # min_compression_rate 2
        total += 4 * POWERSGD_RANK * (n + m) if compress else 4 * n * m
    return float(total)


@functools.cache
def _param_shapes() -> tuple[tuple[int, ...], ...]:
    """The model's parameter shapes (built once: the parent needs them for every row)."""
    return tuple(tuple(p.shape) for p in make_model().parameters())


def _link_s(world: int, rate_mbit: float | None) -> float:
    """Seconds one uncompressed gradient all-reduce needs on the shaped loopback: a ring moves
    2(w-1)/w of the payload out of each of w ranks, and every byte shares the one ``lo``
    (measured: 6.8 s for 2 ranks at 100 Mbit/s against 6.7 s from this)."""
    if rate_mbit is None or world == 1:
        return 0.0
    return 2 * (world - 1) * ddp_wire_bytes("ddp") * 8 / (rate_mbit * 1e6)


def _deadlines(variant: str, world: int, rate_mbit: float | None,
               steps: int) -> tuple[float, float]:
    """(timeout, stall) in seconds: generous, but a hung run is caught within ~a minute of its
    last step. ccfx compiles (silently) inside the first step, hence its larger margins; the
    initial parameter broadcast counts as one more step."""
    link = 0.0 if variant in REFERENCES else _link_s(world, rate_mbit)
    base = 400.0 if variant in CCFX_CODECS else 90.0
    return base + 3 * link * (steps + 3), base / 3 + 3 * link


def run_variant(variant: str, world: int, rate_mbit: float | None, steps: int,
                threads: int, timeout_s: float | None, lowering: str = "inductor") -> dict:
    """Run one variant on ``world`` ranks in a fresh namespace; a row of the table."""
    if variant in CCFX_CODECS and (why := ccfx_unavailable(variant, lowering)):
        return {"variant": variant, "status": "skipped", "reason": why}
    if variant == "no-comm":
        world = 1
    limit, stall = _deadlines(variant, world, rate_mbit, steps)
    t0 = time.perf_counter()
    ranks = common.run_timed("bench.data_parallel", "train_rank", variant, world, rate_mbit,
                             {"variant": variant, "steps": steps, "lowering": lowering,
                              "link_gbps": rate_mbit / 1000 if rate_mbit else None},
                             timeout_s=timeout_s or limit, stall_s=stall, threads=threads,
                             env=common.CACHE_OFF if variant in CCFX_CODECS else None)
    if isinstance(ranks, dict):  # failed or skipped: the row says why
        return ranks
    return summarize(variant, ranks, time.perf_counter() - t0)


def summarize(variant: str, ranks: list[dict], wall_s: float) -> dict:
    """Step time = the slowest rank's mean (a step ends when the last rank has its gradients);
    final loss = the mean over ranks of the last step's loss."""
    wire = ranks[0]["wire_bytes"]
    if wire is None and variant in DDP_VARIANTS:
        wire = ddp_wire_bytes(variant)
    return {"variant": variant, "status": "ok", "ranks": len(ranks),
            "step_s": max(statistics.mean(r["times"]) for r in ranks),
            "wire_bytes": wire, "final_loss": statistics.mean(r["losses"][-1] for r in ranks),
            "per_rank": ranks, "wall_s": wall_s, "chosen": ranks[0].get("chosen"),
            "predicted": ranks[0].get("predicted")}


# ---------------------------------------------------------------------------------------------
# Output.


def auto_notes(rows: list[dict]) -> list[str]:
    """What ccfx-auto chose, its predicted step (compile time: FLOPs and the told link) against
    the measured one, and against ccfx-none measured in the same table."""
    by = {r["variant"]: r for r in rows if r.get("status") == "ok"}
    auto, none = by.get("ccfx-auto"), by.get("ccfx-none")
    if auto is None or not auto.get("predicted"):
        return []
    unc, chosen = auto["predicted"]
    out = [(f"auto chose {', '.join(f'{w}: {c}' for w, c in auto['chosen'])}; predicted "
           f"{chosen:.3f} s/step (uncompressed {unc:.3f}), measured {auto['step_s']:.3f} "
           f"({(chosen - auto['step_s']) / auto['step_s']:+.0%})")]
    if none is not None:
        out.append(f"ccfx-none measured {none['step_s']:.3f} s/step against the predicted "
                   f"{unc:.3f} ({(unc - none['step_s']) / none['step_s']:+.0%})")
    return out


def _ratio(base: dict | None, row: dict) -> str:
    if not base or base.get("status") != "ok" or row.get("status") != "ok":
        return "-"
    return f"{base['step_s'] / row['step_s']:.2f}"


def table_rows(rows: list[dict]) -> tuple[list[list[str]], list[str]]:
    """Rows of the printed table, and the notes under it: a variant that failed or was skipped
    says so in its row and why in a numbered note (the reasons are too long for a cell)."""
    by = {r["variant"]: r for r in rows}
    ddp, fp16 = by.get("ddp"), by.get("ddp-fp16")
    out, notes = [], []
    for r in rows:
        if r["status"] != "ok":
            out.append(common.failed_row(r, notes, 7))
            continue
        wire = "-" if r["wire_bytes"] is None else f"{r['wire_bytes'] / 1e6:.2f}"
        if r["variant"] in REFERENCES or not ddp or ddp.get("status") != "ok":
            dloss = "-"
        else:
            dloss = f"{(r['final_loss'] - ddp['final_loss']) / ddp['final_loss']:+.1e}"
        out.append([r["variant"], f"{r['step_s']:.3f}", _ratio(ddp, r), _ratio(fp16, r), wire,
                    f"{r['final_loss']:.5f}", dloss])
    return out, notes


HEADER = ["variant", "s/step", "xDDP", "xfp16-hook", "wire MB/step/rank", "final loss",
          "loss vs DDP"]


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _rate_label(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g} Mbit/s"


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--rates", nargs="+", default=["100", "1000"],
                    help="link rates in Mbit/s ('none': unshaped loopback); default 100 1000")
    ap.add_argument("--world", nargs="+", type=int, default=[2], help="world sizes (default 2)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps after 2 warm-up steps (default 3 at ≤100 Mbit/s, else 5)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                    metavar="VARIANT", help=f"default: all of {' '.join(VARIANTS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per variant run (default: estimated from the rate)")
    ap.add_argument("--lowering", choices=("inductor", "eager"), default="inductor",
                    help="ccfx variants' lowering (default inductor)")
    a = ap.parse_args(argv)
    exit_cleanly_on_sigterm()
    rates = [None if r.lower() in ("none", "unshaped") else float(r) for r in a.rates]
    results = []
    try:
        for world in a.world:
            refs: dict[str, dict] = {}  # no communication: independent of the rate, run once
            for rate in rates:
                steps = a.steps or (3 if rate is not None and rate <= 100 else 5)
                rows = []
                for v in a.variants:
                    if v in REFERENCES and v in refs:
                        rows.append(refs[v])
                        continue
                    _progress(f"[{_rate_label(rate)}, {world} ranks] {v} ...")
                    if v in REFERENCES:  # unshaped, and as many steps as the longest table
                        row = run_variant(v, world, None, a.steps or 5, a.threads, a.timeout)
                    else:
                        row = run_variant(v, world, rate, steps, a.threads, a.timeout,
                                          a.lowering)
                    _progress(f"    {row['status']}"
                              + (f" {row['step_s']:.3f} s/step" if row["status"] == "ok" else
                                 f": {row['reason']}")
                              + (f" ({row['wall_s']:.0f} s)" if "wall_s" in row else ""))
                    if v in REFERENCES:
                        refs[v] = row
                    rows.append(row)
                print(f"\n{_rate_label(rate)}, {world} ranks, {steps} timed steps after 2 warm-up,"
                      f" batch {BATCH}/rank, {a.threads} thread(s)/rank")
                cells, notes = table_rows(rows)
                print(common.table(cells, HEADER))
                print("\n".join(notes + auto_notes(rows)), flush=True)
                results.append({"rate_mbit": rate, "world": world, "steps": steps, "rows": rows})
    except ShapingUnavailable as e:
        print(f"cannot shape the network: {e}", file=sys.stderr)
        return 2
    common.write_json(a.json, "data_parallel", {
        "model": f"MLP {DEPTH} x Linear({WIDTH}, {WIDTH}), ReLU, He init",
        "params": sum(math.prod(s) for s in _param_shapes()), "batch_per_rank": BATCH,
        "lr": LR, "threads_per_rank": a.threads, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
