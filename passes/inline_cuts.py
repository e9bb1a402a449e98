"""inline_cuts: a cut's codec round trip offered to inductor as plain ops it can fuse.

A ``ccfx::cut`` node is an opaque custom op: inductor calls it as a fallback kernel, so the
encode cannot fuse into the kernel that produced the crossing value, nor the decode into the
one that reads it. On an AOT graph bound for inductor, this pass replaces each cut whose codec
can be traced (``codec_of`` returns it: stateless, fixed payload size, static shape) by
``decode(encode(x))`` traced with ``make_fx`` in the graph's fake mode, with the compiler's
decompositions: the same reference functions the op runs, now nodes inductor schedules with
their neighbours. A cut ``codec_of`` refuses stays the op.

The op reported its bytes to the ledger as it ran; an inlined cut cannot, so the pass lists
what each call of the graph sends (``gm.meta["ccfx"]["inlined_cuts"]``, :class:`InlinedCut`)
and the compile layer records exactly that after every call: the same ledger rows, from the
codec's fixed wire size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.fx

from .graph_utils import splice_traced, trace_phase, val


@dataclass(frozen=True)
class InlinedCutFacts:
    """inline_cuts: a node spliced for the cut ``uid``'s ``direction`` ("fwd" / "bwd")."""

    key: ClassVar[str] = "inlined_cut"
    writer: ClassVar[str] = "inline_cuts"

    uid: int
    direction: str


@dataclass(frozen=True)
class InlinedCut:
    """What one call of the graph sends through an inlined cut: the hop ``uid``, its
    ``direction``, the codec's spec and the raw and wire bytes per call."""

    uid: int
    direction: str
    codec: str
    raw_bytes: int
    wire_bytes: int


#: ``codec_of(uid, direction, value) -> codec or None``: the codec to inline for a cut (None:
#: keep the op). The compile layer answers from the hop's registration.
CodecOf = Callable[[int, str, torch.Tensor], object]


def _static(value) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.shape)


def _roundtrip_fn(codec):
    """The round trip, functionalized: the references update temporaries in place
    (``clamp_``), and inductor takes only functional graphs."""
    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        return codec.decode_with(codec.encode_with(x, {}), {}).contiguous()
    return torch.func.functionalize(roundtrip, remove="mutations_and_views")


def inline_cuts(gm: torch.fx.GraphModule, codec_of: CodecOf,
                decompositions=None) -> torch.fx.GraphModule:
    """Replace every ``ccfx::cut`` whose codec ``codec_of`` names by its traced round trip;
    ``gm.meta["ccfx"]["inlined_cuts"]`` lists them in graph order."""
    inlined: list[InlinedCut] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.ccfx.cut.default:
            continue
        x, _, _, uid, backward = node.args
        value, direction = val(x), "bwd" if backward else "fwd"
        if not _static(value):
            continue
        codec = codec_of(uid, direction, value)
        if codec is None:
            continue
        traced = trace_phase(_roundtrip_fn(codec), [value], decompositions)
        (out,) = splice_traced(gm.graph, traced, [x], node, InlinedCutFacts(uid, direction))
        if out is not x:  # the cut's stack and module meta, the traced value and facts
            out.meta = {**node.meta, "val": val(out), "ccfx": out.meta["ccfx"]}
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        shape = tuple(value.shape)
        inlined.append(InlinedCut(uid, direction, codec.spec,
                                  value.numel() * value.element_size(),
                                  int(codec.wire_bytes(shape, value.dtype))))
    gm.meta.setdefault("ccfx", {})["inlined_cuts"] = inlined
    gm.graph.lint()
    gm.recompile()
    return gm
