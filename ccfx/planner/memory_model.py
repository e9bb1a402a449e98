"""Peak memory per device of one pipeline stage under a layout: what a layout planner must
refuse before it prices anything (the memory estimator for 3D-parallel LLM training of the
issue: in 454 runs, no configuration estimated under 80 % of device memory ran out of it).

The parts, per device of stage ``s`` (tensor-parallel degree ``tp``, data-parallel ``dp``):

* **parameters** and **gradients**: the stage's parameter bytes / ``tp`` each (gradients in
  the parameters' dtype, as torch keeps them; at the peak only where a backward ran before it,
  :func:`stage_memory`); sharded data parallel (``ccfx.shard``, ZeRO-3's
  shape) divides both by ``dp`` and adds the largest layer gathered whole, twice (the one
  computing and the next one prefetched);
* **optimizer state**: AdamW's two fp32 moments per parameter (8 bytes each), / ``tp``
  (/ ``dp`` sharded);
* **activations in flight**: the bytes autograd saves for the stage's backward per
  microbatch (measured by the trace, scaled to the microbatch, / ``tp``) times the
  microbatches whose backward has not run yet at the worst moment: under 1F1B stage ``s`` of
  ``pp`` holds ``min(pp - s, m)``, under GPipe all ``m``;
* **transient**: the largest tensor a layer of the stage hands on, twice (an output and its
  gradient while the last microbatch's backward starts);
* **codec buffers and state**: a payload per hop and direction on the sending and receiving
  side, and, for error feedback, one residual the size of the compressed tensor (per hop and
  direction, per gradient bucket).

Measured check (tests/test_layout_planner.py), peaks from ``torch.distributed._tools.
MemTracker`` over real CPU steps with AdamW of the tiny GPT (3.2 M parameters, batch 16):
the first stage of two under 1F1B with 4 microbatches -5.2 %, the last stage -7.3 %, the whole
model in one microbatch -1.3 % (the parts not counted: the allocator's temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass

from .model_facts import StageFacts

#: bytes of optimizer state per parameter: AdamW's exp_avg and exp_avg_sq in fp32
ADAMW_STATE_BYTES = 8
#: a layout whose estimate exceeds this fraction of a device's memory is refused
MEMORY_LIMIT = 0.8

SCHEDULES = ("1F1B", "GPipe")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one stage, by part."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    codec: int
    in_flight: int  # microbatches whose activations are held at the peak

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations
                + self.transient + self.codec)

    def describe(self) -> str:
        gib = 2 ** 30
        grads = f"{self.grads / gib:.3g}" + (" at the peak" if self.grads < self.params
                                                 else "")
        return (f"{self.total / gib:.3g} GiB = params {self.params / gib:.3g} + grads "
                f"{grads} + AdamW {self.optimizer / gib:.3g} + activations "
                f"{self.activations / gib:.3g} ({self.in_flight} microbatch(es) in flight) + "
                f"transient {self.transient / gib:.3g} + codecs {self.codec / gib:.3g}")


def in_flight(schedule: str, stage: int, pp: int, microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at its peak."""
    if schedule == "GPipe":
        return microbatches
    return max(1, min(pp - stage, microbatches))


def stage_memory(stage: StageFacts, *, fraction: float, held: int,
                 microbatches: int | None = None, tp: int = 1, dp: int = 1,
                 sharded: bool = False, largest_layer_bytes: int = 0, codec_bytes: int = 0
                 ) -> MemoryEstimate:
    """The estimate for one device of ``stage``: ``fraction`` is a microbatch's share of the
    traced batch, ``held`` the microbatches in flight (:func:`in_flight`) out of
    ``microbatches`` (None: more than ``held``), ``codec_bytes`` the codecs' buffers and state
    on this device (the caller prices them on its hops and buckets).

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
    per_mb = int(stage.saved_bytes * fraction / tp)
    grads = params
    if microbatches is not None and held >= microbatches:
        grads = max(0, params - per_mb)
    transient = int(2 * stage.max_out_bytes * fraction)
    return MemoryEstimate(params + gathered, grads, optimizer, per_mb * held, transient,
                          int(codec_bytes), held)
