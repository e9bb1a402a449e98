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

import sympy
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
    if isinstance(a, int):
        return -(-a // b)
    return sympy.ceiling(sympy.sympify(a) / b)


@dataclass(frozen=True)
class Codec:
    """Base class. Subclasses set ``name`` and implement encode/decode/wire_bytes."""

    name: ClassVar[str] = ""
    #: "sum" when payloads from several ranks can be all-reduced; "gather" otherwise.
    reduction: ClassVar[str] = "gather"
    #: decode(encode(x)) == x bit for bit.
    lossless: ClassVar[bool] = False
    #: One line for the catalogue.
    summary: ClassVar[str] = ""

    def encode(self, x: torch.Tensor) -> Encoded:
        raise NotImplementedError(f"{type(self).__name__}.encode")

    def decode(self, enc: Encoded) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.decode")

    def wire_bytes(self, shape, dtype: torch.dtype):
        """Exact bytes on the wire for a tensor of this shape and dtype (sympy if symbolic)."""
        raise NotImplementedError(f"{type(self).__name__}.wire_bytes")

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether this codec compresses tensors of ``dtype`` (others travel raw)."""
        return dtype in FLOATING

    def check_input(self, x: torch.Tensor) -> None:
        if not self.applies_to(x.dtype):
            raise CodecError(
                f"codec {self.spec!r} cannot encode a {x.dtype} tensor; it takes floating "
                f"tensors ({', '.join(str(d) for d in FLOATING)}). Use codec 'none' for this edge."
            )

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
