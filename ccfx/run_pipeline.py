"""``ccfx run``: train a model as a real pipeline (× data parallel) on local gloo ranks.

    ccfx run --nproc 2 --stages 2 --codec int8                  # the tiny GPT, 2 stages
    ccfx run --nproc 4 --stages 2 --dp 2 --gradient-codec powersgd:rank=4,ef
    ccfx run --nproc 2 --stages 4 --schedule Interleaved1F1B mypkg.models:factory
    ccfx run --nproc 2 --stages 2 --trace trace.json           # trace.rank0.json, …

torchrun starts ``--nproc`` ranks (gloo on 127.0.0.1); ranks form a ``(dp, pp)`` DeviceMesh
(``nproc = dp × stages / stages-per-rank``). Each rank compiles the model with
``backend="ccfx"``, builds its stages (``ccfx.build_stages``), and trains ``--steps`` steps
under torch's schedule, summing tied weights and averaging over its replicas with
``ccfx.sync_grads``. Rank 0 prints the plan; the last stage's rank of replica 0 prints, per
step, the loss, the step time and the bytes each link carried (from the ledgers of every rank).

The default model is the tiny GPT on the bundled corpus (next-character loss). A
``module:factory`` returns ``(model, example_inputs)`` as for ``ccfx viz``; ccfx then trains on
that example batch against ``mean(output²)``, a stand-in objective for timing the pipeline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")


def add_arguments(p) -> None:
    p.add_argument("factory", nargs="?", default=None,
                   help="module:factory returning (model, example_inputs); default the tiny GPT")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    p.add_argument("--stages", type=int, default=None,
                   help="pipeline stages (default: nproc / dp, one per rank)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--codec", default="none", help="activation codec, forward (default none)")
    p.add_argument("--grad-codec", default=None,
                   help="activation gradient codec, backward (default: --codec)")
    p.add_argument("--gradient-codec", default="none",
                   help="data-parallel gradient codec (with --dp > 1; default none)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="the link's Gbit/s for 'auto' codecs (default: measured by a probe "
                        "between ranks 0 and 1)")
    p.add_argument("--link-latency-ms", type=float, default=None)
    p.add_argument("--schedule", choices=SCHEDULES, default="1F1B")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="samples per replica per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lowering", choices=("eager", "inductor"), default="eager")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="write a Chrome/Perfetto trace per rank (PATH with .rankN inserted)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds any collective may wait before the ranks fail (default 600)")
    p.add_argument("--worker", action="store_true", help="(internal) run as one rank")


def main(args) -> int:
    if args.worker:
        return _rank_main(args)
    if args.nproc % args.dp:
        print(f"ccfx run: --nproc {args.nproc} is not a multiple of --dp {args.dp}",
              file=sys.stderr)
        return 2
    pp = args.nproc // args.dp
    if args.stages is not None and args.stages % pp:
        print(f"ccfx run: {args.stages} stages cannot be shared evenly by {pp} pipeline ranks "
              f"(--nproc {args.nproc} / --dp {args.dp}): give --stages a multiple of {pp}",
              file=sys.stderr)
        return 2
    per_rank = (args.stages or pp) // pp
    if per_rank > 1 and args.schedule in ("GPipe", "1F1B"):
        print(f"ccfx run: {args.stages} stages on {pp} pipeline ranks put {per_rank} stages on "
              f"each rank, and --schedule {args.schedule} runs one stage per rank: use "
              "--schedule Interleaved1F1B (or ZBVZeroBubble, DualPipeV), or --stages "
              f"{pp}", file=sys.stderr)
        return 2
    _check_options(args, pp)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "ccfx.cli", "run", "--worker",
           *_forward(args)]
    return subprocess.call(cmd)


def _check_options(args, pp: int) -> None:
    """The ranks' options checked here, before torchrun starts them: a codec typo is then one
    ConfigError line (``ccfx`` prints it), not every rank's traceback under torchrun's
    ChildFailedError. ``auto`` without --link-gbps gets a stand-in link: the ranks probe it."""
    from ccfx.config import Config
    from ccfx.runtime.pipeline import check_microbatches

    check_microbatches(f"--schedule {args.schedule}", args.microbatches, args.stages or pp)
    codecs = (args.codec, args.grad_codec or args.codec, args.gradient_codec)
    link = {"link_gbps": 1.0} if "auto" in codecs and args.link_gbps is None else {}
    Config.from_options({"stages": args.stages or pp, "activation_codec": codecs[0],
                         "activation_grad_codec": codecs[1], "gradient_codec": codecs[2],
                         "lowering": args.lowering, **link})


def _forward(args) -> list[str]:
    out = []
    for key in ("stages", "dp", "codec", "grad_codec", "gradient_codec", "link_gbps",
                "link_latency_ms", "schedule",
                "microbatches", "batch_size", "steps", "lowering", "lr", "trace", "timeout"):
        v = getattr(args, key)
        if v is not None:
            out += [f"--{key.replace('_', '-')}", str(v)]
    return out + ([args.factory] if args.factory else [])


def _model_and_data(factory: str | None, batch: int, seed: int, rank_in_dp: int):
    import torch
    import torch.nn.functional as F

    if factory is None:
        from ccfx.demo import demo_model_config
        from ccfx.models import CharTokenizer, TinyGPT, batches, load_corpus

        text = load_corpus()
        tok = CharTokenizer(text)
        cfg = demo_model_config(tok.vocab_size)
        torch.manual_seed(seed)
        model = TinyGPT(cfg)
        stream = batches(tok.encode(text), batch, cfg.block_size, 1000 * seed + rank_in_dp)

        def loss_fn(logits, target):
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))

        return model, (lambda: next(stream)), loss_fn
    from ccfx.viz.cli import load_factory

    torch.manual_seed(seed)
    model, example = load_factory(factory)()
    x = example[0] if isinstance(example, (tuple, list)) else example

    def loss_fn(out, target):
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.float().pow(2).mean()

    return model, (lambda: (x, torch.zeros(()))), loss_fn


def _rank_main(args) -> int:
    """One rank of ``ccfx run``: compile the model on the (dp, pp) mesh, build its stages,
    train ``args.steps`` steps under the schedule, and print each step from one rank."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import schedules

    import ccfx

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    world, rank = dist.get_world_size(), dist.get_rank()
    pp_size = world // args.dp
    stages = args.stages or pp_size
    mesh = init_device_mesh("cpu", (args.dp, pp_size), mesh_dim_names=("dp", "pp"))
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    model, next_batch, loss_fn = _model_and_data(args.factory, args.batch_size, 0, dp_rank)
    options, auto = _compile_options(args, stages)
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options=options)
    x, y = next_batch()
    compiled(x.chunk(args.microbatches)[0])
    if rank == 0:
        print(ccfx.plan_of(compiled), flush=True)
    style = "v" if args.schedule in ("ZBVZeroBubble", "DualPipeV") else "loop"
    built = ccfx.build_stages(compiled, pp_rank, "cpu", pp, style=style,
                              dp_group=dp if args.dp > 1 else None)
    ledger = ccfx.ledger_of(compiled)
    if auto and rank == 0:
        print(ccfx.explain(compiled), flush=True)
    del compiled, model
    cls = getattr(schedules, f"Schedule{args.schedule}")
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    sched = cls(built[0] if single else built, n_microbatches=args.microbatches, loss_fn=loss_fn)
    prof = _train(args, sched, built, ledger, next_batch, (x, y), dp_rank == 0)
    if prof is not None:
        prof.stop()
        path = _rank_path(args.trace, rank)
        prof.export_chrome_trace(path)
        print(f"rank {rank}: trace written to {path}", flush=True)
    dist.destroy_process_group()
    return 0


def _compile_options(args, stages: int) -> tuple[dict, bool]:
    """The backend's options from the command line, and whether a codec is ``auto`` (then
    the links, the microbatches and the schedule are the planner's too)."""
    options = {"stages": stages, "activation_codec": args.codec,
               "activation_grad_codec": args.grad_codec or args.codec,
               "gradient_codec": args.gradient_codec, "lowering": args.lowering}
    auto = "auto" in (options["activation_codec"], options["activation_grad_codec"],
                      options["gradient_codec"])
    if auto:
        options.update(_link_options(args), microbatches=args.microbatches)
        if args.schedule in ("1F1B", "GPipe"):
            options["pipeline_schedule"] = args.schedule
    return options, auto


def _train(args, sched, built, ledger, next_batch, first_batch: tuple, dp_leader: bool):
    """The training steps: each timed from a barrier, gradients synced, the optimizer
    stepped; the last stage's first replica prints the loss, the slowest rank's time and
    the bytes per link of all ranks. Returns the profiler (``--trace``) to stop, or None."""
    import torch
    import torch.distributed as dist

    import ccfx

    world = dist.get_world_size()
    x, y = first_batch
    params = [p for s in built for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr)
    first, last = any(s.is_first for s in built), any(s.is_last for s in built)
    reporter = last and dp_leader
    prof = _profiler(args.trace)
    seen = _links(ledger)
    for step in range(args.steps):
        if step:
            x, y = next_batch()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        losses: list = []
        sched.step(*((x,) if first else ()), target=y if last else None,
                   losses=losses if last else None)
        ccfx.sync_grads(built)
        opt.step()
        elapsed = time.perf_counter() - t0
        if prof is not None:
            prof.step()
        now = _links(ledger)
        sent = {k: (v[0] - seen.get(k, (0, 0))[0], v[1] - seen.get(k, (0, 0))[1])
                for k, v in now.items()}
        seen = now
        gathered = [None] * world
        dist.all_gather_object(gathered, (elapsed, sent))
        if reporter:
            loss = sum(float(v.detach()) for v in losses) / len(losses)
            print(format_step(step, loss, max(g[0] for g in gathered), _sum_links(gathered),
                              args.microbatches), flush=True)
    return prof


def _sum_links(gathered: list) -> dict[str, list[int]]:
    """Per link, the raw and wire bytes of one step summed over the ranks' reports."""
    links: dict[str, list[int]] = {}
    for _, per_rank in gathered:
        for k, (raw, wire) in per_rank.items():
            acc = links.setdefault(k, [0, 0])
            acc[0] += raw
            acc[1] += wire
    return links


def format_step(step: int, loss: float, seconds: float, links, microbatches: int) -> str:
    """One step's line: the loss, the slowest rank's time and, per link, the KiB it carried
    over the whole step (every microbatch's messages; gradient buckets once per step), on the
    wire / raw: the same unit as the plan's byte counts."""
    text = "  ".join(f"{k} {w / 1024:.1f}/{r / 1024:.1f}" for k, (r, w) in sorted(links.items()))
    return (f"step {step:3d}  loss {loss:.4f}  {seconds:.3f} s  KiB per step "
            f"({microbatches} microbatch{'es' if microbatches != 1 else ''}), wire/raw per "
            f"link: {text}")


def _link_options(args) -> dict:
    """The link for 'auto': as given, or measured between ranks 0 and 1 (every rank probes
    together, rank 0's answer for all)."""
    if args.link_gbps is not None:
        return {"link_gbps": args.link_gbps,
                **({"link_latency_ms": args.link_latency_ms} if args.link_latency_ms else {})}
    from ccfx.planner import probe_link

    link = probe_link()
    return {"link_gbps": link.gbps, "link_latency_ms": args.link_latency_ms or link.latency_ms}


def _links(ledger) -> dict[str, tuple[int, int]]:
    """Bytes per link so far: ``stage a->b fwd`` / ``bwd``, and data-parallel buckets."""
    out: dict[str, list[int]] = {}
    for c in ledger.entries():
        key = ("dp buckets" if c.direction == "bucket" else
               f"{c.hop[0]}->{c.hop[1]} {c.direction}")
        acc = out.setdefault(key, [0, 0])
        acc[0] += c.raw_bytes
        acc[1] += c.wire_bytes
    return {k: (v[0], v[1]) for k, v in out.items()}


def _rank_path(path: str, rank: int) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def _profiler(trace: str | None):
    if trace is None:
        return None
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
    prof.start()
    return prof

