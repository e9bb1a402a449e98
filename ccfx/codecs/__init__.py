"""The codec catalogue. ``get(spec)`` builds one; ``available()`` lists them."""

from . import cast, identity, int8  # noqa: F401  (each module registers its codecs)
from .base import Codec, Context, Encoded
from .registry import available, canonical, get, names, parse_spec, register

__all__ = [
    "Codec", "Context", "Encoded", "available", "canonical", "get", "names", "parse_spec",
    "register",
]
