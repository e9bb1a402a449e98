"""State an all-reduce keeps per element of its input, whatever the group's size."""

from __future__ import annotations

import torch

from ... import codecs
from ...codecs.ef import ErrorFeedback
from ...errors import ConfigError


def element_state_layout(spec: str, numel: int,
                         dtype: torch.dtype = torch.float32) -> dict | None:
    """Name → (shape, dtype) of the state an all-reduce of ``numel`` elements through ``spec``
    keeps *per element of its input*, the same whatever the group's size; None where the
    codec's state cannot be kept so (no error feedback, or an inner codec with state of its
    own, a stochastic codec's step).

    Why: the encoded reduce-scatter + all-gather lays its state out by the group's size (a
    residual per chunk, one chunk per rank, and the owner's residual of one chunk), and a
    fault-tolerant sync's group changes at every quorum change. Kept per element instead:

    * ``residual``: this rank's error feedback of what it encoded from its own input, element
      by element, whatever chunk the element falls in (the all-gather form of the same codec
      keeps exactly this one: the two forms can alternate);
    * ``residual_owner``: the residual of the owner's re-encode of the reduced sum, at the
      elements of the chunk this rank owns (zeros elsewhere). Every rank decodes those bytes,
      so feeding the residual back keeps the ranks bit-identical. When the group changes,
      the part of the owner residual that falls in this rank's new chunk is kept (it is the
      same elements' error) and the rest is dropped
      (:meth:`CompressedCollective.state_to_elements` counts it): at most one re-encode's
      error per element, lost once, never counted twice."""
    codec = codecs.prototype(spec)
    if not isinstance(codec, ErrorFeedback) or codec.inner.state_layout((1,), dtype):
        return None
    return {"residual": ((numel,), dtype), "residual_owner": ((numel,), dtype)}



def require_elements(cc, elements: dict) -> dict:
    """The per-element layout of ``cc``'s state, or :class:`~ccfx.ConfigError` when ``cc``
    (an all-reduce through an error-feedback codec) does not keep it so or ``elements`` has
    other names."""
    names = element_state_layout(cc.spec, cc.call.numel, cc.call.dtype)
    if names is None or sorted(elements) != sorted(names) or cc.kind != "all_reduce":
        raise ConfigError(f"{cc.kind} through {cc.spec!r}: its state is not kept per "
                          f"element (got {sorted(elements)}, per-element state is "
                          f"{sorted(names or {})})")
    return names
