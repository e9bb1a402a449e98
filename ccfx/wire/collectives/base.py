"""What every compressed collective shares: its construction, its codec calls, running its
phases; each algorithm is a subclass (one per module of this package).

``CompressedCollective(call, spec)`` returns the algorithm that serves ``call`` through
``spec``: the original collective itself for ``"none"`` (:mod:`.plain`), whole rows for an
all_to_all with unequal splits (:mod:`.all_to_all_rows`), else the one of its kind. Each
subclass names what it serves (``class AllGather(Chunked, serves="all_gather")``).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Callable

import torch

from ... import codecs
from ...codecs import ops as _ops  # noqa: F401  (registers torch.ops.ccfx_codecs)
from ...codecs.ef import ErrorFeedback
from ...errors import ConfigError
from .call import KINDS, CollectiveCall, Tensors
from .elements import require_elements
from .refusal import refuse

#: The algorithm for each case: a kind, ``"rows"`` (unequal all_to_all splits), ``"plain"``.
_ALGORITHMS: dict[str, type] = {}


def _algorithm(call: CollectiveCall, spec: str) -> type:
    """The class that serves ``call`` through ``spec`` (the base itself for a kind ccfx does
    not know: its ``__init__`` refuses it, saying so)."""
    if call.kind not in KINDS:
        return CompressedCollective
    if codecs.prototype(spec).name == "none":
        return _ALGORITHMS["plain"]
    return _ALGORITHMS["rows" if call.by_rows else call.kind]


class CompressedCollective(abc.ABC):
    """One collective through a codec, as phases (see the package docstring).

    ``ConfigError`` when :func:`refuse` says the spec cannot compress the call. ``rows``
    (None: decide) forces or forbids encoding and decoding all chunks in one call, where the
    codec allows it (:func:`~.chunking.rows_split`): the bits are the same either way, the
    state layout not (tests compare the two). ``owner_feedback`` (an all-reduce through an
    error-feedback codec): the owner of each reduced chunk keeps the residual of re-encoding
    it (``owner.residual``) and adds it to the next reduced chunk, so the second encode loses
    nothing for good either (see :func:`~.elements.element_state_layout`)."""

    def __init_subclass__(cls, serves: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if serves is not None:
            _ALGORITHMS[serves] = cls

    def __new__(cls, call: CollectiveCall | None = None, spec: str | None = None,
                *args, **kwargs):
        picked = cls
        if cls is CompressedCollective and call is not None:  # (copy.copy passes no call)
            picked = _algorithm(call, spec)
        return super().__new__(picked)

    def __init__(self, call: CollectiveCall, spec: str, rows: bool | None = None,
                 owner_feedback: bool = False):
        why = refuse(call, spec)
        if why is not None:
            raise ConfigError(f"{call.kind} of {tuple(call.shape)} {call.dtype} on "
                              f"{call.world} ranks cannot be compressed with {spec!r}: {why}; "
                              "it must run unchanged (collective codec 'none')")
        self.call = call
        self.codec = codecs.prototype(spec)
        self.spec = self.codec.spec
        self.identity = self.codec.name == "none"
        if owner_feedback and (call.kind != "all_reduce" or call.by_rows
                               or not isinstance(self.codec, ErrorFeedback)):
            raise ConfigError(f"owner_feedback keeps the residual of the all-reduce owner's "
                              f"re-encode: it needs an all_reduce through an error-feedback "
                              f"codec, not a {call.kind} through {self.spec!r}")
        self.owner_feedback = owner_feedback
        self._avg = (call.reduce_op or "").lower() == "avg"
        #: Unequal all_to_all splits: whole rows, each encoded on its own.
        self.by_rows = call.by_rows
        self._encode_state: dict = {}
        self._owner_state: dict = {}
        self._setup(rows)

    def _setup(self, rows: bool | None) -> None:
        """The algorithm's own layout: chunks, packing, state."""

    def bind(self, input_splits, output_splits) -> CompressedCollective:
        """This compressed collective with its split sizes as the graph holds them at trace
        time (SymInts where they are symbolic): what its phases pass to the all_to_all. The
        codec, its state and its messages are those of ``self``."""
        bound = copy.copy(self)
        bound.call = dataclasses.replace(self.call, input_splits=tuple(input_splits),
                                         output_splits=tuple(output_splits))
        return bound

    # -- what the plan and the pass read --------------------------------------------------

    @property
    def kind(self) -> str:
        return self.call.kind

    @property
    def raw_bytes(self) -> int:
        return self.call.raw_bytes

    def wire_bytes(self) -> int:
        """Bytes this rank sends per call, exactly: ``(W-1)`` messages of one chunk's packed
        payload per all-to-all or all-gather (two of those for the all-reduce); the identity
        sends what the uncompressed collective sends."""
        if self.call.symbolic_rows:
            raise ValueError(f"{self.kind} of {self.call.shape}: its row count is only known "
                             "at run time (use row_wire_bytes)")
        return self._wire_bytes()

    @abc.abstractmethod
    def _wire_bytes(self) -> int:
        """:meth:`wire_bytes` for a call of known rows: each algorithm's own count."""

    def row_wire_bytes(self) -> int:
        """Bytes of one row's message (an all_to_all with unequal splits): a call sends
        ``(W-1)/W`` of its rows' messages, the raw bytes' convention."""
        raise ValueError(f"{self.kind} with equal chunks: it is not sent row by row")

    def messages(self) -> list[tuple[str, int]]:
        """The collectives the phases issue, in order: ``(the Comm method, its input's bytes)``
        (an all-to-all's input holds the ``W`` messages this rank sends, one per rank; an
        all-gather's the one message every rank gets). What a planner prices: rounds, bytes,
        and from them :meth:`wire_bytes`."""
        if self.call.symbolic_rows:
            raise ValueError(f"{self.kind} of {self.call.shape}: its row count is only known "
                             "at run time")
        return self._messages()

    @abc.abstractmethod
    def _messages(self) -> list[tuple[str, int]]:
        """:meth:`messages` for a call of known rows: each algorithm's own collectives."""

    def state_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name → (shape, dtype) of every state tensor: the codec's state for what this rank
        encodes from its input (its error-feedback residual, a stochastic codec's step; one per
        chunk when chunks are encoded one by one, ``chunk0003.residual``), and the all-reduce
        owner's (``owner.step``: the inner codec's, no error feedback there)."""
        return {**self._encode_state, **self._owner_state}

    def init_state(self, device=None) -> dict[str, torch.Tensor]:
        return {}

    def state_from_elements(self, elements: dict[str, torch.Tensor],
                            rank: int) -> dict[str, torch.Tensor]:
        """The state :meth:`run` takes, made from state kept per element of the whole input:
        only an all-reduce through an error-feedback codec keeps it (:mod:`.all_reduce`)."""
        require_elements(self, elements)
        raise AssertionError("only an all_reduce keeps state per element")

    # -- the phases ------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def phases(self) -> list[Callable]:
        """The algorithm's phases in order (encode + issue, wait + decode, ...)."""

    def run(self, x: torch.Tensor, state: dict[str, torch.Tensor], comm) -> torch.Tensor:
        """All phases one after the other (eager use and tests)."""
        state_list = [state[k] for k in sorted(self.state_layout())]
        carry: Tensors = []
        for phase in self.phases:
            carry = phase(x, state_list, carry, comm)
        return carry[0]

    # -- the codec's ops ---------------------------------------------------------------------

    def _named(self, state: Tensors) -> dict[str, torch.Tensor]:
        return dict(zip(sorted(self.state_layout()), state))

    @staticmethod
    def _encode(x: torch.Tensor, spec: str, state: Tensors) -> Tensors:
        payload, new = torch.ops.ccfx_codecs.encode(x, spec, state)
        for s, n in zip(state, new):
            s.copy_(n)
        return list(payload)

    def _decode(self, payload: Tensors, numel: int) -> torch.Tensor:
        # The codecs allowed here read no state when they decode (refuse() checks it; a
        # stochastic codec's step is the encode's): the inner codec's, zeros, thrown away.
        inner = codecs.prototype(self._inner_spec)
        device = payload[0].device
        state = [torch.zeros(s, dtype=d, device=device) for _, (s, d) in
                 sorted(inner.state_layout((numel,), self.call.dtype).items())]
        out, _ = torch.ops.ccfx_codecs.decode(payload, self._inner_spec, [numel],
                                              self.call.dtype, state)
        return out
