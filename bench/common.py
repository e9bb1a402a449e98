"""Shared helpers of the benchmarks: timing, the tiny GPT, the step loops (warm-up, training,
timed steps), timed steps on ranks, tables and JSON output.

Timing uses ``time.perf_counter``: warm-up calls first, then the median of N repeats.
Ratios are always against a baseline measured in the same run, on the same machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from ccfx.models.tiny_gpt import GPTConfig
from ccfx.models.tiny_gpt import TinyGPT as GPT

# ---------------------------------------------------------------------------------------------
# The model: ccfx's tiny GPT (the demo's).

# The demo's shape: 4 layers, width 256, 4 heads, context 64 (about 3.2 M parameters).
GPT_KW = {"vocab_size": 96, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256}
BATCH = 16


def tiny_gpt(seed: int = 0, **overrides) -> nn.Module:
    """The tiny GPT (ccfx.models.tiny_gpt), seeded, dropout 0."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**GPT_KW, **overrides}))


def gpt_batch(batch: int = BATCH, seed: int = 1, **overrides):
    """(idx, targets) of shape (batch, block_size), random tokens."""
    kw = {**GPT_KW, **overrides}
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, kw["vocab_size"], (batch, kw["block_size"] + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def gpt_loss(model, idx, targets):
    out = model(idx, targets)
    return out[1] if isinstance(out, tuple) else out


def compile_model(model: nn.Module, kind: str, *, stages: int = 4, codec: str = "none",
                  **options):
    """``kind``: "eager" (no compile), "aot_eager", "inductor", "ccfx-eager", "ccfx-inductor"."""
    if kind == "eager":
        return model
    if kind in ("aot_eager", "inductor"):
        return torch.compile(model, backend=kind)
    if kind.startswith("ccfx-"):
        return torch.compile(model, backend="ccfx", options={
            "stages": stages, "activation_codec": codec, "lowering": kind[len("ccfx-"):],
            **options})
    raise ValueError(f"unknown kind {kind!r}")


# ---------------------------------------------------------------------------------------------
# Timing.


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` calls (seconds)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 2,
                      inner: int = 1) -> dict[str, list[float]]:
    """Time several callables in turn (A B A B …) so that drift and noise hit them alike.

    Each sample is the mean of ``inner`` back-to-back calls. Returns the samples per name.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        # Alternate the order too, so neither always runs first.
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            samples[name].append((time.perf_counter() - t) / inner)
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------------------------------
# Step loops: every bench's warm-up, training run and timed steps go through these two.

T = TypeVar("T")


def run_steps(step: Callable[[int], T], n: int,
              say: Callable[[int, T], object] | None = None) -> list[T]:
    """``step(i)`` for i in 0 … n-1, untimed (warm-up steps, or a training run whose wall the
    caller times as a whole): the results in order; ``say(i, result)`` after each call (the
    rank's progress line)."""
    out = []
    for i in range(n):
        out.append(step(i))
        if say is not None:
            say(i, out[-1])
    return out


def time_steps(step: Callable[[object], T], n: int, *,
               prepare: Callable[[int], object] = lambda i: i,
               say: Callable[[int, T, float], object] | None = None
               ) -> tuple[list[T], list[float]]:
    """``n`` timed calls ``step(prepare(i))``: their results and each call's seconds
    (``time.perf_counter``). ``prepare`` runs off the clock (a barrier, drawing the next
    batch); so does ``say(i, result, seconds)``, called after each step."""
    results, times = [], []
    for i in range(n):
        arg = prepare(i)
        t = time.perf_counter()
        results.append(step(arg))
        times.append(time.perf_counter() - t)
        if say is not None:
            say(i, results[-1], times[-1])
    return results, times


def slowest_per_step(times: Sequence[Sequence[float]]) -> list[float]:
    """Each step's time as its slowest rank's (a step ends when the last rank is done), from
    every rank's list of step times."""
    return [max(ts[i] for ts in times) for i in range(len(times[0]))]


# ---------------------------------------------------------------------------------------------
# Timed steps on ranks: what bench.data_parallel, bench.tensor_parallel and bench.sharded_dp
# share (each builds its own model and step; the loop, the ledger and the rows are these).


#: The environment of ccfx's ranks: ccfx rewrites the compiled graphs, so inductor's caches
#: must not replay a graph compiled without (or with another) rewrite (DESIGN.md, "Upstream
#: pitfalls").
CACHE_OFF = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}


def log(rank: int, msg: str) -> None:
    """Progress on the rank's log: bench.shaped's parent treats a silent log as a hang."""
    print(f"[rank {rank}] {msg}", flush=True)


def ledger_bytes(compiled) -> float | None:
    """Bytes this rank handed to ccfx's wire so far, per its ledger (None: not ccfx)."""
    import ccfx
    from ccfx.errors import ConfigError

    try:
        return float(ccfx.ledger_of(compiled).totals()[1])
    except ConfigError:  # compiled by another backend, or not at all
        return None


def predicted(compiled) -> dict | None:
    """The planner's predicted step of ``compiled``'s first graph (forward and backward; the
    optimizer step is not in it), uncompressed and as chosen, and what ran on its collectives
    ("all_gather int8 x8, ..."); None for another backend or no prediction."""
    import collections

    import ccfx

    try:
        plan = ccfx.plan_of(compiled)
    except Exception:  # noqa: BLE001 (another backend, or none)
        return None
    p = plan.graphs[0].prediction if plan.graphs else None
    if p is None:
        return None
    chose = collections.Counter((c.kind, c.codec) for c in plan.collectives)
    return {"uncompressed_s": p.uncompressed_s, "chosen_s": p.chosen_s,
            "chose": ", ".join(f"{k} {c} x{n}" for (k, c), n in sorted(chose.items()))}


def _config_error(e: BaseException) -> bool:
    from ccfx.errors import ConfigError

    return isinstance(e, ConfigError)


def timed_steps(rank: int, step: Callable[[], float], *, steps: int, warmup: int = 2,
                compiled=None, wire: Callable[[], float | None] | None = None,
                digits: int = 4, after_warmup: Callable[[], dict] | None = None) -> dict:
    """One rank's timing: ``warmup`` calls of ``step`` (the first compiles; ``step`` returns
    the loss), a barrier, then ``steps`` timed calls. Returns ``times`` and ``losses`` (warm-up
    included), ``wire_bytes`` per timed step (``wire()`` after them where given, else the
    difference of ``compiled``'s ccfx ledger over them, None when not ccfx), ``predicted``
    (:func:`predicted`, where ``compiled`` is given) and what ``after_warmup()`` returns.
    A ccfx ConfigError in a warm-up step (torch.compile checks options at the first call) is
    ``{"skipped": ...}``."""
    import torch.distributed as dist

    try:
        losses = run_steps(lambda i: step(), warmup, say=lambda i, loss: log(
            rank, f"warm-up step {i}: loss {loss:.{digits}f}"))
    except Exception as e:
        if _config_error(e):
            return {"skipped": f"ccfx rejects the options: {str(e).splitlines()[0]}"}
        raise
    before = None if wire is not None else ledger_bytes(compiled)
    extra = after_warmup() if after_warmup is not None else {}
    dist.barrier()
    timed, times = time_steps(lambda i: step(), steps, say=lambda i, loss, s: log(
        rank, f"timed step {i}: loss {loss:.{digits}f}, {s:.3f} s"))
    losses += timed
    if wire is not None:
        per_step = wire()
    else:
        after = ledger_bytes(compiled)
        per_step = None if before is None or after is None else (after - before) / steps
    out = {"times": times, "losses": losses, "wire_bytes": per_step, **extra}
    if compiled is not None:
        out["predicted"] = predicted(compiled)
    return out


def run_timed(module: str, fn: str, variant: str, world: int, rate: float | None,
              kwargs: dict, *, timeout_s: float, stall_s: float, threads: int,
              env: dict | None, nodes: Sequence[int] | None = None) -> list[dict] | dict:
    """``module.fn`` (a function calling :func:`timed_steps`) on ``world`` ranks in a fresh
    network namespace limited to ``rate`` Mbit/s (None: unshaped), or, with ``nodes`` (the
    node of each rank), on bench.shaped's two nodes joined by a link of that rate: every
    rank's result, or the table's row of a variant that failed or that ccfx skipped (with the
    reason)."""
    from bench.shaped import RankFailed, RankTimeout, run_ranks, shaped_namespace, two_nodes

    t0 = time.perf_counter()
    try:
        with (shaped_namespace(rate) if nodes is None else two_nodes(rate)) as where:
            ns, rank_env = where, None
            if nodes is not None:
                ns, rank_env = where.launch(nodes)
            ranks = run_ranks(module, fn, world, kwargs, netns=ns, timeout_s=timeout_s,
                              threads_per_rank=threads, env=env, stall_s=stall_s,
                              rank_env=rank_env)
    except (RankFailed, RankTimeout) as e:
        return {"variant": variant, "status": "fails", "reason": e.reason,
                "details": e.details[-4000:], "wall_s": time.perf_counter() - t0}
    if any("skipped" in r for r in ranks):
        return {"variant": variant, "status": "skipped",
                "reason": next(r["skipped"] for r in ranks if "skipped" in r)}
    return ranks


def time_row(module: str, variant: str, world: int, rate: float | None, steps: int,
             threads: int, link_s: float) -> dict:
    """A variant's row of a time table: ``module.time_rank(variant=, steps=, rate=)`` (a
    function calling :func:`timed_steps`) on ``world`` ranks at ``rate`` Mbit/s, ccfx's
    caches off, with deadlines from ``link_s``, the seconds one uncompressed step needs on the
    link (compiles take minutes: 600 s and 240 s of a silent log on top)."""
    t0 = time.perf_counter()
    ranks = run_timed(module, "time_rank", variant, world, rate,
                      {"variant": variant, "steps": steps, "rate": rate},
                      timeout_s=600 + 3 * link_s * (steps + 2), stall_s=240 + 3 * link_s,
                      threads=threads, env=CACHE_OFF)
    if isinstance(ranks, dict):  # failed or skipped: the row says why
        return ranks
    return step_row(variant, ranks, time.perf_counter() - t0)


def step_row(variant: str, ranks: list[dict], wall_s: float) -> dict:
    """A variant's row from its ranks' :func:`timed_steps`: the step time is the slowest
    rank's mean (a step ends when the last rank has its gradients), the loss rank 0's last,
    the wire bytes and the prediction rank 0's (and ``graphs`` where the ranks counted them)."""
    r0 = ranks[0]
    return {"variant": variant, "status": "ok",
            "step_s": max(statistics.mean(r["times"]) for r in ranks),
            "wire_bytes": r0["wire_bytes"], "loss": r0["losses"][-1],
            **({"graphs": r0["graphs"]} if "graphs" in r0 else {}),
            "predicted": r0.get("predicted"), "wall_s": wall_s}


# ---------------------------------------------------------------------------------------------
# Output.


def failed_row(row: dict, notes: list[str], columns: int) -> list[str]:
    """The table row of a variant that failed or was skipped (``row["status"]``), its reason
    appended to ``notes`` as a numbered note (reasons are too long for a cell)."""
    notes.append(f"({len(notes) + 1}) {row['variant']} {row['status']}: {row['reason']}")
    return [row["variant"], f"{row['status']} ({len(notes)})", *[""] * (columns - 2)]


def machine() -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def print_header(module: str, argv: list[str] | None) -> list[str]:
    """The run's first two lines, the command that reproduces it and the machine; returns
    the command's arguments (for the JSON)."""
    import shlex

    args = sys.argv[1:] if argv is None else list(argv)
    print(f"command: python -m {module} " + shlex.join(args))
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine().items()))
    return args


def table(rows: list[list], header: list[str]) -> str:
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def fmt(r):
        return "  ".join(c.rjust(w) for c, w in zip(r, widths))

    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths]), *map(fmt, cells[1:])])


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.strip().splitlines()[1:]))
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    return ap


def write_json(path: str | None, name: str, results: dict) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"bench": name, "machine": machine(), **results}, f, indent=2)
    print(f"wrote {path}")


def quiet() -> None:
    """Silence the warnings benchmarks do not act on (deprecations, fewer-stage notes)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
