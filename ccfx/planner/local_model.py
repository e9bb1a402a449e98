"""The predicted step of local steps (``sync_every``, ``ccfx.local_steps``): when
syncing every H steps pays, and whether streaming hides the sync.

Over one period of H inner steps a replica computes H steps and syncs every fragment once.
A fragment's sync costs its codec work (encode, and the decodes its collective makes: the
gradient buckets' prices, :func:`~ccfx.planner.dp_model._bucket_cost`) plus its bytes on the
link (an all-reduce ``2 (W-1)/W`` of the payload, an all-gather ``W-1`` payloads, the
re-encoding ring ``2 (W-1)/W`` in ``2 (W-1)`` hops that each pay the latency).

* ``fragment_delay`` = 0: the loop waits for the whole sync, codec and link.
* τ > 0: the link time overlaps the τ inner steps that follow; what the link needs beyond
  them is exposed. The codec work runs on the same cores as the inner steps, so it is counted
  as exposed either way (no CPU contention model beyond that).

The mean step is ``compute + (exposed sync time per period) / H``. Loss is not predicted here:
how far H and a codec can go is measured (bench/local_steps.py), not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..wire.link import Link, resolve_collective
from ..wire.policy import balanced, split_fragment
from .codec_cost import CodecTimer
from .dp_model import BucketTraffic, _bucket_cost


@dataclass(frozen=True)
class FragmentSync:
    index: int
    codec_s: float
    link_s: float
    link_bytes: float  # per rank
    exposed_s: float


@dataclass(frozen=True)
class LocalStepsPrediction:
    step_s: float  # mean over a period of H inner steps
    compute_s: float  # one inner step without communication
    fragments: tuple[FragmentSync, ...]
    sync_every: int

    @property
    def bytes_per_step(self) -> float:
        """Bytes one rank puts on the link per inner step."""
        return sum(f.link_bytes for f in self.fragments) / self.sync_every

    @property
    def slowdown(self) -> float:
        """Step over the step without communication."""
        return self.step_s / self.compute_s if self.compute_s else math.inf

    def explain(self) -> str:
        sync = sum(f.codec_s + f.link_s for f in self.fragments)
        exposed = sum(f.exposed_s for f in self.fragments)
        hidden = " (none of it hidden)" if sync and exposed >= sync - 1e-12 else ""
        return (f"predicted step {self.step_s:.4g} s = compute {self.compute_s:.4g} s + "
                f"{exposed:.4g} s exposed of a {sync:.4g} s sync{hidden} / H={self.sync_every}"
                f" ({self.slowdown:.2f}x the step without communication; "
                f"{self.bytes_per_step:.4g} B per rank per step on the link)")


def predict_local_steps(compute_s: float, shapes: Sequence[tuple[int, ...]], world: int,
                        link: Link, config, timer: CodecTimer | None = None
                        ) -> LocalStepsPrediction:
    """The mean step of local steps with ``config``'s ``sync_every``, ``outer_codec``,
    ``outer_collective``, ``fragments``, ``fragment_delay`` and ``compress_min_numel``, for
    parameters of ``shapes`` (in the model's order, as ``ccfx.local_steps`` fragments them),
    ``compute_s`` per inner step, over ``world`` replicas on ``link``."""
    timer = timer or CodecTimer()
    h, delay = config.sync_every, config.fragment_delay
    share = world if link.shared else 1
    out = []
    for f, members in enumerate(balanced([math.prod(s) for s in shapes], config.fragments)):
        frag_shapes = [tuple(shapes[k]) for k in members]
        codec_s = link_s = link_bytes = 0.0
        for part, spec in split_fragment(frag_shapes, config.outer_codec,
                                         config.compress_min_numel):
            part_shapes = tuple(frag_shapes[i] for i in part)
            numel = sum(math.prod(s) for s in part_shapes)
            collective = resolve_collective(config.outer_collective, spec, numel,
                                            torch.float32, world, link)
            if world < 2:
                continue
            cost = _bucket_cost(BucketTraffic(0, part_shapes, torch.float32, 1.0), spec, world,
                                timer, collective)
            codec_s += cost.codec_s
            link_bytes += cost.link_bytes
            link_s += (link.seconds(cost.link_bytes * share)
                       + (cost.hops - 1) * link.latency_ms * 1e-3)
        exposed = codec_s + (max(0.0, link_s - delay * compute_s) if delay else link_s)
        out.append(FragmentSync(f, codec_s, link_s, link_bytes, exposed))
    step = compute_s + sum(f.exposed_s for f in out) / h
    return LocalStepsPrediction(step, compute_s, tuple(out), h)


def predict_outer(outer, link: Link, compute_s: float, world: int | None = None,
                  timer: CodecTimer | None = None) -> LocalStepsPrediction:
    """The predicted mean step of a running outer loop (the ``LocalSteps`` that
    ``ccfx.local_steps`` returned) on ``link`` with ``compute_s`` per inner step, over
    ``world`` replicas (default: its group's): :func:`predict_local_steps` with its parameter
    shapes and options."""
    return predict_local_steps(compute_s, outer.shapes, world or outer.world, link,
                               outer.config, timer)
