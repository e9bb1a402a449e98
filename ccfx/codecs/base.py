"""The codec interface, in the GRACE spirit.

``encode(x)`` returns an :class:`Encoded`: the *payload* (the tensors that cross the wire) and a
*context* (what the receiver can know without being told: shape, dtype, codec parameters). The
context never crosses the wire, so ``wire_bytes`` is exactly the payload's ``nbytes``.
``decode(encoded)`` returns a tensor of ``x``'s shape and dtype. Error feedback and other state
are separate, composable pieces (see ``ccfx.codecs.registry.get``).

A codec is a frozen dataclass: its fields are its parameters, parsed from a spec string such as
``"int8:block=128"``. Adding a codec is one module that subclasses :class:`Codec` and decorates
it with ``@register``; nothing else changes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import CodecError

FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Context:
    """What the receiving side knows without being told: never crosses the wire."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    extra: Any = None


@dataclass(frozen=True)
class Encoded:
    payload: tuple[torch.Tensor, ...]
    ctx: Context

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.payload)


def numel_of(shape) -> Any:
    """Number of elements; a sympy expression when the shape is symbolic."""
    n = 1
    for d in shape:
        n = n * d
    return n


def ceil_div(a, b: int):
    """``ceil(a / b)`` for ints, torch SymInts (fake-tensor shapes) and sympy expressions."""
    if isinstance(a, (int, torch.SymInt)):
        return -(-a // b)
    import sympy  # here: symbolic sizes only (importing it costs a restarted replica 0.4 s)

    return sympy.ceiling(sympy.sympify(a) / b)


#: One payload tensor's (shape, dtype); shapes may hold SymInts or sympy expressions.
Layout = tuple[tuple[tuple, torch.dtype], ...]


def _must_implement(codec, method: str) -> TypeError:
    return TypeError(f"{type(codec).__name__} is a Codec and must implement {method}() "
                     "(the interface: payload_layout, encode_with, decode_with)")


@dataclass(frozen=True)
class Codec:
    """Base class. Subclasses set ``name`` and implement ``payload_layout``, ``encode_with`` and
    ``decode_with``.

    Two faces over one functional core:

    * the functional core, ``encode_with(x, state)`` / ``decode_with(enc, state)``, takes the
      state as a dict of tensors (made by ``init_state(shape, dtype, device)``) that it updates
      in place. Everything in ccfx's runtime uses this face (the cut op, pipeline wires, bucket
      exchanges, the custom ops in :mod:`ccfx.codecs.ops`): the state lives in tensors the
      runtime owns and checkpoints under one naming scheme (:mod:`ccfx.codecs.state`), never on
      a codec object;
    * the object API, ``encode(x)`` / ``decode(enc)``, for a codec used by hand (tests, the
      catalogue, a notebook): a stateful codec from ``codecs.get`` keeps its own state dict
      (``state_dict()``), so repeated calls warm-start and feed back errors.

    ``payload_layout(shape, dtype)`` gives every payload tensor's shape and dtype from the input
    shape alone. ``wire_bytes`` is its sum, so it is exact by construction, and the receiving
    side of a pipeline (and the custom ops' fake kernels) can allocate the payload without
    being told its size.
    """

    name: ClassVar[str] = ""
    #: "sum" when payloads from several ranks can be all-reduced; "gather" otherwise.
    reduction: ClassVar[str] = "gather"
    #: decode(encode(x)) == x bit for bit.
    lossless: ClassVar[bool] = False
    #: One line for the catalogue.
    summary: ClassVar[str] = ""
    #: True when the codec keeps tensors between calls (``state_layout`` is not empty).
    #: ``registry.get`` returns a fresh object for every call with such a spec.
    stateful: ClassVar[bool] = False
    #: True when the payload's size depends on the data: its tensors have a fixed capacity
    #: (the layout, what ``wire_bytes`` counts) and only the first ``used_elements(payload)``
    #: entries of ``payload[0]`` carry data (see :mod:`ccfx.codecs.variable`).
    variable: ClassVar[bool] = False

    # -- what a subclass implements -------------------------------------------------------

    def payload_layout(self, shape, dtype: torch.dtype) -> Layout:
        """(shape, dtype) of every payload tensor, for an input of ``shape`` and ``dtype``."""
        raise _must_implement(self, "payload_layout")

    def encode_with(self, x: torch.Tensor, state: dict[str, torch.Tensor]) -> Encoded:
        """Encode ``x`` using and updating ``state`` in place (empty for stateless codecs)."""
        raise _must_implement(self, "encode_with")

    def decode_with(self, enc: Encoded, state: dict[str, torch.Tensor]) -> torch.Tensor:
        raise _must_implement(self, "decode_with")

    def state_layout(self, shape, dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """Name → (shape, dtype) of each state tensor for inputs of ``shape``/``dtype``."""
        return {}

    def init_state(self, shape, dtype: torch.dtype, device=None) -> dict[str, torch.Tensor]:
        """Fresh state for inputs of ``shape``/``dtype``: zeros unless a codec says otherwise."""
        return {
            k: torch.zeros(s, dtype=d, device=device)
            for k, (s, d) in self.state_layout(shape, dtype).items()
        }

    # -- the object API -------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> Encoded:
        self.check_input(x)
        return self.encode_with(x, self._live_state(tuple(x.shape), x.dtype, x.device))

    def decode(self, enc: Encoded) -> torch.Tensor:
        device = enc.payload[0].device if enc.payload else None
        return self.decode_with(enc, self._live_state(enc.ctx.shape, enc.ctx.dtype, device))

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def wire_bytes(self, shape, dtype: torch.dtype):
        """Exact bytes on the wire for a tensor of this shape and dtype (sympy if symbolic)."""
        total = 0
        for s, d in self.payload_layout(tuple(shape), dtype):
            total = total + numel_of(s) * d.itemsize
        return total

    def used_elements(self, payload) -> int:
        """How many leading entries of ``payload[0]`` carry data (all but for ``variable``)."""
        return payload[0].numel()

    def used_bytes(self, payload) -> int:
        """The bytes of ``payload`` that carry data: ``nbytes`` unless the codec is
        ``variable``, whose ``payload[0]`` past ``used_elements`` is padding."""
        if not payload:
            return 0
        head, rest = payload[0], payload[1:]
        return (self.used_elements(payload) * head.element_size()
                + sum(t.numel() * t.element_size() for t in rest))

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether this codec compresses tensors of ``dtype`` (others travel raw)."""
        return dtype in FLOATING

    def check_input(self, x: torch.Tensor) -> None:
        if not self.applies_to(x.dtype):
            raise CodecError(
                f"codec {self.spec!r} cannot encode a {x.dtype} tensor; it takes floating "
                f"tensors ({', '.join(str(d) for d in FLOATING)}). Use codec 'none' for this edge."
            )

    # -- state held by the object ---------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live state tensors (not copies); empty until the first encode or ``init_state``."""
        return dict(self._state())

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        live = self._state()
        live.clear()
        live.update({k: v.detach().clone() for k, v in state.items()})

    def reset_state(self, shape=None, dtype=None, device=None) -> dict[str, torch.Tensor]:
        """Drop the state; with a shape, allocate it now (so it can be registered as buffers)."""
        live = self._state()
        live.clear()
        if shape is not None:
            live.update(self.init_state(tuple(shape), dtype, device))
        return self.state_dict()

    def fresh(self) -> Codec:
        """A copy with the same parameters and no state."""
        return dataclasses.replace(self) if self.stateful else self

    def _state(self) -> dict[str, torch.Tensor]:
        # Frozen dataclass: the parameters are immutable, the state dict lives beside them.
        return self.__dict__.setdefault("_ccfx_state", {})

    def _live_state(self, shape, dtype, device) -> dict[str, torch.Tensor]:
        if not self.stateful:
            return {}
        live = self._state()
        if not live:
            live.update(self.init_state(shape, dtype, device))
            return live
        misfit = self.state_misfit(live, shape, dtype)
        if misfit:
            raise CodecError(
                f"codec {self.spec!r} holds {misfit}: use one codec object per tensor "
                "(registry.get returns a fresh one each call), or call reset_state().")
        return live

    def state_misfit(self, live: dict[str, torch.Tensor], shape, dtype) -> str:
        """What of ``live`` does not fit a tensor of ``shape``/``dtype`` ("" when it all fits)."""
        for k, (s, d) in self.state_layout(tuple(shape), dtype).items():
            have = live.get(k)
            if have is None or tuple(have.shape) != tuple(s) or have.dtype != d:
                got = None if have is None else (tuple(have.shape), have.dtype)
                return f"state {k!r} for {got}, but this tensor needs {(tuple(s), d)}"
        return ""

    # -- naming ---------------------------------------------------------------------------

    @property
    def spec(self) -> str:
        """Canonical spec string: the name, then the parameters that differ from the default."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f.name if value is True else f"{f.name}={value}")
        return self.name + (":" + ",".join(parts) if parts else "")

    def __str__(self) -> str:
        return self.spec


def blocked(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, viewed as ``(nblocks, block)``."""
    n = flat.numel()
    nblocks = -(-n // block)
    return torch.nn.functional.pad(flat, (0, nblocks * block - n)).view(nblocks, block)


def nonfinite_rows(rows: torch.Tensor) -> torch.Tensor:
    """``(nblocks, 1)`` bool: the block holds a NaN or an inf."""
    return ~torch.isfinite(rows).all(dim=1, keepdim=True)


def raw_bytes(shape, dtype: torch.dtype):
    n = numel_of(shape)
    return n * dtype.itemsize


def as_int(value) -> int:
    """Evaluate a size that may be a sympy number."""
    if isinstance(value, int):
        return value
    return int(value)


def isclose_ratio(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)
