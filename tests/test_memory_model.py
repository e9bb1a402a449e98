"""The layout planner's memory estimate (ccfx.planner.memory_model) against the measured peak
of live tensor bytes of a real step, per rank, in one process.

Each case runs one rank of a layout for real: ccfx's ``CompressedStage`` under torch's
``Schedule1F1B``, ``ccfx.sync_grads`` (the data-parallel bucket exchange) and AdamW, on
torch's *fake* process group (every collective and transfer returns at once, nothing is
sent: torch's own code path, its buffers and ccfx's allocated as on a real rank). ccfx's
agreements between ranks (``agree.meet``, ``agree.from_rank0``) are answered by this
process alone. The peak is ``torch.distributed._tools.MemTracker``'s over one step after two
warm-up steps. bench/layouts.py measures the same way on real gloo ranks; the 10.7 M GPT's
4-stage pipeline measured there differed from this fake group's figures by exactly the data
set the bench keeps in memory (1.6 MB per rank).

The bound: measured here (2026-12-02), the estimate is +2.2 % above the peak for the first
of two stages (its 2 microbatches in flight, the receive buffers of its output's gradients),
+0.6 % for the last stage, +0.6 % for a stage whose replicas exchange buckets, +0.2 % for data
parallel with int8 buckets (the exchange's peak), -0.35 % for the same in two buckets; 5 % is the largest of them with a margin
of more than twice, half the issue's 10 %. Before this model, the same figures were 20-50 %
short on bench.layouts' ranks.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ccfx
from ccfx.backends.plan_parallel import model_facts
from ccfx.models.tiny_gpt import GPTConfig, TinyGPT
from ccfx.planner.codec_cost import CodecTimer
from ccfx.planner.layout import predict_layout
from ccfx.planner.layout_search import make_layout

BOUND = 0.05
MICROBATCHES = 4
BATCH = 32


def _model():
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=192))


def _owned_tensors(roots) -> list[torch.Tensor]:
    """The tensors a rank's training objects hold before a step (parameters, AdamW's state,
    torch's receive buffers, codec state), found by walking their attributes: the other
    tests' leftovers in this process are not this rank's."""
    out, seen, todo = {}, set(), [(r, 0) for r in roots]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        if issubclass(type(obj), torch.Tensor):  # type(): a dead weakref.proxy raises
            try:
                ptr = obj.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage (fake, functional): no bytes
                continue  # fake tensors in graph metadata
            out.setdefault(ptr, obj)
            continue
        if isinstance(obj, torch.nn.Module):
            todo += [(t, depth + 1) for t in obj.parameters()]
            todo += [(t, depth + 1) for t in obj.buffers()]
            continue
        if isinstance(obj, dict):
            todo += [(v, depth + 1) for v in obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            todo += [(v, depth + 1) for v in obj]
        elif isinstance(obj, torch.optim.Optimizer):
            todo.append((obj.state, depth + 1))
        elif type(obj).__module__.startswith(("torch.distributed.pipelining", "ccfx")) \
                and hasattr(obj, "__dict__"):
            todo.append((vars(obj), depth + 1))
    return list(out.values())


def _measured_peak(stages, step, opt) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    opt.zero_grad(set_to_none=True)
    gc.collect()
    tracker = MemTracker()
    tracker.track_external(*_owned_tensors([stages, opt]))
    tracker.track_external(*[s.submod for s in stages], opt)
    for s in stages:  # one "iteration" per microbatch for MemTracker (bench/layouts.py)
        def forward(*a, _run=s.forward_one_chunk, **k):
            tracker.reset_mod_stats()
            return _run(*a, **k)
        s.forward_one_chunk = forward
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _run_rank(monkeypatch, pp: int, dp: int, rank: int, codec: str,
              bucket_mb: float | None = None) -> tuple[int, int]:
    """(measured peak, the planner's estimate) for global ``rank`` of a (dp, pp) mesh;
    ``bucket_mb``: the buckets' cap, in the compile options and the estimate alike."""
    import functools

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    from ccfx.config import Config
    from ccfx.planner import layout as layout_module
    from ccfx.wire import agree

    if bucket_mb is not None:
        monkeypatch.setattr(layout_module, "bucket_memory", functools.partial(
            layout_module.bucket_memory, config=Config(bucket_mb=bucket_mb)))

    model = _model()
    x = torch.randint(0, 96, (BATCH, 64))
    facts = model_facts(model, (x,))
    cluster = ccfx.Cluster.nodes(1, pp * dp, intra=(100, 0.01), inter=(100, 0.01),
                                 memory="16GiB", flops=1e12)
    layout = make_layout(facts, cluster, pp, dp, microbatches=MICROBATCHES,
                         activation_codec=codec, activation_grad_codec=codec,
                         gradient_codec=codec if dp > 1 else "none")
    est = predict_layout(facts, cluster, layout, timer=CodecTimer(throughput=1e10),
                         simulate=False).memory[rank % pp]

    monkeypatch.setattr(agree, "from_rank0", lambda what, desc, decide, **kw: decide())
    monkeypatch.setattr(agree, "meet", lambda what, desc, ranks=None, **kw: agree.fingerprint(
        agree._full(what, desc, tuple(ranks) if ranks is not None else agree.world_ranks())))
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=pp * dp)
    try:
        mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
        options = {"stages": pp, "activation_codec": codec, "activation_grad_codec": codec,
                   "gradient_codec": codec if dp > 1 else "none", "lowering": "eager"}
        if bucket_mb is not None:
            options["bucket_mb"] = bucket_mb
        if pp > 1:
            options["split_points"] = [facts.layers[b].name for b in layout.boundaries[1:]]
        compiled = torch.compile(model, backend="ccfx", fullgraph=True, options=options)
        mine = x[:BATCH // dp]
        compiled(mine.chunk(MICROBATCHES)[0])
        stages = ccfx.build_stages(compiled, mesh.get_local_rank("pp"), "cpu",
                                   mesh.get_group("pp"),
                                   dp_group=mesh.get_group("dp") if dp > 1 else None)
        del compiled, model
        for st in stages:  # the ranks' vote on static metadata (no DTensors): static
            st._warmup_backward_result = lambda received_result=None: torch.ones(
                1, dtype=torch.int32)
        sched = Schedule1F1B(stages[0], n_microbatches=MICROBATCHES, loss_fn=lambda out, y:
                             F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1)))
        opt = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=1e-3)
        first, last = stages[0].is_first, stages[-1].is_last

        def step():
            opt.zero_grad(set_to_none=True)
            sched.step(*((mine,) if first else ()), target=mine if last else None,
                       losses=[] if last else None)
            ccfx.sync_grads(stages)
            opt.step()

        step()
        step()
        measured = _measured_peak(stages, step, opt)
    finally:
        dist.destroy_process_group()
    return measured, est


CASES = {
    # first stage of 2 under 1F1B: 2 microbatches in flight, the output grads' buffers
    "pp2 stage 0": (2, 1, 0, "none"),
    # last stage: the received activations' buffers, the loss
    "pp2 stage 1": (2, 1, 1, "none"),
    # a stage whose replicas exchange buckets after the schedule (the exchange's peak)
    "pp2-dp2 stage 0": (2, 2, 0, "none"),
    # data parallel with int8 buckets: every replica's payload all-gathered
    "dp2 int8": (1, 2, 0, "int8"),
    # the same in 4 MiB buckets (two), exchanged one after the other: the peak is one
    # bucket's working set (the model had added the previous bucket's average: +6.5 %)
    "dp2 int8 buckets": (1, 2, 0, "int8", 4.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_matches_the_measured_tensor_peak(monkeypatch, case):
    measured, est = _run_rank(monkeypatch, *CASES[case])
    error = est.total / measured - 1
    print(f"memory, {case}: estimated {est.total} B ({est.peak_phase}'s peak), measured "
          f"{measured} B ({error:+.2%}); {est.describe()}")
    assert abs(error) < BOUND, est.describe()
