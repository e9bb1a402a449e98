"""``ccfx::cut``: the codec round trip on one hop of a cut edge, forward and backward.

``cut(x, codec, grad_codec, uid, backward)`` returns ``decode(encode(x))`` with ``codec``; its
autograd rule sends the incoming gradient through ``grad_codec`` the same way (compressed
backpropagation). One op therefore carries both directions, and after aot_autograd it appears
in the forward graph and in the backward graph.

``uid`` names the hop in a process-wide table (``register_hop``) so the op can report its bytes
to the right ledger; an unknown uid still computes the round trip, it just is not counted.
The table holds weak references: a :class:`Hop` belongs to the backend that registered it (one
per ``torch.compile`` call), so hops, ledgers and codec state die with the compiled model.

Codec state is explicit (:mod:`ccfx.codecs.state`): a stateful codec's tensors (error-feedback
residual, PowerSGD's Q) are made by ``init_state``, registered in the backend's
:class:`~ccfx.codecs.state.CodecState` (``ccfx.codec_state(compiled)``) under the hop's channel,
``graph0.edge3.hop1to2.fwd`` / ``.bwd``, and passed to ``encode_with`` / ``decode_with`` at every
call; no codec object keeps any.
The op never aliases its input (the identity codec copies), as custom ops must not, and its
output is always contiguous (a received buffer), whatever the input's strides.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass

import torch

from .. import codecs
from ..codecs.state import CodecState, edge_channel
from ..errors import CodecError
from .ledger import Ledger


@dataclass(frozen=True, eq=False)
class Hop:
    """One hop's runtime: where its bytes are counted, its codecs (shared, stateless objects)
    and where its codecs' state tensors live (``state``: the owning backend's holder)."""

    ledger: Ledger
    graph: int
    edge: int
    hop: tuple[int, int]
    codec: codecs.Codec | None = None
    grad_codec: codecs.Codec | None = None
    state: CodecState | None = None

    def codec_for(self, direction: str, dtype: torch.dtype) -> codecs.Codec | None:
        """The codec of ``direction`` for a tensor of ``dtype`` (``none`` where it does not
        apply, e.g. integer tensors)."""
        codec = self.grad_codec if direction == "bwd" else self.codec
        if codec is not None and not codec.applies_to(dtype):
            codec = codecs.prototype("none")
        return codec

    def channel(self, direction: str) -> str:
        return edge_channel(self.graph, self.edge, self.hop, direction)

    def state_for(self, direction: str, shape, dtype: torch.dtype,
                  device=None) -> dict[str, torch.Tensor]:
        """The state tensors of ``direction`` for a tensor of ``shape``/``dtype``: registered
        under the hop's channel at the first call (the backend allocates them when it compiles,
        for static shapes), the same tensors from then on."""
        codec = self.codec_for(direction, dtype)
        if codec is None or not codec.stateful:
            return {}
        channel = self.channel(direction)
        live = self.state.channel(channel) if self.state is not None else None
        if live is None:
            fresh = codec.init_state(tuple(shape), dtype, device)
            if self.state is None:
                return fresh
            return self.state.add(channel, codec.spec, fresh,
                                  legacy=f"graph{self.graph}_edge{self.edge}_hop{self.hop[0]}"
                                         f"to{self.hop[1]}_{direction}_")
        misfit = codec.state_misfit(live, shape, dtype)
        if misfit:
            raise CodecError(
                f"cut edge {channel}: codec {codec.spec!r} keeps {misfit}: a stateful codec's "
                "state has one shape; compile without dynamic shapes for it, or use a "
                "stateless codec on this edge")
        return live


_HOPS: weakref.WeakValueDictionary[int, Hop] = weakref.WeakValueDictionary()
_next_uid = itertools.count(1)
_lock = threading.Lock()


def register_hop(hop: Hop) -> int:
    """A uid for ``hop``; the caller keeps ``hop`` alive (the table only refers to it)."""
    with _lock:
        uid = next(_next_uid)
        _HOPS[uid] = hop
    return uid


def hop_of(uid: int) -> Hop:
    return _HOPS[uid]


def find_hop(uid: int) -> Hop | None:
    """The hop ``uid`` names, None when it is not registered (or gone)."""
    return _HOPS.get(uid)


def forget_hops(uids) -> None:
    with _lock:
        for uid in uids:
            _HOPS.pop(uid, None)


def registered_hops() -> int:
    """How many hops are registered and alive (for tests of lifetimes)."""
    return len(_HOPS)


def _roundtrip(x: torch.Tensor, spec: str, uid: int, direction: str) -> torch.Tensor:
    hop = _HOPS.get(uid)
    codec = hop.codec_for(direction, x.dtype) if hop is not None else None
    if codec is None:  # not registered: the codec with fresh state, counted nowhere
        codec = codecs.prototype(spec)
        if not codec.applies_to(x.dtype):
            codec = codecs.prototype("none")
        state = codec.init_state(tuple(x.shape), x.dtype, x.device) if codec.stateful else {}
    else:
        state = hop.state_for(direction, tuple(x.shape), x.dtype, x.device)
    codec.check_input(x)
    enc = codec.encode_with(x, state)
    out = codec.decode_with(enc, state).contiguous()  # what the fake kernel promises
    if hop is not None:
        hop.ledger.record(hop.graph, hop.edge, hop.hop, direction,
                          x.numel() * x.element_size(), enc.nbytes)
    return out


def cut_body(x: torch.Tensor, codec: str, grad_codec: str, uid: int,
             backward: bool) -> torch.Tensor:
    """The op's computation, callable without the dispatcher (see ``backends.lowering``)."""
    return _roundtrip(x, codec, uid, "bwd" if backward else "fwd")


@torch.library.custom_op("ccfx::cut", mutates_args=())
def cut(x: torch.Tensor, codec: str, grad_codec: str, uid: int, backward: bool) -> torch.Tensor:
    return cut_body(x, codec, grad_codec, uid, backward)


@cut.register_fake
def _(x, codec, grad_codec, uid, backward):
    # Contiguous whatever the input's strides: what arrives off a wire is a fresh buffer.
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    _, _, grad_codec, uid, _ = inputs
    ctx.grad_codec = grad_codec
    ctx.uid = uid


def _backward(ctx, grad):
    return torch.ops.ccfx.cut(grad, ctx.grad_codec, ctx.grad_codec, ctx.uid, True), None, None, None, None


cut.register_autograd(_backward, setup_context=_setup_context)


def describe_uid(uid: int) -> str:
    """A stable name for a hop, for printing graphs: ``"e3:1->2"`` (edge 3, stage 1 to 2)."""
    hop = _HOPS.get(uid)
    if hop is None:
        return "unregistered"
    return f"e{hop.edge}:{hop.hop[0]}->{hop.hop[1]}"
