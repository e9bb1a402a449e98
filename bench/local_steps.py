"""Local steps (DiLoCo, Streaming DiLoCo) beside DDP and per-step PowerSGD on slow links (#11).

The tiny GPT (or a ≥ 10 M-parameter GPT) trained on N gloo ranks (default 4), each rank its own
stream of the embedded corpus, AdamW (lr 6e-3, betas 0.9/0.95, weight decay 0.1, gradients
clipped at 1), batch 8 per rank. Variants:

  ddp           torch DDP, gradients all-reduced uncompressed at every step
  powersgd      ccfx per-step data parallel: the model compiled with backend="ccfx",
                data_parallel=True, gradient_codec="powersgd:rank=4,ef" (as bench/data_parallel)
  H<h>-<codec>  ccfx.local_steps(model, opt, sync_every=h, outer_codec=...) on the plain model:
                h inner AdamW steps per replica, then the pseudo-gradient is averaged through the
                codec (none, int8, int4, topk = "topk:ratio=0.01,ef") and an outer SGD steps the
                global parameters. Streaming off: fragments=1, fragment_delay=0.
  H<h>-<codec>-s  streaming on: --fragments P (4; 2 where h // 4 < 2) strided fragments, one
                every h/P steps, each exchanged on a background thread for --delay τ (1) inner
                steps and merged with --alpha α (0.5): local ← (1-α)·global + α·local.
                ``-s<P>d<τ>`` sets P and τ for that variant (H200-int8-s4d25).
  ...@<outer>   the outer optimizer: "diloco" (lr 0.7, momentum 0.9, Nesterov; ccfx's default),
                "fedavg" (lr 1, momentum 0: the plain average), or "lr=X,momentum=Y[,nesterov]".
                ``--outer`` lists those applied to every local-steps variant without its own.
  no-comm-all   every rank trains alone, nothing exchanged (the same CPU sharing as the ranks)

Two parts, because this 2-core machine runs the 4 ranks on shared cores and a full matrix of
trainings through a shaped link would take hours:

1. ``--part loss``: the loss does not depend on the link, so every variant trains ``--steps``
   steps unshaped (ranks on 127.0.0.1, bench.shaped.run_ranks without a namespace), from the
   same initialisation (seed), each rank on the same batches in every variant (same tokens).
   Reported: the held-out loss (32 fixed batches of 16 windows from the last 10 % of the corpus,
   which no rank trains on) of the global parameters after the final sync (``finish()``; for
   per-step variants the model, for no-comm-all rank 0's own), and of rank 0's own model (with
   streaming and α > 0 replicas differ by their last steps, and a fragment's global copy is up
   to h·(P-1)/P steps old at the end); the mean training loss over ranks of the last 10 steps;
   the payload bytes a rank contributes per step (DDP: 4 B per gradient element; PowerSGD: the
   ledger's gradient buckets; local steps: ``LocalSteps.wire_bytes`` over the steps).
2. ``--part time``: per rate (``--rates``, Mbit/s) and variant, fresh ranks in a fresh network
   namespace (bench/shaped.py). Setup and warm-up run unshaped (DDP and PowerSGD 2 steps,
   compiling included; local steps one full period of h steps, every fragment synced once), then
   rank 0 adds the tc tbf qdisc to the namespace's loopback (the one bench/shaped.py uses:
   burst 256kb, latency 50ms) and every rank times whole sync periods (``--periods``, at least
   ``--min-timed`` steps: any window of k·h steps holds exactly k syncs and k merges of every
   fragment); DDP and PowerSGD a few steps. Step time = the slowest rank's wall time over the
   timed steps divided by their number, the syncs included; "step / own quiet step" divides it
   by the mean of the variant's own timed steps in which no exchange started, ran or merged
   (slowest rank): a compute-only reference from the same run, which the machine's load drift
   (other jobs on the 2 cores) moves less than the separate no-comm-all run. Shaping after
   setup keeps the initial parameter broadcasts (43 MB each for the 10 M model) off the slow
   link; they are not timed either way. Bytes: the payload counts above over the timed steps, and the bytes the
   namespace's ``lo`` sent during them (/sys/class/net/lo/statistics/tx_bytes, read by rank 0
   before and after the timed region): every rank's traffic, TCP/IP headers and ACKs included
   (an all-gather of W ranks moves W·(W-1) payloads; a ring all-reduce 2(W-1); lo's 64 KiB
   MTU keeps the headers near 0.1 %).

Goals read off the tables (printed, not asserted): ≥ 100× fewer bytes per step than DDP at a
held-out loss within 3 % of DDP's; at 10 Mbit/s a step within 1.2× of the no-comm-all step.

    python -m bench.local_steps --part loss                         # tiny GPT, 4 ranks, 600 steps
    python -m bench.local_steps --part time --rates 10 100
    python -m bench.local_steps --part time --model 10m --variants ddp powersgd H50-int8 \\
        H50-int8-s no-comm-all --periods 1
    python -m bench.local_steps --quick                             # a minute-sized look at both
"""

from __future__ import annotations

import copy
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from bench import common
from bench.shaped import (
    RankFailed,
    RankTimeout,
    ShapingUnavailable,
    exit_cleanly_on_sigterm,
    run_ranks,
    shaped_namespace,
)

#: GPT shapes. "tiny" is tests/test_dp_training.py's (0.11 M parameters, 0.43 MB in fp32);
#: "demo" the demo's 3.2 M; "10m" 10.7 M (42.8 MB). ``step_s``: a generous estimate of one
#: step on 4 ranks sharing 2 cores (for deadlines only).
MODELS = {
    "tiny": {"gpt": {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32}, "step_s": 0.3},
    "demo": {"gpt": {"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 64}, "step_s": 3.0},
    "10m": {"gpt": {"n_layer": 6, "n_embd": 384, "n_head": 6, "block_size": 64}, "step_s": 8.0},
}
CODECS = {"none": "none", "int8": "int8", "int4": "int4", "topk": "topk:ratio=0.01,ef"}
#: Rough wire/raw of each codec, for deadlines only (measured ratios come from the runs).
_CODEC_RATIO = {"none": 1.0, "int8": 0.27, "int4": 0.14, "topk": 0.05}
POWERSGD = "powersgd:rank=4,ef"
OUTERS = {"diloco": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
          "fedavg": {"lr": 1.0, "momentum": 0.0, "nesterov": False}}
HS = (10, 50, 200)
PER_STEP = ("ddp", "powersgd")
NO_COMM = "no-comm-all"
LR, BATCH, LAST = 6e-3, 8, 10
EVAL_BATCHES, EVAL_BATCH = 32, 16
VAL_FRACTION = 0.1
TBF = {"burst": "256kb", "latency": "50ms"}  # bench.shaped.shaped_namespace's defaults


def default_variants() -> list[str]:
    out = ["ddp", "powersgd"]
    for h in HS:
        for codec in CODECS:
            out += [f"H{h}-{codec}", f"H{h}-{codec}-s"]
    return [*out, NO_COMM]


# ---------------------------------------------------------------------------------------------
# Variants.


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "ddp", "powersgd", "local", "nocomm"
    h: int = 0
    codec: str = "none"  # the short name (CODECS)
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    outer: str = "diloco"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True

    @property
    def streaming(self) -> bool:
        return self.fragments > 1

    def options(self, collective: str) -> dict:
        """ccfx.local_steps' options of a local-steps variant."""
        return {"sync_every": self.h, "outer_codec": CODECS[self.codec],
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "outer_nesterov": self.outer_nesterov, "fragments": self.fragments,
                "fragment_delay": self.delay, "fragment_alpha": self.alpha,
                "outer_collective": collective}


def parse_outer(text: str) -> tuple[str, dict]:
    """("diloco" | "fedavg" | a canonical "lr=..,momentum=..[,nesterov]", its settings)."""
    if text in OUTERS:
        return text, dict(OUTERS[text])
    out = {"lr": None, "momentum": 0.0, "nesterov": False}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = {"m": "momentum"}.get(key.strip(), key.strip())
        if key == "nesterov" and not value:
            out["nesterov"] = True
        elif key in ("lr", "momentum") and value:
            out[key] = float(value)
        else:
            raise ValueError(f"outer setting {text!r}: use diloco, fedavg or "
                             "lr=X,momentum=Y[,nesterov]")
    if out["lr"] is None:
        raise ValueError(f"outer setting {text!r} has no lr=")
    label = f"lr={out['lr']:g},momentum={out['momentum']:g}" + (
        ",nesterov" if out["nesterov"] else "")
    return label, out


_LOCAL = re.compile(r"H(\d+)-(\w+?)(-s(?:(\d+)d(\d+))?)?(?:@(.+))?")


def parse_variant(text: str, *, fragments: int = 4, delay: int = 1, alpha: float = 0.5,
                  outer: str = "diloco") -> Variant:
    """A variant name (see the module docstring) as a Variant."""
    if text in PER_STEP:
        return Variant(text, text)
    if text == NO_COMM:
        return Variant(text, "nocomm")
    m = _LOCAL.fullmatch(text)
    if not m or m.group(2) not in CODECS:
        raise ValueError(f"unknown variant {text!r}: ddp, powersgd, {NO_COMM}, or "
                         f"H<h>-<{'|'.join(CODECS)}>[-s[<P>d<τ>]][@<outer>]")
    h, codec = int(m.group(1)), m.group(2)
    label, o = parse_outer(m.group(6) or outer)
    if not m.group(3):
        p, d, a = 1, 0, 0.0
    elif m.group(4):
        p, d, a = int(m.group(4)), int(m.group(5)), alpha
    else:
        p = fragments if h // fragments >= 2 else 2
        d, a = delay, alpha
    base = text.split("@")[0]
    return Variant(f"{base}@{label}" if label != "diloco" else base, "local", h, codec, p, d, a,
                   label, o["lr"], o["momentum"], o["nesterov"])


def expand_variants(names: list[str], outers: list[str], **streaming) -> list[Variant]:
    """Each name under each ``--outer`` setting (local steps without their own ``@``)."""
    out, seen = [], set()
    for name in names:
        per = outers if _LOCAL.fullmatch(name) and "@" not in name else [None]
        for o in per:
            v = parse_variant(name, outer=o or "diloco", **streaming)
            if v.name not in seen:
                seen.add(v.name)
                out.append(v)
    return out


# ---------------------------------------------------------------------------------------------
# What one rank runs (imported by bench.shaped's worker).


def _log(rank: int, msg: str) -> None:
    """Progress on the rank's log: the parent treats a silent log as a hang (``stall_s``)."""
    print(f"[rank {rank}] {msg}", flush=True)


def _data(block_size: int, seed: int, rank: int, batch: int):
    """(this rank's endless training batches, the fixed held-out batches, vocabulary size).
    Training windows come from the first 90 % of the corpus, held-out ones from the rest."""
    from ccfx.models import CharTokenizer, batches, load_corpus

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    cut = int(data.numel() * (1 - VAL_FRACTION))
    held = batches(data[cut:], EVAL_BATCH, block_size, 10_000 + seed)
    held_out = [next(held) for _ in range(EVAL_BATCHES)]
    return (batches(data[:cut], batch, block_size, seed * 1000 + rank), held_out,
            tokenizer.vocab_size)


def _evaluate(model, held_out) -> float:
    import torch

    with torch.no_grad():
        return sum(model(x, y)[1].item() for x, y in held_out) / len(held_out)


class _Run:
    """One rank's model wrapped for a variant: ``step(x, y)`` trains one step and returns the
    loss; ``payload()`` the bytes this rank has handed to its collectives so far."""

    def __init__(self, variant: dict, gpt: dict, seed: int, lowering: str, collective: str,
                 vocab: int, lr: float, sync_timeout: float | None = None):
        import torch

        from ccfx.models import GPTConfig, TinyGPT

        v = Variant(**variant)
        self.v = v
        torch.manual_seed(seed)
        self.model = TinyGPT(GPTConfig(vocab_size=vocab, **gpt))
        self.numel = self.model.num_parameters()
        self.net, self.outer = self.model, None
        if v.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.model)
        elif v.kind == "powersgd":
            self.net = torch.compile(self.model, backend="ccfx", fullgraph=True, options={
                "data_parallel": True, "gradient_codec": POWERSGD, "lowering": lowering})
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95),
                                     weight_decay=0.1)
        if v.kind == "local":
            import ccfx

            extra = {} if sync_timeout is None else {"collective_timeout_s": sync_timeout}
            self.outer = ccfx.local_steps(self.model, self.opt, **v.options(collective),
                                          **extra)
        self.steps = 0

    def step(self, x, y) -> float:
        import torch

        _, loss = self.net(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.steps += 1
        return loss.item()

    def payload(self) -> float:
        if self.v.kind == "ddp":
            return 4.0 * self.numel * self.steps
        if self.v.kind == "powersgd":
            import ccfx

            return float(ccfx.ledger_of(self.net).totals("bucket")[1])
        if self.v.kind == "local":
            return float(self.outer.wire_bytes)
        return 0.0

    def global_model(self):
        """The model with the global parameters (local steps), else the model itself."""
        import torch

        if self.outer is None:
            return self.model
        params = self.outer.global_parameters()
        model = copy.deepcopy(self.model)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        return model


def _collectives(outer) -> list[str] | None:
    """How each fragment's pseudo-gradient was averaged (None without local steps)."""
    if outer is None:
        return None
    found = getattr(outer, "collectives", None)
    return list(found) if found is not None else [getattr(outer, "collective", "?")]


def _progress(rank: int, i: int, total: int, loss: float, last: list[float], what: str) -> None:
    now = time.monotonic()
    if now - last[0] > 5.0 or i + 1 == total:
        last[0] = now
        _log(rank, f"{what} step {i + 1}/{total}: loss {loss:.4f}")


def loss_rank(rank: int, world: int, *, variant: dict, gpt: dict, steps: int, batch: int,
              lr: float, seed: int, lowering: str, collective: str,
              sync_timeout: float | None = None) -> dict:
    """Train ``steps`` steps; every step's loss on this rank, the held-out losses, the payload."""
    stream, held_out, vocab = _data(gpt["block_size"], seed, rank, batch)
    run = _Run(variant, gpt, seed, lowering, collective, vocab, lr, sync_timeout)
    _log(rank, f"{run.v.name} ready ({run.numel} parameters)"
         + (f": {run.outer!r}" if run.outer is not None else ""))
    last = [time.monotonic()]
    t0 = time.perf_counter()
    losses = common.run_steps(lambda i: run.step(*next(stream)), steps, say=lambda i, loss:
                              _progress(rank, i, steps, loss, last, f"{run.v.name} train"))
    if run.outer is not None:
        run.outer.finish()
    wall = time.perf_counter() - t0
    out = {"losses": losses, "payload": run.payload(), "steps": steps, "wall_s": wall,
           "eval_local": _evaluate(run.model, held_out), "params": run.numel,
           "syncs": run.outer.syncs if run.outer is not None else None,
           "collective": _collectives(run.outer)}
    if rank == 0:
        out["eval_global"] = _evaluate(run.global_model(), held_out)
    if run.outer is not None:
        run.outer.close()
    return out


def loss_ranks(rank: int, world: int, *, variants: list[dict], results: str, **kwargs) -> None:
    """``loss_rank`` for each variant in turn in these processes (one start-up for the lot);
    after each, rank 0 appends every rank's result to the JSON-lines file ``results``, so the
    parent keeps what finished when a later variant fails."""
    import json

    import torch
    import torch.distributed as dist

    for variant in variants:
        torch._dynamo.reset()  # each compiles from scratch, as in a fresh process
        out = loss_rank(rank, world, variant=variant, **kwargs)
        gathered = [None] * world
        dist.all_gather_object(gathered, out)
        if rank == 0:
            with open(results, "a") as f:
                f.write(json.dumps({"variant": variant["name"], "ranks": gathered}) + "\n")


def _sync_state(outer) -> tuple[int, bool]:
    """(merges so far, whether an exchange is in flight): a step that changes neither, with
    nothing in flight, is a "quiet" step, compute alone (the in-run no-communication step)."""
    if outer is None:
        return 0, False
    return outer.syncs, any(f.in_flight is not None for f in getattr(outer, "fragments", ()))


def _lo_tx_bytes() -> int:
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def _shape_link(netns: str, rate_mbit: float) -> None:
    """Add the tbf qdisc to this namespace's loopback (rank 0, after setup and warm-up). Refuses
    unless this process is inside ``netns``: never the machine's own loopback."""
    me = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True,
                        text=True, check=False).stdout.strip()
    if me != netns:
        raise RuntimeError(f"not inside the benchmark's namespace {netns!r} (in {me!r}): "
                           "refusing to shape this loopback")
    cmd = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{rate_mbit:g}mbit",
           "burst", TBF["burst"], "latency", TBF["latency"]]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


def time_rank(rank: int, world: int, *, variant: dict, gpt: dict, warmup: int, steps: int,
              rate_mbit: float | None, netns: str | None, batch: int, lr: float, seed: int,
              lowering: str, collective: str, sync_timeout: float | None = None) -> dict:
    """Warm up unshaped, shape the link, time ``steps`` steps; the wall time, the payload and
    (rank 0) the loopback's bytes over the timed steps."""
    import torch.distributed as dist

    stream, _, vocab = _data(gpt["block_size"], seed, rank, batch)
    run = _Run(variant, gpt, seed, lowering, collective, vocab, lr, sync_timeout)
    _log(rank, f"{run.v.name} ready; warm-up {warmup} steps (unshaped)")
    last = [time.monotonic()]
    common.run_steps(lambda i: run.step(*next(stream)), warmup,
                     say=lambda i, loss: _progress(rank, i, warmup, loss, last, "warm-up"))
    dist.barrier()
    if rank == 0 and rate_mbit is not None:
        _shape_link(netns, rate_mbit)
        _log(rank, f"loopback shaped to {rate_mbit:g} Mbit/s")
    dist.barrier()
    tx0 = _lo_tx_bytes() if rank == 0 else 0
    pay0, syncs0 = run.payload(), (run.outer.syncs if run.outer else 0)
    dist.barrier()
    before, quiet = [], []

    def prepare(i: int):
        batch = next(stream)
        before.append(_sync_state(run.outer))
        return batch

    def say(i: int, loss: float, _) -> None:
        quiet.append(before[i] == _sync_state(run.outer) and not before[i][1])
        _progress(rank, i, steps, loss, last, "timed")

    t0 = time.perf_counter()
    losses, times = common.time_steps(lambda b: run.step(*b), steps, prepare=prepare, say=say)
    wall = time.perf_counter() - t0
    out = {"wall_s": wall, "steps": steps, "payload": run.payload() - pay0,
           "syncs": (run.outer.syncs - syncs0) if run.outer else None, "losses": losses,
           "params": run.numel, "times": times, "quiet": quiet}
    dist.barrier()  # every rank's timed traffic is on the wire before rank 0 reads it
    if rank == 0:
        out["lo_tx"] = _lo_tx_bytes() - tx0
    if run.outer is not None:
        run.outer.close()
    return out


# ---------------------------------------------------------------------------------------------
# The parent.


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _env(v: Variant) -> dict | None:
    # ccfx rewrites the compiled backward: keep inductor's caches from replaying another graph.
    return ({"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
            if v.kind == "powersgd" else None)


def _numel(gpt: dict) -> int:
    from ccfx.models import GPTConfig, TinyGPT

    return TinyGPT(GPTConfig(vocab_size=96, **gpt)).num_parameters()  # the corpus has 96


def _sync_link_s(v: Variant, numel: int, world: int, rate_mbit: float | None) -> float:
    """An upper bound on the seconds one exchange keeps the link busy: an all-gather of the
    whole model's (compressed) fp32 payload, W·(W-1) payloads on the one loopback."""
    if rate_mbit is None or world < 2 or v.kind == "nocomm":
        return 0.0
    ratio = {"ddp": 1.0, "powersgd": 0.05}.get(v.kind, _CODEC_RATIO.get(v.codec, 1.0))
    return world * (world - 1) * 4 * numel * ratio * 8 / (rate_mbit * 1e6)


def _deadlines(v: Variant, numel: int, world: int, rate: float | None, steps: int,
               step_s: float, syncs: int) -> tuple[float, float]:
    """(timeout, stall) in seconds: generous, but a hung run is caught within minutes."""
    link = _sync_link_s(v, numel, world, rate)
    base = 300.0 if v.kind == "powersgd" else 120.0
    per_step_links = steps if v.kind in PER_STEP else syncs
    return (base + 2 * steps * step_s + 2 * per_step_links * link + 300.0,
            base + 2 * link)


def _launch(func: str, v: Variant, world: int, args: dict, *, netns: str | None,
            timeout: float, stall: float, threads: int) -> dict:
    t0 = time.perf_counter()
    try:
        ranks = run_ranks("bench.local_steps", func, world, {"variant": asdict(v), **args},
                          netns=netns, timeout_s=timeout, threads_per_rank=threads,
                          env=_env(v), stall_s=stall)
    except (RankFailed, RankTimeout) as e:
        return {"variant": v.name, "status": "fails", "reason": e.reason, "details": str(e),
                "wall_s": time.perf_counter() - t0}
    return {"variant": v.name, "status": "ok", "ranks": ranks,
            "wall_s": time.perf_counter() - t0, "load": os.getloadavg()[0]}


def _describe(v: Variant) -> dict:
    return {"kind": v.kind, "h": v.h or None, "codec": CODECS[v.codec] if v.kind == "local" else
            (POWERSGD if v.kind == "powersgd" else ("none" if v.kind == "ddp" else None)),
            "fragments": v.fragments, "delay": v.delay, "alpha": v.alpha,
            "outer": v.outer if v.kind == "local" else None}


def _loss_batch(batch: list[Variant], a) -> tuple[dict[str, list[dict]], str | None, str]:
    """Run ``batch`` in one launch: (variant name → its ranks' results, for those that
    finished; the failure's one-line reason and details, if the launch failed)."""
    import json
    import tempfile

    gpt, step_s = MODELS[a.model]["gpt"], MODELS[a.model]["step_s"]
    limits = [_deadlines(v, _numel(gpt), a.world, None, a.steps, step_s, 0) for v in batch]
    timeout = a.timeout or sum(t for t, _ in limits)
    stall = max(st for _, st in limits)
    env = next((e for e in map(_env, batch) if e), None)
    with tempfile.TemporaryDirectory(prefix="ccfx-bench-") as tmp:
        results = os.path.join(tmp, "results.jsonl")
        reason = details = None
        try:
            run_ranks("bench.local_steps", "loss_ranks", a.world,
                      {"variants": [asdict(v) for v in batch], "results": results,
                       "gpt": gpt, "steps": a.steps, "batch": a.batch, "lr": a.lr,
                       "seed": a.seed, "lowering": a.lowering, "collective": a.collective,
                       "sync_timeout": a.collective_timeout},
                      netns=None, timeout_s=timeout, threads_per_rank=a.threads, env=env,
                      stall_s=stall)
        except (RankFailed, RankTimeout) as e:
            reason, details = e.reason, str(e)
        done = {}
        if os.path.exists(results):
            with open(results) as f:
                for line in f:
                    got = json.loads(line)
                    done[got["variant"]] = got["ranks"]
    return done, reason, details


def _loss_row(v: Variant, ranks: list[dict], steps: int) -> dict:
    per_step = [statistics.fmean(rk["losses"][i] for rk in ranks) for i in range(steps)]
    return {"variant": v.name, "status": "ok", **_describe(v),
            "eval_global": ranks[0]["eval_global"], "eval_rank0": ranks[0]["eval_local"],
            "eval_ranks": [rk["eval_local"] for rk in ranks],
            "train_last": statistics.fmean(per_step[-LAST:]), "train_losses": per_step,
            "bytes_per_step": ranks[0]["payload"] / steps,
            "bytes_per_step_ranks": [rk["payload"] / steps for rk in ranks],
            "syncs": ranks[0]["syncs"], "collective": ranks[0]["collective"],
            "params": ranks[0]["params"], "train_s": max(rk["wall_s"] for rk in ranks)}


def run_loss(variants: list[Variant], a) -> list[dict]:
    """Every variant's row. One launch runs them all in turn (``--launch batched``); if it
    fails, the variants it had not finished run one launch each, so a failure is its own."""
    _say(f"[loss, {a.world} ranks] {' '.join(v.name for v in variants)}")
    rows: dict[str, dict] = {}
    pending = variants if a.launch == "each" else []
    if a.launch == "batched":
        t0 = time.perf_counter()
        done, reason, _ = _loss_batch(variants, a)
        for v in variants:
            if v.name in done:
                rows[v.name] = _loss_row(v, done[v.name], a.steps)
        pending = [v for v in variants if v.name not in done]
        _say(f"    {len(done)} of {len(variants)} variants in one launch "
             f"({time.perf_counter() - t0:.0f} s)" + (f"; failed: {reason}" if reason else ""))
    for v in pending:
        t0 = time.perf_counter()
        done, reason, details = _loss_batch([v], a)
        rows[v.name] = (_loss_row(v, done[v.name], a.steps) if v.name in done else
                        {"variant": v.name, "status": "fails", **_describe(v),
                         "reason": reason, "details": details})
        _say(f"    {v.name}: {rows[v.name]['status']} ({time.perf_counter() - t0:.0f} s)")
    for v in variants:
        r = rows[v.name]
        if _ok(r):
            _say(f"    {v.name}: eval {r['eval_global']:.4f}, train {r['train_last']:.4f}, "
                 f"{r['bytes_per_step'] / 1e3:.2f} KB/step, {r['train_s']:.0f} s training")
        else:
            _say(f"    {v.name}: {r['status']}: {r['reason']}")
    return [rows[v.name] for v in variants]


def _timed_steps(v: Variant, a, rate: float | None, numel: int) -> tuple[int, int]:
    """(warm-up, timed) steps of a variant: per-step variants a few (fewer where one step is
    long on the link), local steps whole periods."""
    if v.kind == "local":
        periods = max(a.periods, math.ceil(a.min_timed / v.h))
        return v.h, v.h * periods
    if v.kind == "nocomm":
        return 3, a.nocomm_steps
    link = _sync_link_s(v, numel, a.world, rate) / (a.world / 2)  # ring: 2(W-1), not W(W-1)
    return 2, a.dp_steps or max(1, min(10, int(30 / max(link, 1e-9))))


def _save_partial(a, results: list[dict]) -> None:
    """The time part's rows so far, to ``--json`` (a run killed half-way keeps them)."""
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({"bench": "local_steps", "partial": True, "machine": common.machine(),
                       "command": a.argv, "time": {"results": results}}, f, indent=2)


def run_time(variants: list[Variant], a) -> list[dict]:
    gpt = MODELS[a.model]["gpt"]
    step_s = MODELS[a.model]["step_s"]
    numel = _numel(gpt)
    results = []
    for rate in a.rates:
        rows = []
        for v in variants:  # no-comm-all again at every rate: this machine's load drifts
            r_rate = None if v.kind == "nocomm" else rate
            warmup, steps = _timed_steps(v, a, r_rate, numel)
            syncs = (warmup + steps) // v.h * v.fragments + 1 if v.kind == "local" else 0
            timeout, stall = _deadlines(v, numel, a.world, r_rate, warmup + steps, step_s, syncs)
            if a.collective_timeout and v.kind == "local":  # a sync may be silent that long
                stall = max(stall, a.collective_timeout + 60)
                timeout = max(timeout, stall * (syncs + 1))
            _say(f"[time, {_rate_label(r_rate)}, {a.world} ranks] {v.name}: {warmup} warm-up + "
                 f"{steps} timed steps ...")
            with shaped_namespace(None) as ns:  # shaped by rank 0 after the warm-up
                r = _launch("time_rank", v, a.world,
                            {"gpt": gpt, "warmup": warmup, "steps": steps, "rate_mbit": r_rate,
                             "netns": ns, "batch": a.batch, "lr": a.lr, "seed": a.seed,
                             "lowering": a.lowering, "collective": a.collective,
                             "sync_timeout": a.collective_timeout},
                            netns=ns, timeout=a.timeout or timeout, stall=stall,
                            threads=a.threads)
            row = {**r, **_describe(v), "rate_mbit": r_rate, "warmup": warmup}
            row.pop("ranks", None)
            if r["status"] == "ok":
                ranks = r["ranks"]
                quiet = [statistics.fmean(t for t, q in zip(rk["times"], rk["quiet"]) if q)
                         for rk in ranks if any(rk["quiet"])]
                row.update(step_s=max(rk["wall_s"] for rk in ranks) / steps, steps=steps,
                           quiet_step_s=max(quiet) if v.kind in ("local", "nocomm") and quiet
                           else None,
                           bytes_per_step=ranks[0]["payload"] / steps,
                           lo_bytes_per_step=ranks[0]["lo_tx"] / steps,
                           syncs=ranks[0]["syncs"], params=ranks[0]["params"],
                           rank_wall_s=[rk["wall_s"] for rk in ranks])
                _say(f"    {row['step_s']:.3f} s/step, {row['bytes_per_step'] / 1e3:.2f} KB/step"
                     f"/rank payload, lo {row['lo_bytes_per_step'] / 1e3:.2f} KB/step "
                     f"({row['wall_s']:.0f} s)")
            else:
                _say(f"    {r['status']}: {r['reason']}")
            rows.append(row)
            _save_partial(a, results + [{"rate_mbit": rate, "rows": rows}])
        results.append({"rate_mbit": rate, "rows": rows})
    return results


# ---------------------------------------------------------------------------------------------
# Tables.


def _rate_label(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g} Mbit/s"


def _ok(row: dict | None) -> bool:
    return bool(row) and row.get("status") == "ok"


def _stream_label(row: dict) -> str:
    if row["kind"] != "local":
        return "-"
    return "off" if row["fragments"] == 1 else f"P={row['fragments']} τ={row['delay']} " \
                                                  f"α={row['alpha']:g}"


def _fewer(ddp: dict | None, row: dict) -> str:
    if not _ok(ddp) or not _ok(row) or not row["bytes_per_step"]:
        return "-"
    return f"{ddp['bytes_per_step'] / row['bytes_per_step']:.0f}"


def _pct(x: float | None, base: float | None) -> str:
    return "-" if x is None or base is None else f"{(x / base - 1) * 100:+.1f} %"


LOSS_HEADER = ["variant", "codec", "H", "streaming", "outer", "syncs", "KB/step/rank",
               "x fewer B than DDP", "eval (global)", "loss vs DDP", "eval rank 0",
               "train last 10", "train vs DDP"]


def loss_table(rows: list[dict]) -> tuple[list[list[str]], list[str]]:
    ddp = next((r for r in rows if r["variant"] == "ddp"), None)
    base_eval = ddp["eval_global"] if _ok(ddp) else None
    base_train = ddp["train_last"] if _ok(ddp) else None
    cells, notes = [], []
    for r in rows:
        head = [r["variant"], r["codec"] or "-", str(r["h"] or "-"), _stream_label(r),
                r["outer"] or "-"]
        if not _ok(r):
            notes.append(f"({len(notes) + 1}) {r['variant']} {r['status']}: {r['reason']}")
            cells.append([*head, f"{r['status']} ({len(notes)})", *[""] * 7])
            continue
        cells.append([*head, str(r["syncs"] if r["syncs"] is not None else "-"),
                      f"{r['bytes_per_step'] / 1e3:.3f}", _fewer(ddp, r),
                      f"{r['eval_global']:.4f}", _pct(r["eval_global"], base_eval),
                      f"{r['eval_rank0']:.4f}", f"{r['train_last']:.4f}",
                      _pct(r["train_last"], base_train)])
    return cells, notes


def loss_goals(rows: list[dict]) -> list[str]:
    ddp = next((r for r in rows if r["variant"] == "ddp"), None)
    if not _ok(ddp):
        return ["goals: need the ddp row"]
    met, near = [], []
    for r in rows:
        if not _ok(r) or r["kind"] != "local" or not r["bytes_per_step"]:
            continue
        fewer = ddp["bytes_per_step"] / r["bytes_per_step"]
        gap = r["eval_global"] / ddp["eval_global"] - 1
        (met if fewer >= 100 and gap <= 0.03 else near).append((r["variant"], fewer, gap))
    lines = [("goal ≥ 100x fewer bytes than DDP at a held-out loss within 3 % of DDP's "
              f"(DDP eval {ddp['eval_global']:.4f}):")]
    lines.append("  met by: " + (", ".join(f"{n} ({f:.0f}x, {g:+.1%})" for n, f, g in met)
                                 or "none"))
    lines.append("  not met: " + (", ".join(f"{n} ({f:.0f}x, {g:+.1%})" for n, f, g in near)
                                  or "none"))
    return lines


TIME_HEADER = ["variant", "streaming", "timed steps", "syncs", "s/step", "step / no-comm-all",
               "step / own quiet step", "x DDP speed", "payload KB/step/rank", "x fewer B than DDP",
               "lo KB/step (all ranks)", "load"]


def time_table(rows: list[dict]) -> tuple[list[list[str]], list[str]]:
    ddp = next((r for r in rows if r["variant"] == "ddp"), None)
    ref = next((r for r in rows if r["variant"] == NO_COMM), None)
    cells, notes = [], []
    for r in rows:
        head = [r["variant"], _stream_label(r)]
        if not _ok(r):
            notes.append(f"({len(notes) + 1}) {r['variant']} {r['status']}: {r['reason']}")
            cells.append([*head, f"{r['status']} ({len(notes)})", *[""] * 9])
            continue
        cells.append([
            *head, str(r["steps"]), str(r["syncs"] if r["syncs"] is not None else "-"),
            f"{r['step_s']:.3f}",
            f"{r['step_s'] / ref['step_s']:.2f}" if _ok(ref) else "-",
            f"{r['step_s'] / r['quiet_step_s']:.2f}" if r.get("quiet_step_s") else "-",
            f"{ddp['step_s'] / r['step_s']:.1f}" if _ok(ddp) else "-",
            f"{r['bytes_per_step'] / 1e3:.3f}", _fewer(ddp, r),
            f"{r['lo_bytes_per_step'] / 1e3:.2f}", f"{r['load']:.1f}"])
    return cells, notes


def time_goals(rate: float | None, rows: list[dict]) -> list[str]:
    ref = next((r for r in rows if r["variant"] == NO_COMM), None)
    if rate != 10 or not _ok(ref):
        return []
    ok = [r for r in rows if _ok(r) and r["kind"] not in ("nocomm",)]
    met = [r for r in ok if r["step_s"] <= 1.2 * ref["step_s"]]
    own = [r for r in ok if r.get("quiet_step_s") and r["step_s"] <= 1.2 * r["quiet_step_s"]]
    return [f"goal at 10 Mbit/s, a step within 1.2x of no-comm-all ({ref['step_s']:.3f} s): "
            + (", ".join(f"{r['variant']} ({r['step_s'] / ref['step_s']:.2f})" for r in met)
               or "none"),
            "  within 1.2x of its own quiet steps: "
            + (", ".join(f"{r['variant']} ({r['step_s'] / r['quiet_step_s']:.2f})" for r in own)
               or "none")]


# ---------------------------------------------------------------------------------------------


QUICK = {"steps": 40, "variants": ["ddp", "powersgd", "H10-int8", "H10-int8-s", NO_COMM],
         "rates": ["100"], "periods": 1, "min_timed": 20, "nocomm_steps": 20, "dp_steps": 2}


def _parser():
    """The command line: the parts, the model, the variants, the link rates and the run's limits."""
    ap = common.parser(__doc__)
    ap.add_argument("--part", choices=("loss", "time", "both"), default="both")
    ap.add_argument("--model", choices=list(MODELS), default="tiny",
                    help="tiny (0.11 M, default), demo (3.2 M), 10m (10.7 M)")
    ap.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--variants", nargs="+", default=None, metavar="VARIANT",
                    help="default (also 'all'): ddp powersgd, H{10,50,200} x "
                         "{none,int8,int4,topk} with streaming off and on (-s), no-comm-all")
    ap.add_argument("--outer", nargs="+", default=["diloco"],
                    help="outer settings for local-steps variants without their own @: "
                         "diloco, fedavg, lr=X,momentum=Y[,nesterov] (default diloco)")
    ap.add_argument("--fragments", type=int, default=4, help="streaming: fragments P (4)")
    ap.add_argument("--delay", type=int, default=1, help="streaming: fragment_delay τ (1)")
    ap.add_argument("--alpha", type=float, default=0.5, help="streaming: fragment_alpha α (0.5)")
    ap.add_argument("--collective", choices=("all_gather", "ring", "auto"), default="all_gather",
                    help="outer_collective of the non-summable codecs (default all_gather)")
    ap.add_argument("--steps", type=int, default=600, help="loss part: training steps (600)")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"sequences per rank ({BATCH})")
    ap.add_argument("--lr", type=float, default=LR, help=f"AdamW learning rate ({LR:g})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rates", nargs="+", default=["10", "100"],
                    help="time part: link rates in Mbit/s (default 10 100)")
    ap.add_argument("--periods", type=int, default=2,
                    help="time part: sync periods timed per local-steps variant (2)")
    ap.add_argument("--min-timed", type=int, default=100,
                    help="time part: at least this many timed steps (whole periods; 100)")
    ap.add_argument("--dp-steps", type=int, default=None,
                    help="time part: timed steps of ddp and powersgd (default: ~30 s of link "
                         "time, 1 to 10)")
    ap.add_argument("--nocomm-steps", type=int, default=100,
                    help="time part: timed steps of no-comm-all (100)")
    ap.add_argument("--lowering", choices=("eager", "inductor"), default="eager",
                    help="powersgd's ccfx lowering (default eager)")
    ap.add_argument("--launch", choices=("batched", "each"), default="batched",
                    help="loss part: every variant in one launch of the ranks, in turn "
                         "(default; a failure reruns the rest one launch each), or one each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    ap.add_argument("--collective-timeout", type=float, default=None,
                    help="local steps' collective_timeout_s (default ccfx's, 300 s): a sync "
                         "slower than this fails")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per variant run (default: estimated)")
    ap.add_argument("--quick", action="store_true",
                    help="a small look: 40 loss steps, 5 variants, 100 Mbit/s, short timings "
                         "(explicit options win)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(args)
    a.argv = args
    if a.quick:
        given = {s.split("=")[0].lstrip("-").replace("-", "_") for s in args if s.startswith("--")}
        for k, val in QUICK.items():
            if k not in given:
                setattr(a, k, val)
    exit_cleanly_on_sigterm()
    common.quiet()
    a.rates = [None if r.lower() in ("none", "unshaped") else float(r) for r in a.rates]
    try:
        names = [n for v in (a.variants or ["all"])
                 for n in (default_variants() if v == "all" else [v])]
        variants = expand_variants(names, a.outer,
                                   fragments=a.fragments, delay=a.delay, alpha=a.alpha)
    except ValueError as e:
        ap.error(str(e))
    gpt = MODELS[a.model]["gpt"]
    common.print_header("bench.local_steps", args)
    out: dict = {"command": args, "model": a.model, "gpt": gpt, "world": a.world,
                 "batch_per_rank": a.batch, "lr": a.lr, "seed": a.seed,
                 "collective": a.collective, "variants": [asdict(v) for v in variants]}
    t_start = time.perf_counter()
    if a.part in ("loss", "both"):
        out["loss"] = _loss_part(variants, a)
    if a.part in ("time", "both"):
        t0 = time.perf_counter()
        try:
            results = run_time(variants, a)
        except ShapingUnavailable as e:
            print(f"cannot make a network namespace: {e}", file=sys.stderr)
            return 2
        out["time"] = {"periods": a.periods, "min_timed": a.min_timed, "results": results,
                       "wall_s": time.perf_counter() - t0}
        for res in results:
            print(f"\ntime part: {a.model} GPT, {a.world} ranks, {_rate_label(res['rate_mbit'])}"
                  f" (tc tbf after an unshaped warm-up), batch {a.batch}/rank, {a.threads} "
                  "thread(s)/rank; s/step = slowest rank over the timed steps, syncs included; "
                  "no-comm-all unshaped; lo = the namespace loopback's tx bytes, every rank, "
                  "headers included; load = the machine's 1-minute load average after the run")
            cells, notes = time_table(res["rows"])
            print(common.table(cells, TIME_HEADER))
            print("\n".join(notes + time_goals(res["rate_mbit"], res["rows"])), flush=True)
        print(f"time part: {out['time']['wall_s']:.0f} s", flush=True)
    out["wall_s"] = time.perf_counter() - t_start
    common.write_json(a.json, "local_steps", out)
    return 0


def _loss_part(variants: list, a) -> dict:
    """The loss part (every variant unshaped) and its table; its entry of the JSON."""
    gpt = MODELS[a.model]["gpt"]
    t0 = time.perf_counter()
    rows = run_loss(variants, a)
    part = {"steps": a.steps, "rows": rows, "wall_s": time.perf_counter() - t0}
    params = next((r["params"] for r in rows if _ok(r)), None)
    print(f"\nloss part: {MODELS[a.model]['gpt']} GPT"
          + (f", {params / 1e6:.2f} M parameters" if params else "")
          + f", {a.world} ranks, {a.steps} steps of {a.batch} x {gpt['block_size']} tokens "
          f"per rank, AdamW lr {a.lr:g}, seed {a.seed}; unshaped; eval = held-out loss of "
          "the global parameters after finish(); train = mean over ranks of the last "
          f"{LAST} steps; bytes = payload a rank contributes per step")
    cells, notes = loss_table(rows)
    print(common.table(cells, LOSS_HEADER))
    print("\n".join(notes + loss_goals(rows)))
    print(f"loss part: {part['wall_s']:.0f} s", flush=True)
    return part


if __name__ == "__main__":
    sys.exit(main())
