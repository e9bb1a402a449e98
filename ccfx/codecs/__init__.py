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
    redsync,
    sign,
    terngrad,
    threshold,
    tlc,
    topk,
)
from .base import Codec, Context, Encoded
from .dispatch import implementation
from .registry import (
    available,
    canonical,
    canonical_as_written,
    get,
    names,
    parse_spec,
    prototype,
    register,
    spelled,
)

__all__ = [
    "Codec", "Context", "Encoded", "available", "canonical", "canonical_as_written", "get",
    "implementation", "names", "parse_spec", "prototype", "register", "spelled",
]
