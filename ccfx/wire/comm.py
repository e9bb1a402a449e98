"""The ``Comm`` objects an exchange (:mod:`ccfx.wire.exchange`) issues its collectives through.

Every ``Comm`` has ``world``, ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
``wait`` and ``ring``; the same exchange phases (and :mod:`ccfx.wire.collectives`' phases) run
over any of them:

* :class:`FunctionalComm`: ``torch.ops._c10d_functional`` collectives, which trace into graphs
  (the compiled backward's gradient buckets, ``passes.grad_buckets``);
* :class:`ProcessGroupComm`: eager ``torch.distributed`` collectives on a process group (the
  DDP comm hook, the pipeline's data-parallel gradients, local steps' outer sync);
* :class:`LocalComm`: world size 1 without a process group, every collective the identity (the
  codec as a local round trip: one process computes what the codec does to training).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import ring as _ring

Tensors = list[torch.Tensor]

#: ``dist.all_gather_single`` (torch 2.13, which deprecates ``all_gather_into_tensor``); the
#: older name where the newer is missing (torch 2.11 on the GPU machines here)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class FunctionalComm:
    """Collectives as ``torch.ops._c10d_functional`` ops: they trace into graphs and return
    at once; ``wait`` is ``wait_tensor``."""

    def __init__(self, group_name: str, world_size: int):
        self.group_name = group_name
        self.world = world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.all_reduce(t, "sum", self.group_name)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``(world * t.numel(),)`` flat, rank-major."""
        return torch.ops._c10d_functional.all_gather_into_tensor(
            t.reshape(-1), self.world, self.group_name)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of this rank's ``1 / world`` of dim 0 (``reduce_scatter_tensor``)."""
        return torch.ops._c10d_functional.reduce_scatter_tensor(
            t.contiguous(), "sum", self.world, self.group_name)

    def all_to_all(self, t: torch.Tensor, output_splits=None, input_splits=None) -> torch.Tensor:
        """Chunk ``j`` of dim 0 goes to rank ``j``, the result's chunk ``j`` came from rank ``j``
        (``all_to_all_single``): equal chunks, or the rows ``input_splits`` / ``output_splits``
        give (ints or SymInts, both or neither)."""
        if output_splits is None:
            output_splits = input_splits = [t.shape[0] // self.world] * self.world
        return torch.ops._c10d_functional.all_to_all_single(
            t.contiguous(), list(output_splits), list(input_splits), self.group_name)

    def wait(self, t: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.wait_tensor(t)

    def ring(self, flat: torch.Tensor, spec: str, state: Tensors) -> tuple[torch.Tensor, Tensors]:
        """The ring all-reduce's mean and the updated state (``ccfx::ring_all_reduce``: it
        traces into the graph and blocks when it runs)."""
        out, new = torch.ops.ccfx.ring_all_reduce(flat, spec, self.group_name, list(state))
        return out, list(new)


class LocalComm:
    """World size 1 without a process group: every collective is the identity."""

    world = 1

    def all_reduce(self, t):
        return t

    def all_gather(self, t):
        return t.reshape(-1)

    def reduce_scatter(self, t):
        return t

    def all_to_all(self, t, output_splits=None, input_splits=None):
        return t

    def wait(self, t):
        return t

    def ring(self, flat, spec, state):
        new = [t.clone() for t in state]
        return _ring.ring_round_trip(flat, spec, new), new


def wait_work(work, timeout_s: float | None) -> None:
    """Wait for a ``torch.distributed`` ``Work``, at most ``timeout_s`` seconds (None: the
    group's own timeout). Past it gloo raises ``RuntimeError("... timed out ...")`` and the
    group is left as it is: the caller names the peer (:mod:`ccfx.wire.blame`)."""
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timeout=timedelta(seconds=timeout_s))


@dataclass
class _InFlight:
    """A collective issued but not yet waited on, and the tensor it fills."""

    work: Any
    result: torch.Tensor


class ProcessGroupComm:
    """The exchanges' ``Comm`` over ``torch.distributed`` on ``group`` (None: WORLD), eager.

    Collectives issue asynchronously and return a handle; ``wait`` waits
    and returns the result tensor. Inputs are left untouched, as with
    :class:`FunctionalComm`: ``all_reduce`` reduces a copy, since a codec's payload may be a
    view of the gradients or of its state.

    ``timeout_s``: ``wait`` gives up after that long (:func:`wait_work`), so a frozen peer is
    found without touching the group's own timeout; None waits as long as the group does.
    """

    def __init__(self, group=None, timeout_s: float | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.timeout_s = timeout_s

    def all_reduce(self, t: torch.Tensor) -> _InFlight:
        out = t.detach().clone(memory_format=torch.contiguous_format)
        return _InFlight(dist.all_reduce(out, group=self.group, async_op=True), out)

    def all_gather(self, t: torch.Tensor) -> _InFlight:
        """Fills a ``(world * t.numel(),)`` flat, rank-major tensor."""
        flat = t.detach().reshape(-1).contiguous()
        out = flat.new_empty(self.world * flat.numel())
        return _InFlight(_all_gather_flat(out, flat, group=self.group, async_op=True), out)

    def reduce_scatter(self, t: torch.Tensor) -> _InFlight:
        """Fills this rank's ``1 / world`` of dim 0, summed over ranks."""
        inp = t.detach().contiguous()
        out = inp.new_empty((inp.shape[0] // self.world, *inp.shape[1:]))
        return _InFlight(dist.reduce_scatter_tensor(out, inp, group=self.group, async_op=True),
                         out)

    def all_to_all(self, t: torch.Tensor, output_splits=None, input_splits=None) -> _InFlight:
        """Chunk ``j`` of dim 0 to rank ``j``, from rank ``j`` into chunk ``j``: equal chunks, or
        the rows ``input_splits`` / ``output_splits`` give (both or neither)."""
        inp = t.detach().contiguous()
        if output_splits is None:
            out = torch.empty_like(inp)
            work = dist.all_to_all_single(out, inp, group=self.group, async_op=True)
        else:
            out = inp.new_empty((sum(output_splits), *inp.shape[1:]))
            work = dist.all_to_all_single(out, inp, list(output_splits), list(input_splits),
                                          group=self.group, async_op=True)
        return _InFlight(work, out)

    def wait(self, handle: _InFlight) -> torch.Tensor:
        wait_work(handle.work, self.timeout_s)
        return handle.result

    def ring(self, flat: torch.Tensor, spec: str,
             state: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:func:`~ccfx.wire.ring.ring_all_reduce` on ``group``, eager and blocking; the
        mean and the updated state (the inputs are left untouched)."""
        new = [t.detach().clone() for t in state]
        return _ring.ring_all_reduce(flat.detach(), spec, self.group, new), new
