"""``ccfx.plan_parallel``: the model's facts, measured once without running it at size, then the
layout search of :mod:`ccfx.planner.layout_search`; and ``ccfx plan`` on the command line.

    best = ccfx.plan_parallel(model, example_inputs, cluster)
    print(best.explain()); best.layout; best.predicted_step_s; best.peak_memory_bytes
    compiled = torch.compile(model, backend="ccfx", options=best.options(rank))

``example_inputs`` is the whole step's batch (every replica's microbatches together); the
planner splits it over ``dp × microbatches``.

How the facts are measured (:func:`model_facts`): the model's forward runs once through
``torch.func.functional_call`` under a ``FakeTensorMode``, every parameter, buffer and input
replaced by a fake CPU tensor of its shape and dtype: shapes propagate, nothing is allocated or
computed, and the user's module and its tensors (real or ``meta``) are untouched (a
1 B-parameter transformer at batch 512 × 2048 traces in about a second, in no memory). Fake
*CPU* tensors rather than ``meta`` ones because kernels are chosen by device: on ``meta``,
``scaled_dot_product_attention`` takes the math path and saves the T × T attention
probabilities for backward (twice the activations of a 1 B GPT at sequence 2048), while CPU and
CUDA run a fused flash kernel that saves its output and log-sum-exp only. Three PyTorch tools
read the trace:

* ``torch.utils.flop_counter.FlopCounterMode``: forward FLOPs, read at each block's forward
  hooks (the counter ``torch.distributed._tools.RuntimeEstimator`` itself builds on; its
  roofline and benchmark modes need a CUDA device to time or to read peak rates from, and a
  cluster's devices are described, not present, so the planner turns FLOPs into seconds with
  each device's own rate, ``Cluster.rate``);
* ``torch.autograd.graph.saved_tensors_hooks``: the bytes autograd keeps for each block's
  backward (the activations a pipeline stage holds per microbatch in flight), each tensor
  counted once, parameters not counted;
* forward hooks on the blocks: the tensor a cut after each block would send.

``torch.distributed._tools.MemTracker`` serves where a real run exists: the tests check the
memory model against its measured peak of a CPU step (tests/test_layout_planner.py). Models
whose forward depends on data values (``.item()``, boolean masks) cannot run on fake tensors:
the trace says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from ccfx import _torch_compat as tc
from ccfx.cost import FREE
from ccfx.errors import CcfxError, ConfigError, first_line
from ccfx.planner.cluster import Cluster
from ccfx.planner.layout_result import ParallelPlan
from ccfx.planner.layout_search import search
from ccfx.planner.model_facts import LayerFacts, ModelFacts

from .tp_derive import LinearFlow


class _OpCounter(tc.TorchDispatchMode):
    """Counts the aten ops each part of the forward runs (views and other free ops left out,
    :data:`ccfx.cost.FREE`, and queries such as ``prim::device``): what a CPU spends per op beyond its FLOPs
    (:func:`ccfx.planner.compute.machine_rate`'s second figure)."""

    def __init__(self, current: list):
        super().__init__()
        self.current = current
        self.counts: dict[str, int] = {}
        #: (rows, inner, columns) of each 2-D matmul → its FLOPs summed over the forward
        self.matmuls: dict[tuple[int, int, int], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name not in FREE:
            self.counts[self.current[0]] = self.counts.get(self.current[0], 0) + 1
            a, b = (args[1], args[2]) if name == "addmm" else args[:2] if name == "mm" \
                else (None, None)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                key = (int(a.shape[0]), int(a.shape[1]), int(b.shape[1]))
                self.matmuls[key] = self.matmuls.get(key, 0) + 2 * key[0] * key[1] * key[2]
        return func(*args, **(kwargs or {}))

    def main_matmul(self) -> tuple[int, int, int] | None:
        """The matmul shape that does the most FLOPs."""
        return max(self.matmuls, key=self.matmuls.get) if self.matmuls else None


def find_blocks(model: torch.nn.Module) -> tuple[str, list[tuple[str, torch.nn.Module]]]:
    """The model's repeated blocks: the ``ModuleList`` / ``Sequential`` with the most children
    holding parameters (the first of equals), as (its name, [(qualified name, block)])."""
    best_name, best = "", []
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            kids = [(f"{name}.{k}" if name else k, c) for k, c in mod.named_children()
                    if any(True for _ in c.parameters())]
            if len(kids) >= 2 and len(kids) > len(best):
                best_name, best = name, kids
    return best_name, best


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(value, Mapping):
        for v in value.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    if hasattr(value, "to_tuple"):  # Hugging Face ModelOutput
        return _first_tensor(value.to_tuple())
    return None


def _fake(value):
    """``value`` with every tensor replaced by an empty CPU tensor of its shape and dtype
    (called under a FakeTensorMode: nothing is allocated)."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="cpu")
    if isinstance(value, (tuple, list)):
        return type(value)(_fake(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _fake(v) for k, v in value.items()}
    return value


def _tp_plan(model: torch.nn.Module):
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or \
        getattr(model, "_tp_plan", None)
    if not plan:
        return None
    return tuple(sorted((str(k), str(v)) for k, v in dict(plan).items()))


def model_facts(model: torch.nn.Module, example_inputs, *, measure: bool = False) -> ModelFacts:
    """Per block: forward FLOPs, parameters, saved activation bytes and the tensor handed on,
    at ``example_inputs``' batch, from one forward on fake tensors (the module docstring).
    ``measure``: also time the real model here (:func:`ccfx.planner.compute.measure_model`:
    a small CPU model with real inputs; skipped, ``facts.measured`` None, where it cannot
    be), so "measure here" devices are priced from its own seconds, not a matmul's rate."""
    facts = _traced_facts(model, example_inputs)
    if not measure:
        return facts
    from dataclasses import replace

    from ccfx.planner.compute import measure_model

    args, kwargs = _split_inputs(example_inputs)
    measured = measure_model(model, args, kwargs, flops=facts.flops,
                             ops=sum(x.ops for x in facts.layers),
                             param_numel=facts.param_numel, batch=facts.batch)
    return replace(facts, measured=measured) if measured is not None else facts


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    return tuple(example_inputs), {}


def _traced_facts(model: torch.nn.Module, example_inputs) -> ModelFacts:
    """The model's facts per repeated block from one forward on fake tensors: FLOPs, ops,
    parameters, saved activations and each block's output (the whole model one layer where
    it has no repeated blocks)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"plan_parallel: the model is a {type(model).__name__}: give the "
                          "torch.nn.Module (not a compiled wrapper or a function)")
    args, kwargs = _split_inputs(example_inputs)
    first = _first_tensor((args, kwargs))
    if first is None or first.dim() == 0:
        raise ConfigError("plan_parallel: the example inputs hold no batched tensor: give the "
                          "step's batch (e.g. (token_ids,) of shape (batch, sequence))")
    batch = int(first.shape[0])
    container, blocks = find_blocks(model)
    block_ids = {id(b) for _, b in blocks}

    fake_mode = tc.FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        params = {n: _fake(p).requires_grad_(p.requires_grad)
                  for n, p in model.named_parameters()}
        buffers = {n: _fake(b) for n, b in model.named_buffers()}
        fake_args, fake_kwargs = _fake(args), _fake(kwargs)
    trace = _BlockTrace({id(p) for p in params.values()})
    flow = LinearFlow(container, *blocks[0]) if blocks else None
    trace.run(model, blocks, fake_mode, {**params, **buffers}, fake_args, fake_kwargs, flow)
    total = trace.counter.get_total_flops()
    saved, ops = trace.saved, trace.ops

    if not blocks:  # one layer: the whole model
        return ModelFacts((LayerFacts(
            "", float(total), sum(p.numel() for p in params.values()),
            sum(p.nbytes for p in params.values()), sum(sum(v.values()) for v in saved.values()),
            (batch,), str(first.dtype).replace("torch.", ""),
            tuple(tuple(p.shape) for p in params.values()), sum(ops.counts.values())),),
            batch, _tp_plan(model), "fake-tensor trace (no repeated blocks found: one layer)",
            ops.main_matmul())

    pre_params, post_params = _params_outside_blocks(model, container, block_ids)
    layers = [_block_facts(trace, i, name, block, len(blocks), total, pre_params, post_params)
              for i, (name, block) in enumerate(blocks)]
    return ModelFacts(tuple(layers), batch, _tp_plan(model), "fake-tensor trace",
                      ops.main_matmul(), derived_tp_plan=flow.plan())


class _BlockTrace:
    """What one fake-tensor forward records per block ("pre" and "post" for the rest): the
    FLOP counter at its start and end, the bytes of the tensors autograd saves in it, its
    ops and its output."""

    def __init__(self, param_ids: set[int]):
        self.param_ids = param_ids
        self.current = ["pre"]
        self.flops_at: dict[str, float] = {}
        self.saved: dict[str, dict[int, int]] = {}
        self.outs: dict[str, torch.Tensor] = {}
        self.keep: list[torch.Tensor] = []
        self.counter = FlopCounterMode(display=False)
        self.ops = _OpCounter(self.current)

    def pack(self, t):
        """A saved-tensor hook: count a saved activation (not a parameter) once per base."""
        base = tc.view_base(t)
        if id(base) not in self.param_ids and id(t) not in self.param_ids:
            self.keep.append(base)  # alive until the trace ends: ids stay unique
            self.saved.setdefault(self.current[0], {})[id(base)] = base.nbytes
        return t

    def hook(self, block: torch.nn.Module, name: str) -> list:
        """Hooks on ``block`` that mark where its forward starts and ends; their handles."""
        def pre(mod, a):
            self.flops_at[name + ":start"] = self.counter.get_total_flops()
            self.current[0] = name

        def post(mod, a, out):
            self.flops_at[name + ":end"] = self.counter.get_total_flops()
            self.current[0] = "post"
            t = _first_tensor(out)
            if t is not None:
                self.outs[name] = t

        return [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]

    def run(self, model: torch.nn.Module, blocks: list[tuple[str, torch.nn.Module]],
            fake_mode, state: dict, fake_args, fake_kwargs, flow=None) -> None:
        """Run the model's forward on fake tensors with every block hooked (and ``flow``, a
        :class:`~ccfx.backends.tp_derive.LinearFlow`, recording); a ConfigError where the
        forward cannot run on fake tensors (it reads data values)."""
        handles = flow.hooks() if flow is not None else []
        for name, block in blocks:
            handles += self.hook(block, name)
        try:
            with fake_mode, self.counter, self.ops, \
                    flow.mode if flow is not None else contextlib.nullcontext(), \
                    torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                torch.func.functional_call(model, state, fake_args, fake_kwargs)
        # what a fake tensor raises where the forward needs data (DataDependentOutputError is a
        # RuntimeError; an op without a fake kernel, NotImplementedError; Python on a fake
        # value, TypeError / ValueError): anything else is a bug and propagates
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            raise ConfigError(
                f"plan_parallel: the model's forward did not run on fake tensors ({type(e).__name__}:"
                f" {first_line(str(e))}): the planner traces shapes only, so a "
                "forward that reads data values (.item(), boolean masks) cannot be planned; give "
                "ModelFacts yourself (ccfx.planner.model_facts)") from e
        finally:
            for h in handles:
                h.remove()


def _params_outside_blocks(model: torch.nn.Module, container: str, block_ids: set[int]
                           ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Parameters outside the blocks: before the container (embeddings) or after (head); a
    tied parameter used on both sides is held by both."""
    pre_params: dict[int, torch.Tensor] = {}
    post_params: dict[int, torch.Tensor] = {}
    side = pre_params
    for name, mod in model.named_modules(remove_duplicate=False):
        if name == container:
            side = post_params
            continue
        if id(mod) in block_ids or (container and name.startswith(container + ".")):
            continue
        for p in mod.parameters(recurse=False):
            side[id(p)] = p
    return pre_params, post_params


def _block_facts(trace: _BlockTrace, i: int, name: str, block: torch.nn.Module, n_blocks: int,
                 total: float, pre_params: dict, post_params: dict) -> LayerFacts:
    """Block ``i``'s layer facts; the first also holds what runs before the blocks, the last
    what runs after."""
    saved, ops, flops_at = trace.saved, trace.ops, trace.flops_at
    if name not in trace.outs:
        raise ConfigError(f"plan_parallel: block {name} did not run in the forward: the "
                          "planner needs every repeated block on the forward path")
    ps = list(block.parameters())
    extra = []
    fl = flops_at[name + ":end"] - flops_at[name + ":start"]
    sv = sum(saved.get(name, {}).values())
    n_ops = ops.counts.get(name, 0)
    if i == 0:
        extra += list(pre_params.values())
        fl += flops_at[name + ":start"]
        sv += sum(saved.get("pre", {}).values())
        n_ops += ops.counts.get("pre", 0)
    if i == n_blocks - 1:
        extra += list(post_params.values())
        fl += total - flops_at[name + ":end"]
        sv += sum(saved.get("post", {}).values())
        n_ops += ops.counts.get("post", 0)
    every = ps + extra
    out = trace.outs[name]
    largest = max((b for k in (name, "pre" if i == 0 else None,
                                "post" if i == n_blocks - 1 else None)
                    for b in saved.get(k, {}).values()), default=0)
    return LayerFacts(
        name, float(fl), sum(p.numel() for p in every),
        sum(p.numel() * p.element_size() for p in every), int(sv), tuple(out.shape),
        str(out.dtype).replace("torch.", ""), tuple(tuple(p.shape) for p in every), n_ops,
        int(largest))


def as_cluster(cluster) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, (str, Path)):
        return Cluster.from_file(cluster)
    if isinstance(cluster, Mapping):
        return Cluster.from_dict(cluster)
    raise ConfigError(f"plan_parallel: cluster is a {type(cluster).__name__}: give a "
                      "ccfx.Cluster, a .toml / .json file's path or Cluster.to_dict()'s dict")


def plan_parallel(model, example_inputs, cluster, *, target: int | None = None, top: int = 5,
                  microbatches=None, schedule: str = "1F1B", tensor_parallel: bool | None = None,
                  local_steps: bool | None = None, timer=None,
                  measure: bool | None = None, recompute: bool | None = None,
                  progress=None) -> ParallelPlan:
    """The fastest pipeline × data (× tensor) layout of ``model`` on ``cluster`` that fits in
    memory, its runners-up and the refused ones (:class:`ccfx.planner.layout_result.
    ParallelPlan`). ``example_inputs``: the whole step's batch. ``target``: the steps the
    run needs (the explanation then gives the time to it). ``top``: layouts the explanation
    lists. ``microbatches``, ``schedule``, ``tensor_parallel``, ``local_steps``: narrow the search
    (:func:`ccfx.planner.layout_search.search`); ``timer``: a ``CodecTimer`` for codec prices.
    ``measure``: time the model on this machine (:func:`model_facts`); None: where a device
    is "measure here" (its flops not given). ``recompute``: activation recomputation per
    block (None: where a layout does not fit without). ``progress``: called with a line
    every few seconds of a long search (``ccfx plan`` prints them to stderr)."""
    cluster = as_cluster(cluster)
    if measure is None:
        measure = any(d.flops is None for d in cluster.devices)
    facts = model if isinstance(model, ModelFacts) else model_facts(model, example_inputs,
                                                                    measure=measure)
    return search(facts, cluster, top=top, timer=timer, microbatches=microbatches,
                  schedule=schedule, tensor_parallel=tensor_parallel, target_steps=target,
                  local_steps=local_steps, recompute=recompute, progress=progress)


# -- ccfx plan ------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="the cluster: a .toml / .json (/ .yaml) "
                   "file (examples/cluster64.toml)")
    p.add_argument("--model", required=True, metavar="MODULE:CALLABLE",
                   help="a callable with no arguments returning (model, example_inputs): the "
                        "inputs are the whole step's batch (build a large model on the meta "
                        "device: only shapes are used)")
    p.add_argument("--top", type=int, default=5, help="layouts to list (default 5)")
    p.add_argument("--target", type=int, default=None, metavar="STEPS",
                   help="steps the run needs: also print the time to reach them")
    p.add_argument("--schedule", default="1F1B", choices=("1F1B", "GPipe"))
    p.add_argument("--json", action="store_true", help="print the chosen options as JSON")


def main(args) -> int:
    from ccfx.factory import load_factory

    try:
        made = load_factory(args.model)()
        if not (isinstance(made, (tuple, list)) and len(made) == 2
                and isinstance(made[0], torch.nn.Module)):
            raise ConfigError(f"{args.model} returned {type(made).__name__}: return the pair "
                              "(model, example_inputs)")
        plan = plan_parallel(made[0], made[1], args.cluster, target=args.target, top=args.top,
                             schedule=args.schedule,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
    except CcfxError as e:
        print(f"ccfx plan: {e}", file=sys.stderr)
        return 2
    print(plan.explain())
    options = {k: v for k, v in plan.options(0).items() if k != "cluster"}
    if args.json:
        print(json.dumps(options, indent=1))
    else:
        if "placement" in options:
            p = options["placement"]
            options["placement"] = f"({p[0]}, {p[1]}, … {len(p)} devices: rank r on p[r])"
        print(f"options (every rank, with \"cluster\": {args.cluster}): {options}")
    return 0
