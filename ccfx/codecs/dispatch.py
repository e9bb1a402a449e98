"""Which implementation of a codec runs: its Triton kernels or its torch reference.

By default the device decides: CUDA tensors run the Triton kernels in ``ccfx.backends.triton``
(where a codec has them), everything else runs the torch reference (compiled by inductor for
large CPU tensors, see :mod:`ccfx.codecs._fast`). Benchmarks and tests override that:

    with ccfx.codecs.implementation("reference"):   # torch reference, even on CUDA
        ...
    with ccfx.codecs.implementation("triton"):      # Triton, even on CPU (TRITON_INTERPRET=1)
        ...

The choice is per thread of control (a ``contextvars`` variable), so a benchmark's override
never leaks into code running elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os

import torch

from ..errors import CodecError

CHOICES = ("auto", "triton", "reference")

_choice: contextvars.ContextVar[str] = contextvars.ContextVar("ccfx_codec_impl", default="auto")


@contextlib.contextmanager
def implementation(choice: str):
    """Run codecs with ``choice`` (``auto``, ``triton`` or ``reference``) inside the block."""
    if choice not in CHOICES:
        raise CodecError(f"codec implementation must be one of {', '.join(CHOICES)}, "
                         f"got {choice!r}")
    token = _choice.set(choice)
    try:
        yield
    finally:
        _choice.reset(token)


def current() -> str:
    return _choice.get()


def use_triton(t: torch.Tensor) -> bool:
    """Whether a codec with Triton kernels runs them on ``t``."""
    choice = _choice.get()
    if choice == "reference":
        return False
    if choice == "auto":
        return t.is_cuda
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise CodecError(
            "implementation('triton') on a CPU tensor: Triton kernels need a CUDA tensor, or "
            "TRITON_INTERPRET=1 in the environment (set before triton is imported) to "
            "interpret them on the CPU."
        )
    return True


def pick(t: torch.Tensor, family: str, which: str, reference):
    """``ccfx.backends.triton.<family>.<family>_<which>`` when :func:`use_triton` says so (the
    module is imported then: only the Triton path needs triton), else ``reference``."""
    if use_triton(t):
        kernels = importlib.import_module(f"ccfx.backends.triton.{family}")
        return getattr(kernels, f"{family}_{which}")
    return reference
