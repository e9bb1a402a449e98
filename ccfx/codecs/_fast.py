"""The CPU fast path: codec reference functions compiled by inductor.

Eager torch runs a blockwise codec as a chain of full-size temporaries, so large CPU tensors go
through ``torch.compile``d copies of the same reference functions. Tensors under tracing
(fake/functional subclasses, dispatch modes, an enclosing torch.compile) and CUDA tensors take
the eager function (CUDA tensors normally run Triton kernels, not the reference), and so do
small tensors: a compiled call costs ~0.4 ms of guards and launch, and each new shape a few
seconds of compile. Hence the threshold of 2**17 elements (a 512 KiB fp32 activation): above
it a compiled round trip wins by 2x or more on CPU, and a few seconds of compile per shape are
repaid within a few hundred steps.

``CCFX_CODEC_COMPILE=0`` turns the compiled path off, ``=1`` forces it for every size and device
(bench/codecs.py uses that to time an inductor-compiled reference against the Triton kernels);
``CCFX_CODEC_COMPILE_MIN_NUMEL`` sets the size threshold. Shapes that change every step (no
padding or bucketing of sequence lengths) would compile again and again: set
``CCFX_CODEC_COMPILE=0`` there.

Each distinct (shape, dtype, parameters) compiles once, with static shapes: dynamic shapes ran
the int8 encode 5x slower. A model's edges and gradient buckets come in many shapes, more than
dynamo's default recompile limit (8) per function, after which it would silently run eager; so
the compiled calls raise that limit to :data:`RECOMPILE_LIMIT`.

Where others wait on a call (a fault-tolerant replica's exchange, which every member of the
quorum waits on), a compile is the wrong cost to pay there: a replica that joins mid-run
compiles its first exchange's shapes (4 s with inductor's cache warm, 10 s cold, on a 10 M
model's chunks here) while the quorum waits. Inside :func:`compile_later` a call whose
signature :func:`compile_now` has not compiled yet runs eagerly (0.35 s for that exchange's
round trips) and is kept; :func:`compile_now` compiles the kept calls afterwards, off the path
the others wait on.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

from .. import _torch_compat as tc

#: Shapes (and dtypes, parameters) each reference compiles for before dynamo runs it eagerly.
RECOMPILE_LIMIT = 64


def _mode() -> str:
    return os.environ.get("CCFX_CODEC_COMPILE", "auto")


def _min_numel() -> int:
    return int(os.environ.get("CCFX_CODEC_COMPILE_MIN_NUMEL", str(1 << 17)))


def _eligible(x) -> bool:
    mode = _mode()
    if mode == "0" or type(x) is not torch.Tensor:
        return False
    if torch.compiler.is_compiling() or tc.len_torch_dispatch_stack() > 0:
        return False
    return mode == "1" or (x.device.type == "cpu" and x.numel() >= _min_numel())


#: Inside compile_later: the calls run eagerly that would have compiled, to compile afterwards.
_later: contextvars.ContextVar[list | None] = contextvars.ContextVar("ccfx_compile_later",
                                                                    default=None)


@contextlib.contextmanager
def compile_later():
    """Within it, a call whose signature :func:`compile_now` has not compiled runs eagerly
    instead and is appended to the list this yields; :func:`compile_now` compiles them."""
    calls: list = []
    token = _later.set(calls)
    try:
        yield calls
    finally:
        _later.reset(token)


def compile_now(calls: list) -> None:
    """Compile what :func:`compile_later` kept: each call again, compiled (results dropped)."""
    for wrapper, args, kwargs, key in calls:
        wrapper(*args, **kwargs)
        wrapper.ready.add(key)
    calls.clear()


def _signature(args, kwargs):
    """What a static-shape compile specializes on: tensors' shape, stride and dtype, the other
    arguments' values."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), a.stride(), a.dtype, a.device.type)
        if isinstance(a, (list, tuple)):
            return tuple(one(x) for x in a)
        return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else repr(a)

    return one(args), tuple(sorted((k, one(v)) for k, v in kwargs.items()))


def fast(fn=None, *, finish=None):
    """Run ``fn`` compiled when its first argument is a large plain CPU tensor (eagerly, for a
    signature :func:`compile_now` has not compiled, inside :func:`compile_later`).

    ``finish(out, *args, **kwargs)``, when given, turns ``fn``'s result into the function's,
    always uncompiled: a small epilogue kept out of the compiled graph, where it would cost a
    pass. (inductor fuses a per-block reduction with the loop that consumes it, one pass over
    the input, but not when a per-block output of another loop shape joins them: so a codec's
    ``fn`` returns its raw block reduction and ``finish`` derives the scales from it.)

    ``wrapper.eager`` is the uncompiled function, finish included (tests and the benchmark
    compare both).
    """
    if fn is None:
        return functools.partial(fast, finish=finish)
    compiled = None

    def done(out, args, kwargs):
        return out if finish is None else finish(out, *args, **kwargs)

    def eager(*args, **kwargs):
        return done(fn(*args, **kwargs), args, kwargs)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if not _eligible(args[0]):
            return eager(*args, **kwargs)
        later = _later.get()
        if later is not None:  # (the signature only here: not on every compiled call)
            key = _signature(args, kwargs)
            if key not in wrapper.ready:
                later.append((wrapper, args, kwargs, key))
                return eager(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False)
        with torch.no_grad(), tc.dynamo_config.patch(recompile_limit=RECOMPILE_LIMIT):
            return done(compiled(*args, **kwargs), args, kwargs)

    wrapper.eager = eager
    wrapper.ready = set()  # signatures compile_now compiled (the others run eagerly inside it)
    return wrapper
