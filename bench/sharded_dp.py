"""Sharded data parallel (FSDP / ZeRO-3) on a bandwidth-limited link: torch's FSDP2
``fully_shard`` beside ``ccfx.shard``, uncompressed, int8, and ZeRO++'s int8 weights + int4
gradients.

The model is bench/tensor_parallel's :class:`TPGPT` (4 layers, width 512, 12.7 M parameters),
here not tensor-parallel: every rank holds 1/W of every parameter and trains on a batch of its
own (8 x 64 tokens, a different one on every rank), AdamW, the same seed. Per step each weight is
all-gathered in the forward, gathered again in the backward (neither keeps the whole weight for
backward) and its gradient reduce-scattered.

Variants (all compiled unless the name says eager):

* ``fsdp2``: ``fully_shard`` (torch.distributed.fsdp) on every block and on the root, gloo CPU,
  ``torch.compile(backend="inductor")`` (checked on torch 2.13: Dynamo compiles a block's
  forward, whose inputs are the gathered whole parameters, once for all blocks; FSDP2's gathers
  and reduce-scatters run eagerly in its hooks, and the root's embeddings, head and loss in no
  graph); ``fsdp2-eager`` the same without compile;
* ``ccfx-eager``: ``ccfx.shard(model)``, not compiled (uncompressed);
* ``ccfx-none``: ``ccfx.shard(model)`` + ``backend="ccfx"``, ``collective_codec="none"``;
* ``ccfx-int8``: ``collective_overrides`` all_gather and reduce_scatter int8;
* ``ccfx-zero++``: all_gather int8, reduce_scatter ``int4:ef`` (ZeRO++'s qwZ / qgZ shape);
* ``ccfx-none-unbucketed``, ``ccfx-int8-unbucketed``: as those, one collective per parameter
  (``shard_bucket="none"``); the others merge each block's (``"block"``, the default).

Three parts:

* ``--part time`` (default): each variant in a fresh network namespace whose loopback is limited
  with tc tbf (bench/shaped.py; root), 2 warm-up steps then N timed steps; the step time is the
  slowest rank's mean; "x fsdp2" and "x ccfx-none" are those rows' step times over the
  variant's, measured in the same table.
* ``--part buckets``: as the time part, for ``ccfx.shard``'s bucketing (``shard_bucket``):
  ``ccfx-none`` and ``ccfx-int8`` with one all-gather / reduce-scatter per parameter
  (``-unbucketed``) and per block (the default), the collectives each rank issues per step
  (ccfx's ledger) and the ratios of both.
* ``--part memory``: per rank, one training step (after a first one: AdamW allocates its state
  there) against the unsharded model on one rank: this rank's bytes of parameters, gradients
  (after backward) and AdamW state (after the step), counted, and ccfx's codec state
  (error-feedback residuals) beside them; for eager steps also the peak that
  torch.distributed._tools.MemTracker sees, with and without activations (MemTracker's
  dispatch mode keeps compiled graphs from running). The issue's goal is within 1.1 x 1/W.
* ``--part loss``: unshaped, ``--steps`` steps on the embedded corpus for each ``--seeds`` seed
  (each rank its own batches), the held-out loss per seed, and mean and spread per variant.

    python -m bench.sharded_dp                              # time part, 100 and 1000 Mbit/s
    python -m bench.sharded_dp --part buckets --rates 100       # per parameter vs per block
    python -m bench.sharded_dp --part memory
    python -m bench.sharded_dp --part loss --variants ccfx-none --seeds 0 1 2 --steps 40
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch

from bench import common
from bench.shaped import ShapingUnavailable, exit_cleanly_on_sigterm, run_ranks
from bench.tensor_parallel import (
    BATCH,
    BLOCK,
    LAYERS,
    LR,
    TPGPT,
    VOCAB,
    WIDTH,
    fixed_batch_step,
    num_parameters,
    train_on_corpus,
)

OVERRIDES = {
    "ccfx-none": {},
    "ccfx-int8": {"all_gather": "int8", "reduce_scatter": "int8"},
    "ccfx-zero++": {"all_gather": "int8", "reduce_scatter": "int4:ef"},
}
#: The same variants with one collective per parameter (``shard_bucket="none"``); the others
#: merge each block's (the default, ``"block"``).
UNBUCKETED = {f"{v}-unbucketed": v for v in ("ccfx-none", "ccfx-int8")}
#: ``--part buckets``: each variant per parameter, then bucketed per block.
BUCKET_VARIANTS = ("ccfx-none-unbucketed", "ccfx-none", "ccfx-int8-unbucketed", "ccfx-int8")
#: ``collective_codec="auto"`` planned for the shaped link (the time part's rate; 100 Mbit/s
#: unshaped): the planner picks per collective within the loss budget.
AUTO = "ccfx-auto"
VARIANTS = ("fsdp2", "fsdp2-eager", "ccfx-eager", *OVERRIDES, *UNBUCKETED, AUTO)
DEFAULT_VARIANTS = ("fsdp2", *OVERRIDES)


_log = common.log


# ---------------------------------------------------------------------------------------------
# What one rank runs.


def _shard(variant: str, seed: int, world: int) -> torch.nn.Module:
    """The model, sharded over every rank the way ``variant`` does it (not compiled)."""
    torch.manual_seed(seed)
    model = TPGPT()
    if variant.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    import ccfx

    return ccfx.shard(model)


def _compile(model: torch.nn.Module, variant: str, rate: float | None = None):
    if variant == "fsdp2":
        return torch.compile(model, backend="inductor")
    if variant in ("fsdp2-eager", "ccfx-eager"):
        return model
    if variant == AUTO:
        return torch.compile(model, backend="ccfx", options={
            "collective_codec": "auto", "link_gbps": (rate or 100.0) / 1000,
            "link_shared": True})
    bucket = "none" if variant in UNBUCKETED else "block"
    return torch.compile(model, backend="ccfx", options={
        "collective_codec": "none", "shard_bucket": bucket,
        "collective_overrides": OVERRIDES[UNBUCKETED.get(variant, variant)]})


def _graphs() -> dict:
    """How many graphs Dynamo compiled and how many graph breaks it took (compiled variants:
    FSDP2's hooks are skipped by Dynamo, so its graphs are the modules' compute only)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values())}


def _messages(compiled) -> int | None:
    """Collectives this rank issued so far, per ccfx's ledger (every compiled collective,
    compressed or not, counts one per call); None when not ccfx."""
    import ccfx
    from ccfx.errors import ConfigError

    try:
        return sum(e.calls for e in ccfx.ledger_of(compiled).entries("collective"))
    except ConfigError:
        return None


def time_rank(rank: int, world: int, *, variant: str, steps: int, warmup: int = 2,
              seed: int = 0, rate: float | None = None) -> dict:
    """Warm up (compiles), barrier, time ``steps`` steps on a fixed random batch of this rank
    (:func:`bench.common.timed_steps`; with the graphs Dynamo compiled)."""
    model = _shard(variant, seed, world)
    compiled = _compile(model, variant, rate)
    step = fixed_batch_step(model, compiled, 1000 * seed + rank)

    def graphs() -> dict:
        out = _graphs()
        _log(rank, f"Dynamo: {out}")
        return {"graphs": out, "messages_before": _messages(compiled)}

    out = common.timed_steps(rank, step, steps=steps, warmup=warmup, compiled=compiled,
                             after_warmup=graphs)
    if "skipped" in out:
        return out
    # the collectives the compiled graphs issue per timed step, beside their count
    before, after = out.pop("messages_before"), _messages(compiled)
    out["graphs"]["messages"] = None if before is None else (after - before) / steps
    return out


def loss_rank(rank: int, world: int, *, variant: str, steps: int, seed: int) -> dict:
    """``steps`` AdamW steps on the corpus (each rank its own batches), then the held-out loss
    (the same held-out batches on every rank)."""
    model = _shard(variant, seed, world)
    return train_on_corpus(rank, model, _compile(model, variant), steps=steps,
                           train_seed=1000 + 100 * seed + rank, held_seed=10_000 + seed,
                           log_every=10)


def _local_bytes(t: torch.Tensor | None) -> int:
    from torch.distributed.tensor import DTensor

    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _counted(model, opt) -> dict:
    return {"params": sum(_local_bytes(p) for p in model.parameters()),
            "grads": sum(_local_bytes(p.grad) for p in model.parameters()),
            "optimizer": sum(_local_bytes(v) for st in opt.state.values() for v in st.values()
                             if isinstance(v, torch.Tensor))}


def _codec_state_bytes(run) -> int:
    """Bytes of this rank's codec state (int4:ef's error-feedback residuals); 0 when the model
    is not compiled by ccfx or keeps none."""
    import ccfx
    from ccfx.errors import ConfigError

    try:
        state = ccfx.codec_state(run).state_dict()
    except ConfigError:
        return 0
    return sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))


def memory_rank(rank: int, world: int, *, variants: list[str], seed: int = 0) -> dict:
    """Per variant (and ``unsharded``: the plain model on this rank alone): eager, MemTracker's
    peak by category of the second training step; compiled, this rank's bytes of parameters,
    gradients (after backward, before the step) and AdamW state (after the step), and apart
    from them ccfx's codec state (error feedback keeps a residual per rank)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g)
    out: dict = {}
    kinds = {"unsharded": "eager", "fsdp2-eager": "eager", "fsdp2": "compiled",
             "ccfx-eager": "eager", "ccfx-none": "compiled", "ccfx-int8": "compiled",
             "ccfx-zero++": "compiled"}
    for variant in ["unsharded", *variants]:
        _log(rank, f"memory: {variant}")
        if variant == "unsharded":
            torch.manual_seed(seed)
            model = run = TPGPT()
        else:
            model = _shard(variant, seed, world)
            run = _compile(model, variant)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def step(model=model, run=run, opt=opt):
            opt.zero_grad(set_to_none=True)
            run(x, y).backward()
            grads = _counted(model, opt)["grads"]
            opt.step()
            return grads

        step()  # compiles; AdamW allocates its state
        row: dict = {"how": kinds[variant]}
        if kinds[variant] == "eager":
            tracker = MemTracker()
            tracker.track_external(model, opt)
            try:
                with tracker:
                    step()
                peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
                row["peak"] = {str(k).split(".")[-1]: v for k, v in peak.items()}
            except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
                row["tracker_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                _log(rank, f"MemTracker failed on {variant}: {row['tracker_error']}")
        grads = step()
        row["counted"] = {**_counted(model, opt), "grads": grads}
        row["codec_state"] = _codec_state_bytes(run)
        out[variant] = row
        torch._dynamo.reset()
    return out


# ---------------------------------------------------------------------------------------------
# The parent.


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _link_s(world: int, rate: float | None) -> float:
    """Seconds the uncompressed collectives of one step need on the shared loopback: every
    weight gathered twice (forward, backward) and every gradient reduce-scattered, each moving
    (W-1)/W of the model out of each of the W ranks."""
    if rate is None:
        return 0.0
    per_step = 3 * (world - 1) * num_parameters() * 4
    return per_step * 8 / (rate * 1e6)


def run_time(variant: str, world: int, rate: float | None, steps: int, threads: int) -> dict:
    return common.time_row("bench.sharded_dp", variant, world, rate, steps, threads,
                           _link_s(world, rate))


def time_table(rows: list[dict]) -> tuple[list[list[str]], list[str]]:
    def ok(name):
        return next((r for r in rows if r["variant"] == name and r["status"] == "ok"), None)

    bases = [ok("fsdp2") or ok("fsdp2-eager"), ok("ccfx-none")]
    out, notes = [], []
    for r in rows:
        if r["status"] != "ok":
            out.append(common.failed_row(r, notes, 6))
            continue
        ratios = [f"{b['step_s'] / r['step_s']:.2f}" if b else "-" for b in bases]
        wire = "-" if r["wire_bytes"] is None else f"{r['wire_bytes'] / 2**20:.2f}"
        out.append([r["variant"], f"{r['step_s']:.3f}", *ratios, wire, f"{r['loss']:.4f}"])
        p = r.get("predicted")
        if p:
            notes.append(f"planner ({r['variant']}: {p['chose']}): predicted {p['chosen_s']:.3f} "
                         f"s/step as chosen, measured {r['step_s']:.3f} "
                         f"({p['chosen_s'] / r['step_s'] - 1:+.0%}); predicted "
                         f"{p['uncompressed_s']:.3f} s uncompressed (no optimizer step)")
    return out, notes


def memory_table(ranks: list[dict], world: int) -> tuple[list[list[str]], list[str]]:
    """One row per variant: the largest rank's figures, and their ratio to the unsharded ones.

    MemTracker's "peak" snapshot is the breakdown at the moment of the total's peak (the start
    of backward, before gradients exist), so its categories are not each one's own peak: the
    table gives the total, and the total without activations (data parallel does not shard
    them: every rank runs its whole batch through the whole model)."""
    rows, header = [], ["variant", "run", "params+grads+AdamW MiB (ratio)", "x W",
                        "+ codec state MiB (ratio)", "MemTracker peak MiB (ratio)",
                        "peak - activations MiB (ratio)"]
    whole = ranks[0]["unsharded"]
    w_count = sum(whole["counted"].values())
    w_total = whole["peak"]["Total"]
    w_rest = w_total - whole["peak"]["ACT"]
    for variant in ranks[0]:
        got = [r[variant] for r in ranks]
        count = max(sum(g["counted"].values()) for g in got)
        peak = rest = "-"
        if any("tracker_error" in g for g in got):
            peak = "MemTracker: " + next(g["tracker_error"] for g in got if "tracker_error" in g)
        elif "peak" in got[0]:
            t = max(g["peak"]["Total"] for g in got)
            r = max(g["peak"]["Total"] - g["peak"]["ACT"] for g in got)
            peak = f"{t / 2**20:.1f} ({t / w_total:.3f})"
            rest = f"{r / 2**20:.1f} ({r / w_rest:.3f})"
        state = max(count + g.get("codec_state", 0) for g in got)
        rows.append([variant, got[0]["how"], f"{count / 2**20:.1f} ({count / w_count:.3f})",
                     f"{count / w_count * world:.2f}",
                     f"{state / 2**20:.1f} ({state / w_count:.3f})", peak, rest])
    return rows, header


def bucket_table(rows: list[dict]) -> tuple[list[list[str]], list[str]]:
    """``--part buckets``: per variant its collectives per step and step time, and for a
    bucketed one both ratios against its per-parameter twin (``<variant>-unbucketed``) of
    the same table."""
    ok = {r["variant"]: r for r in rows if r["status"] == "ok"}
    out, notes = [], []
    for r in rows:
        if r["status"] != "ok":
            out.append(common.failed_row(r, notes, 6))
            continue
        msgs = r.get("graphs", {}).get("messages")
        base = ok.get(f"{r['variant']}-unbucketed")
        base_msgs = base.get("graphs", {}).get("messages") if base else None
        out.append([r["variant"], "-" if msgs is None else f"{msgs:.0f}", f"{r['step_s']:.3f}",
                    f"{base_msgs / msgs:.1f}" if base_msgs and msgs else "-",
                    f"{base['step_s'] / r['step_s']:.2f}" if base else "-",
                    f"{r['loss']:.4f}"])
    return out, notes


BUCKET_HEADER = ["variant", "collectives/step/rank", "s/step", "x fewer collectives",
                 "x faster", "loss"]
TIME_HEADER = ["variant", "s/step", "x fsdp2", "x ccfx-none", "wire MiB/step/rank", "loss"]


def _time_part(a, variants: list[str], table, header: list[str]) -> list[dict]:
    """Every variant at every ``--rates`` rate, one table per rate (``table(rows)``)."""
    rates = [None if r.lower() in ("none", "unshaped") else float(r) for r in a.rates]
    steps = a.steps or 3
    tables = []
    for rate in rates:
        rows = []
        label = "unshaped" if rate is None else f"{rate:g} Mbit/s"
        for v in variants:
            _progress(f"[{label}] {v} ...")
            row = run_time(v, a.world, rate, steps, a.threads)
            _progress(f"    {row['status']}" + (
                f" {row['step_s']:.3f} s/step, {row['graphs']}" if row["status"] == "ok"
                else f": {row['reason']}"))
            rows.append(row)
        print(f"\n{label}, {a.world} ranks, {steps} timed steps after 2 warm-up")
        cells, notes = table(rows)
        print(common.table(cells, header))
        print("\n".join(notes), flush=True)
        tables.append({"rate_mbit": rate, "rows": rows})
    return tables


def _memory_part(a) -> list[dict]:
    variants = a.variants or ["fsdp2-eager", "ccfx-eager", "fsdp2", "ccfx-none", "ccfx-zero++"]
    ranks = run_ranks("bench.sharded_dp", "memory_rank", a.world, {"variants": variants},
                      netns=None, timeout_s=1200, threads_per_rank=a.threads,
                      env=common.CACHE_OFF, stall_s=300)
    print(f"\nper-rank memory of a training step over the unsharded model on one rank "
          f"(1/W = {1 / a.world:.3f}; the largest rank). params+grads+AdamW: this rank's "
          "tensors, counted (gradients after backward, AdamW after its step)")
    print(common.table(*memory_table(ranks, a.world)))
    for variant in ranks[0]:
        peak = ranks[0][variant].get("peak")
        if peak:
            print(f"  {variant} MemTracker peak by category (MiB, rank 0): " + ", ".join(
                f"{k} {v / 2**20:.1f}" for k, v in peak.items() if v))
    return ranks


def _loss_part(a) -> dict:
    variants = a.variants or list(DEFAULT_VARIANTS)
    steps = a.steps or 40
    rows, out = [], {}
    for v in variants:
        vals, secs = [], []
        for seed in a.seeds:
            _progress(f"[loss] {v} seed {seed} ...")
            t0 = time.perf_counter()
            ranks = run_ranks("bench.sharded_dp", "loss_rank", a.world,
                              {"variant": v, "steps": steps, "seed": seed}, netns=None,
                              timeout_s=1800, threads_per_rank=a.threads,
                              env=common.CACHE_OFF, stall_s=300)
            secs.append(time.perf_counter() - t0)
            vals.append(ranks[0]["held_out"])
            _progress(f"    held-out {vals[-1]:.4f} ({secs[-1]:.0f} s)")
        sd = statistics.stdev(vals) if len(vals) > 1 else math.nan
        rows.append([v, " ".join(f"{x:.4f}" for x in vals),
                     f"{statistics.mean(vals):.4f} ± {sd:.4f}", f"{max(secs):.0f}"])
        out[v] = vals
    print(f"\nheld-out loss after {steps} steps ({len(a.seeds)} seeds), {a.world} ranks")
    print(common.table(rows, ["variant", "per seed", "mean ± std", "s per seed (max)"]))
    return out


def _arguments(argv: list[str] | None):
    ap = common.parser(__doc__)
    ap.add_argument("--part", choices=("time", "buckets", "memory", "loss"), default="time")
    ap.add_argument("--rates", nargs="+", default=["100", "1000"],
                    help="link rates in Mbit/s ('none': unshaped); time and buckets parts")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps (time part, default 3) or training steps (loss, 40)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="loss part")
    ap.add_argument("--variants", nargs="+", default=None, choices=VARIANTS)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _arguments(argv)
    exit_cleanly_on_sigterm()
    params = num_parameters()
    print(f"TPGPT: {LAYERS} layers, width {WIDTH}, {params / 1e6:.1f} M parameters "
          f"({params * 4 / 2**20:.1f} MiB fp32); {a.world} sharded data-parallel ranks, "
          f"batch {BATCH} x {BLOCK} tokens per rank (each its own)")
    results: dict = {"params": params, "world": a.world, "part": a.part}
    try:
        if a.part == "time":
            results["tables"] = _time_part(a, a.variants or list(DEFAULT_VARIANTS),
                                           time_table, TIME_HEADER)
        elif a.part == "buckets":
            results["tables"] = _time_part(a, a.variants or list(BUCKET_VARIANTS),
                                           bucket_table, BUCKET_HEADER)
        elif a.part == "memory":
            results["memory"] = _memory_part(a)
        else:
            results["loss"] = _loss_part(a)
    except ShapingUnavailable as e:
        print(f"cannot shape the network: {e}", file=sys.stderr)
        return 2
    common.write_json(a.json, "sharded_dp", results)
    return 0

if __name__ == "__main__":
    sys.exit(main())
