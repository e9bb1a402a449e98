"""Time to a target loss on a grid of links, latencies, microbatch counts and shapes, from ONE
set of loss runs (issue 19 item 4): where compressing the pipeline pays, and where it cannot.

The loss runs do not depend on the link, so they are trained once (``python -m
bench.time_to_loss --json RUNS``) and every grid point here only re-prices the step: T =
none's mean steps to the target x the row's steps multiplier (mean over seeds of its steps
over none's on the same seed) x the planner's predicted steady step, "T vs none" = none's T
over the row's. The steps multipliers (mean ± std over seeds, and the standard error of the mean) come
from the runs; the per-role table ``auto`` searches with is built from them exactly as
bench/time_to_loss.py builds it.

Two shapes of timing run:

  loss-run batch   the loss runs' own batch (16 x 64 tokens per step) in ``--microbatches``
                   microbatches: each microbatch count is its own timed profile of the 8
                   stages on this machine (eager, one thread). At 200 Mbit/s a microbatch's
                   activation (8 x 64 x 128 fp32, 256 KiB) is 10.5 ms on the wire against
                   50 ms of latency: latency-bound, compression can buy little.
  speedrun tokens  (``--speedrun``) the Protocol NanoGPT speedrun's tokens per step and per
                   microbatch (524,288 and 8,192: 64 microbatches of 128 x 64 here, 1F1B, as
                   its vanilla baseline), its stages' compute timed on this machine at that
                   microbatch and then scaled by each ``--compute-scale``: 1 is this CPU
                   thread, and a scale s stands for a device 1/s times faster (stage compute,
                   the optimizer step and the codecs' encode / decode alike; the link is
                   unchanged). The speedrun itself sits near s = 0.003 (a GPT block of width
                   1024 on 8,192 tokens is about 7e11 FLOP forward and backward, ~2 ms on an
                   H100, against 671 ms on the wire per message): **that compute is a
                   prediction from FLOPs, not a measurement.** The steps are still the loss
                   runs' (measured at 1,024 tokens per step): only the ratio "T vs none" is
                   read here, on the assumption that a codec's steps multiplier carries over
                   to the larger batch; the absolute T of this shape is not a number of any
                   run.

``auto`` at each grid point is ``choose_pipeline_codecs`` with ``objective="time_to_loss"`` on
that point's timing model; its steps come from the runs when a run trained its exact choice
("measured"), else from the steps model ("predicted"). ``--train`` trains, over the runs'
seeds, every auto choice of the grid that no run holds (each becomes a measured row), and
``--json`` writes all runs again, so the output is a valid ``--reuse`` input.

The crossing: per grid line (shape, latency, schedule, microbatches, scale) the link rates at
which the best fixed codec's T first equals none's (1.0x) and reaches the issue's 1.62x,
found by bisection on the model (below those rates compression wins by that much).

    python -m bench.time_to_loss --seeds 0 1 2 3 4 5 --json runs.json     # the loss runs
    python -m bench.time_to_loss_sweep --reuse runs.json --speedrun        # the grid
    python -m bench.time_to_loss_sweep --reuse runs.json --speedrun --train --json swept.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from bench import common, convergence
from bench import time_to_loss as ttl
from ccfx.models import GPTConfig, TinyGPT

#: The Protocol NanoGPT speedrun's vanilla baseline: tokens per step (512 sequences of 1024),
#: per microbatch (8 x 1024), its schedule (PluralisResearch/ProtocolNanoGPT README, records).
SPEEDRUN_TOKENS = 524_288
SPEEDRUN_MICROBATCH_TOKENS = 8_192
SPEEDRUN_SCHEDULE = "1F1B"
GOAL = 1.62


@dataclass(frozen=True)
class Point:
    """One grid line: the timing run's shape and everything but the link rate."""

    shape: str  # "loss-run batch" | "speedrun tokens"
    latency_ms: float
    schedule: str
    microbatches: int
    scale: float = 1.0

    def label(self) -> str:
        scale = "" if self.scale == 1 else f", compute x{self.scale:g}"
        return (f"{self.shape}, {self.latency_ms:g} ms, {self.schedule}, "
                f"{self.microbatches} mb{scale}")


class ScaledTimer:
    """A codec timer whose encode / decode seconds are ``scale`` times the measured ones."""

    def __init__(self, timer, scale: float):
        self.timer, self.scale = timer, scale

    def cost(self, spec, shape, dtype):
        c = self.timer.cost(spec, shape, dtype)
        return replace(c, encode_s=c.encode_s * self.scale, decode_s=c.decode_s * self.scale)


def priced(pm, gbps: float, latency_ms: float, schedule: str, scale: float = 1.0):
    """``pm`` on another link and schedule, every on-device second times ``scale``."""
    from ccfx.planner import Link, PipelineModel
    from ccfx.planner.pipeline_model import StageCompute

    compute = pm.compute if scale == 1 else [
        StageCompute(c.forward_s * scale, c.backward_s * scale, f"{c.source} x{scale:g}")
        for c in pm.compute]
    return PipelineModel(compute, pm.edges, Link(gbps, latency_ms), schedule=schedule,
                         microbatches=pm.microbatches,
                         timer=pm.timer if scale == 1 else ScaledTimer(pm.timer, scale),
                         shared=pm.shared, tail_s=[t * scale for t in pm.tail_s])


def load_runs(paths: list[str]) -> dict:
    """The --json of bench.time_to_loss (or of this bench), or several of the same settings:
    their runs together (a run of the same variant, seed and options once), and the timed
    profiles any of them holds."""
    merged: dict = {}
    seen = set()
    for path in paths:
        with open(path) as f:
            old = json.load(f)
        for key in ("runs", "model", "steps", "batch_size", "lr"):
            if key not in old:
                raise SystemExit(f"{path}: no {key!r}: give the --json of bench.time_to_loss")
        if merged:
            for key in ("model", "steps", "batch_size", "lr"):
                if old[key] != merged[key]:
                    raise SystemExit(f"{path}: {key} {old[key]!r} differs from "
                                     f"{paths[0]}'s {merged[key]!r}: runs of other settings")
        else:
            merged = {k: v for k, v in old.items() if k not in ("runs", "profiles")}
            merged.update(runs=[], profiles={})
        merged["profiles"].update(old.get("profiles") or {})
        for r in old["runs"]:
            key = (r["variant"], r["seed"], json.dumps(r.get("options"), sort_keys=True))
            if key not in seen:
                seen.add(key)
                merged["runs"].append(dict(r))
    return merged


def profile_to_json(pm) -> dict:
    """What the timing model measured (stage compute, optimizer tail) and the plan's edges, so
    a later sweep prices the same step without timing again (the machine's load moves it)."""
    return {"microbatches": pm.microbatches,
            "compute": [[c.forward_s, c.backward_s, c.source] for c in pm.compute],
            "tail": list(pm.tail_s), "shared": [[list(s), n] for s, n in pm.shared],
            "edges": [[e.index, e.name, list(e.shape), str(e.dtype).replace("torch.", ""),
                       [list(h) for h in e.hops], e.requires_grad] for e in pm.edges]}


def profile_from_json(p: dict):
    from ccfx.planner import Link, PipelineModel
    from ccfx.planner.pipeline_model import EdgeTraffic, StageCompute

    edges = [EdgeTraffic(i, n, tuple(s), getattr(torch, d), tuple(map(tuple, h)), g)
             for i, n, s, d, h, g in p["edges"]]
    return PipelineModel([StageCompute(f, b, src) for f, b, src in p["compute"]], edges,
                         Link(0.2, 50.0), schedule="GPipe", microbatches=p["microbatches"],
                         shared=[(tuple(s), n) for s, n in p["shared"]], tail_s=p["tail"])


def choice_of_options(opts: dict, pm) -> tuple:
    """The (fwd, bwd) per edge a run's compile options put on the cut edges."""
    overrides = opts.get("codec_overrides") or {}
    fwd, bwd = opts.get("activation_codec", "none"), opts.get("activation_grad_codec", "none")
    choice = ttl.uniform(pm, fwd, bwd)
    for name, pair in overrides.items():
        f, b = pair.split("/")
        choice[int(name.split()[-1])] = (f, b)
    return ttl._key(pm, choice)


def summarise(runs: list[dict], smooth: int, target_at: float) -> dict[str, dict]:
    """Per variant: steps to the target and multiplier (bench.convergence) over the seeds, with
    the standard error of the mean multiplier, and the band multiplier (the mean over targets
    at 0.3 .. 0.8 of none's run: ``convergence.band_multipliers``), reported beside it: the
    grid prices the single target's, as bench.time_to_loss does."""
    convergence.add_steps_to_target(runs, at=target_at, window=smooth)
    bands = convergence.band_multipliers(runs, window=smooth)
    out = {}
    for name in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == name]
        s = convergence.steps_summary(mine)
        s["seeds"] = len(mine)
        s["multiplier_sem"] = (s["multiplier_std"] / math.sqrt(len(mine))
                               if s["multiplier_std"] is not None else None)
        band = [m for (v, _), m in bands.items() if v == name]
        s["band"] = statistics.fmean(band) if band else None
        s["band_std"] = statistics.stdev(band) if len(band) > 1 else None
        out[name] = s
    return out


def steps_row(choice, pm, trained, summary, model) -> tuple[dict, str]:
    """The steps of a choice: none's mean steps x the choice's multiplier, the mean over seeds
    of a trained run's (measured) or the steps model's (predicted). Through the multiplier,
    not the variant's own mean steps, so that variants trained on different seeds (a later
    --train) compare on the same footing: each seed's ratio to none on that seed."""
    twin = trained.get(ttl._key(pm, choice))
    if twin is not None:
        m, source = summary[twin]["multiplier"], f"measured ({twin})"
    else:
        m, source = model(choice), "predicted"
    return {"steps_mean": m * summary["none"]["steps_mean"], "multiplier": m}, source


def crossing(pm, point: Point, fixed: dict, summary: dict, ratio: float) -> float | None:
    """The link rate (Gbit/s) at which the best fixed codec's T vs none equals ``ratio``
    (log bisection between 0.1 Mbit/s and 1 Tbit/s); None if it is never reached."""
    def best(gbps: float) -> float:
        p = priced(pm, gbps, point.latency_ms, point.schedule, point.scale)
        none_s = p.predict({}).step_s
        return max(none_s / (summary[n]["multiplier"]
                             * p.predict(ttl.uniform(p, *ttl.FIXED[n])).step_s)
                   for n in fixed if n != "none")

    lo, hi = math.log(1e-4), math.log(1e3)
    if best(math.exp(lo)) < ratio:
        return None
    if best(math.exp(hi)) >= ratio:
        return math.exp(hi)
    for _ in range(18):  # 7 decades / 2**18: the rate to 0.01 %
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best(math.exp(mid)) >= ratio else (lo, mid)
    return math.exp(lo)


def _parser():
    ap = common.parser(__doc__)
    ap.add_argument("--reuse", metavar="JSON", nargs="+", required=True,
                    help="the loss runs: --json files of bench.time_to_loss (or of this "
                         "bench) with the same settings; timed profiles they hold are reused")
    ap.add_argument("--profile-again", action="store_true",
                    help="time the stages again even where a --reuse file holds a profile")
    ap.add_argument("--gbps", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2])
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[50.0, 5.0])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--schedule", nargs="+", choices=("GPipe", "1F1B"), default=["GPipe"])
    ap.add_argument("--speedrun", action="store_true",
                    help="add the speedrun's tokens per step and microbatch (1F1B, 64 mb)")
    ap.add_argument("--compute-scale", type=float, nargs="+", default=[1.0, 0.1, 0.01, 0.003],
                    help="the speedrun shape's on-device seconds x this (1: this CPU)")
    ap.add_argument("--min-gain", type=float, default=0.10)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per stage")
    ap.add_argument("--train", action="store_true",
                    help="train every auto choice no run holds, over the runs' seeds")
    return ap


@dataclass
class Prices:
    """What every cell of the grid is priced with: the per-role table auto searches
    (``table``), the fixed variants the runs hold, the choices a run trained (choice key →
    variant), the steps per variant over the seeds (``summarise``), the steps model for the
    choices no run trained, and auto's ``min_gain``."""

    table: dict
    fixed: list[str]
    trained: dict
    summary: dict
    model: object
    min_gain: float


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    common.quiet()
    torch.set_num_threads(1)
    args = common.print_header("bench.time_to_loss_sweep", argv)
    t0 = time.perf_counter()

    old = load_runs(a.reuse)
    runs = [dict(r) for r in old["runs"]]
    smooth = old.get("smooth", convergence.SMOOTH)
    target_at = old.get("target_at", convergence.TARGET_AT)
    seeds = sorted({r["seed"] for r in runs})
    summary = summarise(runs, smooth, target_at)
    fixed = [n for n in ttl.FIXED if n in summary]
    if "none" not in fixed:
        raise SystemExit(f"{a.reuse}: no 'none' runs: the target is none's loss")

    from ccfx.planner.steps_model import StepsModel, role_table
    from ccfx.steps_table import StepsTable

    table = role_table({n: (*ttl.FIXED[n], summary[n]["multiplier"])
                        for n in fixed if n != "none"})
    data, vocab = convergence.corpus()
    config = GPTConfig(vocab_size=vocab, **old["model"])
    shapes = timing_shapes(old["batch_size"], config.block_size, a)
    profiles = timed_profiles(shapes, old, config, data, a)
    any_pm = next(iter(profiles.values()))
    trained = {}
    for r in runs:
        trained.setdefault(choice_of_options(r.get("options") or {}, any_pm), r["variant"])
    prices = Prices(table, fixed, trained, summary,
                    StepsModel(StepsTable.from_dict(table), any_pm.edges), a.min_gain)

    if a.json:  # the timed profiles first: the grid below can take long
        common.write_json(a.json, "time_to_loss_sweep", {
            **{k: old[k] for k in ("model", "steps", "batch_size", "lr")}, "runs": runs,
            "profiles": {f"{s}|{m}": profile_to_json(p) for (s, m), p in profiles.items()}})
    points = grid_points(shapes, profiles, a)
    rows = grid(points, a.gbps, prices)
    if a.train and train_autos(rows, any_pm, runs, trained, old, config, data):
        prices.summary = summarise(runs, smooth, target_at)
        rows = grid(points, a.gbps, prices)
    wall = time.perf_counter() - t0

    print(f"\nloss runs: {' '.join(a.reuse)} ({old['steps']} steps of {old['batch_size']} x "
          f"{config.block_size} tokens, seeds {' '.join(map(str, seeds))}; target: none's "
          f"smoothed loss at {target_at:g} of the run, smoothing {smooth})")
    print(common.table(multiplier_rows(prices.summary), MULT_HEADER))
    print(f"per-role table auto searches: {table}")
    print_grid(rows, points, prices)
    print(f"\nwall time {wall:.0f} s")
    common.write_json(a.json, "time_to_loss_sweep", {
        **{k: old[k] for k in ("model", "steps", "batch_size", "lr")}, "command": args,
        "smooth": smooth, "target_at": target_at, "seeds": seeds, "table": table,
        "summary": prices.summary, "grid": rows, "runs": runs, "wall_s": wall,
        "profiles": {f"{shape}|{mb}": profile_to_json(pm) for (shape, mb), pm in profiles.items()}})
    return 0


def timing_shapes(batch_size: int, block: int, a) -> list[tuple[str, int, int]]:
    """(shape, batch, microbatches) per timed profile: the loss runs' batch in each
    ``--microbatches``, and with ``--speedrun`` the speedrun's tokens per step and microbatch."""
    shapes = [("loss-run batch", batch_size, m) for m in a.microbatches]
    if a.speedrun:
        shapes.append(("speedrun tokens", SPEEDRUN_TOKENS // block,
                       SPEEDRUN_TOKENS // SPEEDRUN_MICROBATCH_TOKENS))
    return shapes


def timed_profiles(shapes, old: dict, config: GPTConfig, data, a) -> dict:
    """One timing model per shape and microbatch count: a profile a --reuse file holds (unless
    ``--profile-again``), else the stages timed on this machine."""
    profiles = {}
    for shape, batch, mb in shapes:
        stored = old["profiles"].get(f"{shape}|{mb}")
        if stored is not None and not a.profile_again:
            profiles[shape, mb] = profile_from_json(stored)
            print(f"  {shape}, {mb} mb: profile reused", file=sys.stderr, flush=True)
            continue
        torch.manual_seed(0)
        ns = SimpleNamespace(batch_size=batch, microbatches=mb, repeats=a.repeats,
                             lr=old["lr"], gbps=0.2, latency_ms=50.0, schedule="GPipe")
        profiles[shape, mb] = ttl.timing_model(TinyGPT(config), data, ns)
        print(f"  profiled {shape}: {batch // mb} x {config.block_size} tokens per microbatch",
              file=sys.stderr, flush=True)
    return profiles


def grid_points(shapes, profiles: dict, a) -> list[tuple[Point, object]]:
    """Every grid line with its timing model: the loss-run batch per microbatch count,
    latency and schedule, then the speedrun shape per latency and compute scale."""
    # 1F1B needs at least as many microbatches as stages (torch's Schedule1F1B refuses fewer)
    points = [(Point(shape, lat, sched, mb), profiles[shape, mb])
              for shape, _, mb in shapes if shape == "loss-run batch"
              for lat in a.latency_ms for sched in a.schedule
              if sched != "1F1B" or mb >= ttl.STAGES]
    if a.speedrun:
        pm = profiles["speedrun tokens", SPEEDRUN_TOKENS // SPEEDRUN_MICROBATCH_TOKENS]
        points += [(Point("speedrun tokens", lat, SPEEDRUN_SCHEDULE, pm.microbatches, s), pm)
                   for lat in a.latency_ms for s in a.compute_scale]
    return points


def grid(points, rates: list[float], prices: Prices) -> list[dict]:
    """A row per grid line and link rate: auto's choice there and every cell priced."""
    rows = []
    for point, pm in points:
        for gbps in rates:
            p = priced(pm, gbps, point.latency_ms, point.schedule, point.scale)
            choice = ttl.plan_auto(p, prices.table, "time_to_loss", prices.min_gain)
            rows.append(price(point, p, gbps, choice, prices))
    return rows


def price(point: Point, p, gbps: float, auto_choice, prices: Prices) -> dict:
    """One row: per fixed variant and auto, its codecs, predicted step, multiplier and T, and
    T against none's."""
    cells = {}
    for name in [*prices.fixed, "auto"]:
        choice = ttl.uniform(p, *ttl.FIXED[name]) if name != "auto" else auto_choice
        steps, source = steps_row(choice, p, prices.trained, prices.summary, prices.model)
        step = p.predict(choice).step_s
        cells[name] = {"codecs": ttl.describe(choice, p), "step_s": step,
                       "multiplier": steps["multiplier"], "source": source,
                       "T_s": steps["steps_mean"] * step,
                       "choice": {str(e): list(v) for e, v in choice.items()}}
    for c in cells.values():
        c["speedup"] = cells["none"]["T_s"] / c["T_s"]
    return {"point": point.__dict__, "label": point.label(), "gbps": gbps, "cells": cells}


def train_autos(rows, any_pm, runs: list[dict], trained: dict, old: dict, config: GPTConfig,
                data) -> bool:
    """``--train``: every auto choice of the grid that no run holds, trained over the runs'
    seeds (appended to ``runs``, recorded in ``trained``); whether there was any."""
    seeds = sorted({r["seed"] for r in runs})
    new = {}
    for r in rows:
        c = r["cells"]["auto"]
        if c["source"] == "predicted":
            new.setdefault(ttl._key(any_pm, {int(e): tuple(v)
                                             for e, v in c["choice"].items()}), c)
    for key, c in new.items():
        name = f"auto[{c['codecs']}]"
        overrides = {f"edge {e}": f"{f}/{b}" for e, (f, b) in c["choice"].items()}
        ns = SimpleNamespace(reused={}, reuse=None, batch_size=old["batch_size"],
                             lr=old["lr"])
        for seed in seeds:
            torch.manual_seed(seed)
            runs.append(ttl._run(name, TinyGPT(config), data, seed, old["steps"], ns,
                                 ttl.options("none", "none", overrides)))
        trained[key] = name
    return bool(new)


def print_grid(rows: list[dict], points, prices: Prices) -> None:
    """A table per grid line, and under it where the best fixed codec crosses 1x and 1.62x."""
    names = [*prices.fixed, "auto"]
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        print(f"\n{label}:")
        print(common.table(grid_rows(mine, names), grid_header(names)))
        point, pm = next((pt, pm) for pt, pm in points if pt.label() == label)
        print(crossing_line(pm, point, prices.fixed, prices.summary))


MULT_HEADER = ["variant", "seeds", "steps x (mean ± std)", "std err", "unreached",
               "band 0.3-0.8 (mean ± std)"]


def multiplier_rows(summary: dict) -> list[list[str]]:
    out = []
    for name, s in summary.items():
        std = f" ± {s['multiplier_std']:.3f}" if s["multiplier_std"] is not None else ""
        sem = f"{s['multiplier_sem']:.3f}" if s["multiplier_sem"] is not None else "-"
        band = "-" if s["band"] is None else f"{s['band']:.3f}" + (
            f" ± {s['band_std']:.3f}" if s["band_std"] is not None else "")
        out.append([name, s["seeds"], f"{s['multiplier']:.3f}{std}", sem, s["unreached"], band])
    return out


def grid_header(names: list[str]) -> list[str]:
    return ["Mbit/s", "none step s", *(f"{n}" for n in names if n not in ("none", "auto")),
            "auto chose", "auto steps x", "auto", "auto vs best fixed", "auto vs bf16"]


def grid_rows(rows: list[dict], names: list[str]) -> list[list[str]]:
    """T vs none per variant; auto's choice, its multiplier ("pred.": the steps model's),
    and auto's T against the best fixed variant's and bf16's (the speedrun's own baseline
    sends bf16, ccfx's none sends fp32)."""
    out = []
    for r in rows:
        c = r["cells"]
        auto = c["auto"]
        src = "" if auto["source"].startswith("measured") else " (pred.)"
        best = min((v for n, v in c.items() if n != "auto"), key=lambda v: v["T_s"])
        bf16 = f"{c['bf16']['T_s'] / auto['T_s']:.2f}x" if "bf16" in c else "-"
        out.append([f"{r['gbps'] * 1000:g}", f"{c['none']['step_s']:.3f}",
                    *(f"{c[n]['speedup']:.2f}x" for n in names if n not in ("none", "auto")),
                    auto["codecs"], f"{auto['multiplier']:.3f}{src}",
                    f"{auto['speedup']:.2f}x", f"{best['T_s'] / auto['T_s']:.3f}x", bf16])
    return out


def crossing_line(pm, point: Point, fixed, summary) -> str:
    parts = []
    for ratio in (1.0, GOAL):
        g = crossing(pm, point, fixed, summary, ratio)
        parts.append(f"{ratio:g}x {'never' if g is None else f'below {g * 1000:.3g} Mbit/s'}")
    return "best fixed codec over none: " + "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
