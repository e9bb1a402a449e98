"""A Megatron tensor-parallel plan for a model that declares none, from one block's data flow.

Megatron-LM splits a transformer block's matmuls in pairs: a column-parallel linear (its
output features sharded: attention's q / k / v or fused qkv, the MLP's up and gate) feeds,
through ops local to a head or an element, a row-parallel linear (its input features sharded:
attention's output projection, the MLP's down projection) whose partial sums one all-reduce
completes. :class:`LinearFlow` finds those pairs in the planner's one fake-tensor forward,
following which linear's output reaches which linear's input in the first repeated block:

* the linears run in order; one whose input derives from a still *open* column-parallel
  linear is row-parallel and closes every column-parallel linear it reads; any other opens as
  column-parallel (it reads the residual stream);
* the plan holds only if every column-parallel linear is closed, each row-parallel linear
  gives back the block's width and each column-parallel one reads it.

It assumes what Megatron's blocks guarantee: the ops between a pair mix no features across
heads (a norm over the whole sharded width between them would need a gather). The plan is in
Hugging Face's ``base_model_tp_plan`` form (``"blocks.*.attn.qkv": "colwise"``), so
``ColwiseParallel`` / ``RowwiseParallel`` apply it as a declared one.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ccfx import _torch_compat as tc


class _Provenance(TorchFunctionMode):
    """Which linears of the block each tensor derives from (by tensor id; the block's tensors
    stay alive for the trace, so ids are not reused meanwhile)."""

    def __init__(self):
        super().__init__()
        self.of: dict[int, frozenset[str]] = {}
        self.keep: list = []

    def sources(self, value) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for t in tc.tree_leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            out |= self.of.get(id(t), frozenset())
        return out

    def mark(self, value, sources: frozenset[str]) -> None:
        for t in tc.tree_leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            self.of[id(t)] = sources
            self.keep.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.mark(out, self.sources((args, kwargs)))
        return out


class LinearFlow:
    """Records, while the model's forward runs under :attr:`mode` with :meth:`hooks`
    registered, the first block's linears in call order and the linears of that block each
    one's input derives from."""

    def __init__(self, container: str, block_name: str, block: torch.nn.Module):
        self.container, self.block_name, self.block = container, block_name, block
        self.mode = _Provenance()
        self.calls: list[tuple[str, torch.nn.Linear, frozenset[str]]] = []

    def hooks(self) -> list:
        handles = []
        for name, mod in self.block.named_modules():
            if isinstance(mod, torch.nn.Linear):
                def pre(m, args, name=name):
                    self.calls.append((name, m, self.mode.sources(args)))

                def post(m, args, out, name=name):
                    self.mode.mark(out, frozenset({name}))

                handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        return handles

    def plan(self) -> tuple[tuple[str, str], ...] | None:
        """The derived plan (``(pattern, style)`` pairs, every block alike), or None."""
        width = self.calls[0][1].in_features if self.calls else None  # the residual's
        styles = None if width is None else pair_linears(self.calls, width)
        if styles is None:
            return None
        prefix = f"{self.container}.*" if self.container else "*"
        return tuple(sorted((f"{prefix}.{lin}", style) for lin, style in styles.items()))


def pair_linears(calls, width: int) -> dict[str, str] | None:
    """``{linear name: "colwise" | "rowwise"}`` by the rule of the module docstring, or None
    where the block has no complete Megatron pairing."""
    styles: dict[str, str] = {}
    open_cols: set[str] = set()
    for name, lin, sources in calls:
        if name in styles:
            return None  # a linear called twice in one block: not a plain transformer block
        reads = sources & open_cols
        if reads:
            if lin.out_features != width:
                return None
            styles[name] = "rowwise"
            open_cols -= reads
        else:
            if lin.in_features != width:
                return None
            styles[name] = "colwise"
            open_cols.add(name)
    if open_cols or "rowwise" not in styles.values():
        return None
    return styles
