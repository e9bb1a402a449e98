"""grad_buckets: average parameter gradients across ranks from inside the backward graph.

Runs on the backward graph aot_autograd produces (the forward's passes ran long before).
Three steps, each usable alone:

1. :func:`find_param_grads`: which outputs of the backward are gradients of parameters (the
   output node's ``meta["desc"]``: ``GradAOTOutput(grad_of=PlainAOTInput(k))``, input ``k`` of
   the forward being an ``nn.Parameter``), in the order backward makes them.
2. :func:`~ccfx.wire.policy.assign_buckets` (the wire layer's bucket policy, DDP's):
   gradients fill buckets in that order up to ``bucket_mb``; 0-d/1-D parameters and those
   under ``compress_min_numel`` go to buckets of their own that travel uncompressed, and so
   does a bucket the codec would not shrink by ``min_compression_rate``. One dtype per bucket.
3. :func:`grad_buckets` (the pass): per bucket, the phases of its
   :class:`~ccfx.wire.exchange.Exchange` traced with ``make_fx`` (functional
   collectives and the codecs' own ops) and spliced in: the first phase right after the
   bucket's last gradient (the collective starts as soon as the bucket is ready), middle
   phases after the next buckets' gradients, the last phase (wait, decode, ÷ world) just
   before the output (waited on as late as possible). A bucket on the ring
   (``BucketAssignment.collective == "ring"``) is one blocking ``ccfx::ring_all_reduce`` op
   in its first phase. The output then returns the averaged gradients. Codec state becomes
   extra placeholders at the end of the inputs, updated in the graph with ``copy_``: the
   caller passes the tensors it owns (see
   ``ccfx.runtime.data_parallel``).

Facts: each spliced node gets a :class:`~ccfx.passes.facts.BucketFacts` (``bucket`` i,
``phase`` k), each state placeholder one with its ``state`` name; the graph gets
``gm.meta["ccfx"]["buckets"]`` (the :class:`BucketAssignment` list) and ``"state_inputs"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx

from ccfx import _torch_compat as tc
from ccfx.errors import CcfxError
from ccfx.wire.exchange import Exchange, exchange_for
from ccfx.wire.policy import BucketAssignment, GradSlot

from .facts import BucketFacts, put
from .graph_utils import splice_traced, trace_phase


def _output_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def find_param_grads(gm: torch.fx.GraphModule, param_names: Mapping[int, str]) -> list[GradSlot]:
    """Parameter gradients among the backward's outputs, in the order they become ready.
    ``param_names`` maps forward input index → parameter name (inputs that are parameters)."""
    out = _output_node(gm)
    descs = out.meta.get("desc")
    values = list(out.args[0])
    if descs is None or len(descs) != len(values):
        raise CcfxError(
            "ccfx data parallel could not tell which backward outputs are parameter gradients "
            "(the backward graph's output carries no aot_autograd descriptors); this torch "
            "version is not supported for data_parallel")
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    slots = []
    for k, (node, desc) in enumerate(zip(values, descs)):
        grad_of = getattr(desc, "grad_of", None)
        index = getattr(grad_of, "idx", None)
        if node is None or index is None or index not in param_names:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        slots.append(GradSlot(k, index, param_names[index], tuple(int(d) for d in value.shape),
                              value.dtype, pos[node]))
    return sorted(slots, key=lambda s: (s.ready, s.output_index))



def grad_buckets(gm: torch.fx.GraphModule, buckets: Sequence[BucketAssignment],
                 state: Sequence[Mapping[str, torch.Tensor]], comm,
                 decompositions=None) -> torch.fx.GraphModule:
    """Splice each bucket's exchange into the backward ``gm`` (see the module docstring).
    ``state[i]`` holds bucket i's codec state tensors (real, for their shapes and dtypes);
    they become placeholders ``ccfx_state_<i>_<name>`` appended to the inputs in that order."""
    graph = gm.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    fake_mode = tc.detect_fake_mode([n.meta.get("val") for n in placeholders])
    out_node = _output_node(gm)
    grads_out = list(out_node.args[0])
    first_op = next(n for n in nodes if n.op != "placeholder")
    state_nodes = _bucket_state_placeholders(graph, buckets, state, fake_mode, first_op)
    exchanges: list[Exchange] = [exchange_for(b.layout, b.spec, b.collective) for b in buckets]

    carry: dict[int, list[torch.fx.Node]] = {i: [] for i in range(len(buckets))}
    for _, i, k, anchor in _phase_anchors(nodes, buckets, exchanges, out_node, first_op):
        b, ex = buckets[i], exchanges[i]
        grad_nodes = [grads_out[s.output_index] for s in b.slots]
        inputs = [*grad_nodes, *state_nodes[i], *carry[i]]
        n_g, n_s = len(grad_nodes), len(state_nodes[i])
        phase = ex.phases[k]

        def fn(*flat, phase=phase, n_g=n_g, n_s=n_s):
            return list(phase(list(flat[:n_g]), list(flat[n_g:n_g + n_s]),
                              list(flat[n_g + n_s:]), comm))

        traced = trace_phase(fn, [n.meta["val"] for n in inputs], decompositions)
        new_nodes = splice_traced(graph, traced, inputs, anchor, BucketFacts(b.index, phase=k))
        carry[i] = new_nodes

    for i, b in enumerate(buckets):
        for slot, node in zip(b.slots, carry[i]):
            grads_out[slot.output_index] = node
    out_node.args = (tuple(grads_out),) + tuple(out_node.args[1:])
    meta = gm.meta.setdefault("ccfx", {})
    meta["buckets"] = list(buckets)
    meta["state_inputs"] = [(b.index, name) for b, named in zip(buckets, state)
                            for name in sorted(named)]
    graph.lint()
    gm.recompile()
    return gm


def _bucket_state_placeholders(graph: torch.fx.Graph, buckets: Sequence[BucketAssignment],
                               state: Sequence[Mapping[str, torch.Tensor]], fake_mode,
                               first_op: torch.fx.Node) -> list[list[torch.fx.Node]]:
    """A placeholder per codec state tensor of each bucket (before the first op), per
    bucket in name order."""
    state_nodes: list[list[torch.fx.Node]] = []
    with graph.inserting_before(first_op):
        for b, named in zip(buckets, state):
            row = []
            for name in sorted(named):
                node = graph.placeholder(f"ccfx_state_{b.index}_{name}")
                node.meta["val"] = fake_mode.from_tensor(named[name], static_shapes=True)
                put(node, BucketFacts(b.index, state=name))
                row.append(node)
            state_nodes.append(row)
    return state_nodes


def _phase_anchors(nodes: list[torch.fx.Node], buckets: Sequence[BucketAssignment],
                   exchanges: list[Exchange], out_node: torch.fx.Node,
                   first_op: torch.fx.Node) -> list[tuple[int, int, int, torch.fx.Node]]:
    """(order, bucket, phase, anchor) in the order the phases are inserted: a bucket's
    phase k after bucket i+k is ready (phases of one bucket in turn), its last at the
    output."""
    after_ready = [nodes[b.ready + 1] if nodes[b.ready].op != "placeholder" else first_op
                   for b in buckets]
    work = []
    for i, ex in enumerate(exchanges):
        n_phases = len(ex.phases)
        for k in range(n_phases):
            if k == n_phases - 1:
                anchor, order = out_node, len(nodes)
            else:
                j = min(i + k, len(buckets) - 1)
                anchor, order = after_ready[j], buckets[j].ready
            work.append((order, i, k, anchor))
    work.sort(key=lambda w: w[:3])
    return work


