"""Every codec as a pair of generic custom ops, ``ccfx_codecs::encode`` / ``ccfx_codecs::decode``.

One pair serves the whole catalogue: the codec is a string argument (its spec), so adding a
codec adds no op. The payload is a list of tensors whose shapes and dtypes follow from the
input shape (``Codec.payload_layout``): that is the fake kernel, so the ops trace under Dynamo
and aot_autograd with fake and symbolic shapes.

State (error-feedback residual, PowerSGD's Q, step counters) is passed in as a list of tensors,
in :func:`state_names` order, and the ops are functional: they return the updated state, which
the caller copies back (``aten.copy_`` in the graph) into tensors it owns, e.g. buffers of the
user's module. (Mutating a ``Tensor[]`` argument in place is not an option: functionalization
refuses custom ops that mutate and return a ``Tensor[]``.) Allocate state with
:func:`init_state`:

    state = ops.init_state(spec, x.shape, x.dtype, x.device)
    payload, new = torch.ops.ccfx_codecs.encode(x, spec, state)
    for s, n in zip(state, new): s.copy_(n)
    y, new = torch.ops.ccfx_codecs.decode(payload, spec, list(x.shape), x.dtype, state)
    for s, n in zip(state, new): s.copy_(n)

Stateless codecs take and return empty lists.

Outputs never alias inputs (custom-op rule): payload tensors that are views of the input, and a
decoded tensor that is a payload tensor, are copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Context, Encoded
from .registry import prototype


def state_names(spec: str, shape, dtype: torch.dtype) -> list[str]:
    """The names of the state tensors the ops take, in order."""
    return sorted(prototype(spec).state_layout(tuple(shape), dtype))


def init_state(spec: str, shape, dtype: torch.dtype, device=None) -> list[torch.Tensor]:
    state = prototype(spec).init_state(tuple(shape), dtype, device)
    return [state[k] for k in sorted(state)]


def _bind(spec, shape, dtype, state: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    names = state_names(spec, shape, dtype)
    if len(names) != len(state):
        raise ValueError(
            f"codec {spec!r} takes {len(names)} state tensors ({', '.join(names) or 'none'}), "
            f"got {len(state)}: allocate them with ccfx.codecs.ops.init_state"
        )
    return dict(zip(names, state))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else -1


def _unaliased(outs, inputs) -> list[torch.Tensor]:
    taken = {_storage(t) for t in inputs} - {-1}
    result = []
    for t in outs:
        t = t.contiguous()
        ptr = _storage(t)
        if ptr in taken:
            t = t.clone()
            ptr = _storage(t)
        taken.add(ptr)
        result.append(t)
    return result


@torch.library.custom_op("ccfx_codecs::encode", mutates_args=())
def encode(
    x: torch.Tensor, spec: str, state: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    codec = prototype(spec)
    codec.check_input(x)
    new = [t.clone() for t in state]
    enc = codec.encode_with(x, _bind(spec, x.shape, x.dtype, new))
    return _unaliased(enc.payload, [x, *state, *new]), new


@encode.register_fake
def _(x, spec, state):
    layout = prototype(spec).payload_layout(tuple(x.shape), x.dtype)
    return [x.new_empty(s, dtype=d) for s, d in layout], [torch.empty_like(t) for t in state]


@torch.library.custom_op("ccfx_codecs::decode", mutates_args=())
def decode(
    payload: list[torch.Tensor],
    spec: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    state: list[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    shape = tuple(shape)
    new = [t.clone() for t in state]
    enc = Encoded(tuple(payload), Context(shape, dtype))
    out = prototype(spec).decode_with(enc, _bind(spec, shape, dtype, new))
    return _unaliased([out], [*payload, *state, *new])[0], new


@decode.register_fake
def _(payload, spec, shape, dtype, state):
    out = payload[0].new_empty(tuple(shape), dtype=dtype)
    return out, [torch.empty_like(t) for t in state]
