"""What travels compressed and in which group: one rule for every runtime.

* :func:`raw_reason` / :func:`compressible`: a tensor's codec applies only to matrices of at
  least ``compress_min_numel`` elements; vectors, scalars and small tensors (biases, norms)
  travel uncompressed. The gradient buckets, the pipeline's data-parallel gradients, local
  steps' fragments and the planner's pricing of all three read this one rule.
* The bucket policy (DDP's): :func:`assign_buckets` fills buckets with gradients in the order
  backward makes them (:class:`GradSlot`), up to ``bucket_mb``; tensors the codec does not
  take go to buckets of their own, and so does a bucket the codec would not shrink by
  ``min_compression_rate``. One dtype per bucket.
* The fragment policy (Streaming DiLoCo): :func:`balanced` splits parameters into fragments of
  about equal size, :func:`split_fragment` a fragment into its compressed and raw exchanges.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .exchange import BucketLayout, exchange_for


def raw_reason(shape: Sequence[int], compress_min_numel: int) -> str:
    """'' when a tensor of ``shape`` may be compressed, else why it travels raw."""
    if len(shape) < 2:
        return "0-d/1-D parameters travel uncompressed"
    if math.prod(shape) < compress_min_numel:
        return f"below compress_min_numel={compress_min_numel}"
    return ""


def compressible(shape: Sequence[int], compress_min_numel: int) -> bool:
    """Whether a tensor of ``shape`` may go through a lossy codec (:func:`raw_reason`)."""
    return not raw_reason(shape, compress_min_numel)


# -- buckets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradSlot:
    """One parameter gradient among the backward's outputs."""

    output_index: int  # position in the backward's output tuple
    input_index: int  # the forward input (example_inputs[k]) it is the gradient of
    name: str  # the parameter's qualified name
    shape: tuple[int, ...]
    dtype: torch.dtype
    ready: int  # position in the graph of the node that produces it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketAssignment:
    index: int
    slots: tuple[GradSlot, ...]
    spec: str  # the codec applied ("none" when the policy skipped compression)
    reason: str = ""  # why it travels uncompressed, when it does
    #: how a non-summable payload is averaged: "all_gather" or "ring" (summable codecs
    #: all-reduce whichever it says; see ccfx.wire.exchange.exchange_for)
    collective: str = "all_gather"

    @property
    def layout(self) -> BucketLayout:
        return BucketLayout(tuple(s.shape for s in self.slots), self.slots[0].dtype)

    @property
    def ready(self) -> int:
        return max(s.ready for s in self.slots)


def assign_buckets(slots: Sequence[GradSlot], codec: str, bucket_mb: float,
                   compress_min_numel: int, min_compression_rate: float) -> list[BucketAssignment]:
    """``slots`` (in the order they become ready) into buckets (see the module docstring)."""
    cap = bucket_mb * 2**20
    open_buckets: dict[tuple, list[GradSlot]] = {}
    closed: list[tuple[str, list[GradSlot]]] = []
    for slot in slots:
        reason = raw_reason(slot.shape, compress_min_numel) if codec != "none" else ""
        key = (slot.dtype, reason)
        members = open_buckets.setdefault(key, [])
        members.append(slot)
        if sum(s.numel * s.dtype.itemsize for s in members) >= cap:
            closed.append((reason, open_buckets.pop(key)))
    closed += [(reason, members) for (_, reason), members in open_buckets.items()]
    closed.sort(key=lambda rm: max(s.ready for s in rm[1]))  # the order they become ready
    buckets = []
    for i, (reason, members) in enumerate(closed):
        spec = "none" if reason else codec
        if spec != "none":
            ex = exchange_for(BucketLayout(tuple(s.shape for s in members), members[0].dtype), spec)
            rate = ex.raw_bytes / max(ex.wire_bytes(), 1)
            if rate < min_compression_rate:
                spec, reason = "none", (f"{codec} would shrink it {rate:.2f}x only "
                                        f"(< min_compression_rate={min_compression_rate:g})")
        buckets.append(BucketAssignment(i, tuple(members), spec, reason))
    return buckets


# -- fragments -----------------------------------------------------------------------------------


def balanced(numels: Sequence[int], fragments: int) -> list[list[int]]:
    """Parameters into ``fragments`` fragments of about equal size: in the model's order, each
    parameter joins the fragment with the fewest elements so far (the lowest index on a tie),
    so the link carries about the same bytes at each fragment's sync (fragments differ by at
    most the largest tensor) and fragments tend to mix early and late layers. (Taking every
    P-th tensor does not balance: weights and biases alternate.)"""
    if fragments > len(numels):
        raise ConfigError(f"fragments={fragments} but the model has {len(numels)} parameters: "
                          f"use at most {len(numels)} fragments")
    out: list[list[int]] = [[] for _ in range(fragments)]
    sizes = [0] * fragments
    for k, n in enumerate(numels):
        f = min(range(fragments), key=lambda i: (sizes[i], i))
        out[f].append(k)
        sizes[f] += n
    return out


def split_fragment(shapes: Sequence[tuple[int, ...]], codec: str,
                   min_numel: int) -> list[tuple[list[int], str]]:
    """A fragment's exchanges: (member indices, codec). The codec takes the tensors
    :func:`compressible` admits; vectors and tensors under ``min_numel`` elements (biases,
    norms) travel in an uncompressed part of their own, as the gradient buckets' policy does."""
    small = [i for i, s in enumerate(shapes) if not compressible(s, min_numel)]
    big = [i for i in range(len(shapes)) if i not in small]
    return [(members, spec) for members, spec in ((big, codec), (small, "none")) if members]
