"""Data parallel on one NCCL rank: ccfx's gradient path on CUDA (scripts/gpu_check.sh, step 5).

One process joins a process group of world size 1 (``--backend nccl``, a file store in a temporary
directory; no network needed) and trains a small MLP for a few SGD steps per case with
``torch.compile(model, backend="ccfx", options={"data_parallel": True, "gradient_codec": ...})``,
the README's data-parallel path. World size 1 still runs ccfx's gradient buckets through its
collectives on the NCCL group, and the codecs on CUDA tensors (their Triton kernels). Per case:

* the plan's data-parallel line (world size and backend: must say nccl);
* gradients against plain autograd's on an uncompiled copy: codec ``none`` must match to fp32
  rounding (the average over one rank is the rank's own gradient), a lossy codec within its
  relative-error bound;
* the loss over the steps (finite), ms per step after the first, and the wire bytes per step.

A case that fails is reported and the others still run; the exit status is 1 if any failed.
``--backend gloo --device cpu`` runs the same checks on the CPU (how this script is tested
without a GPU).

    python scripts/gpu_dp_one_rank.py                       # nccl on cuda:0
    python scripts/gpu_dp_one_rank.py --backend gloo --device cpu
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

#: (gradient codec, lowering, extra options, max relative error of the first step's gradients)
CASES = [
    ("none", "eager", {}, 1e-5),
    ("int8", "eager", {}, 0.02),
    ("fp8", "eager", {}, 0.1),
    ("powersgd:rank=4,ef", "eager", {}, None),  # low rank: no bound, finite and training
    ("int8", "eager", {"gradient_collective": "ring"}, 0.02),
    ("int8", "inductor", {}, 0.02),  # last: inductor's CUDA codegen takes longest to compile
]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 16))


def batch(step: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(64, 256, generator=g).to(device)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum((g.float() - w.float()).square().sum().item() for g, w in zip(got, want))
    den = sum(w.float().square().sum().item() for w in want)
    return math.sqrt(num / max(den, 1e-30))


def run_case(codec: str, lowering: str, extra: dict, bound, steps: int, device) -> dict:
    import ccfx

    model = mlp().to(device)
    reference = copy.deepcopy(model)
    opts = {"data_parallel": True, "gradient_codec": codec, "lowering": lowering,
            "compress_min_numel": 0, **extra}
    compiled = torch.compile(model, backend="ccfx", options=opts)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, times, err = [], [], None
    for step in range(steps):
        x = batch(step, device)
        if step == 0:  # the exact gradients of the same step, for the error bound
            loss_fn(reference(x)).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = loss_fn(compiled(x))
        loss.backward()
        if step == 0:
            err = rel_error([p.grad for p in model.parameters()],
                            [p.grad for p in reference.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes
        times.append(time.perf_counter() - t0)
    plan = ccfx.plan_of(compiled)
    dp = plan.data_parallel
    ledger = ccfx.ledger_of(compiled)
    raw, wire = ledger.per_step("bucket")
    problems = []
    if dp is None or dp.world_size != 1 or dp.backend != dist.get_backend():
        problems.append(f"plan's data parallel is {dp}, expected world size 1 on "
                        f"{dist.get_backend()}")
    if not all(math.isfinite(v) for v in losses):
        problems.append(f"non-finite loss {losses}")
    if bound is not None and not err <= bound:
        problems.append(f"gradient relative error {err:.3g} > {bound}")
    if steps >= 3 and not losses[-1] < losses[0]:
        problems.append(f"loss did not decrease: {losses[0]:.4f} -> {losses[-1]:.4f}")
    lines = str(plan).splitlines()
    # The bucket table's rows (codec and collective of each bucket) and the data-parallel line.
    dp_lines = [line for line in lines if line.lstrip()[:1].isdigit() and (
        "all_gather" in line or "all_reduce" in line or "ring" in line or "powersgd" in line)]
    dp_lines += [line for line in lines if line.startswith("data parallel")]
    return {"codec": codec, "lowering": lowering, "extra": extra, "losses": losses,
            "grad_rel_error": err, "first_s": times[0],
            "ms_per_step": 1e3 * statistics.median(times[1:] or times),
            "raw_bytes": raw, "wire_bytes": wire, "plan": dp_lines[:6], "problems": problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cases", nargs="+", type=int, default=None, metavar="I",
                    help=f"indices into CASES (default all {len(CASES)})")
    ap.add_argument("--timeout-s", type=float, default=60,
                    help="the process group's timeout (ccfx's own collectives: "
                         "collective_timeout_s is set to it too)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(f"no CUDA device (torch {torch.__version__}): nothing to run on {device}")
            return 2
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
        print(f"device {device}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    print(f"process group: {args.backend}, world size 1, file store", flush=True)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="ccfx-dp1-") as tmp:
        kwargs = {}
        if args.backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(args.backend, init_method=f"file://{tmp}/store", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=args.timeout_s),
                                **kwargs)
        try:
            cases = [CASES[i] for i in args.cases] if args.cases is not None else CASES
            for codec, lowering, extra, bound in cases:
                extra = {"collective_timeout_s": args.timeout_s, **extra}
                label = f"{codec} {lowering}" + "".join(
                    f" {k}={v}" for k, v in extra.items() if k != "collective_timeout_s")
                torch._dynamo.reset()
                try:
                    r = run_case(codec, lowering, extra, bound, args.steps, device)
                except Exception as e:  # noqa: BLE001 (report the case, run the others)
                    failed += 1
                    print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[0][:400]}")
                    print("".join(traceback.format_exc().splitlines(True)[-12:]), flush=True)
                    continue
                status = "FAIL" if r["problems"] else "ok"
                failed += bool(r["problems"])
                err = "-" if r["grad_rel_error"] is None else f"{r['grad_rel_error']:.2e}"
                print(f"{status:<4} {label}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, "
                      f"grad rel. error {err}, first step {r['first_s']:.2f} s, then "
                      f"{r['ms_per_step']:.2f} ms/step, bucket bytes/step {r['raw_bytes']:.0f} raw "
                      f"-> {r['wire_bytes']:.0f} wire")
                for line in r["plan"]:
                    print(f"       | {line.strip()}")
                for p in r["problems"]:
                    print(f"       ! {p}")
                sys.stdout.flush()
        finally:
            dist.destroy_process_group()
    print(f"{'FAILED' if failed else 'passed'}: {failed} of {len(cases)} cases failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
