"""Lowering: aot_autograd splits the cut graph into forward and backward graphs, then inductor
or eager runs them. The graphs each compiler receives are recorded for tests and drawings.

The ``ccfx::cut`` ops survive both paths as opaque calls: inductor emits a fallback call to the
op (its Python body runs the codec: Triton on CUDA, torch on CPU); eager calls the op's Python
body directly, skipping the dispatcher (``direct_cut_calls``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx


@dataclass
class LoweredGraphs:
    """What aot_autograd produced: forward, backward (compiled lazily, at the first
    ``.backward()``) and inference graphs. With inductor, a hit in its FX-graph or AOT-autograd
    cache skips the compile and so the recording: these lists may then be empty."""

    forward: list[torch.fx.GraphModule] = field(default_factory=list)
    backward: list[torch.fx.GraphModule] = field(default_factory=list)
    inference: list[torch.fx.GraphModule] = field(default_factory=list)


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


def _eager(graphs: LoweredGraphs, rewrite: BackwardRewrite | None):
    from functorch.compile import make_boxed_func

    def compile_eager(gm: torch.fx.GraphModule):
        return make_boxed_func(direct_cut_calls(gm).forward)

    def compiler(kind):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            if kind == "backward" and rewrite is not None:
                return rewrite(gm, compile_eager, None, graphs.backward.append)
            getattr(graphs, kind).append(gm)
            return compile_eager(gm)
        return compile_graph

    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(
        fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"), keep_inference_input_mutations=True,
    )


def _inductor(graphs: LoweredGraphs, mode: str | None, rewrite: BackwardRewrite | None):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward") and rewrite is not None:
            from torch._inductor.decomposition import select_decomp_table

            def compile_backward(rewritten: torch.fx.GraphModule):
                inputs = [n.meta["val"] for n in rewritten.graph.nodes if n.op == "placeholder"]
                # Keep each collective where the pass put it: inductor's default memory
                # reordering moves waits early and collectives late.
                with torch._inductor.config.patch(reorder_for_peak_memory=False):
                    return compile_fx_inner(rewritten, inputs, **kwargs)

            return rewrite(gm, compile_backward, select_decomp_table(), graphs.backward.append)
        if kwargs.get("is_backward"):
            graphs.backward.append(gm)
        elif kwargs.get("is_inference"):
            graphs.inference.append(gm)
        else:
            graphs.forward.append(gm)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    patches = None
    if mode:
        patches = torch._inductor.list_mode_options(mode)

    def compile_graph(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

    return compile_graph


def _rewriting_backward():
    """A hit in AOT autograd's cache skips the backward compiler, and with it the gradient
    buckets: graphs ccfx rewrites are never served from (or stored in) that cache. And the
    backward compiles with the forward (not lazily at the first ``.backward()``), so buckets,
    their codec state and the plan exist after the first call, and every rank checks the bucket
    plan at the same point."""
    return torch._functorch.config.patch(enable_autograd_cache=False,
                                         force_non_lazy_backward_lowering=True)


def lower(gm: torch.fx.GraphModule, example_inputs: Sequence, lowering: str,
          mode: str | None = None,
          rewrite_backward: BackwardRewrite | None = None) -> tuple[Callable, LoweredGraphs]:
    graphs = LoweredGraphs()
    if lowering == "eager":
        compiler = _eager(graphs, rewrite_backward)
    else:
        compiler = _inductor(graphs, mode, rewrite_backward)
    guard = _rewriting_backward() if rewrite_backward is not None else contextlib.nullcontext()
    with guard:
        return compiler(gm, list(example_inputs)), graphs
