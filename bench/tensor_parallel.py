"""Tensor-parallel training on a bandwidth-limited link: torch's own TP, with and without ccfx's
compressed collectives.

The model is a GPT written for tensor parallelism (:class:`TPGPT`: separate q / k / v / o
projections, so torch's ``ColwiseParallel`` / ``RowwiseParallel`` shard whole heads; 4 layers,
width 512, 12.7 M parameters), parallelized with ``parallelize_module`` on a 1-D DeviceMesh of
gloo CPU ranks (q, k, v and the MLP's up projection column-wise, o and the MLP's down projection
row-wise: Megatron's layout). Every TP rank sees the same batch. Each block puts two all-reduces
in the forward graph (after o and after the down projection) and one per column-wise input in
the backward graph; ccfx's ``collective_codec`` replaces each by its compressed form (an encoded
reduce-scatter, then an all-gather of the owners' encoded sums: every rank decodes the same
bytes).

Variants (all compiled, AdamW, the same seed on every rank):

* ``inductor``: ``torch.compile(backend="inductor")``, uncompressed: the baseline;
* ``ccfx-none``: ``backend="ccfx"`` with ``collective_codec="none"`` (must match the baseline);
* ``ccfx-int8``, ``ccfx-fp8``, ``ccfx-bf16``: ``collective_codec`` set to that codec;
* ``ccfx-auto``: ``collective_codec="auto"`` with the shaped link's rate (``link_gbps``,
  ``link_shared``): the planner picks per collective, and its predicted step is printed beside
  the measured one (the goal: within 25 %).

Two parts:

* ``--part time`` (default): each variant on 2 (or ``--world``) ranks inside a fresh network
  namespace whose loopback is limited with tc tbf (bench/shaped.py; root), 2 warm-up steps then N
  timed steps; the step time is the slowest rank's mean. "x inductor" is the baseline's step time
  over the variant's, measured in the same table.
* ``--part loss``: unshaped, ``--steps`` steps on the embedded corpus for each ``--seeds``
  seed, the held-out loss per seed, and the mean and spread per variant: a codec whose mean is
  within the baseline's spread costs nothing measurable here.

    python -m bench.tensor_parallel                        # time part, 100 and 1000 Mbit/s, 2 ranks
    python -m bench.tensor_parallel --part loss --seeds 0 1 2 --steps 150
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench import common
from bench.shaped import ShapingUnavailable, exit_cleanly_on_sigterm, run_ranks

WIDTH, LAYERS, HEADS, BLOCK, VOCAB = 512, 4, 8, 64, 96
BATCH, LR = 8, 3e-3
CODECS = {"ccfx-none": "none", "ccfx-int8": "int8", "ccfx-fp8": "fp8", "ccfx-bf16": "bf16",
          "ccfx-auto": "auto"}
#: The link ``auto`` plans for in the loss part (unshaped): the time part's slowest rate.
LOSS_PLAN_MBIT = 100.0
VARIANTS = ("inductor", *CODECS)
EVAL_BATCHES = 8


# ---------------------------------------------------------------------------------------------
# The model: a GPT whose projections TP can shard head by head.


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: this rank's share of them once q/k/v are sharded column-wise
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TPGPT(nn.Module):
    def __init__(self, width: int = WIDTH, layers: int = LAYERS, heads: int = HEADS,
                 vocab: int = VOCAB, block: int = BLOCK):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def tp_plan(model: TPGPT) -> dict:
    """Megatron's layout in torch's TP styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.blocks)):
        for name in ("attn.q", "attn.k", "attn.v", "up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def num_parameters(**kw) -> int:
    return sum(p.numel() for p in TPGPT(**kw).parameters())


# ---------------------------------------------------------------------------------------------
# What one rank runs.


_log = common.log


def _options(variant: str, rate: float | None) -> dict:
    """ccfx's options for a variant; ``auto`` plans for the shaped link (``rate`` Mbit/s, one
    loopback every rank's bytes cross: shared)."""
    out = {"collective_codec": CODECS[variant]}
    if CODECS[variant] == "auto":
        out.update(link_gbps=(rate or LOSS_PLAN_MBIT) / 1000, link_shared=True)
    return out


def _build(variant: str, seed: int, world: int, rate: float | None = None):
    """The model parallelized over every rank and compiled for ``variant``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    model = TPGPT()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, tp_plan(model))
    if variant == "inductor":
        compiled = torch.compile(model, backend="inductor")
    else:
        compiled = torch.compile(model, backend="ccfx", options=_options(variant, rate))
    return model, compiled


def time_rank(rank: int, world: int, *, variant: str, steps: int, warmup: int = 2,
              seed: int = 0, rate: float | None = None) -> dict:
    """Warm up (compiles), barrier, time ``steps`` steps on a fixed random batch
    (:func:`bench.common.timed_steps`)."""
    try:
        model, compiled = _build(variant, seed, world, rate)
    except Exception as e:
        if type(e).__name__ == "ConfigError":
            return {"skipped": f"ccfx rejects the options: {str(e).splitlines()[0]}"}
        raise
    return common.timed_steps(rank, fixed_batch_step(model, compiled, seed), steps=steps,
                              warmup=warmup, compiled=compiled)


def fixed_batch_step(model: nn.Module, compiled, seed: int):
    """One AdamW training step of ``compiled`` (``model``'s parameters) on a fixed random
    batch drawn with ``seed``, returning the loss: what the time parts time."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def loss_rank(rank: int, world: int, *, variant: str, steps: int, seed: int) -> dict:
    """``steps`` AdamW steps on the corpus (the same batches on every TP rank), then the
    held-out loss."""
    model, compiled = _build(variant, seed, world)
    return {**train_on_corpus(rank, model, compiled, steps=steps, train_seed=1000 + seed,
                              held_seed=10_000 + seed, log_every=25),
            "chosen": _chosen(compiled)}


def train_on_corpus(rank: int, model: nn.Module, compiled, *, steps: int, train_seed: int,
                    held_seed: int, log_every: int) -> dict:
    """``steps`` AdamW steps of ``compiled`` (``model``'s parameters) on the embedded corpus's
    first 90 % (batches drawn with ``train_seed``), then the mean loss of ``EVAL_BATCHES``
    batches of the rest (``held_seed``): ``held_out`` and the training's seconds."""
    from ccfx.models import CharTokenizer, batches, load_corpus

    text = load_corpus()
    data = CharTokenizer(text).encode(text)
    cut = int(data.numel() * 0.9)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train = batches(data[:cut], BATCH, BLOCK, train_seed)
    held = batches(data[cut:], BATCH, BLOCK, held_seed)
    held_out = [next(held) for _ in range(EVAL_BATCHES)]

    def step(i: int) -> None:
        x, y = next(train)
        opt.zero_grad(set_to_none=True)
        compiled(x, y).backward()
        opt.step()

    def say(i: int, _) -> None:
        if i % log_every == 0:
            _log(rank, f"step {i} ({time.perf_counter() - t0:.0f} s)")

    t0 = time.perf_counter()
    common.run_steps(step, steps, say=say)
    with torch.no_grad():
        val = sum(compiled(x, y).item() for x, y in held_out) / len(held_out)
    return {"held_out": val, "train_s": time.perf_counter() - t0}


def _chosen(compiled) -> str | None:
    """What ran on each collective (``auto``'s choice), as "forward int8 x8, backward ..."."""
    import collections

    import ccfx

    try:
        rows = ccfx.plan_of(compiled).collectives
    except Exception:  # noqa: BLE001 (another backend)
        return None
    counts = collections.Counter((c.part, c.codec) for c in rows)
    return ", ".join(f"{part} {codec} x{n}" for (part, codec), n in sorted(counts.items()))


# ---------------------------------------------------------------------------------------------
# The parent.


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _activation_bytes() -> int:
    return BATCH * BLOCK * WIDTH * 4


def _link_s(world: int, rate: float | None) -> float:
    """Seconds the uncompressed all-reduces of one step need: per layer 2 in the forward and 4
    in the backward (q, k, v and up each all-reduce their input's gradient), each a ring moving
    2(W-1)/W of an activation out of each of W ranks over one shared loopback."""
    if rate is None:
        return 0.0
    per_step = 6 * LAYERS * _activation_bytes() * 2 * (world - 1)
    return per_step * 8 / (rate * 1e6)


def formula_mib(variant: str, world: int) -> float | None:
    """Bytes one rank sends to its all-reduces per step by the wire layer's formula (MiB): per
    layer 2 forward and 4 backward all-reduces of one activation, each ``2 (W-1)/W`` of it
    uncompressed, ``2 (W-1)`` packed chunks compressed; None for ``auto`` (per collective)."""
    from ccfx.wire.collectives import CollectiveCall, CompressedCollective

    spec = "none" if variant == "inductor" else CODECS[variant]
    if spec == "auto":
        return None
    call = CollectiveCall("all_reduce", (BATCH, BLOCK, WIDTH), torch.float32, world, "sum")
    return 6 * LAYERS * CompressedCollective(call, spec).wire_bytes() / 2**20


def run_time(variant: str, world: int, rate: float | None, steps: int, threads: int) -> dict:
    return common.time_row("bench.tensor_parallel", variant, world, rate, steps, threads,
                           _link_s(world, rate))


def time_table(rows: list[dict], world: int) -> tuple[list[list[str]], list[str]]:
    base = next((r for r in rows if r["variant"] == "inductor" and r["status"] == "ok"), None)
    out, notes = [], []
    for r in rows:
        if r["status"] != "ok":
            out.append(common.failed_row(r, notes, 6))
            continue
        ratio = f"{base['step_s'] / r['step_s']:.2f}" if base else "-"
        wire = "-" if r["wire_bytes"] is None else f"{r['wire_bytes'] / 2**20:.2f}"
        formula = formula_mib(r["variant"], world)
        out.append([r["variant"], f"{r['step_s']:.3f}", ratio, wire,
                    "-" if formula is None else f"{formula:.2f}", f"{r['loss']:.4f}"])
        p = r.get("predicted")
        if p:  # the planner's step against what ran: as chosen, and uncompressed (inductor's)
            line = (f"planner ({r['variant']}): predicted {p['chosen_s']:.3f} s/step as chosen, "
                    f"measured {r['step_s']:.3f} ({p['chosen_s'] / r['step_s'] - 1:+.0%})")
            if base:
                line += (f"; predicted {p['uncompressed_s']:.3f} s uncompressed, inductor "
                         f"measured {base['step_s']:.3f} "
                         f"({p['uncompressed_s'] / base['step_s'] - 1:+.0%})")
            notes.append(line + " (the prediction leaves out the optimizer step)")
    return out, notes


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--part", choices=("time", "loss"), default="time")
    ap.add_argument("--rates", nargs="+", default=["100", "1000"],
                    help="link rates in Mbit/s ('none': unshaped); time part")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps (time part, default 3) or training steps (loss, 150)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="loss part")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = ap.parse_args(argv)
    exit_cleanly_on_sigterm()
    params = num_parameters()
    print(f"TPGPT: {LAYERS} layers, width {WIDTH}, {params / 1e6:.1f} M parameters; "
          f"{a.world} TP ranks, batch {BATCH} x {BLOCK} tokens (the same on every rank)")
    results: dict = {"params": params, "world": a.world, "part": a.part}
    if a.part == "time":
        rates = [None if r.lower() in ("none", "unshaped") else float(r) for r in a.rates]
        steps = a.steps or 3
        results["tables"] = []
        try:
            for rate in rates:
                rows = []
                for v in a.variants:
                    _progress(f"[{'unshaped' if rate is None else f'{rate:g} Mbit/s'}] {v} ...")
                    row = run_time(v, a.world, rate, steps, a.threads)
                    _progress(f"    {row['status']}" + (f" {row['step_s']:.3f} s/step"
                                                       if row["status"] == "ok" else
                                                       f": {row['reason']}"))
                    rows.append(row)
                label = "unshaped" if rate is None else f"{rate:g} Mbit/s"
                print(f"\n{label}, {a.world} ranks, {steps} timed steps after 2 warm-up")
                cells, notes = time_table(rows, a.world)
                print(common.table(cells, ["variant", "s/step", "x inductor",
                                           "wire MiB/step/rank", "formula", "loss"]))
                print("\n".join(notes), flush=True)
                results["tables"].append({"rate_mbit": rate, "rows": rows})
        except ShapingUnavailable as e:
            print(f"cannot shape the network: {e}", file=sys.stderr)
            return 2
    else:
        steps = a.steps or 150
        rows = []
        for v in a.variants:
            vals = []
            for seed in a.seeds:
                _progress(f"[loss] {v} seed {seed} ...")
                ranks = run_ranks("bench.tensor_parallel", "loss_rank", a.world,
                                  {"variant": v, "steps": steps, "seed": seed}, netns=None,
                                  timeout_s=1800, threads_per_rank=a.threads,
                                  env=common.CACHE_OFF)
                vals.append(ranks[0]["held_out"])
                if ranks[0].get("chosen") and CODECS.get(v) == "auto":
                    _progress(f"    {v} ran: {ranks[0]['chosen']}")
            sd = statistics.stdev(vals) if len(vals) > 1 else math.nan
            rows.append([v, " ".join(f"{x:.4f}" for x in vals),
                         f"{statistics.mean(vals):.4f} ± {sd:.4f}"])
            results.setdefault("loss", {})[v] = vals
        print(f"\nheld-out loss after {steps} steps ({len(a.seeds)} seeds)")
        print(common.table(rows, ["variant", "per seed", "mean ± std"]))
    common.write_json(a.json, "tensor_parallel", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
