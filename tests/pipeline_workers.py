"""Workers for tests/test_pipeline.py: a model trained for a few steps by the real pipeline
(torch's schedules on gloo ranks, ccfx's compressed stages) and by the single-process
simulation (the compiled model called per microbatch). They return data; the tests assert."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import ccfx

from . import toy_models

WIDTH = 32
BATCH = 8
LOWERING = os.environ.get("CCFX_TEST_LOWERING", "eager")


VOCAB, SEQ = 64, 16


class Logits(torch.nn.Module):
    """A language model's logits only (Hugging Face returns an output object)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        out = self.lm(ids)
        return getattr(out, "logits", out)


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return toy_models.MLP(width=WIDTH, depth=8)
    if name == "skip":
        return toy_models.LongSkip(width=WIDTH, depth=8)
    if name == "gpt":  # the tiny GPT, small: its embedding and LM head are one (tied) weight
        from ccfx.models import GPTConfig, TinyGPT

        return TinyGPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2,
                                 n_embd=32, dropout=0.0))
    if name == "llama":  # a Hugging Face Llama from a config (nothing downloaded)
        import transformers

        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
            attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            attn_implementation="eager", use_cache=False)
        return Logits(transformers.LlamaForCausalLM(cfg))
    raise ValueError(name)


def batches(steps: int, model: str = "mlp", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    if model in ("gpt", "llama"):
        return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                 torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(steps)]
    return [(torch.randn(4 * BATCH, WIDTH, generator=g),
             torch.randn(4 * BATCH, WIDTH, generator=g)) for _ in range(steps)]


def loss_fn(out, target):
    if out.dim() == 3:  # logits
        return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))
    return F.mse_loss(out, target)


def options(stages: int, codec: str, grad_codec: str | None, lowering: str = LOWERING,
            overrides: dict | None = None, extra: dict | None = None) -> dict:
    opts = {"stages": stages, "activation_codec": codec, "balance": "params", "lowering": lowering,
            **(extra or {})}
    if overrides:
        opts["codec_overrides"] = overrides
    if grad_codec:
        opts["activation_grad_codec"] = grad_codec
    return opts


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def simulate(model: str, stages: int, codec: str, grad_codec: str | None, n_micro: int,
             steps: int, lr: float = 0.05, overrides: dict | None = None) -> dict:
    """The single-process simulation, microbatch by microbatch as the schedules do it: each
    microbatch's loss backpropagated on its own, the gradients divided by the number of
    microbatches after the last (torch's ``scale_grads``)."""
    m = make_model(model)
    compiled = torch.compile(m, backend="ccfx", fullgraph=True,
                             options=options(stages, codec, grad_codec, overrides=overrides))
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    losses, first_grads = [], None
    for x, y in batches(steps, model):
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(n_micro), y.chunk(n_micro)):
            loss = loss_fn(compiled(xm), ym)
            loss.backward()
            losses.append(loss.item())
        for p in m.parameters():
            p.grad /= n_micro
        if first_grads is None:
            first_grads = _grads(m)
        opt.step()
    ledger = ccfx.ledger_of(compiled)
    return {"losses": losses, "grads": first_grads,
            "params": {n: p.detach().clone() for n, p in m.named_parameters()},
            "ledger": {d: ledger.totals(d) for d in ("fwd", "bwd")}}


def pipeline(rank: int, world: int, model: str, stages: int, codec: str,
             grad_codec: str | None, n_micro: int, steps: int, schedule: str,
             lr: float = 0.05, lowering: str = LOWERING, overrides: dict | None = None,
             extra: dict | None = None) -> dict:
    """The same training on ``world`` ranks under torch's ``schedule``; ``extra``: more ccfx
    options."""
    from torch.distributed.pipelining import schedules

    m = make_model(model)
    compiled = torch.compile(m, backend="ccfx", fullgraph=True,
                             options=options(stages, codec, grad_codec, lowering, overrides,
                                             extra))
    data = batches(steps, model)
    compiled(data[0][0].chunk(n_micro)[0])  # compiles and plans at the microbatch shape
    style = "v" if schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") else "loop"
    built = ccfx.build_stages(compiled, rank, "cpu", style=style)
    del compiled, m  # the stages hold this rank's parameters only
    cls = getattr(schedules, schedule)
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    sched = cls(built[0] if single else built, n_microbatches=n_micro, loss_fn=loss_fn)
    before = ccfx_totals(built)
    params = [p for s in built for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    losses, first_grads = [], None
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        out = []
        is_first = any(s.is_first for s in built)
        is_last = any(s.is_last for s in built)
        sched.step(*((x,) if is_first else ()), target=y if is_last else None,
                   losses=out if is_last else None)
        losses += [float(v.detach()) for v in out]
        ccfx.sync_grads(built)
        if first_grads is None:
            first_grads = {n: p.grad.clone() for s in built for n, p in s.submod.named_parameters()
                           if p.grad is not None}
        opt.step()
    return {"losses": losses, "grads": first_grads, "stages": [s.stage_index for s in built],
            "params": {n: p.detach().clone() for s in built
                       for n, p in s.submod.named_parameters()},
            "ledger": {d: tuple(a - b for a, b in zip(v, before[d]))
                       for d, v in ccfx_totals(built).items()},
            "ledger_steps": built[0].ledger.steps}


def ccfx_totals(built) -> dict:
    ledger = built[0].ledger
    return {d: ledger.totals(d) for d in ("fwd", "bwd")}


def pipeline_dp(rank: int, world: int, model: str, codec: str, gradient_codec: str,
                n_micro: int, steps: int, lr: float = 0.05, extra: dict | None = None) -> dict:
    """PP × DP on 4 ranks: 2 stages × 2 replicas (a DeviceMesh ``("dp", "pp")``). Replica r
    trains on rows [r/2, (r+1)/2) of every batch, so the two replicas together see what the
    simulation sees with twice the microbatches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "pp"))
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    m = make_model(model)
    opts = {**options(world // 2, codec, None), "gradient_codec": gradient_codec,
            "compress_min_numel": 16, **(extra or {})}
    compiled = torch.compile(m, backend="ccfx", fullgraph=True, options=opts)
    data = [(x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]) for x, y in batches(steps, model)]
    compiled(data[0][0].chunk(n_micro)[0])
    built = ccfx.build_stages(compiled, pp_rank, "cpu", pp, dp_group=dp)
    stage = built[0]
    sched = Schedule1F1B(stage, n_microbatches=n_micro, loss_fn=loss_fn)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=lr)
    losses, first_grads = [], None
    before = ccfx.ledger_of(compiled).totals("bucket")
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        out = []
        sched.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None,
                   losses=out if stage.is_last else None)
        losses += [float(v.detach()) for v in out]
        ccfx.sync_grads(built)
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in stage.submod.named_parameters()}
        opt.step()
    after = ccfx.ledger_of(compiled).totals("bucket")
    decisions = [(d.what, d.chosen, d.reason) for d in ccfx.plan_of(compiled).graphs[0].decisions]
    return {"rank": rank, "pp": pp_rank, "dp": dp_rank, "losses": losses, "grads": first_grads,
            "decisions": decisions,
            "params": {n: p.detach().clone() for n, p in stage.submod.named_parameters()},
            "buckets": tuple(a - b for a, b in zip(after, before))}


def broken(rank: int, world: int, case: str) -> dict:
    """Two ranks, two stages of the MLP, one way of going wrong; returns the error this rank
    saw (type, message, seconds into the failing call) instead of raising it."""
    import time

    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    codec = "int8" if case == "plan_mismatch" and rank == 1 else "none"
    m = make_model("mlp")
    # a frozen peer fails a transfer after collective_timeout_s (the pipeline's own group)
    timeout = {"collective_timeout_s": 8.0 if case == "frozen" else 20.0}
    compiled = torch.compile(m, backend="ccfx", fullgraph=True,
                             options=options(2, codec, None, extra=timeout))
    data = batches(2)
    n_micro = 1 if case == "few_microbatches" else 4
    compiled(data[0][0].chunk(n_micro)[0])
    start = time.monotonic()
    try:
        built = ccfx.build_stages(compiled, rank, "cpu")
        stage = built[0]
        # torch's 1F1B refuses fewer microbatches than stages itself; GPipe does not
        cls = ScheduleGPipe if case == "few_microbatches" else Schedule1F1B
        sched = cls(stage, n_microbatches=n_micro, loss_fn=loss_fn)
        for step, (x, y) in enumerate(data):
            if case == "shape_change" and step == 1:
                x, y = x[:-4], y[:-4]  # a smaller last batch
                if rank == 1:  # post after rank 0 has given up: gloo refuses the post itself
                    time.sleep(1.0)
            if case in ("dies", "frozen") and step == 1 and rank == 1:
                import os
                import signal

                if case == "frozen":  # until the survivor has failed and wakes it (below)
                    os.kill(os.getpid(), signal.SIGSTOP)
                os._exit(3)
            start = time.monotonic()
            sched.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None)
            ccfx.sync_grads(built)
    except Exception as e:  # noqa: BLE001 (returned to the test, which asserts on it)
        got = {"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - start}
        if case == "frozen":  # wake the frozen peer (its pid: what ranks publish) to end it
            _wake(1 - rank)
        if case == "shape_change":  # rank 0 hosts the store rank 1's error reads rank 0's
            _until_both_failed(rank)  # reason from: it stays until rank 1 has failed
        return got
    return {"error": None}


def _until_both_failed(rank: int) -> None:
    from datetime import timedelta

    from ccfx.wire import agree

    store, key = agree._store(), "tests/broken/rank1_failed"
    if rank == 1:
        store.set(key, b"1")
    else:
        store.wait([key], timedelta(seconds=60))


def _wake(peer: int) -> None:
    import json
    import os
    import signal

    from ccfx.wire import agree

    proc = json.loads(agree._store().get(f"ccfx/agree/proc/{peer}").decode())
    os.kill(proc["pid"], signal.SIGCONT)


def resume(rank: int, world: int, codec: str, grad_codec: str, n_micro: int) -> dict:
    """Train 4 steps; and, in the same ranks, stages built afresh from a checkpoint taken
    after step 2 (each rank's ``stage.submod.state_dict()``: parameters and codec state) that
    train steps 3 and 4. Returns both runs' last two steps' losses and parameters."""
    import copy

    from torch.distributed.pipelining import Schedule1F1B

    data = batches(4, "mlp")

    def build():
        m = make_model("mlp")
        compiled = torch.compile(m, backend="ccfx", fullgraph=True,
                                 options=options(2, codec, grad_codec))
        compiled(data[0][0].chunk(n_micro)[0])
        stage = ccfx.build_stage(compiled, rank, "cpu")
        return stage, torch.optim.SGD(stage.submod.parameters(), lr=0.05)

    def train(stage, opt, steps):
        sched = Schedule1F1B(stage, n_microbatches=n_micro, loss_fn=loss_fn)
        losses = []
        for x, y in steps:
            opt.zero_grad(set_to_none=True)
            out = []
            sched.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None,
                       losses=out if stage.is_last else None)
            ccfx.sync_grads([stage])
            opt.step()
            losses += [float(v.detach()) for v in out]
        return losses

    stage, opt = build()
    train(stage, opt, data[:2])
    checkpoint = copy.deepcopy(stage.submod.state_dict())
    state_names = [k for k in checkpoint if k.startswith("ccfx_codec_state.")]
    straight = train(stage, opt, data[2:])
    params = {n: p.detach().clone() for n, p in stage.submod.named_parameters()}

    stage2, opt2 = build()
    stage2.submod.load_state_dict(checkpoint)
    resumed = train(stage2, opt2, data[2:])
    return {"straight": straight, "resumed": resumed, "state_names": state_names,
            "params_equal": all(torch.equal(p, params[n])
                                for n, p in stage2.submod.named_parameters())}


def evaluate(rank: int, world: int, codec: str, n_micro: int) -> dict:
    """Forward only: torch's ``schedule.eval`` over ccfx's stages; the last rank returns the
    merged output."""
    from torch.distributed.pipelining import ScheduleGPipe

    m = make_model("mlp")
    compiled = torch.compile(m, backend="ccfx", fullgraph=True, options=options(2, codec, None))
    x, _ = batches(1)[0]
    compiled(x.chunk(n_micro)[0])
    stage = ccfx.build_stage(compiled, rank, "cpu")
    sched = ScheduleGPipe(stage, n_microbatches=n_micro)  # no loss_fn: inference only
    out = sched.eval(x) if stage.is_first else sched.eval()
    return {"out": out.detach() if isinstance(out, torch.Tensor) else None}


def simulate_forward(codec: str, n_micro: int) -> torch.Tensor:
    m = make_model("mlp")
    compiled = torch.compile(m, backend="ccfx", fullgraph=True, options=options(2, codec, None))
    x, _ = batches(1)[0]
    with torch.no_grad():
        return torch.cat([compiled(xm) for xm in x.chunk(n_micro)])


def epilogue_pairs(rank: int, world: int, n_micro: int, schedules: list[str]) -> dict:
    """Per schedule, the mlp's backward int8 with every send compressed and then epilogue-only
    (Optimus-CC): one step each, in the same ranks; their ledgers and losses."""
    return {schedule: [pipeline(rank, world, "mlp", world, "none", "int8", n_micro, 1, schedule,
                                extra={"epilogue_only": only,
                                       "pipeline_schedule": schedule[len("Schedule"):]})
                       for only in (False, True)]
            for schedule in schedules}


def selective_stages(rank: int, world: int, n_micro: int, steps: int) -> list:
    """PP × DP twice in the same ranks: PowerSGD gradients on stage 0 only (given), then
    ``gradient_codec="auto"`` on a 1 Mbit/s link (the planner picks the stages)."""
    given = pipeline_dp(rank, world, "mlp", "none", "powersgd:rank=2", n_micro, steps,
                        extra={"gradient_codec_stages": [0]})
    auto = pipeline_dp(rank, world, "mlp", "none", "auto", n_micro, steps,
                       extra={"link_gbps": 0.001, "microbatches": n_micro,
                              "auto_loss_budget": 0.05})
    return [given, auto]


def replica_dies(rank: int, world: int) -> dict:
    """PP x DP with one stage per replica (a DeviceMesh ("dp", "pp") of (world, 1)): a step on
    every rank, then the last replica exits; the others' ``sync_grads`` must fail naming the
    bucket and the dead replica (the error as data)."""
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import ScheduleGPipe

    from .ranks import caught

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "pp"))
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    m = make_model("mlp")
    opts = {**options(1, "none", None), "gradient_codec": "int8", "compress_min_numel": 16}
    compiled = torch.compile(m, backend="ccfx", fullgraph=True, options=opts)
    data = batches(2)
    compiled(data[0][0].chunk(2)[0])
    built = ccfx.build_stages(compiled, 0, "cpu", pp, dp_group=dp)
    sched = ScheduleGPipe(built[0], n_microbatches=2, loss_fn=loss_fn)
    for step, (x, y) in enumerate(data):
        if step == 1 and rank == world - 1:
            os._exit(0)
        sched.step(x, target=y)
        if step == 1:
            time.sleep(0.5)
            return caught(lambda: ccfx.sync_grads(built))
        ccfx.sync_grads(built)
    return {"error": None}
