"""The codec catalogue. ``get(spec)`` builds one; ``available()`` lists them."""

from . import (  # noqa: F401  (each module registers its codecs)
    cast,
    fp8,
    identity,
    int4,
    int8,
    powersgd,
    qsgd,
    randomk,
    sign,
    terngrad,
    threshold,
    topk,
)
from .base import Codec, Context, Encoded
from .dispatch import implementation
from .registry import available, canonical, get, names, parse_spec, prototype, register

__all__ = [
    "Codec", "Context", "Encoded", "available", "canonical", "get", "implementation", "names",
    "parse_spec", "prototype", "register",
]
