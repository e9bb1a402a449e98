"""A codec that sends more bytes than the tensor it encodes, and a spelling that would not.

``int8:block=1`` carries a 4-byte scale per element beside its byte: 1.25x a float32 tensor's
raw bytes. The backend notes every channel (cut edge, gradient bucket, collective) whose wire
bytes exceed its raw bytes in the plan and warns once; :func:`better_spec` is the spelling it
suggests.
"""

from __future__ import annotations

import math

import torch

from .registry import parse_spec, prototype


def ratio(spec: str, shape, dtype: torch.dtype) -> float | None:
    """Wire over raw bytes of ``spec`` on a tensor of ``shape`` and ``dtype``; None when the
    shape is symbolic or empty."""
    if not shape or not all(isinstance(d, int) for d in shape) or math.prod(shape) == 0:
        return None
    return float(prototype(spec).wire_bytes(tuple(shape), dtype)) / (math.prod(shape)
                                                                     * dtype.itemsize)


def better_spec(spec: str, shape, dtype: torch.dtype) -> tuple[str, float]:
    """A spelling that shrinks a tensor of ``shape`` / ``dtype`` where ``spec`` expands it, and
    its ratio: the codec with its default parameters (error feedback kept), else bf16 (a wider
    float), else ``"none"`` (the raw tensor)."""
    name, params = parse_spec(spec)
    candidates = [name + (":ef" if params.get("ef") else "")]
    if dtype.is_floating_point and dtype.itemsize > 2:
        candidates.append("bf16")
    for candidate in candidates:
        if prototype(candidate).spec == prototype(spec).spec:
            continue
        r = ratio(candidate, shape, dtype)
        if r is not None and r < 1:
            return prototype(candidate).spec, r
    return "none", 1.0
