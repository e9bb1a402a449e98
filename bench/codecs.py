"""Codec throughput over ``torch.clone`` bandwidth, measured in the same run (issue 3, Numbers).

For each tensor size and codec: encode+decode round-trip throughput (input bytes / second)
divided by clone throughput on the same tensor, eager and compiled (the CPU fast path,
``ccfx.codecs._fast``), plus the exact wire ratio. On CUDA (when present) the same table runs
the Triton kernels.

    python bench/codecs.py                      # 64 MB fp32, every codec
    python bench/codecs.py --mb 1 16 256 --codecs int8 fp16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ccfx import codecs


def _time(fn, reps: int) -> float:
    fn()  # warm-up (and compile)
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def bench(mb: float, specs, reps: int, device: str, modes):
    n = int(mb * 2**20) // 4
    x = torch.randn(n // 4096, 4096, device=device)  # 2-D, so powersgd compresses
    nbytes = x.numel() * x.element_size()
    clone_s = _time(lambda: x.clone(), reps)
    print(f"\n{mb:g} MB fp32 on {device}: clone {nbytes / clone_s / 1e9:.2f} GB/s")
    print(f"{'codec':<12} {'wire':>7} " + " ".join(f"{m + ' xclone':>14}" for m in modes))
    for spec in specs:
        codec = codecs.get(spec)
        cells = []
        for mode in modes:
            os.environ["CCFX_CODEC_COMPILE"] = {"eager": "0", "compiled": "1"}[mode]
            s = _time(lambda c=codec: c.decode(c.encode(x)), reps)
            cells.append(f"{clone_s / s:>14.2f}")
        ratio = codec.wire_bytes(x.shape, x.dtype) / nbytes
        print(f"{spec:<12} {ratio:>7.4f} " + " ".join(cells), flush=True)
    os.environ.pop("CCFX_CODEC_COMPILE", None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[64])
    ap.add_argument("--codecs", nargs="+", default=codecs.names())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"])
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    modes = ["eager"] if device == "cuda" else args.modes
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for mb in args.mb:
        bench(mb, args.codecs, args.reps, device, modes)


if __name__ == "__main__":
    main()
