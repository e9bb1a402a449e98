"""Seconds of compute per stage: from FLOPs and a measured machine rate, or a timed profile.

Two sources, both measured on this machine:

* :func:`from_flops`, what ``auto`` uses at compile time, when nothing has run yet: a stage's
  forward is ``flops / rate + ops * overhead`` and its backward twice the FLOPs (the usual
  2:1) plus the same per-op overhead. ``rate`` is a matmul's FLOP/s and ``overhead`` the time
  of a tiny op (:func:`machine_rate`, cached beside the codec timings): the second term is what
  small models on CPUs spend, and a FLOP count alone misses it.
* :func:`time_stages`: the stage modules a pipeline rank runs (``passes.split_stages``,
  lowered as the plan says), each timed forward and backward on its own at the microbatch
  shape, the median of a few repeats. Slower to get, closer to the truth; what bench/planner.py
  validates against. ``ccfx.backends.profile.profile_stages(compiled, microbatch)`` gets the
  stages of a compiled model and times them with it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence

import torch

from .codec_cost import cache_path
from .pipeline_model import StageCompute


def machine_rate(device: torch.device | str = "cpu", refresh: bool = False) -> tuple[float, float]:
    """(FLOP/s of a 512³ fp32 matmul, seconds of one tiny elementwise op), cached per machine."""
    device = torch.device(device)
    path = cache_path(device).with_name(cache_path(device).name.replace("codec_times", "rate"))
    if path.exists() and not refresh:
        try:
            data = json.loads(path.read_text())
            return float(data["flops_per_s"]), float(data["op_s"])
        except (OSError, ValueError, KeyError):
            pass
    n = 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    mm = _median_s(lambda: a @ b, device)
    tiny = torch.ones(8, device=device)
    op = _median_s(lambda: tiny + tiny, device, repeats=50)
    rate = 2 * n ** 3 / mm
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"flops_per_s": rate, "op_s": op}))
    except OSError:
        pass
    return rate, op


def from_flops(stage_flops: Sequence[float], stage_ops: Sequence[int], microbatches: int = 1,
               device: torch.device | str = "cpu",
               rate: tuple[float, float] | None = None) -> list[StageCompute]:
    """Per-stage seconds per microbatch from the plan's FLOPs (counted at the compiled shape;
    divided by ``microbatches`` when that shape was the whole batch)."""
    flops_per_s, op_s = rate or machine_rate(device)
    out = []
    for flops, ops in zip(stage_flops, stage_ops, strict=True):
        f = flops / microbatches / flops_per_s
        out.append(StageCompute(f + ops * op_s, 2 * f + 2 * ops * op_s, "flops"))
    return out


def time_stages(modules: Sequence[torch.nn.Module], interfaces: Sequence, inputs: Sequence,
                repeats: int = 5) -> list[StageCompute]:
    """Time each pipeline stage forward and backward, on its own: ``modules[s]`` (lowered as
    it will run) with ``interfaces[s]`` (its ``StageInterface``); stage 0 on ``inputs`` (a
    microbatch, as the model takes it: token ids stay valid ids), later stages on Gaussian
    tensors of their ports' shapes."""
    out = []
    for child, iface in zip(modules, interfaces, strict=True):
        args = list(inputs) if iface.index == 0 else [_port_input(p) for p in iface.inputs]
        out.append(_time_stage(child, args, repeats))
    return out


def _port_input(port) -> torch.Tensor:
    if port.dtype.is_floating_point:
        return torch.randn(port.shape, dtype=port.dtype).requires_grad_(port.requires_grad)
    return torch.zeros(port.shape, dtype=port.dtype)


def _time_stage(child: torch.nn.Module, args: Sequence, repeats: int) -> StageCompute:
    fwd, bwd = [], []
    for i in range(repeats + 2):  # two warm-ups: inductor compiles the first call
        inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
                  else a for a in args]
        t0 = time.perf_counter()
        out = child(*inputs)
        t1 = time.perf_counter()
        tensors = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(o, torch.Tensor) and o.requires_grad]
        if tensors:
            torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
        t2 = time.perf_counter()
        if i >= 2:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return StageCompute(statistics.median(fwd), statistics.median(bwd), "profile")


def _median_s(fn, device: torch.device, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_optimizer(stage_params: Sequence[Sequence[torch.nn.Parameter]], make_optimizer, *,
                   repeats: int = 5) -> list[float]:
    """Per stage, the seconds of one ``make_optimizer(params).step()`` over copies of the
    stage's own parameters (gradients set to random values): the part of a step after the
    schedule."""
    out = []
    for stage in stage_params:
        params = [p.detach().clone().requires_grad_(True) for p in stage]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make_optimizer(params)
        out.append(_median_s(opt.step, params[0].device if params else torch.device("cpu"),
                             repeats) if params else 0.0)
    return out


#: the longest a :func:`measure_model` forward may take, estimated from FLOPs, before the
#: planner gives up timing the model (a large model is priced from FLOPs instead)
MEASURE_LIMIT_S = 0.5


def measure_model(model: torch.nn.Module, args: Sequence, kwargs: dict, *, flops: float,
                  ops: int, param_numel: int, batch: int, repeats: int = 3,
                  cache: bool = True):
    """The model timed forward and backward on this machine at two slices of its example
    batch (``batch // 16`` and ``batch // 4`` samples: a pipeline's and a replica's
    microbatches lie between), fitted as per-FLOP and per-op seconds
    (:class:`~ccfx.planner.model_facts.MeasuredCompute`), plus an AdamW step per parameter.
    ``flops`` and ``ops``: the traced forward's totals at ``batch``. None where the model
    cannot be timed here (meta or non-CPU tensors, a forward estimated above
    :data:`MEASURE_LIMIT_S`, no differentiable output). Cached per machine, model shape and
    batch beside the codec timings (delete the file to time again)."""
    from .model_facts import MeasuredCompute

    params = list(model.parameters())
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    if not params or any(t.device.type != "cpu" for t in params + tensors):
        return None
    rate, _ = machine_rate()
    small, large = max(1, batch // 16), max(2, batch // 4)
    if large > batch or flops * large / batch / rate > MEASURE_LIMIT_S:
        return None
    key = "|".join([type(model).__name__, str(batch), str(torch.get_num_threads()),
                    ";".join("x".join(map(str, p.shape)) for p in params),
                    ";".join("x".join(map(str, t.shape)) for t in tensors)])
    path = cache_path().with_name(cache_path().name.replace("codec_times", "model_times"))
    table = _read_json(path) if cache else {}
    if key in table:
        return MeasuredCompute(**table[key])
    timed = _time_passes(model, args, kwargs, batch, (small, large), repeats)
    if timed is None:
        return None
    fwd, bwd = timed
    numel = min(param_numel, 1 << 22)
    opt_s = _adamw_step_s(numel)
    (fpf, fpo), (bpf, bpo) = (_fit_per_flop_and_op(t, flops, ops, batch, small, large)
                              for t in (fwd, bwd))
    out = MeasuredCompute(fpf, fpo, bpf, bpo, opt_s / numel, rate, torch.get_num_threads())
    if cache:
        table[key] = out.__dict__
        _write_json(path, table)
    return out


def _time_passes(model: torch.nn.Module, args: Sequence, kwargs: dict, batch: int,
                 sizes: Sequence[int], repeats: int
                 ) -> tuple[dict[int, float], dict[int, float]] | None:
    """The fastest forward and backward seconds of the model at each slice of ``sizes``
    samples of its example batch (the first run a warm-up); None without a differentiable
    output."""
    def sliced(value, n):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return value[:n]
        return value

    fwd, bwd = {}, {}
    for n in sizes:
        a = [sliced(v, n) for v in args]
        k = {name: sliced(v, n) for name, v in kwargs.items()}
        f_times, b_times = [], []
        for i in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            out = model(*a, **k)
            t1 = time.perf_counter()
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if not outs:
                return None
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            t2 = time.perf_counter()
            if i:
                f_times.append(t1 - t0)
                b_times.append(t2 - t1)
        fwd[n], bwd[n] = min(f_times), min(b_times)
    model.zero_grad(set_to_none=True)
    return fwd, bwd


def _fit_per_flop_and_op(times: dict[int, float], flops: float, ops: int, batch: int,
                         small: int, large: int) -> tuple[float, float]:
    """(per FLOP, per op) through the two points; a negative intercept (noise) → 0."""
    f_small, f_large = flops * small / batch, flops * large / batch
    slope = (times[large] - times[small]) / (f_large - f_small)
    per_op = (times[small] - slope * f_small) / max(ops, 1)
    if slope <= 0 or per_op < 0:
        return times[large] / f_large, 0.0
    return slope, per_op


def _adamw_step_s(numel: int) -> float:
    """The median seconds of an AdamW step over ``numel`` parameters (its state allocated
    by a first step)."""
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-3)
    opt.step()  # the first step allocates the state
    return _median_s(opt.step, torch.device("cpu"), repeats=5)


def _write_json(path, table: dict) -> None:
    """Write ``table`` to ``path`` atomically (a temporary file renamed); a failure to
    write leaves the cache as it was."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass


def _read_json(path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def contention(cores: int | None, stage_work: int | Sequence[float], replicas: int,
               microbatches: int) -> float:
    """How much longer compute takes when a pipeline's ranks (``replicas`` of each stage)
    share ``cores`` one-thread cores (None: 1, a core each). ``stage_work``: each stage's
    seconds per microbatch (or the number of equal stages). The schedule's ``m + pp - 1``
    slots (stage ``s`` busy in slots ``s … s + m - 1``); a stage lighter than the slowest is
    busy that fraction of a slot; each rank's work in a slot is stretched by ``busy / cores``
    where more ranks than cores run, weighted by the work done in it. A pipeline's warm-up and
    drain and its light stages leave cores free for the busy ranks: four ranks on two cores
    run four replicas 2x slower, two 2-stage pipelines 1.75x, a 4-stage pipeline of equal
    stages and 4 microbatches 1.44x, of stages weighing 1, 2, 2, 1 (6 blocks) 1.23x
    (checked on bench/RESULTS.md, Layouts: pp4-dp1)."""
    if not cores:
        return 1.0
    work = [1.0] * stage_work if isinstance(stage_work, int) else list(stage_work)
    pp, m = len(work), microbatches
    top = max(work) or 1.0
    busy = [replicas * sum(w / top for s, w in enumerate(work) if s <= j < s + m)
            for j in range(m + pp - 1)]
    return sum(n * max(1.0, n / cores) for n in busy) / sum(busy)
