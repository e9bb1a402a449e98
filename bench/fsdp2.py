"""FSDP2 with ccfx's codecs on a bandwidth-limited link: torch's own ``fully_shard``, plain and
through ``ccfx.integrations.register_codec``, beside ``ccfx.shard`` with the same codecs.

Models (``--model``): ``tiny``, ccfx's tiny GPT (``ccfx.models.tiny_gpt``, the demo's shape: 4
layers, width 256, 3.2 M parameters), and ``gpt12m``, bench/tensor_parallel's :class:`TPGPT`
(4 layers, width 512, 12.7 M parameters). Every rank holds 1/W of every parameter and trains on
a batch of its own (8 x 64 tokens), AdamW, the same seed.

Variants:

* ``fsdp2``: ``fully_shard`` on every block and on the root, gloo CPU, eager: the baseline;
* ``fsdp2-ccfx``: the same model and loop, plus one line,
  ``register_codec(model, {"all_gather": "int8", "reduce_scatter": "int4:ef"})``: every FSDP
  module's all-gather and reduce-scatter through ccfx's codecs (still eager);
* ``fsdp2-ccfx-compiled``: ``fsdp2-ccfx`` with every block compiled by inductor
  (``block.compile()`` before ``fully_shard``, as torchtitan compiles per block): the FSDP2
  row whose compute is compiled like ``ccfx-shard``'s;
* ``fsdp2-auto``: ``register_codec(model, "auto", options={"link_gbps": <the shaped rate>,
  "link_shared": True})`` (every rank crosses the one shaped loopback):
  ccfx picks each module's codecs from the link and prices the step's collectives; the table's
  notes set that prediction beside the seconds measured inside ccfx's comms, and the predicted
  step (the measured step less the measured comms, plus the predicted ones) beside the step;
* ``ccfx-shard``: ``ccfx.shard(model)`` compiled by ``backend="ccfx"`` with the same codecs
  (``collective_overrides``; bench/sharded_dp's ``ccfx-zero++``). ccfx.shard compresses only
  inside a graph ccfx compiled, so this row includes compiled compute.

Three parts:

* ``--part time`` (default): each variant on ``--world`` ranks in a fresh network namespace
  whose loopback is limited with tc tbf (bench/shaped.py; root), 2 warm-up steps then N timed
  steps; the step time is the slowest rank's mean, "x fsdp2" the fsdp2 row's step over the
  variant's (same table). The wire bytes are ccfx's ledger per step and rank beside the
  formula (:func:`formula_bytes`: the same collectives priced by the wire layer from the
  model's parameter shapes); plain FSDP2 has no ledger, its formula is given in parentheses.
* ``--part loss``: unshaped, ``--steps`` steps on the embedded corpus per ``--seeds`` seed
  (each rank its own batches; every variant of a seed from the same initialisation on the
  same batches, bench/convergence's method), the held-out loss per seed, the mean and the
  paired (seed-by-seed) difference against fsdp2.
* ``--part hsdp``: the time part for HSDP on 4 ranks, 2 "nodes" x 2 (bench/shaped.py's
  ``two_nodes``: the link between the nodes shaped, each node's loopback not): ``hsdp``,
  torch's own (``fully_shard`` on the (replicate, shard) mesh), beside ``hsdp-ccfx``,
  ``fully_shard`` over ``mesh["shard"]`` and ``register_codec(model, {"all_reduce":
  "int4:ef"}, replicate=mesh["replicate"])``: only the replicas' all-reduce, the one that
  crosses the slow link, compressed. ``--part loss --variants hsdp hsdp-ccfx`` trains them.
* ``--part memory``: unshaped, per rank, the peak of the second training step as torch's
  ``FSDPMemTracker`` sees it (eager FSDP2 variants; it cannot follow a compiled graph), and
  for every variant the growth of the rank's maximum resident set over its whole run (each
  variant in fresh processes), with ccfx's codec state (error-feedback residuals) apart.

    python -m bench.fsdp2                                   # time: 2 ranks, 100 and 1000 Mbit/s
    python -m bench.fsdp2 --model tiny --world 4 --rates 100
    python -m bench.fsdp2 --part loss --seeds 0 1 2 --steps 40
    python -m bench.fsdp2 --part memory
    python -m bench.fsdp2 --part hsdp --rates 100
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

import torch

from bench import common
from bench.shaped import ShapingUnavailable, exit_cleanly_on_sigterm, run_ranks
from bench.tensor_parallel import BATCH, BLOCK, TPGPT, fixed_batch_step, train_on_corpus
from ccfx.models import GPTConfig, TinyGPT

#: What FSDP2 + ccfx and ccfx.shard run (ZeRO++'s shape: int8 weights, int4 gradients with
#: error feedback).
CODECS = {"all_gather": "int8", "reduce_scatter": "int4:ef"}
#: HSDP: only the replicas' all-reduce (the slow link between the nodes) compressed.
HSDP_CODECS = {"all_reduce": "int4:ef"}
VARIANTS = ("fsdp2", "fsdp2-ccfx", "fsdp2-ccfx-compiled", "fsdp2-auto", "ccfx-shard")
HSDP_VARIANTS = ("hsdp", "hsdp-ccfx")
#: HSDP's placement on bench.shaped's two nodes: ranks 0, 1 on node 0 and 2, 3 on node 1, so
#: the shard groups ({0, 1}, {2, 3}) stay inside a node and the replicas' ({0, 2}, {1, 3})
#: cross the link.
HSDP_NODES = (0, 0, 1, 1)
MODELS = ("tiny", "gpt12m")

_log = common.log


class TinyLoss(TinyGPT):
    """ccfx's tiny GPT returning the loss alone (the step loops call ``model(x, y)``)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward(idx, targets)[1]


def make_model(name: str, seed: int) -> torch.nn.Module:
    """``name``'s model, seeded (both have ``blocks``, vocabulary 96, context 64)."""
    torch.manual_seed(seed)
    if name == "tiny":
        return TinyLoss(GPTConfig(**common.GPT_KW))
    if name == "gpt12m":
        return TPGPT()
    raise ValueError(f"unknown model {name!r}: one of {MODELS}")


def num_parameters(name: str) -> int:
    return sum(p.numel() for p in make_model(name, 0).parameters())


# ---------------------------------------------------------------------------------------------
# What one rank runs.


def _hsdp(model: torch.nn.Module, variant: str, world: int) -> None:
    """HSDP on a (replicate 2, shard W/2) mesh: ``hsdp`` is torch's own (fully_shard on the 2-D
    mesh: it reduce-scatters over the shard group and all-reduces over the replicas itself);
    ``hsdp-ccfx`` shards over ``mesh["shard"]`` and hands the replicas' all-reduce to ccfx."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    on = mesh if variant == "hsdp" else mesh["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=on)
    fully_shard(model, mesh=on)
    if variant == "hsdp-ccfx":
        import ccfx.integrations

        ccfx.integrations.register_codec(model, dict(HSDP_CODECS),
                                         replicate=mesh["replicate"])


def build(variant: str, model_name: str, seed: int, world: int, link_gbps: float = 1.0):
    """``(model, run)``: ``model_name`` sharded over every rank as ``variant`` does it, and what
    to call (the model itself, or ccfx.shard's model compiled by backend="ccfx");
    ``link_gbps``: the link ``fsdp2-auto`` prices."""
    if variant not in VARIANTS + HSDP_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: one of {VARIANTS + HSDP_VARIANTS}")
    model = make_model(model_name, seed)
    if variant in HSDP_VARIANTS:
        _hsdp(model, variant, world)
        return model, model
    if variant == "ccfx-shard":
        import ccfx

        ccfx.shard(model)
        return model, torch.compile(model, backend="ccfx", options={
            "collective_codec": "none", "collective_overrides": dict(CODECS)})
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        if variant == "fsdp2-ccfx-compiled":
            block.compile()
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if variant in ("fsdp2-ccfx", "fsdp2-ccfx-compiled"):
        import ccfx.integrations

        ccfx.integrations.register_codec(model, dict(CODECS))
    elif variant == "fsdp2-auto":
        import ccfx.integrations

        ccfx.integrations.register_codec(model, "auto", options={"link_gbps": link_gbps,
                                                                 "link_shared": True})
    return model, model


def time_rank(rank: int, world: int, *, variant: str, model: str, steps: int,
              warmup: int = 2, seed: int = 0, link_gbps: float = 1.0) -> dict:
    """Warm up (ccfx-shard compiles), barrier, time ``steps`` steps on a fixed random batch of
    this rank (:func:`bench.common.timed_steps`, wire bytes from ccfx's ledger); for FSDP2
    with ccfx's comms also ``comm_s``, the seconds per timed step inside them."""
    from ccfx.runtime.fsdp2_comms import fsdp2_state_of

    module, run = build(variant, model, seed, world, link_gbps)
    step = fixed_batch_step(module, run, 1000 * seed + rank)
    state = fsdp2_state_of(module)
    out = common.timed_steps(rank, step, steps=steps, warmup=warmup, compiled=run,
                             after_warmup=lambda: {"comm_s": state.seconds} if state else {})
    if state is not None and "comm_s" in out:
        out["comm_s"] = (state.seconds - out["comm_s"]) / steps
    return out


def loss_rank(rank: int, world: int, *, variant: str, model: str, steps: int,
              seeds: list[int]) -> dict:
    """Per seed: ``steps`` AdamW steps on the corpus (each rank its own batches), then the
    held-out loss (the same held-out batches on every rank)."""
    out = {}
    for seed in seeds:
        _log(rank, f"seed {seed}")
        module, run = build(variant, model, seed, world)
        got = train_on_corpus(rank, module, run, steps=steps,
                              train_seed=1000 + 100 * seed + rank, held_seed=10_000 + seed,
                              log_every=10)
        out[str(seed)] = got["held_out"]
        torch._dynamo.reset()
    return out


def _max_rss() -> int:
    """This process's largest resident set so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tracked_peak(module, step, opt) -> dict:
    """The peak of one ``step()`` by FSDPMemTracker's categories (``{"error": ...}`` when the
    tracker cannot follow it)."""
    from ccfx import _torch_compat as tc

    try:
        tracker = tc.FSDPMemTracker(module, opt)
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        return {str(k).split(".")[-1]: v for k, v in peak.items()}
    except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}


def memory_rank(rank: int, world: int, *, variant: str, model: str, seed: int = 0) -> dict:
    """This rank's memory over two training steps of ``variant`` (the first allocates AdamW's
    state): FSDPMemTracker's peak of the second (eager FSDP2 only), the growth of the maximum
    resident set since before the model was built, and the codec state's bytes."""
    base = _max_rss()
    module, run = build(variant, model, seed, world)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x, y = (torch.randint(0, 96, (BATCH, BLOCK), generator=g) for _ in range(2))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        run(x, y).backward()
        opt.step()

    step()
    peak = _tracked_peak(module, step, opt) if variant != "ccfx-shard" else None
    step()
    return {"peak": peak, "rss_growth": _max_rss() - base,
            "codec_state": _codec_state(module, run)}


def _codec_state(module, run) -> int:
    """Bytes of this rank's codec state (error-feedback residuals): register_codec's on an
    FSDP2 model, the compiled model's for ccfx.shard, 0 for plain FSDP2."""
    import ccfx
    from ccfx.errors import ConfigError
    from ccfx.runtime.fsdp2_comms import fsdp2_state_of

    held = fsdp2_state_of(module)
    if held is not None:
        state = held.state_tensors()
    else:
        try:
            state = ccfx.codec_state(run).state_dict()
        except ConfigError:  # no ccfx codec on it
            state = {}
    return sum(v.numel() * v.element_size() for v in state.values()
               if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------------------------------
# The formula.


def buffers(model_name: str, world: int) -> list[tuple[str, int, int]]:
    """``(FSDP module, all-gather input numel, reduce-scatter input numel)`` of each FSDP
    module, from the parameter shapes: FSDP2 shards each parameter on dim 0 in ``world`` chunks
    of ``ceil(dim0 / world)`` rows (padded), and a module's buffer is its own parameters' (those
    of no FSDP block below it)."""
    model = make_model(model_name, 0)
    owned: dict[str, list] = {"root": []}
    for i, block in enumerate(model.blocks):
        owned[f"blocks.{i}"] = list(block.parameters())
    inner = {id(p) for ps in owned.values() for p in ps}
    owned["root"] = [p for p in model.parameters() if id(p) not in inner]

    def shard(p: torch.Tensor) -> int:
        rows = -(-p.shape[0] // world) if p.dim() else 1
        return rows * (p[0].numel() if p.dim() else 1)

    return [(name, sum(map(shard, ps)), world * sum(map(shard, ps)))
            for name, ps in owned.items()]


def _spec(variant: str, kind: str) -> str:
    if variant in ("fsdp2", "hsdp"):
        return "none"
    return HSDP_CODECS.get(kind, "none") if variant == "hsdp-ccfx" else CODECS[kind]


def formula_bytes(variant: str, model_name: str, world: int) -> float | None:
    """Bytes one rank sends per step by the wire layer's formula (the ring convention): a
    block's weights gathered twice (forward, and again in backward: ``reshard_after_forward``),
    the root's once (FSDP2 keeps the root's gathered for backward), each module's gradients
    reduce-scattered once; under HSDP over a shard group of W/2, then the reduce-scatter's
    output all-reduced across the 2 replicas. The codecs are the variant's (``fsdp2`` and
    ``hsdp``: none; ``fsdp2-auto``: None, chosen on the ranks). ccfx.shard's own collectives are per parameter, not per module: its row
    prints this as an approximation."""
    from ccfx.wire.collectives import CollectiveCall, CompressedCollective

    if variant == "fsdp2-auto":  # its codecs are chosen on the ranks: no formula ahead
        return None
    hsdp = variant in HSDP_VARIANTS
    group = world // 2 if hsdp else world
    total = 0
    for name, shard, whole in buffers(model_name, group):
        gathers = 1 if name == "root" and variant != "ccfx-shard" else 2
        calls = [("all_gather", shard, gathers, None, group),
                 ("reduce_scatter", whole, 1, "sum", group)]
        calls += [("all_reduce", shard, 1, "avg", 2)] if hsdp else []
        for kind, numel, times, op, size in calls:
            call = CollectiveCall(kind, (numel,), torch.float32, size, op)
            total += times * CompressedCollective(call, _spec(variant, kind)).wire_bytes()
    return float(total)


# ---------------------------------------------------------------------------------------------
# The parent.


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_time(variant: str, model: str, world: int, rate: float | None, steps: int,
             threads: int, nodes: tuple[int, ...] | None = None) -> dict:
    """A variant's row of the time table (bench.common's row; deadlines from the seconds the
    uncompressed step's bytes need on the link, and a compile's silence for ccfx-shard: over
    4 minutes on a busy 2-core machine); ``nodes``: on bench.shaped's two nodes."""
    link_s = 0.0 if rate is None else formula_bytes("fsdp2", model, world) * world * 8 / (
        rate * 1e6)
    silent_s = 900 if variant == "ccfx-shard" else 240
    t0 = time.perf_counter()
    kwargs = {"variant": variant, "model": model, "steps": steps,
              "link_gbps": 100.0 if rate is None else rate / 1000}
    ranks = common.run_timed("bench.fsdp2", "time_rank", variant, world, rate, kwargs,
                             timeout_s=2 * silent_s + 3 * link_s * (steps + 2),
                             stall_s=silent_s + 3 * link_s,
                             threads=threads, env=common.CACHE_OFF, nodes=nodes)
    if isinstance(ranks, dict):  # failed or skipped: the row says why
        return ranks
    row = common.step_row(variant, ranks, time.perf_counter() - t0)
    row["comm_s"] = ranks[0].get("comm_s")
    return row


def prediction_note(row: dict) -> str:
    """For a row with auto's prediction: the predicted collectives beside those measured
    inside ccfx's comms, and the predicted step (the measured step less the measured comms,
    plus the predicted) beside the measured one."""
    p, comm = row.get("predicted"), row.get("comm_s")
    if row["status"] != "ok" or not p or comm is None:
        return ""
    step = row["step_s"] - comm + p["chosen_s"]
    return (f"{row['variant']}: collectives predicted {p['chosen_s']:.3f} s/step "
            f"(uncompressed {p['uncompressed_s']:.3f}), measured inside ccfx's comms "
            f"{comm:.3f} s; predicted step {step:.3f} s against {row['step_s']:.3f} s "
            f"measured: {step / row['step_s'] - 1:+.1%}")


def time_table(rows: list[dict], model: str, world: int) -> list[list[str]]:
    """Rows of variant, s/step, x fsdp2 (or x hsdp), wire MiB/step/rank (ledger), formula,
    loss; a failed variant's reason as a numbered note (the last row holds the notes' text,
    if any)."""
    base = next((r for r in rows if r["variant"] in ("fsdp2", "hsdp") and r["status"] == "ok"),
                None)
    out, notes = [], []
    for r in rows:
        if r["status"] != "ok":
            out.append(common.failed_row(r, notes, 6))
            continue
        formula = formula_bytes(r["variant"], model, world)
        wire = "-" if r["wire_bytes"] is None else f"{r['wire_bytes'] / 2**20:.2f}"
        out.append([r["variant"], f"{r['step_s']:.3f}",
                    f"{base['step_s'] / r['step_s']:.2f}" if base else "-", wire,
                    "-" if formula is None else f"({formula / 2**20:.2f})"
                    if r["variant"] in ("fsdp2", "hsdp") else f"{formula / 2**20:.2f}",
                    f"{r['loss']:.4f}"])
    return out + ([["\n".join(notes)]] if notes else [])


TIME_HEADER = ["variant", "s/step", "x fsdp2", "wire MiB/step/rank", "formula", "loss"]


def time_part(a) -> dict:
    """The time tables, one per rate; ``{"tables": [...]}``. ``--part hsdp``: on two nodes
    (:data:`HSDP_NODES`), the link between them shaped."""
    rates = [None if r.lower() in ("none", "unshaped") else float(r) for r in a.rates]
    steps = a.steps or 3
    hsdp = a.part == "hsdp"
    tables = []
    for rate in rates:
        label = "unshaped" if rate is None else f"{rate:g} Mbit/s"
        label += " between 2 nodes" if hsdp else ""
        rows = []
        for v in a.variants or (HSDP_VARIANTS if hsdp else VARIANTS):
            _progress(f"[{label}] {v} ...")
            row = run_time(v, a.model, a.world, rate, steps, a.threads,
                           HSDP_NODES if hsdp else None)
            _progress(f"    {row['status']}" + (f" {row['step_s']:.3f} s/step"
                                               if row["status"] == "ok" else
                                               f": {row['reason']}"))
            rows.append(row)
        cells = time_table(rows, a.model, a.world)
        notes = cells.pop()[0] if cells and len(cells[-1]) == 1 else ""
        print(f"\n{a.model}, {label}, {a.world} ranks, {steps} timed steps after 2 warm-up")
        print(common.table(cells, [*TIME_HEADER[:2], "x hsdp" if hsdp else "x fsdp2",
                                   *TIME_HEADER[3:]]))
        print(notes, flush=True)
        for note in filter(None, map(prediction_note, rows)):
            print(note, flush=True)
        tables.append({"rate_mbit": rate, "rows": rows})
    return {"tables": tables}


def loss_table(losses: dict[str, dict[str, float]]) -> list[list[str]]:
    """Rows of variant, per seed, mean ± std, paired difference against its baseline (plain
    fsdp2; torch's hsdp for hsdp-ccfx): the mean of the seeds' relative differences, and the
    largest."""
    rows = []
    for variant, by_seed in losses.items():
        vals = list(by_seed.values())
        sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        diff = "-"
        plain = "hsdp" if variant in HSDP_VARIANTS else "fsdp2"
        base = losses.get(plain)
        if base is not None and variant != plain:
            rel = [by_seed[s] / base[s] - 1 for s in by_seed if s in base]
            diff = f"{statistics.mean(rel):+.2%} (max {max(rel, key=abs):+.2%})"
        rows.append([variant, " ".join(f"{x:.4f}" for x in vals),
                     f"{statistics.mean(vals):.4f} ± {sd:.4f}", diff])
    return rows


def loss_part(a) -> dict:
    steps = a.steps or 40
    losses = {}
    for v in a.variants or VARIANTS:
        _progress(f"[loss] {v}, seeds {a.seeds} ...")
        ranks = run_ranks("bench.fsdp2", "loss_rank", a.world,
                          {"variant": v, "model": a.model, "steps": steps, "seeds": a.seeds},
                          netns=None, timeout_s=600 + 600 * len(a.seeds),
                          threads_per_rank=a.threads, env=common.CACHE_OFF, stall_s=300)
        losses[v] = ranks[0]
    print(f"\n{a.model}: held-out loss after {steps} steps ({len(a.seeds)} seeds), "
          f"{a.world} ranks")
    print(common.table(loss_table(losses), ["variant", "per seed", "mean ± std",
                                            "paired vs plain"]))
    return {"loss": losses}


def memory_table(runs: dict[str, list[dict]]) -> list[list[str]]:
    """Rows of variant, FSDPMemTracker peak MiB (largest rank), max-RSS growth MiB (largest
    rank), codec state MiB, each with its ratio to fsdp2's."""
    def mib(x):
        return f"{x / 2**20:.1f}"

    def peak(ranks):
        if ranks[0]["peak"] is None:
            return None
        if any("error" in r["peak"] for r in ranks):
            return next(r["peak"]["error"] for r in ranks if "error" in r["peak"])
        return max(r["peak"]["Total"] for r in ranks)

    base_peak = peak(runs["fsdp2"]) if "fsdp2" in runs else None
    base_rss = max(r["rss_growth"] for r in runs["fsdp2"]) if "fsdp2" in runs else None
    rows = []
    for variant, ranks in runs.items():
        p, rss = peak(ranks), max(r["rss_growth"] for r in ranks)
        if isinstance(p, (int, float)):
            p = mib(p) + (f" ({p / base_peak:.2f})" if isinstance(base_peak, (int, float))
                          else "")
        rows.append([variant, p or "-", mib(rss) + (f" ({rss / base_rss:.2f})" if base_rss
                                                     else ""),
                     mib(max(r["codec_state"] for r in ranks))])
    return rows


def memory_part(a) -> dict:
    runs = {}
    for v in a.variants or VARIANTS:
        _progress(f"[memory] {v} ...")
        runs[v] = run_ranks("bench.fsdp2", "memory_rank", a.world,
                            {"variant": v, "model": a.model}, netns=None, timeout_s=900,
                            threads_per_rank=a.threads, env=common.CACHE_OFF, stall_s=300)
    print(f"\n{a.model}: per-rank memory of a training step, {a.world} ranks (largest rank; "
          "ratio to fsdp2's)")
    print(common.table(memory_table(runs), ["variant", "FSDPMemTracker peak MiB",
                                            "max RSS growth MiB", "codec state MiB"]))
    return {"memory": runs}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--part", choices=("time", "loss", "memory", "hsdp"), default="time",
                    help="hsdp: the time part for HSDP on two nodes, 4 ranks")
    ap.add_argument("--model", choices=MODELS, default="gpt12m")
    ap.add_argument("--rates", nargs="+", default=["100", "1000"],
                    help="link rates in Mbit/s ('none': unshaped); time part")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps (time part, default 3) or training steps (loss, 40)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="loss part")
    ap.add_argument("--variants", nargs="+", default=None, choices=VARIANTS + HSDP_VARIANTS)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = ap.parse_args(argv)
    if a.part == "hsdp" or set(a.variants or ()) & set(HSDP_VARIANTS):
        a.world = 4  # 2 nodes x 2 ranks
    exit_cleanly_on_sigterm()
    params = num_parameters(a.model)
    print(f"{a.model}: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.1f} MiB fp32); "
          f"{a.world} FSDP ranks, batch {BATCH} x {BLOCK} tokens per rank (each its own); "
          f"codecs {HSDP_CODECS if a.part == 'hsdp' else CODECS}")
    try:
        results = {"time": time_part, "hsdp": time_part, "loss": loss_part,
                   "memory": memory_part}[a.part](a)
    except ShapingUnavailable as e:
        print(f"cannot shape the network: {e}", file=sys.stderr)
        return 2
    common.write_json(a.json, "fsdp2", {"model": a.model, "params": params, "world": a.world,
                                        "part": a.part, **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
