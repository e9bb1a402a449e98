"""Whether a codec can compress a collective (:func:`refuse`), and why not when it cannot.

A refused collective runs unchanged. Every rank must decide alike, so only what the ranks
share (kind, shapes, dtype, world, codec) decides; an all_to_all with unequal splits is
judged by its rows (:func:`_rows_reason`).
"""

from __future__ import annotations

import torch

from ... import codecs
from ...codecs.base import Codec
from ...codecs.ef import ErrorFeedback
from ...errors import ConfigError
from .call import KINDS, SUMMABLE_OPS, CollectiveCall, static
from .chunking import inner_codec, row_encoding, state_per_element


def _codec_reason(codec: Codec, dtype: torch.dtype) -> str | None:
    """Why ``codec`` cannot run on a collective's chunks, or None."""
    from ...codecs.powersgd import PowerSGD

    inner = inner_codec(codec)
    if isinstance(inner, PowerSGD):
        return (f"codec {codec.spec!r} is PowerSGD: low rank needs a matrix per gradient and "
                "summable all-reduces of its own, not a collective's chunks (use int8, fp8, "
                "int4, bf16...)")
    extra = sorted(set(inner.state_layout((1,), torch.float32)) - {"step"})
    if extra:
        return (f"codec {codec.spec!r} keeps state besides its step ({', '.join(extra)}), "
                "which a collective's chunks cannot carry: each rank encodes chunks and "
                "decodes other ranks' payloads (use a codec whose only state is its step or "
                "an error-feedback residual: int8, fp8, int4, bf16, topk, with or without ef)")
    if not codec.applies_to(dtype):
        return f"codec {codec.spec!r} does not apply to {dtype} tensors"
    return None


def refuse(call: CollectiveCall, spec: str) -> str | None:
    """None if ``spec`` can compress ``call``, else why the collective must run unchanged.

    A bad spec (unknown codec, bad parameter) is not a refusal: it raises
    :class:`~ccfx.ConfigError`. ``"none"`` is accepted wherever a codec would be (it then runs
    the original collective)."""
    if call.kind not in KINDS:
        raise ConfigError(f"collective kind {call.kind!r}: ccfx knows {', '.join(KINDS)}")
    codec = codecs.prototype(spec)
    # unequal all_to_all splits go whole rows, any row count (a symbolic one included)
    rows = call.by_rows and len(call.shape) > 0 and static(call.shape[1:])
    if not (rows or static(call.shape)) or not isinstance(call.world, int):
        return f"symbolic shape {tuple(call.shape)} (a compressed collective needs static sizes)"
    if call.world < 2:
        return "a group of one rank: nothing crosses the wire"
    if not call.dtype.is_floating_point:
        return f"{call.dtype} data: codecs compress floating-point tensors only"
    if rows:
        return _rows_reason(call, codec)
    if call.kind in ("all_reduce", "reduce_scatter"):
        op = (call.reduce_op or "").lower()
        if op not in SUMMABLE_OPS:
            return (f"a {call.reduce_op!r} reduction: only sum and avg can be taken over "
                    "decoded values (a max / min / product runs unchanged)")
    if call.kind != "all_reduce" and len(call.shape) == 0:
        return f"a 0-d input: {call.kind} splits or stacks dim 0"
    if call.numel == 0:
        return "an empty tensor: nothing crosses the wire"
    if call.kind in ("reduce_scatter", "all_to_all") and call.shape[0] % call.world:
        return (f"dim 0 of {tuple(call.shape)} does not split into {call.world} equal chunks "
                f"(torch's {call.kind} needs it too)")
    if codec.name == "none":
        return None
    return _codec_reason(codec, call.dtype)


def _rows_reason(call: CollectiveCall, codec: Codec) -> str | None:
    """Why an all_to_all with unequal splits (:attr:`CollectiveCall.by_rows`) cannot be
    compressed with ``codec``, or None.

    Every rank must decide alike, and the ranks' row counts differ (one may send or receive
    none, and they may be symbolic, known only when the call runs): only what the ranks share
    (world, row width, dtype, codec) decides. A symbolic row count is no obstacle (each row is
    encoded on its own, its message's size fixed by the row width, and the receiver sizes what
    it gets from the output splits it already has), except for a codec whose state has one
    entry per element (error feedback's residual): it needs a fixed row count."""
    splits = {"input": call.input_splits, "output": call.output_splits}
    for which, sizes in splits.items():
        if not sizes:
            return (f"{which} split sizes missing beside the "
                    f"{'output' if which == 'input' else 'input'} ones (torch needs both)")
        known = [v for v in sizes if static((v,))]
        if len(sizes) != call.world or (known and min(known) < 0):
            return f"{which} split sizes {tuple(sizes)} are not {call.world} sizes >= 0"
    if static(call.input_splits) and not call.symbolic_rows and \
            sum(call.input_splits) != call.shape[0]:
        return (f"input split sizes {tuple(call.input_splits)} do not add up to dim 0 of "
                f"{tuple(call.shape)}")
    if call.row == 0:
        return "rows of 0 elements: nothing crosses the wire"
    if codec.name == "none":
        return None
    if call.symbolic_rows and state_per_element(codec, call.row, call.dtype):
        what = ("error feedback" if isinstance(codec, ErrorFeedback)
                else "state with one entry per element")
        return (f"codec {codec.spec!r} keeps {what}, and {what} needs a fixed row count: "
                f"this all-to-all's rows ({call.shape[0]}) are data-dependent (known only "
                f"at run time); use a codec without it "
                f"({codecs.spelled(inner_codec(codec).spec)!r})")
    why = _codec_reason(codec, call.dtype)
    if why is None and row_encoding(codec, call.row, call.dtype) is None:
        why = (f"codec {codec.spec!r} cannot encode each row of {call.row} elements on its own "
               "(unequal splits send whole rows, each decodable by itself: use int8, fp8, int4, "
               "bf16, fp16...)")
    return why

