"""Compressed gossip (CHOCO-SGD) against data parallel at the same bytes (issue #39).

The tiny GPT (2 layers, width 128 by default) on N gloo ranks (default 4, a ring), each rank
its own stream of the embedded corpus, AdamW (lr 3e-3, weight decay 0.1), batch 8 per rank,
for ``--steps`` steps and each of ``--seeds``. Variants, all from the same initialisation and on
the same batches:

  dp-fp32        plain data parallel: gradients averaged by an fp32 all-reduce every step
  dp-int8        gradients averaged through int8 on ccfx's re-encoding ring every step
                 (:func:`ccfx.wire.ring.ring_all_reduce`: bit-identical replicas)
  gossip-topk    local AdamW steps, then a CHOCO gossip step on the ring (``ccfx.gossip``)
                 through topk, its ratio chosen so a rank sends no more bytes per step than
                 dp-int8 does (from the codecs' ``wire_bytes``: d = 2 neighbours × topk payload
                 ≤ ring_wire_bytes(int8)), γ = ``--gamma``
  no-comm        every rank trains alone

Reported per variant, mean ± spread over the seeds: the held-out loss (16 fixed batches of the
last 10 % of the corpus) of the mean model x̄ (for gossip the average of the ranks' models,
computed for the report only) and of rank 0's own model; the consensus error
mean_i ||x_i − x̄||² / ||x̄||² at the end; bytes a rank sends per step; and a *modelled* link
time per step (unshaped run: ranks on 127.0.0.1 of a shared 2-core VM, where wall times say
nothing about a link): each rank's NIC at ``--rate`` Mbit/s full duplex with ``--latency`` ms
per message; a ring all-reduce takes 2(W-1) sequential hops of a chunk, a gossip step sends its
payload to its d neighbours at once (one latency, d payloads through the NIC).

With ``--two-nodes MBIT`` the ranks run for real on bench.shaped's two nodes (ranks 0 … W/2-1
on one, the rest on the other, the link between them limited to MBIT Mbit/s, each node's
loopback not; the ring crosses it twice), and the table adds each variant's measured step (the
slowest rank's median, the first 3 steps dropped).

    python -m bench.gossip                       # 4 ranks, 150 steps, 3 seeds
    python -m bench.gossip --steps 20 --seeds 1 --world 2
    python -m bench.gossip --two-nodes 100 --steps 40 --seeds 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

VARIANTS = ("dp-fp32", "dp-int8", "gossip-topk", "no-comm")
GPT = {"block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 128}


def _data(seed: int, rank: int, batch: int):
    """(this rank's training batches, the held-out batches, vocabulary size)."""
    from ccfx.models import CharTokenizer, batches, load_corpus

    text = load_corpus()
    tok = CharTokenizer(text)
    data = tok.encode(text)
    cut = int(data.numel() * 0.9)
    held = batches(data[cut:], 16, GPT["block_size"], 10_000 + seed)
    return (batches(data[:cut], batch, GPT["block_size"], seed * 1000 + rank),
            [next(held) for _ in range(16)], tok.vocab_size)


def equal_bytes_ratio(numel: int, world: int) -> float:
    """The largest topk ratio (in steps of 1e-5) whose gossip bytes per rank per step on the
    ring are at most those of an int8 ring all-reduce of ``numel`` fp32 elements."""
    import torch

    from ccfx.runtime.gossip import gossip_wire_bytes
    from ccfx.wire.ring import ring_wire_bytes

    budget = ring_wire_bytes(numel, "int8", torch.float32, world)
    ratio = math.floor(budget / gossip_wire_bytes(numel, "none", world) * 4 / 8 * 1e5) / 1e5
    while gossip_wire_bytes(numel, f"topk:ratio={ratio}", world) > budget:
        ratio = round(ratio - 1e-5, 5)
    return ratio


def _average(grads, spec: str) -> None:
    """Average the gradients over the ranks (fp32 all-reduce, or ``spec`` on the ring)."""
    import torch
    import torch.distributed as dist

    from ccfx.wire.ring import ring_all_reduce

    flat = torch.cat([g.reshape(-1) for g in grads])
    if spec == "none":
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
    else:
        flat = ring_all_reduce(flat, spec)
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()


def _mean_model(model):
    """The mean of the ranks' models, in a copy (for the report only)."""
    import copy

    import torch
    import torch.distributed as dist

    mean = copy.deepcopy(model)
    with torch.no_grad():
        for p in mean.parameters():
            dist.all_reduce(p)
            p /= dist.get_world_size()
    return mean


def _train(rank: int, world: int, variant: str, seed: int, a: dict) -> dict:
    """One variant, one seed, on this rank: losses, bytes, the held-out losses, consensus."""
    import torch

    import ccfx
    from ccfx.models import GPTConfig, TinyGPT
    from ccfx.wire.ring import ring_wire_bytes

    train, held, vocab = _data(seed, rank, a["batch"])
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab_size=vocab, **GPT))
    numel = model.num_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    g = None
    if variant == "gossip-topk":
        g = ccfx.gossip(model, opt, spec=f"topk:ratio={a['ratio']}", gamma=a["gamma"])
    losses, times = [], []
    for _ in range(a["steps"]):
        start = time.perf_counter()
        x, y = next(train)
        loss = model(x, y)[1]
        loss.backward()
        if variant.startswith("dp-"):
            _average([p.grad for p in model.parameters()], "none" if variant == "dp-fp32"
                     else "int8")
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    sent = {"dp-fp32": ring_wire_bytes(numel, "none", torch.float32, world),
            "dp-int8": ring_wire_bytes(numel, "int8", torch.float32, world)}.get(variant, 0)
    row = {"variant": variant, "seed": seed, "params": numel, "train_last": losses[-10:],
           "step_s": statistics.median(times[3:] or times),
           "bytes_per_step": g.bytes_per_step if g is not None else sent,
           "consensus": g.consensus() if g is not None else _consensus(model)}
    with torch.no_grad():
        row["eval_mean"] = _evaluate(_mean_model(model), held)
        row["eval_rank0"] = _evaluate(model, held)
    if g is not None:
        g.close()
    return row


def _consensus(model) -> float:
    """The consensus error of ranks that do not gossip (zero for data parallel)."""
    import torch
    import torch.distributed as dist

    x = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    both = torch.cat([x, (x * x).sum().reshape(1)])
    dist.all_reduce(both)
    mean = both[:-1] / dist.get_world_size()
    norm = float((mean * mean).sum())
    return max(float(both[-1]) / dist.get_world_size() - norm, 0.0) / norm


def _evaluate(model, held) -> float:
    return sum(model(x, y)[1].item() for x, y in held) / len(held)


def bench_rank(rank: int, world: int, a: dict) -> list[dict]:
    """Every variant and seed on this rank, one after the other (one spawn)."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for seed in range(a["seeds"]):
        for variant in a["variants"]:
            rows.append(_train(rank, world, variant, seed, a))
            if rank == 0:
                print(f"[rank 0] seed {seed} {variant}: eval {rows[-1]['eval_mean']:.4f}",
                      flush=True)
    return rows


def shaped_rank(rank: int, world: int, **a) -> list[dict]:
    """:func:`bench_rank` under bench.shaped's ``run_ranks`` (keyword arguments, JSON out)."""
    return bench_rank(rank, world, a)


def _run(a, args: dict) -> list[dict]:
    """Rank 0's rows, each with ``step_s`` the slowest rank's (with ``--two-nodes``: on the
    shaped nodes; else spawned on 127.0.0.1)."""
    from ccfx.runtime.launch import spawn

    if a.two_nodes is None:
        return spawn(bench_rank, a.world, (args,), timeout_s=a.timeout, pg_timeout_s=600)[0]
    from bench.shaped import run_ranks, two_nodes

    with two_nodes(a.two_nodes) as nodes:
        ns, env = nodes.launch([r * 2 // a.world for r in range(a.world)])
        ranks = run_ranks("bench.gossip", "shaped_rank", a.world, args, netns=ns,
                          timeout_s=a.timeout, rank_env=env)
    return [{**row, "step_s": max(r[i]["step_s"] for r in ranks)}
            for i, row in enumerate(ranks[0])]


def link_s(variant: str, numel: int, world: int, ratio: float, rate_mbit: float,
           latency_ms: float) -> float:
    """Modelled seconds on the link per step (see the module docstring)."""
    import torch

    from ccfx.codecs import prototype
    from ccfx.runtime.gossip import neighbours
    from ccfx.wire.ring import chunk_payload_bytes

    bps, lat = rate_mbit * 1e6 / 8, latency_ms / 1e3
    if variant.startswith("dp-"):
        spec = "none" if variant == "dp-fp32" else "int8"
        chunk = max(chunk_payload_bytes(numel, spec, torch.float32, world))
        return 2 * (world - 1) * (lat + chunk / bps)
    if variant == "gossip-topk":
        payload = prototype(f"topk:ratio={ratio}").wire_bytes((numel,), torch.float32)
        return lat + len(neighbours(0, world, "ring")) * payload / bps
    return 0.0


def _summary(rows: list[dict], a) -> list[dict]:
    """Per variant over the seeds: mean and spread of the figures, rank 0's view."""
    out = []
    for v in a.variants:
        mine = [r for r in rows if r["variant"] == v]
        ev = [r["eval_mean"] for r in mine]
        out.append({
            "variant": v, "seeds": len(mine), "params": mine[0]["params"],
            "eval_mean": statistics.fmean(ev),
            "eval_spread": (max(ev) - min(ev)) / 2,
            "eval_rank0": statistics.fmean(r["eval_rank0"] for r in mine),
            "train_last": statistics.fmean(statistics.fmean(r["train_last"]) for r in mine),
            "consensus": statistics.fmean(r["consensus"] for r in mine),
            "bytes_per_step": mine[0]["bytes_per_step"],
            "step_s": statistics.fmean(r["step_s"] for r in mine),
            "link_ms": 1e3 * link_s(v, mine[0]["params"], a.world, a.ratio, a.rate,
                                    a.latency)})
    return out


def _table(summary: list[dict], a) -> str:
    from bench.common import table

    rows = [[s["variant"], f"{s['eval_mean']:.4f} ± {s['eval_spread']:.4f}",
             f"{s['eval_rank0']:.4f}", f"{s['train_last']:.4f}", f"{s['consensus']:.2e}",
             f"{s['bytes_per_step'] / 1e3:.1f}", f"{s['link_ms']:.1f}"] for s in summary]
    header = ["variant", "held-out loss of x̄", "of rank 0", "train (last 10)",
              "consensus", "kB sent/rank/step", f"link ms/step @{a.rate:g} Mbit"]
    if a.two_nodes is not None:
        for row, s in zip(rows, summary):
            row.append(f"{s['step_s'] * 1e3:.0f}")
        header.append(f"measured ms/step, 2 nodes @{a.two_nodes:g} Mbit")
    return table(rows, header)


def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--rate", type=float, default=100.0, help="modelled link, Mbit/s")
    p.add_argument("--latency", type=float, default=1.0, help="modelled latency, ms/message")
    p.add_argument("--two-nodes", type=float, default=None, metavar="MBIT",
                   help="run on bench.shaped's two nodes, the link between them at MBIT")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", default=None)
    return p


def main(argv=None) -> int:
    from bench.common import write_json
    from ccfx.models import CharTokenizer, GPTConfig, TinyGPT, load_corpus

    a = _parser().parse_args(argv)
    vocab = CharTokenizer(load_corpus()).vocab_size
    numel = TinyGPT(GPTConfig(vocab_size=vocab, **GPT)).num_parameters()
    a.ratio = equal_bytes_ratio(numel, a.world)
    args = {k: getattr(a, k) for k in ("steps", "seeds", "batch", "gamma", "variants", "ratio")}
    rows = _run(a, args)
    summary = _summary(rows, a)
    print(f"compressed gossip vs data parallel: tiny GPT {rows[0]['params']} params, "
          f"{a.world} ranks (ring), {a.steps} steps, {a.seeds} seeds, topk ratio {a.ratio} "
          f"(bytes ≤ dp-int8's), gamma {a.gamma}")
    print(_table(summary, a))
    write_json(a.json, "gossip", {"world": a.world, "two_nodes_mbit": a.two_nodes,
                                  "steps": a.steps, "seeds": a.seeds,
                                  "gamma": a.gamma, "ratio": a.ratio, "summary": summary,
                                  "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
