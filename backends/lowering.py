"""Lowering: aot_autograd splits the cut graph into forward and backward graphs, then inductor
or eager runs them. The graphs each compiler receives are recorded for tests and drawings.

Under eager, the ``ccfx::cut`` ops stay opaque calls, made to the op's Python body directly,
skipping the dispatcher (``direct_cut_calls``). Under inductor, a cut whose codec is stateless
and of fixed size is inlined as plain ops (``passes.inline_cuts``, option ``fuse_codecs``) that
inductor fuses with the kernels around it, and the compiled call records its bytes
(``counted_cuts``); the other cuts stay fallback calls to the op (Triton on CUDA, torch on CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from ccfx import _torch_compat as tc


@dataclass
class LoweredGraphs:
    """What aot_autograd produced: forward, backward (compiled lazily, at the first
    ``.backward()``) and inference graphs. With inductor, a hit in its FX-graph or AOT-autograd
    cache skips the compile and so the recording: these lists may then be empty."""

    forward: list[torch.fx.GraphModule] = field(default_factory=list)
    backward: list[torch.fx.GraphModule] = field(default_factory=list)
    inference: list[torch.fx.GraphModule] = field(default_factory=list)
    #: the cuts inductor received as plain ops, over every graph it compiled (see inline_cuts)
    inlined_cuts: list = field(default_factory=list)


def direct_cut_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose ``ccfx::cut`` calls run the op's Python body directly.

    After aot_autograd the graphs need nothing the dispatcher adds to a custom op (autograd is
    already split into forward and backward, and nothing traces them again), while a Python
    custom op costs ~60 µs per call to dispatch: several times an identity round trip on
    activation-sized tensors. ``gm`` itself (recorded for tests and drawings) is not changed.
    """
    from ccfx.runtime.cut_op import cut_body

    if not any(n.target is torch.ops.ccfx.cut.default for n in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.target is torch.ops.ccfx.cut.default:
            node.target = cut_body
    return torch.fx.GraphModule(gm, graph)


#: ``rewrite(backward_gm, compile_fn, decompositions, record) -> boxed callable``: how the
#: data-parallel runtime takes over the backward (``DataParallel.compile_backward``).
BackwardRewrite = Callable[..., Callable]
#: ``rewrite(kind, gm, compile_fn, decompositions) -> boxed callable``: the compressed
#: collectives of every AOT graph, ``kind`` "forward", "backward" or "inference"
#: (``backends.collectives``). It runs first; ``compile_fn`` then does the rest (the
#: data-parallel backward's buckets included) on the graph it rewrote.
CollectivesRewrite = Callable[..., Callable]


def _eager(graphs: LoweredGraphs, rewrite: BackwardRewrite | None,
           collectives: CollectivesRewrite | None = None):
    from functorch.compile import make_boxed_func

    def compile_eager(gm: torch.fx.GraphModule):
        return make_boxed_func(direct_cut_calls(gm).forward)

    def compiler(kind):
        def finish(gm: torch.fx.GraphModule):
            if kind == "backward" and rewrite is not None:
                return rewrite(gm, compile_eager, None, graphs.backward.append)
            getattr(graphs, kind).append(gm)
            return compile_eager(gm)

        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            if collectives is not None:
                return collectives(kind, gm, finish, None)
            return finish(gm)
        return compile_graph

    return tc.aot_autograd(
        fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"), keep_inference_input_mutations=True,
        partition_fn=_partition,
    )


def _partition(joint, inputs, **kwargs):
    """AOT's default partitioner, except for graphs with recompute tags (a checkpointed region,
    ``ccfx.shard``'s gathers), which get inductor's min-cut one: the default saves every
    untagged forward node that backward reads, such as the transpose of a gathered weight,
    which keeps the whole weight alive until backward."""
    chosen = (tc.min_cut_rematerialization_partition if tc.has_recomputable_ops(joint)
              else tc.default_partition)
    return chosen(joint, inputs, **kwargs)


def _fusible_codec(uid: int, direction: str, value: torch.Tensor):
    """The codec of a registered hop that inline_cuts may trace (stateless: no tensors to
    thread through the graph; fixed size: its wire bytes known from the shape), else None."""
    from ccfx.runtime.cut_op import find_hop

    hop = find_hop(uid)
    codec = hop.codec_for(direction, value.dtype) if hop is not None else None
    if codec is None or codec.stateful or codec.variable:
        return None
    return codec


def counted_cuts(compiled: Callable, cuts: Sequence) -> Callable:
    """``compiled`` (boxed), recording each inlined cut's bytes in its hop's ledger after every
    call, as the op would have while it ran."""
    from ccfx.runtime.cut_op import find_hop

    if not cuts:
        return compiled

    def run(args):
        out = compiled(args)
        for c in cuts:
            hop = find_hop(c.uid)
            if hop is not None:
                hop.ledger.record(hop.graph, hop.edge, hop.hop, c.direction, c.raw_bytes,
                                  c.wire_bytes)
        return out

    return tc.mark_boxed(run)


def _inductor(graphs: LoweredGraphs, mode: str | None, rewrite: BackwardRewrite | None,
              collectives: CollectivesRewrite | None = None, fuse: bool = True):
    from ccfx.passes.graph_utils import copy_graph
    from ccfx.passes.inline_cuts import inline_cuts

    def inner(gm, example_inputs, **kwargs):
        kind = ("backward" if kwargs.get("is_backward") else
                "inference" if kwargs.get("is_inference") else "forward")

        def compile_fx(g: torch.fx.GraphModule, inputs):
            if fuse and any(n.target is torch.ops.ccfx.cut.default for n in g.graph.nodes):
                g = inline_cuts(copy_graph(g), _fusible_codec, tc.select_decomp_table())
                cuts = g.meta["ccfx"]["inlined_cuts"]
                graphs.inlined_cuts.extend(cuts)
                return counted_cuts(tc.compile_fx_inner(g, inputs, **kwargs), cuts)
            return tc.compile_fx_inner(g, inputs, **kwargs)

        def compile_rewritten(rewritten: torch.fx.GraphModule):
            inputs = [n.meta["val"] for n in rewritten.graph.nodes if n.op == "placeholder"]
            # Keep each collective where the pass put it: inductor's default memory
            # reordering moves waits early and collectives late.
            with tc.inductor_config.patch(reorder_for_peak_memory=False):
                return compile_fx(rewritten, inputs)

        def finish(g: torch.fx.GraphModule):
            if kind == "backward" and rewrite is not None:
                return rewrite(g, compile_rewritten, tc.select_decomp_table(),
                               graphs.backward.append)
            getattr(graphs, kind).append(g)
            if g is gm:
                return compile_fx(gm, example_inputs)
            return compile_rewritten(g)

        if collectives is not None:
            return collectives(kind, gm, finish, tc.select_decomp_table())
        return finish(gm)

    patches = None
    if mode:
        patches = tc.inductor_mode_options(mode)

    def compile_graph(gm, example_inputs):
        return tc.compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

    return compile_graph


def _rewriting_backward():
    """A hit in AOT autograd's cache skips the compilers, and with them the gradient buckets,
    the compressed collectives and the byte counts of inlined cuts (those graphs turn the
    cache off alone): graphs ccfx rewrites are never served from (or stored in) that cache. And the backward compiles with the forward
    (not lazily at the first ``.backward()``), so buckets, collectives, their codec state and
    the plan exist after the first call, and every rank checks the bucket and collective plans
    at the same point."""
    return tc.functorch_config.patch(enable_autograd_cache=False,
                                     force_non_lazy_backward_lowering=True)


def lower(gm: torch.fx.GraphModule, example_inputs: Sequence, lowering: str,
          mode: str | None = None,
          rewrite_backward: BackwardRewrite | None = None,
          rewrite_collectives: CollectivesRewrite | None = None, fuse_codecs: bool = True
          ) -> tuple[Callable, LoweredGraphs]:
    graphs = LoweredGraphs()
    if lowering == "eager":
        compiler = _eager(graphs, rewrite_backward, rewrite_collectives)
    else:
        compiler = _inductor(graphs, mode, rewrite_backward, rewrite_collectives,
                             fuse_codecs)
    rewriting = rewrite_backward is not None or rewrite_collectives is not None
    inlining = lowering != "eager" and fuse_codecs and any(
        n.target is torch.ops.ccfx.cut.default for n in gm.graph.nodes)
    guard = (_rewriting_backward() if rewriting else
             tc.functorch_config.patch(enable_autograd_cache=False) if inlining else
             contextlib.nullcontext())  # (inlined cuts count bytes in ccfx's compiled call)
    with guard:
        return compiler(gm, list(example_inputs)), graphs
