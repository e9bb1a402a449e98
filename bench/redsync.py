"""RedSync's sampled threshold against exact top-k: encode time, achieved density, and a short
convergence sanity (issue 39, item 4).

Encode: one Gaussian fp32 tensor of ``--mb`` MB (16 M entries at 64), three encodes at the same
density, interleaved (A B C, C B A, ...: ``common.interleaved_times``), median of ``--reps``:

  torch.topk   exact top-k, ``torch.topk`` over every magnitude (``topk_encode_reference``:
               what the ``topk`` codec runs on CUDA)
  topk         the ``topk`` codec's encode as it runs on the CPU: a sampled cut, a compaction
               and a topk over the candidates (exactly torch.topk's set)
  redsync      the ``redsync`` codec's encode (its step advances: a new sample every call)

"x redsync" is each one's median over redsync's (above 1: redsync is faster). Wire is the
payload over the raw tensor; redsync's achieved density is the mean (and range) over its calls.

Convergence (``--steps`` > 0, not a test): bench.convergence's tiny GPT at 4 stages, data
parallel with world size 1 (each gradient bucket's codec a local round trip), gradients through
``topk:ratio=D,ef`` and ``redsync:density=D,ef``, and none; every variant of a seed starts from
the seed's initialisation and sees the same batches. Final loss = mean of the last 10 steps,
mean and std over seeds; redsync's achieved density is read from ``ccfx.codec_state``.

One torch thread by default (``--threads``): torch.topk is single-threaded on the CPU anyway,
and on a busy 2-core machine a second thread mostly adds noise.

    python -m bench.redsync                      # 64 MB, density 0.01; 100 steps x seeds 0 1 2
    python -m bench.redsync --steps 0            # encode timings only
    python -m bench.redsync --density 0.001 --reps 11
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch

import ccfx
from bench import common
from ccfx import codecs
from ccfx.codecs.redsync import densities
from ccfx.codecs.topk import topk_encode_reference


def encode_fns(x: torch.Tensor, density: float) -> tuple[dict, codecs.Codec]:
    """The three encodes of ``x`` by name, and the redsync codec (its state: the densities)."""
    topk = codecs.get(f"topk:ratio={density}")
    redsync = codecs.get(f"redsync:density={density}")
    k = topk.payload_layout(tuple(x.shape), x.dtype)[0][0][0]  # ceil(density * n)
    return {
        "torch.topk": lambda: topk_encode_reference(x, k),
        "topk": lambda: topk.encode(x),
        "redsync": lambda: redsync.encode(x),
    }, redsync


def time_encodes(mb: int, density: float, reps: int) -> dict:
    """Medians (seconds) of the three encodes, interleaved, and redsync's densities."""
    x = torch.randn(mb * 2**20 // 4, generator=torch.Generator().manual_seed(0))
    fns, redsync = encode_fns(x, density)
    seen = []
    timed = dict(fns, redsync=lambda: seen.append(_density_after(fns["redsync"], redsync)))
    samples = common.interleaved_times(timed, repeats=reps, warmup=2)
    raw = x.numel() * x.element_size()
    return {"numel": x.numel(), "density": density, "reps": reps,
            "medians": {k: statistics.median(v) for k, v in samples.items()},
            "samples": samples, "achieved": seen[-reps:],
            "wire": {name: codecs.get(spec).wire_bytes(tuple(x.shape), x.dtype) / raw
                     for name, spec in (("topk", f"topk:ratio={density}"),
                                        ("redsync", f"redsync:density={density}"))}}


def _density_after(encode, codec) -> float:
    encode()
    return float(codec.state_dict()["density"])


def encode_table(r: dict) -> str:
    med = r["medians"]
    rows = []
    for name in ("torch.topk", "topk", "redsync"):
        wire = r["wire"].get(name, r["wire"]["topk"])
        rows.append([name, f"{med[name] * 1e3:.1f} ms", f"{med[name] / med['redsync']:.2f}",
                     f"{wire:.4f}"])
    got = r["achieved"]
    return (common.table(rows, ["encode", "median", "x redsync", "wire/raw"]) +
            f"\nredsync achieved density: mean {statistics.mean(got):.5f}, range "
            f"{min(got):.5f}-{max(got):.5f} (target {r['density']:g}, {len(got)} calls)")


def train_one(spec: str | None, initial, data, *, seed: int, steps: int) -> dict:
    """One data-parallel run of bench.convergence's tiny GPT, gradients through ``spec``."""
    from bench.convergence import LAST, STAGES
    from ccfx.demo import DEMO_BATCH_SIZE, DEMO_LR, ccfx_compile, train

    torch._dynamo.reset()
    opts = {"stages": STAGES, "lowering": "eager", "activation_codec": "none",
            "activation_grad_codec": "none"}
    if spec is not None:
        opts.update(data_parallel=True, gradient_codec=spec)
    compiled = ccfx_compile(copy.deepcopy(initial), **opts)
    run = train(compiled, data, steps=steps, batch_size=DEMO_BATCH_SIZE,
                block_size=initial.config.block_size, seed=seed, lr=DEMO_LR, name=str(spec),
                progress=False)
    grads = ccfx.ledger_of(compiled).per_step("bucket")
    found = densities(ccfx.codec_state(compiled).state_dict())
    return {"spec": spec, "seed": seed, "final_loss": run.final_loss(LAST),
            "grad_wire": grads[1] / grads[0] if grads[0] else None,
            "densities": found, "wall_s": run.total_s}


def convergence(density: float, steps: int, seeds: list[int]) -> list[dict]:
    from bench.convergence import MODELS, corpus
    from ccfx.models import GPTConfig, TinyGPT

    data, vocab = corpus()
    config = GPTConfig(vocab_size=vocab, **MODELS["gpt"])
    runs = []
    for seed in seeds:
        torch.manual_seed(seed)
        initial = TinyGPT(config)
        for spec in (None, f"topk:ratio={density},ef", f"redsync:density={density},ef"):
            runs.append(train_one(spec, initial, data, seed=seed, steps=steps))
            print(f"  seed {seed} {spec}: final loss {runs[-1]['final_loss']:.4f} "
                  f"({runs[-1]['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return runs


def convergence_table(runs: list[dict]) -> str:
    rows = []
    for spec in dict.fromkeys(r["spec"] for r in runs):
        mine = [r for r in runs if r["spec"] == spec]
        losses = [r["final_loss"] for r in mine]
        std = statistics.stdev(losses) if len(losses) > 1 else 0.0
        dens = [d["mean"] for r in mine for d in r["densities"].values()]
        rows.append([spec or "none", f"{statistics.mean(losses):.4f} ({std:.3f})",
                     " ".join(f"{x:.4f}" for x in losses),
                     f"{mine[0]['grad_wire']:.4f}" if mine[0]["grad_wire"] else "1",
                     f"{statistics.mean(dens):.5f}" if dens else "-"])
    return common.table(rows, ["gradients", "final loss (std)", "per seed", "grad wire/raw",
                               "achieved density"])


def _parser():
    ap = common.parser(__doc__)
    ap.add_argument("--mb", type=int, default=64, help="tensor size in MB of fp32 (64)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=7, help="timed calls of each encode (7)")
    ap.add_argument("--steps", type=int, default=100, help="training steps per run; 0: none")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    common.quiet()
    torch.set_num_threads(a.threads)
    args = common.print_header("bench.redsync", argv)
    timing = time_encodes(a.mb, a.density, a.reps)
    print(f"\nencode, {a.mb} MB fp32 ({timing['numel']} entries), density {a.density:g}, "
          f"median of {a.reps}:")
    print(encode_table(timing))
    runs = convergence(a.density, a.steps, a.seeds) if a.steps > 0 else []
    if runs:
        print(f"\ntiny GPT, data parallel (world 1), {a.steps} AdamW steps, seeds "
              f"{' '.join(map(str, a.seeds))}; final loss = mean of the last 10 steps:")
        print(convergence_table(runs))
    common.write_json(a.json, "redsync", {"command": args, "encode": timing, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
