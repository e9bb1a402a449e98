"""The main job: train the tiny GPT with compressed pipeline cuts beside an uncompressed baseline.

Two identical copies of ``TinyGPT`` (same initialisation, same batches, same optimiser) train for
``steps`` steps on the embedded corpus:

* the baseline: the plain eager model (``baseline="eager"``, the default), or the model compiled
  by ccfx with the same stages and lowering but the identity codec (``baseline="ccfx"``);
* the compressed model: ``torch.compile(model, backend="ccfx", options={"stages": stages,
  "activation_codec": codec, "lowering": lowering}, fullgraph=True)``. On one process this runs
  the whole model with every cut edge's codec applied as a round trip, forward and backward.

``format_demo`` prints the plan, both loss curves' final values and the wire saving.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import ccfx
from ccfx.models import CharTokenizer, GPTConfig, TinyGPT, batches, load_corpus
from ccfx.viz.progress import progress as progress_bar

from .demo_common import (
    BASELINES,
    DEMO_BATCH_SIZE,
    DEMO_LR,
    DEMO_STEPS,
    DP_DEMO_STEPS,
    RunResult,
    demo_model_config,
)
from .plan import human_bytes


@dataclass
class DemoResult:
    baseline: RunResult
    compressed: RunResult
    compiled: nn.Module  # the compressed model as torch.compile returned it: ccfx.plan_of(it)
    options: dict
    baseline_kind: str
    model_config: GPTConfig
    num_parameters: int
    batch_size: int
    seed: int
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model_config.block_size


def ccfx_compile(model: nn.Module, **options) -> nn.Module:
    return torch.compile(model, backend="ccfx", options=options, fullgraph=True)


def train(
    model: nn.Module,
    data: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    block_size: int,
    seed: int,
    lr: float = DEMO_LR,
    name: str = "train",
    progress: bool = True,
    device: str | torch.device | None = None,
) -> RunResult:
    """AdamW at a fixed learning rate, gradient norm clipped at 1; batches drawn from ``seed``
    (on the CPU, then moved to ``device`` when given: the same batches on every device)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    params = [p for g in opt.param_groups for p in g["params"]]
    stream = batches(data, batch_size, block_size, seed)
    losses: list[float] = []
    times: list[float] = []
    raw_per_step: list[int] = []
    wire_per_step: list[int] = []
    ledger, seen = None, (0, 0)
    bar = progress_bar(range(steps), desc=name, disable=None if progress else True, leave=True)
    for _ in bar:
        x, y = next(stream)
        if device is not None:
            x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = loss.item()
        times.append(time.perf_counter() - t0)
        losses.append(value)
        if ledger is None:
            ledger = _ledger_or_none(model)
        if ledger is not None:
            now = ledger.totals()
            raw_per_step.append(now[0] - seen[0])
            wire_per_step.append(now[1] - seen[1])
            seen = now
        bar.set_postfix(loss=f"{value:.3f}")
    bar.close()
    return RunResult(name=name, losses=losses, step_times=times, raw_bytes=raw_per_step,
                     wire_bytes=wire_per_step)


def _ledger_or_none(model):
    try:
        return ccfx.ledger_of(model)
    except ccfx.CcfxError:
        return None  # not compiled by ccfx (the eager baseline, or an injected compile_fn)


def run_demo(
    steps: int = DEMO_STEPS,
    stages: int = 4,
    codec: str = "int8",
    batch_size: int = DEMO_BATCH_SIZE,
    lowering: str = "eager",
    seed: int = 0,
    progress: bool = True,
    compile_fn: Callable[[nn.Module], nn.Module] | None = None,
    baseline: str = "eager",
    model_config: GPTConfig | None = None,
    lr: float = DEMO_LR,
    device: str | torch.device = "cpu",
) -> DemoResult:
    """Train the baseline and the ccfx-compressed tiny GPT from the same init on the same batches.

    compile_fn: replaces the ccfx compilation (called with the model, returns what to train); it
        is used for the compressed model and, with ``baseline="ccfx"``, for the baseline too.
        For tests and experiments.
    baseline: "eager" (the plain model) or "ccfx" (ccfx with the same stages and lowering and
        the identity codec "none").
    model_config: the GPT to train; by default ``demo_model_config`` with the corpus's vocabulary.
    device: where both models train ("cpu", "cuda"); initialised on the CPU first, so every
        device starts from the same weights. On CUDA the codecs run their Triton kernels.
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r} is not valid; choose one of {', '.join(BASELINES)}")
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    config = model_config or demo_model_config(tokenizer.vocab_size)
    if config.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model vocab_size={config.vocab_size} is smaller than the corpus's "
            f"{tokenizer.vocab_size} characters"
        )
    options = {"stages": stages, "activation_codec": codec, "lowering": lowering}
    ccfx.Config.from_options(options)  # a typo fails now, not after the baseline's whole run

    torch.manual_seed(seed)
    base_model = TinyGPT(config).to(device)
    num_parameters = base_model.num_parameters()
    base_run_model, base_name, compiled = _demo_models(base_model, options, baseline, compile_fn)

    common = {
        "data": data, "steps": steps, "batch_size": batch_size, "block_size": config.block_size,
        "seed": seed, "lr": lr, "progress": progress, "device": device,
    }
    base_run = train(base_run_model, name=base_name, **common)
    comp_run = train(compiled, name=f"ccfx {stages} stages, {codec}", **common)
    return DemoResult(
        baseline=base_run,
        compressed=comp_run,
        compiled=compiled,
        options=options,
        baseline_kind=baseline,
        model_config=config,
        num_parameters=num_parameters,
        batch_size=batch_size,
        seed=seed,
    )


def _demo_models(base_model: nn.Module, options: dict, baseline: str,
                 compile_fn: Callable[[nn.Module], nn.Module] | None
                 ) -> tuple[nn.Module, str, nn.Module]:
    """The baseline to train (eager, or ccfx without a codec) and its name, and the
    compressed model compiled from a copy of the same init (deepcopy keeps the tying)."""
    comp_model = copy.deepcopy(base_model)  # same init; deepcopy keeps the weight tying

    def compile_with(model: nn.Module, opts: dict) -> nn.Module:
        return compile_fn(model) if compile_fn is not None else ccfx_compile(model, **opts)

    if baseline == "ccfx":
        base_run_model = compile_with(base_model, {**options, "activation_codec": "none"})
        base_name = f"baseline (ccfx {options['stages']} stages, no codec)"
    else:
        base_run_model = base_model
        base_name = "baseline (eager, uncompressed)"
    return base_run_model, base_name, compile_with(comp_model, options)


def format_demo(result: DemoResult, last: int = 10) -> str:
    """The report: model, plan, final losses of both runs, timings and the wire saving."""
    import ccfx

    plan = ccfx.plan_of(result.compiled)
    ledger = ccfx.ledger_of(result.compiled)
    cfg = result.model_config
    out = [
        (
            f"tiny GPT: {result.num_parameters / 1e6:.2f} M parameters ({cfg.n_layer} layers, "
            f"width {cfg.n_embd}, {cfg.n_head} heads, context {cfg.block_size}, "
            f"vocabulary {cfg.vocab_size}), tied embedding / LM head"
        ),
        (
            f"{len(result.compressed.losses)} steps of {result.batch_size} x {cfg.block_size} "
            f"tokens, options {result.options}"
        ),
        "",
        str(plan),
        "",
        f"loss (mean of the last {last} steps; first step {result.baseline.losses[0]:.3f}):",
    ]
    rows = [
        (r.name, r.final_loss(last), r.total_s, r.first_step_s, r.steady_step_s)
        for r in (result.baseline, result.compressed)
    ]
    width = max(len(r[0]) for r in rows)
    for name, loss, total, first, steady in rows:
        out.append(
            f"  {name.ljust(width)}  {loss:.4f}   {total:6.1f} s total, first step {first:.2f} s, "
            f"then {steady * 1000:.0f} ms/step"
        )
    gap = result.compressed.final_loss(last) - result.baseline.final_loss(last)
    out.append(f"  difference (compressed - baseline): {gap:+.4f}")
    points = min(12, len(result.baseline.losses))
    out.append(f"loss curve (mean over {points} consecutive windows of the run):")
    for r, label in ((result.baseline, "baseline"), (result.compressed, "ccfx")):
        out.append(f"  {label:<8}  " + " ".join(f"{v:.2f}" for v in r.curve(points)))

    # Wire bytes per training step, as the ledger counted them while the compressed model ran:
    # every cut edge once per hop, forward activations and backward gradients.
    out += ["", f"wire per step (counted over {ledger.steps} steps, every cut edge and hop):"]
    raw_fwd, wire_fwd = ledger.per_step("fwd")
    raw_bwd, wire_bwd = ledger.per_step("bwd")
    raw, wire = raw_fwd + raw_bwd, wire_fwd + wire_bwd
    for label, r, w in (("forward ", raw_fwd, wire_fwd), ("backward", raw_bwd, wire_bwd),
                        ("total   ", raw, wire)):
        if r:
            out.append(
                f"  {label} {human_bytes(r):>10} raw -> {human_bytes(w):>10} on the wire "
                f"({w / r:.3f} of raw, {r / max(w, 1):.2f}x less)"
            )
    if not raw:
        out.append("  nothing crossed a stage boundary")
    return "\n".join(out)


def add_arguments(parser) -> None:
    """``ccfx demo`` options (an argparse parser or subparser)."""
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps per run (default {DEMO_STEPS}; with --dp "
                             f"{DP_DEMO_STEPS}, so its two runs on N ranks fit in two minutes "
                             "on 2 cores)")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages")
    parser.add_argument("--codec", default="int8", help="activation codec spec (default int8)")
    parser.add_argument("--batch-size", type=int, default=DEMO_BATCH_SIZE)
    parser.add_argument("--lowering", choices=("eager", "inductor"), default="eager",
                        help="what runs the partitioned graphs (eager compiles fastest)")
    parser.add_argument("--baseline", choices=BASELINES, default="eager",
                        help="eager: the plain model; ccfx: same stages, identity codec")
    parser.add_argument("--lr", type=float, default=DEMO_LR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu",
                        help="where the single-process demo trains: cpu (default) or cuda "
                             "(codecs run their Triton kernels there); not with --dp")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bars")
    parser.add_argument("--report", default=None, metavar="PATH",
                        help=f"self-contained HTML report to write (default {REPORT}, with "
                             f"--dp {DP_REPORT}; '' for none)")
    parser.add_argument("--dp", type=int, default=0, metavar="N",
                        help="train data-parallel on N spawned gloo ranks instead (gradient "
                             "codec beside uncompressed; --stages and --codec do not apply)")
    parser.add_argument("--gradient-codec", default=None,
                        help="with --dp: the gradient codec (default powersgd:rank=4,ef)")
    parser.add_argument("--sync-every", type=int, default=None, metavar="H",
                        help="with --dp: local steps instead of a gradient codec (H optimizer "
                             "steps per replica between syncs, DiLoCo), beside per-step DP")
    parser.add_argument("--outer-codec", default="int8",
                        help="with --sync-every: the pseudo-gradient codec (default int8)")


#: Where each demo writes its report unless --report says otherwise: one file per demo, so
#: ``ccfx demo --dp`` does not overwrite the pipeline demo's.
REPORT = "ccfx-demo-report.html"
DP_REPORT = "ccfx-demo-dp-report.html"


def report_path(args) -> str:
    """The report file for parsed demo arguments: --report, else the demo's own default."""
    if args.report is not None:
        return args.report
    return DP_REPORT if getattr(args, "dp", 0) else REPORT


def _main_dp(args) -> int:
    from .demo_dp import DP_CODEC, format_dp_demo, run_dp_demo, write_dp_report

    if args.dp < 1:
        raise SystemExit("--dp takes the number of ranks, at least 1")
    if getattr(args, "device", "cpu") != "cpu":
        raise SystemExit("--device applies to the single-process demo: --dp trains on gloo "
                         "ranks on the CPU")
    steps = args.steps if args.steps is not None else DP_DEMO_STEPS
    codec = args.gradient_codec or DP_CODEC
    if args.sync_every is not None:
        if args.gradient_codec:
            raise SystemExit("--sync-every and --gradient-codec are two ways to sync: pick one")
        codec = {"name": f"local steps H={args.sync_every} {args.outer_codec}",
                 "sync_every": args.sync_every, "outer_codec": args.outer_codec,
                 "outer_lr": 1.0, "outer_momentum": 0.0}
    # a codec typo fails here, before the ranks start and train the uncompressed run
    ccfx.Config.from_options({"data_parallel": True, "gradient_codec": codec}
                             if isinstance(codec, str) else
                             {k: codec[k] for k in ("sync_every", "outer_codec")})
    result = run_dp_demo(world=args.dp, steps=steps, codec=codec,
                         batch_per_rank=max(args.batch_size // args.dp, 1),
                         lowering=args.lowering, seed=args.seed, lr=args.lr,
                         eval_batches=4 if args.sync_every is not None else 0)
    print(format_dp_demo(result))
    if report_path(args):
        path = write_dp_report(result, report_path(args))
        print(f"\nreport: {path} (plan with gradient buckets, loss curves, wire bytes per step)")
    return 0


def main(args) -> int:
    """Run the demo from parsed ``add_arguments`` options and print the report."""
    if getattr(args, "dp", 0):
        return _main_dp(args)
    steps = args.steps if args.steps is not None else DEMO_STEPS
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    result = run_demo(
        steps=steps, stages=args.stages, codec=args.codec, batch_size=args.batch_size,
        lowering=args.lowering, seed=args.seed, progress=args.progress, baseline=args.baseline,
        lr=args.lr, device=args.device,
    )
    print(format_demo(result))
    if report_path(args):
        path = write_demo_report(result, report_path(args))
        print(f"\nreport: {path} (plan, drawing, loss curves, wire bytes per step)")
    return 0


def write_demo_report(result: DemoResult, path):
    """The HTML report of a demo run: plan, drawing, both loss curves, wire bytes per step."""
    from ccfx.viz.report import write_report

    comp = result.compressed
    wire = {f"on the wire ({result.options['activation_codec']})": comp.wire_bytes,
            "uncompressed": comp.raw_bytes}
    notes = [
        (f"TinyGPT, {result.num_parameters / 1e6:.2f} M parameters, {result.batch_size} x "
         f"{result.model_config.block_size} tokens per step, seed {result.seed}."),
        (f"Final loss (mean of the last 10 steps): {result.baseline.name} "
         f"{result.baseline.final_loss():.3f}; {comp.name} {comp.final_loss():.3f}."),
    ]
    return write_report(path, result.compiled,
                        losses={result.baseline.name: result.baseline.losses,
                                comp.name: comp.losses},
                        wire_per_step=wire, title="ccfx demo", notes=notes)


if __name__ == "__main__":
    import argparse

    _parser = argparse.ArgumentParser(prog="python -m ccfx.demo", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
