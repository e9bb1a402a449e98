"""Peak memory per device of one pipeline stage under a layout: what a layout planner must
refuse before it prices anything (the memory estimator for 3D-parallel LLM training of the
issue: in 454 runs, no configuration estimated under 80 % of device memory ran out of it).

The figure is the peak of live tensor bytes on the device during a step (what
``torch.cuda.max_memory_allocated`` reports on a GPU), not the process's resident memory.
A step has three phases, each with its own peak, on top of what lives throughout:

* **always**: the parameters (/ ``tp``; sharded data parallel, ``ccfx.shard`` as ZeRO-3,
  divides by ``dp`` and adds the largest layer gathered whole, twice: the one computing and
  the next one prefetched), AdamW's two fp32 moments per parameter (8 bytes each), torch's
  pipeline **receive buffers** (``PipelineStage`` keeps one per microbatch of the step, made
  once: the activations a stage receives, and the gradients of those it sends) and the
  codecs' state and payload buffers;
* **the schedule**: the activations autograd saves per microbatch (measured by the trace,
  scaled to the microbatch; under tensor parallelism split over the TP ranks, all of them
  with sequence parallelism, Megatron's TP span only without; less the attention core with
  selective recomputation, the blocks' inputs only with each block checkpointed:
  :func:`activation_bytes`), less the stage's input (saved, but it *is* the receive buffer),
  plus the output the stage keeps until that microbatch's backward; times the microbatches
  whose backward has not run at the worst moment (under 1F1B stage ``s`` of ``pp`` holds
  ``min(pp - s, m)``, under GPipe all ``m``); the gradients where a backward ran before that
  moment; and the backward's first temporaries, two of the stage's largest saved tensor
  (a transformer's MLP hidden and its gradient through the activation);
* **the gradient exchange** (data parallel, after the schedule): the gradients and the
  bucket being exchanged (:func:`bucket_memory`: ccfx's own bucket plan and exchange);
* **the optimizer step**: the gradients and AdamW's temporaries (foreach, torch's default on
  GPUs: one tensor per parameter; on CPU torch loops per parameter: two of the largest).

Measured check (tests/test_memory_model.py): real ``CompressedStage`` s under torch's
``Schedule1F1B`` and ccfx's bucket exchange, on a fake process group in one process (torch's
own code path, nothing sent), peaks from ``torch.distributed._tools.MemTracker``; and
bench/layouts.py on real gloo ranks (README, "Layouts on two nodes").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .model_facts import StageFacts

#: bytes of optimizer state per parameter: AdamW's exp_avg and exp_avg_sq in fp32
ADAMW_STATE_BYTES = 8
#: a layout whose estimate exceeds this fraction of a device's memory is refused
MEMORY_LIMIT = 0.8

SCHEDULES = ("1F1B", "GPipe")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one stage, by part: ``params``, ``optimizer`` (AdamW's state),
    ``buffers`` (pipeline receive buffers) and ``codec`` (codec state and payloads) live
    throughout; the peak adds the largest of three phases: the schedule's (``grads`` at that
    moment, ``activations`` of ``in_flight`` microbatches, the backward's ``transient``), the
    gradient exchange's (``full_grads`` + ``exchange``) and the optimizer step's
    (``full_grads`` + ``optimizer_step``)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    codec: int
    in_flight: int  # microbatches whose activations are held at the peak
    buffers: int = 0
    exchange: int = 0
    optimizer_step: int = 0
    full_grads: int = 0

    @property
    def phases(self) -> dict[str, int]:
        """Each phase's bytes on top of what lives throughout."""
        return {"schedule": self.grads + self.activations + self.transient,
                "exchange": self.full_grads + self.exchange if self.exchange else 0,
                "optimizer": self.full_grads + self.optimizer_step}

    @property
    def peak_phase(self) -> str:
        ph = self.phases
        return max(ph, key=ph.get)

    @property
    def total(self) -> int:
        return (self.params + self.optimizer + self.buffers + self.codec
                + max(self.phases.values()))

    def describe(self) -> str:
        gib = 2 ** 30

        def g(x):
            return f"{x / gib:.3g}"

        grads = g(self.grads) + (" at the peak" if self.grads < self.full_grads else "")
        phase = self.peak_phase
        if phase == "schedule":
            peak = (f"grads {grads} + activations {g(self.activations)} ({self.in_flight} "
                    f"microbatch(es) in flight) + transient {g(self.transient)}")
        elif phase == "exchange":
            peak = (f"grads {g(self.full_grads)} + the gradient exchange {g(self.exchange)} "
                    f"(activations {g(self.activations)} with {self.in_flight} microbatch(es) "
                    "in flight peak earlier, lower)")
        else:
            peak = (f"grads {g(self.full_grads)} + AdamW's temporaries "
                    f"{g(self.optimizer_step)} (activations {g(self.activations)} with "
                    f"{self.in_flight} microbatch(es) in flight peak earlier, lower)")
        return (f"{g(self.total)} GiB = params {g(self.params)} + AdamW {g(self.optimizer)} + "
                f"receive buffers {g(self.buffers)} + codecs {g(self.codec)} + at the "
                f"{phase}'s peak: {peak}")


def in_flight(schedule: str, stage: int, pp: int, microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at its peak."""
    if schedule == "GPipe":
        return microbatches
    return max(1, min(pp - stage, microbatches))


def stage_memory(stage: StageFacts, *, fraction: float, held: int,
                 microbatches: int | None = None, tp: int = 1, dp: int = 1,
                 sharded: bool = False, largest_layer_bytes: int = 0, codec_bytes: int = 0,
                 exchange_bytes: int = 0, foreach: bool = True,
                 recompute: tuple[int, int, int] | None = None, sequence_parallel: bool = True,
                 selective: bool = False) -> MemoryEstimate:
    """The estimate for one device of ``stage``: ``fraction`` is a microbatch's share of the
    traced batch, ``held`` the microbatches in flight (:func:`in_flight`) out of
    ``microbatches`` (None: more than ``held``), ``codec_bytes`` the codecs' state and buffers
    on this device (the caller prices them on its hops and buckets), ``exchange_bytes`` the
    gradient exchange's working set (:func:`bucket_memory`), ``foreach``: AdamW's foreach
    implementation (torch's default on GPUs; False: CPU's loop over parameters); the
    activations as :func:`activation_bytes` keeps them (``recompute``, ``selective``,
    ``sequence_parallel``).

    Gradients coexist with the held activations when a backward ran before the peak (1F1B's
    steady state: fewer in flight than the step's microbatches). When every microbatch is in
    flight (GPipe, or one microbatch) no gradient exists yet at the first backward, and each
    backward frees a microbatch's activations as the gradients appear: the peak is
    ``max(held · a, (held - 1) · a + g)``, i.e. gradients count only beyond one microbatch's
    activations ``a``."""
    shard = dp if sharded else 1
    params = stage.param_bytes // (tp * shard)
    optimizer = ADAMW_STATE_BYTES * stage.param_numel // (tp * shard)
    gathered = 2 * largest_layer_bytes // tp if sharded and dp > 1 else 0
    m = microbatches if microbatches is not None else held
    # the stage's input is saved by its first layer but is torch's receive buffer (counted
    # there); its output is no layer's saved tensor here but is kept until the backward
    received, sent = stage.in_bytes * fraction, stage.out_bytes * fraction
    kept, rebuilt = activation_bytes(stage, fraction, tp=tp, received=received,
                                     sequence_parallel=sequence_parallel,
                                     recompute=recompute, selective=selective)
    per_mb = int(kept + sent)
    buffers = int(m * (received + sent))
    grads = params
    if microbatches is not None and held >= microbatches:
        grads = max(0, params - per_mb)
    largest_saved = stage.max_saved_bytes or stage.max_out_bytes
    transient = int(2 * largest_saved * fraction / tp) + int(rebuilt)
    if foreach:
        opt_step = params
    else:
        itemsize = stage.param_bytes / max(stage.param_numel, 1)
        biggest = max((math.prod(s) for s in stage.param_shapes), default=0)
        opt_step = int(2 * biggest * itemsize / (tp * shard))
    return MemoryEstimate(params + gathered, grads, optimizer, per_mb * held, transient,
                          int(codec_bytes), held, buffers, int(exchange_bytes), opt_step,
                          params)


def activation_bytes(stage: StageFacts, fraction: float, *, tp: int = 1,
                     received: float = 0.0, sequence_parallel: bool = True,
                     recompute: tuple[int, int, int] | None = None,
                     selective: bool = False) -> tuple[float, float]:
    """(bytes one microbatch keeps for its backward on one TP rank, less ``received``: the
    stage's input, counted as a receive buffer; bytes one layer's backward rebuilds at a
    time). With sequence parallelism every saved byte is split over the ``tp`` ranks; without
    it (Megatron's TP alone) only ``stage.tp_saved_bytes`` is, the rest (norms' inputs,
    residual stream, dropout masks after the row-parallel linear) whole on each. ``selective``
    (Megatron's selective recomputation): the attention core's saved bytes dropped, one
    layer's (the stage's mean) rebuilt in its backward. ``recompute`` each block checkpointed:
    (bytes kept, one block's saved bytes, their TP share) at the traced batch
    (:func:`recompute_bytes`): the kept block inputs are the residual stream, split only by
    sequence parallelism."""
    sp = sequence_parallel or tp == 1
    if recompute is not None:
        kept, block, block_tp = recompute
        whole = max(0.0, kept * fraction - received)
        if sp:
            return whole / tp, block * fraction / tp
        return whole, (block - block_tp + block_tp / tp) * fraction
    core = stage.attn_core_saved_bytes if selective else 0
    every = max(0.0, (stage.saved_bytes - core) * fraction - received)
    layers = max(1, stage.hi - stage.lo)
    rebuilt = core * fraction / (layers * tp)
    if sp:
        return every / tp, rebuilt
    whole = min(every, max(0.0, (stage.saved_bytes - stage.tp_saved_bytes) * fraction
                           - received))
    return whole + (every - whole) / tp, rebuilt


def recompute_bytes(facts, lo: int, hi: int) -> tuple[int, int, int]:
    """Layers ``lo`` … ``hi - 1`` with each block checkpointed (``torch.utils.checkpoint``),
    at the traced batch: (bytes kept per microbatch, the bytes one block's backward rebuilds,
    the TP-sharded share of those, :attr:`LayerFacts.tp_saved_bytes`). A block keeps its
    input (the previous layer's output; the first layer's, its own output's size); what the
    first and last layer save beyond the lightest layer (the embeddings, the head and the loss
    run outside the blocks) stays saved; the rebuilt block is the lightest layer's saved bytes
    (the blocks are alike)."""
    lightest = min(facts.layers, key=lambda x: x.saved_bytes)
    block = lightest.saved_bytes
    kept = 0
    for i in range(lo, hi):
        layer = facts.layers[i]
        kept += facts.layers[i - 1].out_bytes if i > 0 else layer.out_bytes
        kept += layer.saved_bytes - block
    return kept, block, lightest.tp_saved_bytes


def bucket_memory(stage: StageFacts, spec: str, dp: int, *, tp: int = 1,
                  sharded: bool = False, collective: str = "all_gather", config=None
                  ) -> tuple[int, int]:
    """The data-parallel gradient exchange of ``stage`` over ``dp`` replicas with codec
    ``spec``: (codec state kept across steps, the exchange's working set at its peak), in
    bytes per device. The buckets are ccfx's own plan (:func:`ccfx.wire.policy.
    assign_buckets` over the stage's parameters, the config's ``bucket_mb``), each bucket's
    exchange ccfx's (:func:`ccfx.wire.exchange.exchange_for`); buckets run one after the
    other, each one's working set freed before the next one runs:

    * an all-reduce of the raw bucket (``none``): the flattened bucket and its average;
    * a summable codec (``bf16``, PowerSGD, the ring): the flattened bucket, its average,
      the payload out and the one summed;
    * an all-gather (``int8`` …): every replica's payload, a decoded payload, the running
      sum and the next sum.

    Sharded data parallel (``ccfx.shard``) reduce-scatters each layer as it is made: a
    payload each way with a codec, nothing beyond torch's own buffers without one."""
    from ..config import Config
    from ..wire.exchange import BucketLayout, exchange_for
    from ..wire.policy import GradSlot, assign_buckets

    if dp < 2:
        return 0, 0
    cfg = config or Config()
    dtype = getattr(torch, stage.grad_dtype)
    shapes = [tuple(s) for s in stage.param_shapes] or [(max(1, stage.param_numel),)]
    if tp > 1:
        shapes = [(max(1, s[0] // tp), *s[1:]) if s else s for s in shapes]
    if sharded:
        if spec == "none":
            return 0, 0
        numel = max(1, stage.param_numel // tp)
        ex = exchange_for(BucketLayout(((numel,),), dtype), spec)
        return _state_bytes(ex), 2 * ex.wire_bytes() // dp
    n = len(shapes)
    slots = [GradSlot(k, k, f"p{k}", shape, dtype, n - k) for k, shape in enumerate(shapes)]
    plan = assign_buckets(slots, spec, cfg.bucket_mb, cfg.compress_min_numel,
                          cfg.min_compression_rate)
    state = work = 0
    for b in plan:
        layout = BucketLayout(tuple(s.shape for s in b.slots), dtype)
        kind = collective if collective in ("all_gather", "ring") else "all_gather"
        ex = exchange_for(layout, b.spec, kind)
        raw, wire = ex.raw_bytes, ex.wire_bytes()
        state += _state_bytes(ex)
        if b.spec == "none":
            here = 2 * raw
        elif type(ex).__name__ == "GatherExchange":
            here = dp * wire + 3 * raw
        else:
            here = 2 * raw + 2 * wire
        work = max(work, here)
    return state, work


def _state_bytes(ex) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in ex.state_layout().values())
