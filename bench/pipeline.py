"""Pipeline step time on a bandwidth-limited link (tc tbf): torch's own pipeline beside ccfx's
compressed stages, same schedule (1F1B), same model, same microbatches.

Every variant runs as real gloo ranks (OS processes) inside a fresh network namespace whose
loopback is limited with tc tbf (bench/shaped.py; needs root and iproute2).

Models:
  mlp4   4 x Linear(1024, 1024), ReLU between: 2 stages of 2 layers (the issue's baseline:
         batch 256 in 8 microbatches, a 32 x 1024 fp32 activation = 128 KiB per microbatch)
  mlp10  10 x Linear(1024, 1024) (10.5 M parameters), batch 256 in 8 microbatches
  gpt    the tiny GPT (4 layers, n_embd 256, block 64; 3.2 M parameters), batch 64 in 4
         microbatches: its 16 x 64 x 256 activation is 1 MiB per microbatch per direction

Variants (activation codec forward / backward):
  torch            torch.distributed.pipelining's PipelineStage on a hand split of the model
                   (model[:k], model[k:]): no ccfx at all, the baseline
  ccfx-none        ccfx's stages, identity codec (what ccfx costs when it compresses nothing)
  ccfx-int8        int8 both ways
  ccfx-int4        int4 both ways
  ccfx-psgd-bwd    none forward, powersgd:rank=16 backward (Optimus-CC's compressed backprop)
  ccfx-int8-psgd   int8 forward, powersgd:rank=16 backward
  ccfx-auto        the planner's choice per edge and direction (ccfx.planner), told the link's
                   rate (shaped) or measuring it with a probe (unshaped); its choices are
                   printed under the table

``--dp 2`` runs PP x DP on 4 ranks (a (dp, pp) mesh, each replica on its own data) with the
replicas' gradients through ``--gradient-codec``; "wire" then counts every rank's activation
and gradient-bucket bytes.

Per variant: 2 warm-up steps (compiling), then N timed steps; each rank times its steps after
a barrier; a step's time is its slowest rank's, and the table gives the median over steps. SGD lr 0.01 (MLP, MSE against a random
target) or AdamW 3e-3 (GPT, next-token loss on random tokens): "loss" is the last stage's mean
microbatch loss at the last step. Ratios are against ``torch`` in the same table ("x torch":
torch's step time over the variant's; above 1 is faster) and against the unshaped ``torch``
run when ``--rates`` includes ``none``.

    python -m bench.pipeline                                  # rates 100 1000, mlp4 and gpt
    python -m bench.pipeline --rates 100 none --models mlp10 --variants torch ccfx-int8
"""

from __future__ import annotations

import statistics
import sys
import time

from bench import common
from bench.shaped import (
    RankFailed,
    RankTimeout,
    ShapingUnavailable,
    exit_cleanly_on_sigterm,
    run_ranks,
    shaped_namespace,
)

CODECS = {"ccfx-none": ("none", "none"), "ccfx-int8": ("int8", "int8"),
          "ccfx-int4": ("int4", "int4"), "ccfx-psgd-bwd": ("none", "powersgd:rank=16"),
          "ccfx-int8-psgd": ("int8", "powersgd:rank=16"), "ccfx-auto": ("auto", "auto")}
VARIANTS = ("torch", *CODECS)
MODELS = {"mlp4": {"depth": 4, "batch": 256, "micro": 8},
          "mlp10": {"depth": 10, "batch": 256, "micro": 8},
          "gpt": {"batch": 64, "micro": 4}}
WIDTH = 1024


# ---------------------------------------------------------------------------------------------
# What one rank runs (imported by bench.shaped's worker inside the namespace).


def make_model(name: str, seed: int = 0):
    """The tiny GPT, or bench.data_parallel's He-initialised MLP of ``depth`` layers."""
    if name == "gpt":
        return common.tiny_gpt(seed)
    from bench.data_parallel import make_model as mlp

    return mlp(seed, width=WIDTH, depth=MODELS[name]["depth"])


def data(name: str, steps: int, seed: int = 1):
    import torch

    batch = MODELS[name]["batch"]
    if name == "gpt":
        return [common.gpt_batch(batch, seed + s) for s in range(steps)]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, WIDTH, generator=g), torch.randn(batch, WIDTH, generator=g))
            for _ in range(steps)]


def loss_fn(out, target):
    import torch.nn.functional as F

    if out.dim() == 3:
        return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))
    return F.mse_loss(out, target)


def _torch_stage(name: str, model, rank: int, world: int):
    """torch's own pipeline: a hand split (the Sequential's layers, or the GPT's blocks),
    plain PipelineStage, shapes inferred by torch at the first step."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    if name == "gpt":
        raise SystemExit("the torch baseline splits Sequential models only")
    layers = list(model)
    k = len(layers) // world
    k += k % 2  # keep each Linear with its ReLU
    part = nn.Sequential(*(layers[:k] if rank == 0 else layers[k:]))
    return PipelineStage(part, rank, world, "cpu"), part


def train_rank(rank: int, world_size: int, *, model: str, variant: str, steps: int,
               warmup: int = 2, lowering: str = "inductor", dp: int = 1,
               gradient_codec: str = "none", link_gbps: float | None = None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B

    import ccfx

    spec = MODELS[model]
    m = make_model(model)
    pp_world, rank, dp_rank, pp_group, dp_group = _mesh(rank, world_size, dp)
    batches = data(model, warmup + steps, seed=1 + dp_rank)
    micro = spec["micro"]
    example = batches[0][0].chunk(micro)[0]
    ledger, chosen = None, []
    if variant == "torch":
        if dp > 1:
            raise SystemExit("the torch baseline runs without --dp")
        stage, params = _torch_stage(model, m, rank, world_size)
        params = params.parameters()
    else:
        options = _ccfx_options(variant, pp_world, gradient_codec, lowering, micro, link_gbps)
        stage, ledger, chosen = _ccfx_stage(m, options, example, rank, pp_group, dp_group)
        params = stage.submod.parameters()
    world_size = pp_world
    opt = (torch.optim.AdamW(params, lr=3e-3) if model == "gpt"
           else torch.optim.SGD(params, lr=0.01))
    sched = Schedule1F1B(stage, n_microbatches=micro, loss_fn=loss_fn)
    is_first, is_last = rank == 0, rank == world_size - 1
    losses: list[float] = []

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        out: list = []
        sched.step(*((x,) if is_first else ()), target=y if is_last else None,
                   losses=out if is_last else None)
        if out:
            losses.append(statistics.mean(float(v.detach()) for v in out))
        if variant != "torch":
            ccfx.sync_grads([stage])  # the GPT's tied embedding / LM head
        opt.step()

    common.run_steps(lambda i: step(*batches[i]), warmup,
                     say=lambda i, _: _log(rank, f"{variant}: warm-up step {i}"))
    base = ledger.totals() if ledger is not None else (0, 0)
    dist.barrier()
    _, times = common.time_steps(lambda i: step(*batches[warmup + i]), steps,
                                 say=lambda i, _, s: _log(rank, f"{variant}: step {i} {s:.3f} s"))
    if ledger is not None:
        raw, wire = (b - a for a, b in zip(base, ledger.totals()))
    else:
        raw = wire = _raw_bytes(stage) * micro * steps
    return {"times": times, "losses": losses, "raw_bytes": raw / steps, "wire_bytes": wire / steps,
            "chosen": chosen}


def _mesh(rank: int, world_size: int, dp: int):
    """This rank in the pipeline: (pipeline ranks, stage, replica, pp group, dp group); with
    ``dp > 1`` (PP x DP) a (dp, pp) mesh, each replica training on its own data."""
    if dp <= 1:
        return world_size, rank, 0, None, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "pp"))
    return (world_size // dp, mesh.get_local_rank("pp"), mesh.get_local_rank("dp"),
            mesh.get_group("pp"), mesh.get_group("dp"))


def _ccfx_options(variant: str, stages: int, gradient_codec: str, lowering: str,
                  microbatches: int, link_gbps: float | None) -> dict:
    """The compile options of a ccfx variant: its activation codecs forward and backward
    (``ccfx-auto``: the planner's, told the link)."""
    fwd, bwd = CODECS[variant]
    options = {"stages": stages, "activation_codec": fwd, "activation_grad_codec": bwd,
               "gradient_codec": gradient_codec, "lowering": lowering}
    if variant == "ccfx-auto":
        options.update(auto_options(microbatches, link_gbps))
    return options


def _ccfx_stage(m, options: dict, example, rank: int, pp_group, dp_group):
    """This rank's stage of ``m`` compiled with ``options`` and planned at the microbatch
    shape of ``example``; the ledger that counts its bytes and the codecs the plan chose."""
    import torch

    import ccfx

    compiled = torch.compile(m, backend="ccfx", fullgraph=True, options=options)
    compiled(example)  # compiles and plans at the microbatch shape
    chosen = [(d.what, d.chosen) for d in ccfx.plan_of(compiled).graphs[0].decisions]
    stage = ccfx.build_stages(compiled, rank, "cpu", pp_group, dp_group=dp_group)[0]
    return stage, ccfx.ledger_of(compiled), chosen


def auto_options(microbatches: int, link_gbps: float | None) -> dict:
    """The planner's options on the shaped loopback (one token bucket for every rank: a shared
    medium); unshaped, the link is measured by a probe between the ranks."""
    if link_gbps is None:
        from ccfx.planner.probe import probe_link

        link = probe_link(shared=True)
        link_gbps, latency = link.gbps, link.latency_ms
    else:
        latency = 0.05
    return {"link_gbps": link_gbps, "link_latency_ms": latency, "link_shared": True,
            "microbatches": microbatches, "pipeline_schedule": "1F1B"}


def _raw_bytes(stage) -> int:
    """What torch's stage sends per microbatch: its activations forward, or its input
    gradients backward (the same sizes)."""
    metas = stage._stage_meta.outputs if not stage.is_last else stage._stage_meta.inputs
    return sum(m.dtype.itemsize * _numel(m.shape) for m in metas or ())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# What the parent computes.


def run_variant(model: str, variant: str, world: int, rate: float | None, steps: int,
                lowering: str, dp: int = 1, gradient_codec: str = "none") -> dict:
    env = common.CACHE_OFF
    t0 = time.perf_counter()
    try:
        with shaped_namespace(rate) as ns:
            ranks = run_ranks("bench.pipeline", "train_rank", world,
                              {"model": model, "variant": variant, "steps": steps,
                               "lowering": lowering, "dp": dp,
                               "gradient_codec": gradient_codec,
                               "link_gbps": rate / 1000 if rate else None},
                              netns=ns, timeout_s=900, env=env, stall_s=300)
    except (RankFailed, RankTimeout) as e:
        return {"variant": variant, "status": "fails", "reason": e.reason, "details": str(e)}
    last = ranks[-1]
    # A step ends when its slowest rank is done; the median over steps resists the outliers
    # a shared 2-core machine produces.
    per_step = common.slowest_per_step([r["times"] for r in ranks])
    return {"variant": variant, "status": "ok", "step_s": statistics.median(per_step),
            "loss": last["losses"][-1],
            "raw_bytes": sum(r["raw_bytes"] for r in ranks),
            "wire_bytes": sum(r["wire_bytes"] for r in ranks),
            "chosen": ranks[0].get("chosen", []), "wall_s": time.perf_counter() - t0}


HEADER = ["variant", "s/step", "x torch", "x torch unshaped", "wire MB/step (both ways)",
          "wire/raw", "loss", "loss vs torch"]


def table_rows(rows: list[dict], unshaped: dict | None) -> tuple[list[list[str]], list[str]]:
    base = next((r for r in rows if r["variant"] == "torch" and r["status"] == "ok"), None)
    out, notes = [], []
    for r in rows:
        if r["status"] != "ok":
            notes.append(f"({len(notes) + 1}) {r['variant']}: {r['reason']}")
            out.append([r["variant"], f"{r['status']} ({len(notes)})"] + [""] * 6)
            continue
        ratio = f"{base['step_s'] / r['step_s']:.2f}" if base else "-"
        vs_unshaped = f"{r['step_s'] / unshaped['step_s']:.2f}" if unshaped else "-"
        dloss = (f"{(r['loss'] - base['loss']) / base['loss']:+.2%}" if base else "-")
        out.append([r["variant"], f"{r['step_s']:.3f}", ratio, vs_unshaped,
                    f"{r['wire_bytes'] / 1e6:.2f}",
                    f"{r['wire_bytes'] / r['raw_bytes']:.3f}" if r["raw_bytes"] else "-",
                    f"{r['loss']:.4f}", dloss])
    return out, notes


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--rates", nargs="+", default=["100", "1000"],
                    help="link rates in Mbit/s ('none': unshaped); default 100 1000")
    ap.add_argument("--models", nargs="+", default=["mlp4", "gpt"], choices=list(MODELS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--lowering", choices=("inductor", "eager"), default="inductor")
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas (PP x DP on 2 x dp ranks; default 1)")
    ap.add_argument("--gradient-codec", default="none",
                    help="the replicas' gradient codec with --dp > 1 (default none)")
    a = ap.parse_args(argv)
    exit_cleanly_on_sigterm()
    rates = [None if r.lower() in ("none", "unshaped") else float(r) for r in a.rates]
    rates.sort(key=lambda r: (r is not None, r or 0))  # unshaped first: the reference
    results = []
    try:
        for model in a.models:
            unshaped = None
            for rate in rates:
                rows = []
                for v in a.variants:
                    if v == "torch" and (model == "gpt" or a.dp > 1):
                        continue  # a hand split needs a Sequential, and runs without DP
                    print(f"[{model}, {rate or 'unshaped'}] {v} ...", file=sys.stderr, flush=True)
                    rows.append(run_variant(model, v, 2 * a.dp, rate, a.steps, a.lowering,
                                            a.dp, a.gradient_codec))
                    r = rows[-1]
                    print(f"    {r['status']} " + (f"{r['step_s']:.3f} s/step" if r["status"] == "ok"
                                                   else r["reason"]), file=sys.stderr, flush=True)
                if rate is None:
                    unshaped = next((r for r in rows if r["status"] == "ok"), None)
                label = "unshaped" if rate is None else f"{rate:g} Mbit/s"
                print(f"\n{model}, {label}, 2 stages x {a.dp} replica(s) (gradients: "
                      f"{a.gradient_codec}), 1F1B, {MODELS[model]['batch']} "
                      f"samples in {MODELS[model]['micro']} microbatches, {a.steps} timed steps")
                cells, notes = table_rows(rows, unshaped)
                print(common.table(cells, HEADER))
                print("\n".join(notes), flush=True)
                results.append({"model": model, "rate_mbit": rate, "rows": rows})
    except ShapingUnavailable as e:
        print(f"cannot shape the network: {e}", file=sys.stderr)
        return 2
    common.write_json(a.json, "pipeline", {"results": results, "lowering": a.lowering})
    return 0


if __name__ == "__main__":
    sys.exit(main())
