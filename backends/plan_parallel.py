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
CUDA run a fused flash kernel that saves its output and log-sum-exp only. Four PyTorch tools
read the trace:

* ``torch.utils.flop_counter.FlopCounterMode``: forward FLOPs, read at each block's forward
  hooks (the counter ``torch.distributed._tools.RuntimeEstimator`` itself builds on; its
  roofline and benchmark modes need a CUDA device to time or to read peak rates from, and a
  cluster's devices are described, not present, so the planner turns FLOPs into seconds with
  each device's own rate, ``Cluster.rate``);
* ``torch.autograd.graph.saved_tensors_hooks``: the bytes autograd keeps for each block's
  backward (the activations a pipeline stage holds per microbatch in flight), each tensor
  counted once, parameters not counted;
* forward hooks on the blocks: the tensor a cut after each block would send;
* a ``TorchDispatchMode`` (:class:`_Shares`) with forward hooks on the blocks' linears: which
  saved bytes lie in Megatron's TP span (from a column-parallel linear's output to the
  row-parallel one's input, by the declared or derived plan) and which belong to the
  attention core, with its FLOPs: what sequence parallelism and selective recomputation are
  priced by (``LayerFacts.tp_saved_bytes``, ``attn_core_saved_bytes``, ``attn_core_flops``).

``torch.distributed._tools.MemTracker`` serves where a real run exists: the tests check the
memory model against its measured peak of a CPU step (tests/test_layout_planner.py). Models
whose forward depends on data values (``.item()``, boolean masks) cannot run on fake tensors:
the trace says so.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

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


#: aten ops of the fused attention kernels (the attention core in one op), backwards apart
_SDPA = "_scaled_dot_product_"
#: batched matmuls: the attention core's two when they make or read the scores
_BMM = {"bmm": 0, "baddbmm": 1}


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    """FLOPs of the CPU flash attention kernel: torch's formula for its CUDA siblings (the
    counter has none for the CPU op, so a traced model's attention matmuls would go
    uncounted)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


#: what FlopCounterMode lacks among the kernels a CPU trace runs
_CPU_SDPA_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}


class _Shares(tc.TorchDispatchMode):
    """What splits each block's saved bytes (:class:`~ccfx.planner.model_facts.LayerFacts`'
    ``tp_saved_bytes`` and ``attn_core_saved_bytes``), recorded per tensor in one forward:

    * the block linears each tensor derives from, through any op, a linear's output
      starting afresh (:meth:`linear_hooks`): a tensor is in Megatron's TP span when it
      derives from a column-parallel linear (the plan is known after the trace);
    * the attention core: an SDPA kernel's outputs, and from a batched matmul whose output's
      last two dims are both the sequence (the scores) every op keeping that shape (scale,
      mask, softmax, dropout); with the FLOPs of the kernel, or of the two matmuls;
    * who saves each tensor: autograd saves an op's inputs just before the op runs and its
      outputs just after, so the first save of one of the last op's outputs is that op's,
      any other the next op's. A core tensor also saved outside the core (the core's output
      read by the output projection) is kept by selective recomputation.

    The sequence is the first block's input's dim 1 (a batch-first ``(B, T, C)`` input)."""

    def __init__(self, current: list):
        super().__init__()
        self.current = current
        self.seq: int | None = None
        self.linears: dict[int, frozenset[str]] = {}
        self.core: set[int] = set()
        self.core_flops: dict[str, float] = {}
        self.outside: set[int] = set()  # saved by an op outside the core
        self.keep: list[torch.Tensor] = []
        self._last: tuple[set[int], bool] = (set(), False)  # its outputs, in the core
        self._claimed: set[int] = set()  # the last op's outputs it saved
        self._pending: list[int] = []  # saved by the next op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "aten":  # queries (prim::device) between an op and its saves
            return out
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        sources = frozenset().union(*(self.linears.get(id(t), ()) for t in ins))
        if sources:
            self.linears.update((id(t), sources) for t in outs)
        flops, made = self._core(func.overloadpacket.__name__, args, ins, outs)
        if flops:
            key = self.current[0]
            self.core_flops[key] = self.core_flops.get(key, 0.0) + flops
        self.core.update(id(t) for t in made)
        in_core = bool(flops or made)
        if not in_core:
            self.outside.update(self._pending)
        self._pending, self._claimed = [], set()
        self._last = ({id(t) for t in outs}, in_core)
        self.keep += outs
        return out

    def _core(self, name: str, args, ins, outs) -> tuple[float, list[torch.Tensor]]:
        """The attention core's FLOPs in this op and the outputs it adds to the core."""
        if name.startswith(_SDPA) and "backward" not in name:
            q, k, v = args[:3]
            flops = 2 * math.prod(q.shape[:-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
            return float(flops), outs
        square = [t for t in outs if self._square(t)]
        if name in _BMM:
            inner = args[_BMM[name]].shape[-1]
            if square or any(id(t) in self.core and self._square(t) for t in ins):
                return 2.0 * sum(t.numel() for t in outs) * inner, square
        if square and any(id(t) in self.core for t in ins):
            return 0.0, square
        return 0.0, []

    def _square(self, t: torch.Tensor) -> bool:
        return self.seq is not None and t.dim() >= 3 and tuple(t.shape[-2:]) == (self.seq,
                                                                                self.seq)

    def saved(self, t: torch.Tensor, base: torch.Tensor) -> None:
        """Autograd saves ``t`` (a view of ``base``): who saves it, as the class says."""
        last, in_core = self._last
        key = id(base)
        if (id(t) in last or key in last) and key not in self._claimed:
            self._claimed.add(key)
            if not in_core:
                self.outside.add(key)
        else:
            self._pending.append(key)

    def linear_hooks(self, blocks: list[tuple[str, torch.nn.Module]]) -> list:
        """Hooks on every linear in the blocks: its output derives from it alone; a block's
        input from none (the residual stream's history is not the block's)."""
        def restart(mod, a, out, name):
            for t in (out, tc.view_base(out)):
                self.linears[id(t)] = frozenset({name})
            self.keep.append(out)

        def enter(mod, a):
            t = _first_tensor(a)
            if t is not None:
                self.linears[id(t)] = frozenset()
                if self.seq is None and t.dim() == 3:
                    self.seq = int(t.shape[1])

        handles = []
        for block_name, block in blocks:
            handles.append(block.register_forward_pre_hook(enter))
            for name, mod in block.named_modules():
                if isinstance(mod, torch.nn.Linear):
                    handles.append(mod.register_forward_hook(
                        functools.partial(restart, name=f"{block_name}.{name}")))
        return handles

    def span_bytes(self, saved: dict[int, int], columns: frozenset[str]) -> int:
        """The bytes among ``saved`` (base id → bytes) in a TP span: derived from one of
        ``columns``, the column-parallel linears' names."""
        return sum(b for i, b in saved.items() if self.linears.get(i, frozenset()) & columns)

    def core_bytes(self, saved: dict[int, int]) -> int:
        """The bytes among ``saved`` of the attention core that only the core saves."""
        return sum(b for i, b in saved.items() if i in self.core and i not in self.outside)


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []


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
    declared, derived = _tp_plan(model), flow.plan()
    columns = _column_linears(declared or derived, blocks)
    layers = [_block_facts(trace, i, name, block, len(blocks), total, pre_params, post_params,
                           columns)
              for i, (name, block) in enumerate(blocks)]
    return ModelFacts(tuple(layers), batch, declared, "fake-tensor trace",
                      ops.main_matmul(), derived_tp_plan=derived)


def _column_linears(plan, blocks: list[tuple[str, torch.nn.Module]]) -> frozenset[str] | None:
    """The qualified names of the blocks' linears ``plan`` splits column-wise (its patterns
    as Hugging Face writes them: ``layers.*.self_attn.q_proj`` matches
    ``model.layers.3.self_attn.q_proj``); None without a plan or where none matches."""
    if not plan:
        return None
    patterns = [p for p, style in plan if style.endswith("colwise")]
    names = {f"{b}.{n}" for b, block in blocks for n, mod in block.named_modules()
             if isinstance(mod, torch.nn.Linear)}
    found = frozenset(n for n in names if any(
        fnmatch.fnmatchcase(n, p) or fnmatch.fnmatchcase(n, "*." + p) for p in patterns))
    return found or None


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
        self.counter = FlopCounterMode(display=False, custom_mapping=_CPU_SDPA_FLOPS)
        self.ops = _OpCounter(self.current)
        self.shares = _Shares(self.current)

    def pack(self, t):
        """A saved-tensor hook: count a saved activation (not a parameter) once per base."""
        base = tc.view_base(t)
        if id(base) not in self.param_ids and id(t) not in self.param_ids:
            self.keep.append(base)  # alive until the trace ends: ids stay unique
            self.saved.setdefault(self.current[0], {})[id(base)] = base.nbytes
            self.shares.saved(t, base)
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
        handles += self.shares.linear_hooks(blocks)
        try:
            with fake_mode, self.counter, self.ops, self.shares, \
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
                 total: float, pre_params: dict, post_params: dict,
                 columns: frozenset[str] | None = None) -> LayerFacts:
    """Block ``i``'s layer facts; the first also holds what runs before the blocks, the last
    what runs after (outside every TP span: no plan splits them). ``columns``: the
    column-parallel linears (:meth:`_Shares.span_bytes`)."""
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
    parts = [k for k in (name, "pre" if i == 0 else None, "post" if i == n_blocks - 1 else None)
             if k is not None]
    largest = max((b for k in parts for b in saved.get(k, {}).values()), default=0)
    shares = trace.shares
    # no plan: every byte counts as split (the memory model's default); with one, what runs
    # outside the blocks is in no span
    span = sv if columns is None else shares.span_bytes(saved.get(name, {}), columns)
    core = sum(shares.core_bytes(saved.get(k, {})) for k in parts)
    core_flops = sum(shares.core_flops.get(k, 0.0) for k in parts)
    return LayerFacts(
        name, float(fl), sum(p.numel() for p in every),
        sum(p.numel() * p.element_size() for p in every), int(sv), tuple(out.shape),
        str(out.dtype).replace("torch.", ""), tuple(tuple(p.shape) for p in every), n_ops,
        int(largest), tp_saved_bytes=int(span), attn_core_saved_bytes=int(core),
        attn_core_flops=float(core_flops))


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
    is "measure here" (its flops not given). ``recompute``: activation recomputation, the
    attention core or every block (None: where a layout does not fit without; True: both
    everywhere). ``progress``: called with a line
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
