"""What a graph's functional collective asks for (:class:`CollectiveCall`), and its kinds."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Tensors = list[torch.Tensor]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

#: Reductions a codec can carry: a sum of decoded values (``avg`` divides it by the world).
SUMMABLE_OPS = ("sum", "avg")


@dataclass(frozen=True)
class CollectiveCall:
    """What a graph's functional collective asked for.

    ``input_splits`` / ``output_splits`` are an all-to-all's split sizes along dim 0 (``None`` or
    empty: equal splits, ``shape[0] / world`` each). With unequal splits (:attr:`by_rows`) a
    split size and dim 0 may be symbolic: a SymInt, or its expression as a string (what the
    plan and the ranks' agreement read)."""

    kind: str                        # one of KINDS
    shape: tuple[int, ...]           # the input's static shape
    dtype: torch.dtype
    world: int                       # group size
    reduce_op: str | None = None     # "sum" | "avg" | other ("max"...): all_reduce, reduce_scatter
    input_splits: tuple[int, ...] | None = None
    output_splits: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        if self.symbolic_rows:
            raise ValueError(f"{self.kind} of {self.shape}: its row count is only known at run "
                             "time (use row_bytes)")
        return math.prod(self.shape)

    @property
    def symbolic_rows(self) -> bool:
        """An all_to_all with unequal splits (:attr:`by_rows`) whose row count (dim 0 of its
        input) is only known when it runs: counts from the router read with ``.tolist()``
        under ``capture_scalar_outputs`` make it an unbacked SymInt (here its expression as a
        string, ``"u2+u3"``). Its bytes are quoted per row (:attr:`row_bytes`). Symbolic
        split sizes alone (an expert dispatch of a fixed number of tokens) do not make it so:
        what a rank sends, and its codec state, follow from dim 0."""
        return self.by_rows and not static(self.shape[:1])

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of dim 0, uncompressed."""
        return self.row * self.dtype.itemsize

    @property
    def by_rows(self) -> bool:
        """An all_to_all whose split sizes are given and are not ``W`` equal chunks of dim 0
        (an expert-parallel dispatch or combine): it sends whole rows, ``input_splits[j]`` of
        them to rank ``j``, and the ranks' shapes differ."""
        if self.kind != "all_to_all" or not (self.input_splits or self.output_splits):
            return False
        rows = self.shape[0] if self.shape else None
        if not isinstance(rows, int) or rows % self.world:
            return True
        equal = [rows // self.world] * self.world
        return any(splits and [*splits] != equal  # a side not given: equal chunks
                   for splits in (self.input_splits, self.output_splits))

    @property
    def row(self) -> int:
        """Elements per row of dim 0 (the hidden size of a token)."""
        return math.prod(self.shape[1:])

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape the collective + wait returns."""
        if self.kind == "all_gather":
            return (self.shape[0] * self.world, *self.shape[1:])
        if self.kind == "reduce_scatter":
            return (self.shape[0] // self.world, *self.shape[1:])
        if self.by_rows:
            if not static(self.output_splits):  # their expression (phases read real sizes)
                return ("+".join(map(str, self.output_splits)), *self.shape[1:])
            return (sum(self.output_splits), *self.shape[1:])
        return tuple(self.shape)

    @property
    def raw_bytes(self) -> int:
        """Bytes this rank sends for the uncompressed collective, ring algorithms' convention:
        all_reduce ``2 (W-1) / W`` of the input, all_gather ``(W-1)`` shards, reduce_scatter and
        all_to_all ``(W-1) / W`` of the input; rounded up to whole bytes."""
        w, n = self.world, self.numel * self.dtype.itemsize
        sends = {"all_reduce": 2 * (w - 1) * n, "all_gather": (w - 1) * n * w,
                 "reduce_scatter": (w - 1) * n, "all_to_all": (w - 1) * n}[self.kind]
        return -(-sends // w)



def static(values) -> bool:
    """Every value is a plain int (no SymInt, no expression)."""
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def zero(n) -> bool:
    """``n`` is the int 0 (a symbolic size is never taken for zero: guarding on an unbacked
    SymInt fails the trace, and the phases handle 0 rows without a branch)."""
    return isinstance(n, int) and n == 0
