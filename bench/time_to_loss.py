"""Time to a target loss (issue 19 item 4): T = steps to the target x steady step time, measured
the Protocol NanoGPT speedrun's way (a loss run without the slow link, a timing run over it).

Model: the tiny GPT with 8 blocks (width 128, 4 heads, context 64, 1.61 M parameters), one
block per stage, 8 stages (``split_points`` blocks.1 .. blocks.7: stage 0 also holds the
embeddings, stage 7 the final norm and the head, tied to the embedding).

Loss run: ccfx's exact single-process simulation (``stages=8`` in one process, eager lowering:
every cut edge's codec runs as a round trip, forward on the activations and backward on their
gradients, the numbers 8 pipeline ranks would see), AdamW at 3e-3, batches of 16 x 64 tokens,
``--steps`` steps per run, every variant of a seed from the seed's initialisation and batches.
Steps to the target as ``bench.convergence`` defines them: the smoothed loss (trailing mean of
``--smooth`` steps) first at or under none's smoothed loss at ``--target-at`` of the run, per
seed; "steps x" is the steps over none's on the same seed, mean ± std over seeds.

Timing run: the planner's simulation (``ccfx.planner.PipelineModel``): each stage's forward
and backward timed on this machine at the microbatch shape (``profile_stages``, eager, one
thread), each stage's AdamW step after the schedule, the codecs' encode / decode times from the
planner's cache, every boundary a link of ``--gbps`` (0.2: 200 Mbit/s) with ``--latency-ms``
(50) latency, a link per pair of ranks, ``--schedule`` with ``--microbatches``. It is not
validated against shaped runs here: 8 ranks on this 2-core machine would time CPU
contention, not the link (bench/planner.py validates the simulator on 2 and 4 ranks).

Variants (forward / backward cut codec): none, bf16, int8 (both ways), int4:ef bwd (none /
int4 with error feedback), psgd bwd (none / PowerSGD rank 16: Optimus-CC's compressed
backpropagation), and

  auto        ``choose_pipeline_codecs`` on the same simulation with
              ``objective="time_to_loss"``: candidates and multipliers from the table this run
              measured (``ccfx.planner.steps_model.role_table`` of the fixed variants), T =
              m(choice) x step minimised; its choice is then trained like the others (one
              ``codec_overrides`` entry per edge) and its steps measured, not predicted.
  auto-step   the same search with ``objective="step"`` (the default loss budget), for
              comparison; its multiplier is the steps model's prediction unless its choice is
              one of the measured variants.

T = mean steps to the target x predicted steady step; "T vs none" = none's T over the row's.
``--table PATH`` writes the per-role multipliers as ``steps_multipliers`` reads them.

What this shape can show, and the goal it can be held to (issue 19's Numbers). At this
bench's shape (16 x 64 tokens per step, 2 microbatches) a microbatch's activation is 256 KiB,
10.5 ms on a 200 Mbit/s wire against 50 ms of latency per message: the step is latency-bound,
the best codec shortens it by about 10 %, less than the steps the codecs cost, and no codec
can reach 1.62x there; ``auto`` rightly chooses none. The speedrun the 1.62x comes from is
bandwidth-bound: 524,288 tokens per step in 64 microbatches of 8,192, each message 671 ms on
the wire, the compute a few ms. ``python -m bench.time_to_loss_sweep --reuse RUNS
--speedrun`` prices the same loss runs there (the speedrun's tokens per step and microbatch,
1F1B; the stage compute timed on this CPU and scaled to the speedrun's compute-to-wire ratio,
which is a FLOP-based prediction, not a measurement; the steps multipliers carried over from
the 1,024-token loss runs, an assumption), and on a grid of links, latencies and microbatch
counts with the rate where the best codec crosses 1x and 1.62x. The goal is read there
(bench/README.md): at 200 Mbit/s + 50 ms, auto >= 1.62x over none, and auto >= the best
fixed codec; on uniform links auto can only beat the best uniform codec by mixing roles
(int8 forward, int4:ef backward) or hops, and such a mix's multiplier is predicted until
``--train`` trains it.

    python -m bench.time_to_loss                              # 300 steps, seeds 0 1 2
    python -m bench.time_to_loss --quick                      # 200 steps, seeds 0 1 (~15 min)
    python -m bench.time_to_loss --table bench/steps_multipliers.json
"""

from __future__ import annotations

import copy
import shlex
import sys
import time

import torch

import ccfx
from bench import common, convergence
from ccfx.demo import DEMO_BATCH_SIZE, DEMO_LR, ccfx_compile
from ccfx.models import GPTConfig, TinyGPT, batches

STAGES = 8
MODELS = {"gpt8": {"n_layer": 8, "n_head": 4, "n_embd": 128, "block_size": 64},
          "small": {"n_layer": 8, "n_head": 2, "n_embd": 32, "block_size": 16}}
#: name → (forward spec, backward spec)
FIXED = {"none": ("none", "none"), "bf16": ("bf16", "bf16"), "int8": ("int8", "int8"),
         "int4:ef bwd": ("none", "int4:ef"), "psgd bwd": ("none", "powersgd:rank=16")}
AUTO_ROWS = ("auto", "auto-step")


def split_points() -> list[str]:
    return [f"blocks.{i}" for i in range(1, STAGES)]


def options(forward: str, backward: str, overrides: dict[str, str] | None = None) -> dict:
    opts = {"stages": STAGES, "split_points": split_points(), "activation_codec": forward,
            "activation_grad_codec": backward, "lowering": "eager"}
    if overrides:
        opts["codec_overrides"] = overrides
    return opts


def timing_model(initial: TinyGPT, data: torch.Tensor, a):
    """The planner's PipelineModel of one step of ``initial`` at the microbatch shape."""
    from ccfx.backends.profile import optimizer_seconds, profile_stages
    from ccfx.planner import Link, PipelineModel, edges_from_plan
    from ccfx.planner.pipeline_model import shared_from_plan

    if a.batch_size % a.microbatches:
        raise SystemExit(f"--batch-size {a.batch_size} is not a multiple of --microbatches "
                         f"{a.microbatches}")
    torch._dynamo.reset()
    compiled = ccfx_compile(copy.deepcopy(initial), **options("none", "none"))
    x, y = next(batches(data, a.batch_size // a.microbatches, initial.config.block_size, 0))
    compiled(x, y)
    compute = profile_stages(compiled, x, y, repeats=a.repeats)
    tail = optimizer_seconds(compiled, lambda ps: torch.optim.AdamW(ps, lr=a.lr),
                             repeats=a.repeats)
    plan = ccfx.plan_of(compiled)
    return PipelineModel(compute, edges_from_plan(plan), Link(a.gbps, a.latency_ms),
                         schedule=a.schedule, microbatches=a.microbatches,
                         shared=shared_from_plan(plan), tail_s=tail)


def plan_auto(pm, table: dict, objective: str, min_gain: float) -> dict[int, tuple[str, str]]:
    """auto's choice on the timing model: the pool and multiplier ``plan_edges`` would use."""
    from ccfx.config import Config
    from ccfx.planner.auto import choose_pipeline_codecs
    from ccfx.planner.candidates import candidates
    from ccfx.planner.steps_model import for_config

    config = Config(objective=objective, steps_multipliers={"multipliers": table})

    def pool(edge, direction):
        return candidates("activation" if direction == "fwd" else "activation_grad", config,
                          steps=True)

    decided = choose_pipeline_codecs(pm, pool, min_gain=min_gain,
                                     steps_multiplier=for_config(config, pm.edges))
    return dict(decided.choice)


def uniform(pm, fwd: str, bwd: str) -> dict[int, tuple[str, str]]:
    return {e.index: (fwd, bwd) if e.dtype.is_floating_point else ("none", "none")
            for e in pm.edges}


def describe(choice: dict[int, tuple[str, str]], pm) -> str:
    """A choice in words: one pair if every floating-point edge has it, else edge by edge."""
    pairs = [choice[e.index] for e in pm.edges if e.dtype.is_floating_point]
    if len(set(pairs)) == 1:
        return "{} / {}".format(*pairs[0])
    return ", ".join(f"e{e.index} {choice[e.index][0]}/{choice[e.index][1]}"
                     for e in pm.edges if e.dtype.is_floating_point)


def _parser():
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=None, help="steps per loss run (300)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="(0 1 2)")
    ap.add_argument("--quick", action="store_true", help="200 steps, seeds 0 1")
    ap.add_argument("--variants", nargs="+", choices=list(FIXED), default=list(FIXED),
                    help="the fixed variants to train (none is always trained)")
    ap.add_argument("--model", choices=list(MODELS), default="gpt8")
    ap.add_argument("--batch-size", type=int, default=DEMO_BATCH_SIZE)
    ap.add_argument("--lr", type=float, default=DEMO_LR)
    ap.add_argument("--smooth", type=int, default=convergence.SMOOTH)
    ap.add_argument("--target-at", type=float, default=convergence.TARGET_AT)
    ap.add_argument("--gbps", type=float, default=0.2, help="every boundary's link (0.2)")
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--extra-gbps", type=float, nargs="*", default=[],
                    help="more link rates to price the same loss runs on (auto's new choices "
                         "are trained too)")
    ap.add_argument("--schedule", choices=("1F1B", "GPipe"), default="GPipe")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--min-gain", type=float, default=0.10, help="auto_min_gain (0.10)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per stage")
    ap.add_argument("--table", metavar="PATH", help="write the steps-multiplier table here")
    ap.add_argument("--reuse", metavar="JSON", help="take the loss runs a previous --json of "
                    "the same settings holds (same variant, seed and codecs) instead of "
                    "training them again: more seeds for the cost of the new ones")
    return ap


class LossRuns:
    """The loss runs and each variant's steps to the target over the seeds: every variant of
    a seed trained from that seed's initialisation (``initials``) and batches."""

    def __init__(self, data: torch.Tensor, steps: int, seeds: list[int], a):
        self.data, self.steps, self.seeds, self.a = data, steps, seeds, a
        self.runs: list[dict] = []
        self.initials: dict[int, TinyGPT] = {}
        self.summary: dict[str, dict] = {}

    def train_fixed(self, names: list[str], config: GPTConfig) -> None:
        """The fixed variants, seed by seed (each seed's model built just before its runs)."""
        for seed in self.seeds:
            torch.manual_seed(seed)
            self.initials[seed] = TinyGPT(config)
            for name in names:
                self.runs.append(self._run(name, seed, options(*FIXED[name])))
        self._summarise(names)

    def train(self, name: str, opts: dict) -> None:
        """One more variant (compile options ``opts``) over every seed."""
        for seed in self.seeds:
            self.runs.append(self._run(name, seed, opts))
        self._summarise([name])

    def _run(self, name: str, seed: int, opts: dict) -> dict:
        return _run(name, self.initials[seed], self.data, seed, self.steps, self.a, opts)

    def _summarise(self, names: list[str]) -> None:
        convergence.add_steps_to_target(self.runs, at=self.a.target_at, window=self.a.smooth)
        for n in names:
            self.summary[n] = convergence.steps_summary(
                [r for r in self.runs if r["variant"] == n])


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    a.reused = _reusable(a.reuse)
    steps = a.steps or (200 if a.quick else 300)
    seeds = a.seeds or ([0, 1] if a.quick else [0, 1, 2])
    fixed_names = ["none", *(n for n in a.variants if n != "none")]
    common.quiet()
    torch.set_num_threads(1)
    args = common.print_header("bench.time_to_loss", argv)
    t0 = time.perf_counter()

    data, vocab = convergence.corpus()
    config = GPTConfig(vocab_size=vocab, **MODELS[a.model])
    torch.manual_seed(0)
    base = timing_model(TinyGPT(config), data, a)
    loss = LossRuns(data, steps, seeds, a)
    loss.train_fixed(fixed_names, config)

    from ccfx.planner.steps_model import role_table

    table = role_table({n: (*FIXED[n], loss.summary[n]["multiplier"])
                        for n in fixed_names if n != "none"})
    trained, links, choices = price_links(base, table, fixed_names, loss, a)
    wall = time.perf_counter() - t0
    tables = {gbps: link_rows(pm, fixed_names, {row: c for (g, row), c in choices.items()
                                                if g == gbps}, trained, loss.summary, table)
              for gbps, pm in links.items()}
    _report(a, config, loss, table, tables, wall)
    if a.table:
        import json

        with open(a.table, "w") as f:
            json.dump({"multipliers": table, "source": "python -m bench.time_to_loss "
                       + shlex.join(args) + f" ({common.machine().get('date', '')})"},
                      f, indent=2)
    common.write_json(a.json, "time_to_loss", {
        "command": args, "model": MODELS[a.model], "steps": steps, "seeds": seeds,
        "batch_size": a.batch_size, "lr": a.lr, "smooth": a.smooth, "target_at": a.target_at,
        "latency_ms": a.latency_ms, "schedule": a.schedule, "microbatches": a.microbatches,
        "table": table, "wall_s": wall,
        "choices": {f"{g * 1000:g}Mbit/s {row}": {str(e): list(v) for e, v in c.items()}
                    for (g, row), c in choices.items()},
        "tables": {f"{g * 1000:g}Mbit/s": rows for g, rows in tables.items()},
        "runs": loss.runs})
    return 0


def price_links(base, table: dict, fixed_names: list[str], loss: LossRuns, a):
    """Per link (``--gbps``, then ``--extra-gbps``): the timing model and auto's choices under
    both objectives; an auto choice no run holds yet is trained over the seeds. Returns the
    trained choices (key → variant), the timing model per link and the choices per (link,
    row)."""
    trained = {_key(base, uniform(base, *FIXED[n])): n for n in fixed_names}
    links, choices = {}, {}
    for gbps in [a.gbps, *a.extra_gbps]:
        pm = with_link(base, gbps, a.latency_ms)
        links[gbps] = pm
        for row, objective in (("auto", "time_to_loss"), ("auto-step", "step")):
            choices[gbps, row] = plan_auto(pm, table, objective, a.min_gain)
        key = _key(pm, choices[gbps, "auto"])
        if key not in trained:
            name = "auto" if gbps == a.gbps else f"auto@{gbps * 1000:g}Mbit/s"
            overrides = {f"edge {e}": f"{f}/{b}" for e, (f, b) in choices[gbps, "auto"].items()}
            loss.train(name, options("none", "none", overrides))
            trained[key] = name
    return trained, links, choices


def link_rows(pm, fixed_names: list[str], autos: dict, trained: dict, summary: dict,
              table: dict) -> list[dict]:
    """One link's table: per variant (the fixed ones, then ``autos``' rows) its steps to the
    target (a trained run's, measured, else the steps model's prediction), predicted step and
    T, and T against none's."""
    from ccfx.planner.steps_model import StepsModel
    from ccfx.steps_table import StepsTable

    model = StepsModel(StepsTable.from_dict(table), pm.edges)
    rows = []
    for name in [*fixed_names, *AUTO_ROWS]:
        choice = uniform(pm, *FIXED[name]) if name in FIXED else autos[name]
        twin = trained.get(_key(pm, choice))
        if twin is not None:
            steps_row = summary[twin]
            source = "measured" if twin == name else f"measured (= {twin})"
        else:
            m = model(choice)
            steps_row = {"steps_mean": m * summary["none"]["steps_mean"], "steps_std": None,
                         "unreached": 0, "multiplier": m, "multiplier_std": None}
            source = "predicted (steps model)"
        step = pm.predict(choice).step_s
        rows.append({"variant": name, "codecs": describe(choice, pm), "step_s": step,
                     "source": source, **steps_row, "T_s": steps_row["steps_mean"] * step})
    for r in rows:
        r["speedup"] = rows[0]["T_s"] / r["T_s"]
    return rows


def _report(a, config: GPTConfig, loss: LossRuns, table: dict, tables: dict,
            wall: float) -> None:
    """The run's settings, one table per link with the goals under it, the role table."""
    seeds, steps = loss.seeds, loss.steps
    print(f"\ntiny GPT {loss.initials[seeds[0]].num_parameters() / 1e6:.2f} M parameters "
          f"({config.n_layer} blocks, width {config.n_embd}), {STAGES} stages of one block, "
          f"{steps} AdamW steps of {a.batch_size} x {config.block_size} tokens, seeds "
          f"{' '.join(map(str, seeds))};\ntarget: none's smoothed loss (mean of the last "
          f"{a.smooth} steps) at step {max(a.smooth, round(a.target_at * steps))}, per seed; "
          f"timing: {a.schedule}, {a.microbatches} microbatches, every boundary at "
          f"{a.latency_ms:g} ms latency (simulated)")
    for gbps, rows in tables.items():
        print(f"\nevery boundary {gbps * 1000:g} Mbit/s:")
        print(common.table(table_rows(rows), HEADER))
        print("\n".join(goals(rows)))
    print(f"\nsteps multipliers per role (written with --table): {table}")
    print(f"wall time {wall:.0f} s ({len(loss.runs)} loss runs)")


def with_link(pm, gbps: float, latency_ms: float):
    """The same timing model on another link."""
    from ccfx.planner import Link, PipelineModel

    return PipelineModel(pm.compute, pm.edges, Link(gbps, latency_ms), schedule=pm.schedule,
                         microbatches=pm.microbatches, timer=pm.timer, shared=pm.shared,
                         tail_s=pm.tail_s)


def _key(pm, choice) -> tuple:
    return tuple(choice.get(e.index, ("none", "none")) for e in pm.edges)


def _reusable(path: str | None) -> dict:
    """(variant, seed, options as JSON, steps, batch, lr) → a run of a previous --json."""
    if path is None:
        return {}
    import json

    with open(path) as f:
        old = json.load(f)
    return {(r["variant"], r["seed"], json.dumps(r.get("options"), sort_keys=True),
             old["steps"], old["batch_size"], old["lr"]): r for r in old["runs"]}


def _run(name, initial, data, seed, steps, a, opts) -> dict:
    import json

    key = (name, seed, json.dumps(opts, sort_keys=True), steps, a.batch_size, a.lr)
    if key in a.reused:
        r = dict(a.reused[key])
        print(f"  seed {seed} {name}: reused ({a.reuse})", file=sys.stderr, flush=True)
        return r
    r = convergence.run_one(name, initial, data, seed=seed, steps=steps,
                            batch_size=a.batch_size, lowering="eager", lr=a.lr, options=opts)
    r["options"] = opts
    print(f"  seed {seed} {name}: final loss {r['final_loss']:.4f} ({r['wall_s']:.0f} s)",
          file=sys.stderr, flush=True)
    return r


HEADER = ["variant", "forward / backward", "steps to target", "steps x", "steps from",
          "step s (pred.)", "T s", "T vs none"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        steps, mult = convergence.steps_cells(r)
        out.append([r["variant"], r["codecs"], steps, mult, r["source"], f"{r['step_s']:.3f}",
                    f"{r['T_s']:.1f}", f"{r['speedup']:.3f}x"])
    return out


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals: auto's T beats the best fixed codec's and is >= 1.62x none's."""
    by = {r["variant"]: r for r in rows}
    best = min((r for r in rows if r["variant"] in FIXED), key=lambda r: r["T_s"])
    auto = by["auto"]
    return [f"goal auto beats the best fixed variant ({best['variant']}, T {best['T_s']:.1f} s):"
            f" auto T {auto['T_s']:.1f} s: "
            f"{'met' if auto['T_s'] < best['T_s'] else 'not met'}"
            + (" (auto chose it)" if auto["codecs"] == best["codecs"] else ""),
            (f"goal auto >= 1.62x over none: {auto['speedup']:.2f}x: "
             f"{'met' if auto['speedup'] >= 1.62 else 'not met'}")]


if __name__ == "__main__":
    sys.exit(main())
