"""Codec throughput over ``torch.clone`` bandwidth, measured in the same run (issue 3, Numbers).

For each tensor size and codec, the encode+decode round trip and the encode alone, as
throughput (input bytes / second) over the throughput of ``torch.clone`` on the same tensor.
Every codec's timings are interleaved with clone's (clone, codec, clone, codec, ...) and the
ratio is of the medians, so a machine that slows down mid-run moves both.

CPU: the eager torch reference and the compiled one (the CPU fast path, ``ccfx.codecs._fast``).
Page faults matter there: a fresh 64 MB tensor costs ~16k minor faults, which on a VM is most
of clone's time, and a round trip must allocate the payload *and* the decoded tensor. The
``ceiling`` column is what that alone allows, ``raw / (raw + wire)``; ``faults`` is the round
trip's minor faults per call over clone's. The last row, ``naive int8``, is the plainest
blockwise int8 round trip compiled by inductor (the issue's yardstick): what this machine
allows for that computation today, beside ccfx's int8.

Which allocator regime a run measures matters more than any codec: glibc maps every block over
its (moving) mmap threshold fresh, so what is "cold" changes during a run. ``--allocator``
pins it (the script re-executes itself with glibc's ``MALLOC_*`` variables set):
``cold`` maps every block ≥ 128 KiB fresh (page faults on every call: clone is fault-bound);
``warm`` never returns memory to the system (no faults after warm-up: clone runs at memory
bandwidth and the codecs' compute shows); ``default`` leaves glibc alone.

CUDA (chosen whenever torch sees one): the Triton kernels (the default there), the eager torch
reference and the inductor-compiled reference (at ``--inductor-mb`` sizes only, 64 MB by default,
to stay within the time budget: compiling takes seconds per codec and size), timed with
``triton.testing.do_bench`` (``--rep-ms`` of repeats each). A codec that fails there is
reported on its row and the others still run; the exit status is then 1.

    python -m bench.codecs                            # 64 MB fp32, every codec
    python -m bench.codecs --mb 1 16 64 256 --codecs int8 fp16
    python -m bench.codecs --allocator warm           # no page faults: compute vs bandwidth
    python -m bench.codecs --json codecs.json         # the figures, machine-readable
    python -m bench.codecs --inductor-mb              # CUDA: Triton and eager torch only
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import sys
import time

import torch

from ccfx import codecs

from . import common

CPU_MODES = {"eager": "0", "compiled": "1"}  # CCFX_CODEC_COMPILE for each


@contextlib.contextmanager
def compile_mode(value: str):
    old = os.environ.get("CCFX_CODEC_COMPILE")
    os.environ["CCFX_CODEC_COMPILE"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CCFX_CODEC_COMPILE", None)
        else:
            os.environ["CCFX_CODEC_COMPILE"] = old


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def paired_cpu(fn, baseline, reps: int) -> dict:
    """Median seconds of ``fn`` and ``baseline``, interleaved, and ``fn``'s faults per call."""
    for _ in range(3):  # warm-up (and compile); the warm allocator grows its heap meanwhile
        fn(), baseline()
    a, b, faults = [], [], 0
    for _ in range(reps):
        t = time.perf_counter()
        baseline()
        b.append(time.perf_counter() - t)
        f = _faults()
        t = time.perf_counter()
        fn()
        a.append(time.perf_counter() - t)
        faults += _faults() - f
    return {"s": statistics.median(a), "base_s": statistics.median(b), "faults": faults / reps}


def cuda_time(fn, rep_ms: int = 100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") / 1e3


def sample(mb: float, device: str) -> torch.Tensor:
    n = int(mb * 2**20) // 4
    gen = torch.Generator(device=device).manual_seed(0)
    return torch.randn(max(n // 4096, 1), 4096, device=device, generator=gen)  # 2-D: powersgd


def naive_int8(block: int = 256):
    """The issue's yardstick: the plainest blockwise int8 round trip, compiled by inductor (no
    NaN handling, no ragged last block, no FLT_MAX clamp). What this machine allows for that
    shape of computation, measured beside ccfx's int8."""

    @torch.compile(dynamic=False)
    def encode(x):
        rows = x.view(-1, block)
        scale = rows.abs().amax(1, keepdim=True) / 127
        return (rows / scale).round().to(torch.int8), scale

    @torch.compile(dynamic=False)
    def decode(q, scale, shape):
        return (q.float() * scale).view(shape)

    def roundtrip(x):
        with torch.no_grad():
            return decode(*encode(x), x.shape)

    return roundtrip


def bench_cpu(x, specs, reps, modes):
    nbytes = x.numel() * x.element_size()
    f0 = _faults()
    x.clone()
    clone_faults = _faults() - f0
    clone_s = paired_cpu(x.clone, x.clone, reps)["s"]
    print(f"clone {nbytes / clone_s / 1e9:.2f} GB/s, {clone_faults} faults per call")
    rows = []
    head = f"{'codec':<10} {'wire':>7} {'ceiling':>7}"
    head += "".join(f" {m + ' rt':>11} {m + ' enc':>12}" for m in modes)
    print(head + f" {'faults':>7}")
    for spec in specs:
        codec = codecs.get(spec)
        wire = codec.wire_bytes(x.shape, x.dtype) / nbytes
        # The identity's payload is the input itself: only decode allocates.
        row = {"codec": spec, "wire": wire, "ceiling": 1.0 if codec.lossless else 1 / (1 + wire)}
        for mode in modes:
            with compile_mode(CPU_MODES[mode]):
                rt = paired_cpu(lambda c=codec: c.decode(c.encode(x)), x.clone, reps)
                enc = paired_cpu(lambda c=codec: c.encode(x), x.clone, reps)
            row[f"{mode}_rt"] = rt["base_s"] / rt["s"]
            row[f"{mode}_enc"] = enc["base_s"] / enc["s"]
            row["faults"] = rt["faults"] / max(clone_faults, 1)
        rows.append(row)
        cells = "".join(f" {row[m + '_rt']:>11.2f} {row[m + '_enc']:>12.2f}" for m in modes)
        print(f"{spec:<10} {wire:>7.4f} {row['ceiling']:>7.3f}{cells} {row['faults']:>7.2f}",
              flush=True)
    if x.numel() % 256 == 0:
        naive = naive_int8()
        rt = paired_cpu(lambda: naive(x), x.clone, reps)
        rows.append({"codec": "naive-int8", "compiled_rt": rt["base_s"] / rt["s"]})
        print(f"naive int8 (the plainest int8 round trip, compiled): "
              f"{rows[-1]['compiled_rt']:.2f} rt over clone")
    return rows


def bench_cuda(x, specs, compiled: bool, rep_ms: int = 100):
    clone_s = cuda_time(x.clone, rep_ms)
    nbytes = x.numel() * x.element_size()
    print(f"clone {nbytes / clone_s / 1e9:.0f} GB/s")
    impls = {"triton": ("auto", "0"), "torch": ("reference", "0")}
    if compiled:
        impls["inductor"] = ("reference", "1")
    print(f"{'codec':<10} {'wire':>7}" + "".join(f" {k + ' enc':>13} {k + ' rt':>12}" for k in impls)
          + f" {'triton/torch':>12}" + (f" {'triton/ind':>10}" if compiled else ""))
    rows = []
    for spec in specs:
        codec = codecs.get(spec)
        row = {"codec": spec, "wire": codec.wire_bytes(x.shape, x.dtype) / nbytes}
        try:
            for impl, (choice, comp) in impls.items():
                with codecs.implementation(choice), compile_mode(comp):
                    row[f"{impl}_enc"] = clone_s / cuda_time(lambda c=codec: c.encode(x), rep_ms)
                    row[f"{impl}_rt"] = clone_s / cuda_time(
                        lambda c=codec: c.decode(c.encode(x)), rep_ms)
        except Exception as e:  # noqa: BLE001 (a GPU check: report the codec, time the others)
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(f"{spec:<10} FAILED ({impl}): {row['error']}", flush=True)
            rows.append(row)
            continue
        cells = "".join(f" {row[k + '_enc']:>13.2f} {row[k + '_rt']:>12.2f}" for k in impls)
        cells += f" {row['triton_rt'] / row['torch_rt']:>12.2f}"
        if compiled:
            cells += f" {row['triton_rt'] / row['inductor_rt']:>10.2f}"
        print(f"{spec:<10} {row['wire']:>7.4f}{cells}", flush=True)
        rows.append(row)
    return rows


ALLOCATORS = {
    "cold": {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"},
    "warm": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
}


def pin_allocator(regime: str) -> None:
    """Re-execute this script with ``regime``'s glibc variables (read at process start only)."""
    want = ALLOCATORS.get(regime, {})
    if all(os.environ.get(k) == v for k, v in want.items()):
        return
    env = {**os.environ, **want}
    os.execve(sys.executable, [sys.executable, "-m", "bench.codecs", *sys.argv[1:]], env)


def main():
    ap = common.parser(__doc__)
    ap.add_argument("--mb", type=float, nargs="+", default=[64])
    ap.add_argument("--codecs", nargs="+", default=codecs.names())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=list(CPU_MODES), choices=list(CPU_MODES))
    ap.add_argument("--allocator", choices=["default", *ALLOCATORS], default="default",
                    help="pin glibc's allocator regime (see above); CPU only")
    ap.add_argument("--inductor-mb", type=float, nargs="*", default=[64], metavar="MB",
                    help="CUDA: the sizes at which the inductor-compiled reference is timed too "
                         "(default 64; none with no value)")
    ap.add_argument("--rep-ms", type=int, default=100,
                    help="CUDA: do_bench's repeat time per measurement (default 100)")
    args = ap.parse_args()
    if args.allocator != "default":
        pin_allocator(args.allocator)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {device} ({name}), allocator {args.allocator}")
    results = []
    for mb in args.mb:
        x = sample(mb, device)
        print(f"\n{mb:g} MB fp32 on {device}, ratios over clone (higher is better)")
        if device == "cuda":
            rows = bench_cuda(x, args.codecs, compiled=mb in args.inductor_mb,
                              rep_ms=args.rep_ms)
        else:
            rows = bench_cpu(x, args.codecs, args.reps, args.modes)
        results += [{"mb": mb, "device": device, **r} for r in rows]
    common.write_json(args.json, "codecs", {"allocator": args.allocator, "rows": results})
    failed = [r["codec"] for r in results if "error" in r]
    if failed:
        print(f"\nfailed on {device}: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
