"""``ccfx demo --dp N``: the tiny GPT trained data-parallel on N spawned gloo ranks.

Each rank holds the whole model and its own shard of every batch (a different stream of
the corpus per rank); ccfx averages the gradients inside the compiled backward. Two runs from
the same initialisation on the same batches: gradients uncompressed (codec ``none``) and
through a gradient codec (``powersgd:rank=4,ef`` by default). The report gives each run's loss
(the mean over ranks at every step), step time, and the gradient bytes each rank put on the
wire per step, from the ledger.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import ccfx

from .demo_common import DEMO_LR, RunResult, demo_model_config

DP_CODEC = "powersgd:rank=4,ef"


@dataclass
class DPDemoResult:
    runs: list[RunResult]
    plan: ccfx.Plan  # the compressed run's plan (rank 0)
    world: int
    batch_per_rank: int
    num_parameters: int
    seed: int


def _rank_main(rank: int, world: int, steps: int, batch_per_rank: int, codecs: list,
               lowering: str, seed: int, lr: float, model: dict | None = None,
               eval_batches: int = 0):
    """One rank: train once per codec (a gradient codec spec, or a dict of local-step options
    with an optional ``name``); per step the loss averaged over ranks, the step time and the
    gradient or pseudo-gradient bytes this rank sent; at the end the held-out loss."""
    import torch.distributed as dist

    from ccfx.models import CharTokenizer, TinyGPT, batches, load_corpus

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    config = demo_model_config(tokenizer.vocab_size)
    if model:
        import dataclasses

        config = dataclasses.replace(config, **model)
    held_out = [next(batches(data, 16, config.block_size, 10_000 + seed * 7 + i))
                for i in range(eval_batches)]
    out = []
    for codec in codecs:
        torch.manual_seed(seed)
        gpt = TinyGPT(config)
        local = isinstance(codec, dict)  # local steps: {"sync_every": H, "outer_codec": ...}
        options = ({k: v for k, v in codec.items() if k != "name"} if local
                   else {"data_parallel": True, "gradient_codec": codec})
        compiled = torch.compile(gpt, backend="ccfx", fullgraph=True,
                                 options={**options, "lowering": lowering})
        opt = torch.optim.AdamW(gpt.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        outer = ccfx.local_steps(compiled, opt) if local else None
        channel = "outer" if local else "bucket"
        stream = batches(data, batch_per_rank, config.block_size, seed * 1000 + rank)
        losses, times, raw, wire = [], [], [], []
        seen = (0.0, 0.0)
        for _ in range(steps):
            x, y = next(stream)
            dist.barrier()
            t0 = time.perf_counter()
            _, loss = compiled(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
            opt.step()
            times.append(time.perf_counter() - t0)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            ledger = ccfx.ledger_of(compiled)
            now = ledger.totals(channel)
            raw.append(now[0] - seen[0])
            wire.append(now[1] - seen[1])
            seen = now
        if outer is not None:
            outer.close()
        name = codec.get("name", f"local steps {codec}") if local else (
            "uncompressed (none)" if codec == "none" else codec)
        out.append({"name": name, "losses": losses, "times": times, "raw": raw, "wire": wire,
                    "plan": ccfx.plan_of(compiled).to_json() if rank == 0 else None,
                    "params": gpt.num_parameters(), "eval": _evaluate(gpt, held_out)})
    return out


def _evaluate(model, held_out) -> float:
    """The mean loss on held-out batches (the same on every rank), without compilation."""
    with torch.no_grad():
        return sum(model(x, y)[1].item() for x, y in held_out) / max(len(held_out), 1)


def run_dp_demo(world: int = 2, steps: int = 120, codec: str | list = DP_CODEC,
                batch_per_rank: int = 8, lowering: str = "eager", seed: int = 0,
                lr: float = DEMO_LR, timeout_s: float = 1800,
                model: dict | None = None, eval_batches: int = 0) -> DPDemoResult:
    """Spawn ``world`` ranks; train uncompressed, then with each codec in ``codec`` (a
    gradient codec spec, or a dict of local-step options such as ``{"sync_every": 50,
    "outer_codec": "int8", "name": "H=50 int8"}``). ``model``: GPTConfig fields to change (a
    smaller GPT for tests); ``eval_batches``: held-out batches of 16 scored after training."""
    from .runtime.launch import spawn

    codecs = ["none", *([codec] if isinstance(codec, (str, dict)) else codec)]
    for spec in codecs:  # this process prints the plan: it shows the specs as written
        if isinstance(spec, str):
            ccfx.codecs.canonical_as_written(spec)
    results = spawn(_rank_main, world, (steps, batch_per_rank, codecs, lowering, seed, lr, model,
                                        eval_batches),
                    timeout_s=timeout_s, pg_timeout_s=300.0)
    rank0 = results[0]
    runs = []
    for i, run in enumerate(rank0):
        # the slowest rank sets the pace of a synchronous step
        times = [max(r[i]["times"][s] for r in results) for s in range(steps)]
        runs.append(RunResult(name=run["name"], losses=run["losses"], step_times=times,
                              raw_bytes=run["raw"], wire_bytes=run["wire"],
                              eval_loss=run["eval"] if eval_batches else None))
    return DPDemoResult(runs=runs, plan=ccfx.Plan.from_json(rank0[-1]["plan"]), world=world,
                        batch_per_rank=batch_per_rank, num_parameters=rank0[0]["params"],
                        seed=seed)


def format_dp_demo(result: DPDemoResult, last: int = 10) -> str:
    from .plan import human_bytes

    out = [(f"tiny GPT, {result.num_parameters / 1e6:.2f} M parameters, data parallel on "
           f"{result.world} gloo ranks, {result.batch_per_rank} sequences per rank per step, "
           f"seed {result.seed}"), "", str(result.plan), "",
           (f"loss (mean over ranks; mean of the last {last} steps) and time per step "
           "(slowest rank, median after the first step):")]
    width = max(len(r.name) for r in result.runs)
    # Over every step: a local-steps run sends only at its syncs.
    base_wire = sum(result.runs[0].wire_bytes) / max(len(result.runs[0].wire_bytes), 1)
    for r in result.runs:
        wire = sum(r.wire_bytes) / max(len(r.wire_bytes), 1)
        out.append(f"  {r.name.ljust(width)}  loss {r.final_loss(last):.4f}   "
                   f"{r.steady_step_s * 1000:5.0f} ms/step (first {r.first_step_s:.1f} s)   "
                   f"{human_bytes(wire)} per rank per step"
                   + (f" ({base_wire / wire:.0f}x less than uncompressed)"
                      if wire and base_wire / wire > 1.01 else ""))
    base, comp = result.runs[0], result.runs[-1]
    gap = comp.final_loss(last) - base.final_loss(last)
    if comp.eval_loss is not None and base.eval_loss is not None:
        egap = comp.eval_loss - base.eval_loss
        out.append(f"  held-out loss after the last step: {base.eval_loss:.4f} uncompressed, "
                   f"{comp.eval_loss:.4f} {comp.name} ({egap / base.eval_loss:+.1%})")
    out.append(f"  difference (compressed - uncompressed): {gap:+.4f} "
               f"({gap / base.final_loss(last):+.1%}); one seed's difference is not the codec's "
               "effect: compare with the spread over seeds (README)")
    return "\n".join(out)


def write_dp_report(result: DPDemoResult, path):
    from ccfx.viz.report import write_report

    notes = [(f"TinyGPT, {result.num_parameters / 1e6:.2f} M parameters, data parallel on "
             f"{result.world} ranks; losses are the mean over ranks.")]
    return write_report(path, result.plan, losses={r.name: r.losses for r in result.runs},
                        wire_per_step={r.name: r.wire_bytes for r in result.runs},
                        title="ccfx demo --dp", notes=notes)
