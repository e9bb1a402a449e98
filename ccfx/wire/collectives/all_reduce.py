"""The compressed all-reduce: an encoded reduce-scatter, then an all-gather of bytes.

The flattened input is padded to ``W`` equal chunks, each chunk encoded on its own and the
payloads exchanged by one all-to-all; rank ``r`` owns chunk ``r``: it decodes the ``W``
payloads it received and sums them in fp32 *in rank order* (``avg`` divides by ``W``), encodes
that reduced chunk **once** and an all-gather forwards those bytes; every rank, the owner
included, decodes the same bytes, so the result is bit-identical on every rank (replicas of a
TP group never drift apart). ``2 (W-1) B`` bytes sent per rank, where a ring all-reduce sends
``2 (W-1) / W`` of the input. What the owner loses re-encoding a sum is not fed back (no rank
owns that error), unless ``owner_feedback`` keeps it (:mod:`.elements`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import codecs
from .chunked import Chunked
from .elements import require_elements


class AllReduce(Chunked, serves="all_reduce"):
    """All-reduce (sum or avg) through a codec: reduce-scatter, re-encode, all-gather."""

    ROUNDS = 2

    def _setup(self, rows: bool | None) -> None:
        super()._setup(rows)
        # the owner re-encodes its reduced chunk: with the inner codec, or the whole
        # error-feedback codec (owner_feedback)
        owner = self.codec if self.owner_feedback else codecs.prototype(self._inner_spec)
        self._owner_spec = owner.spec
        self._owner_state = {f"owner.{k}": v for k, v in
                             owner.state_layout((self.chunk,), self.call.dtype).items()}
        self._owner_names = sorted(self._owner_state)

    def _messages(self) -> list[tuple[str, int]]:
        b = self.packing.nbytes
        return [("all_to_all", self.call.world * b), ("all_gather", b)]

    @property
    def phases(self) -> list[Callable]:
        return [self._scatter_issue, self._reduce_regather, self._gather_finish]

    def _reduce_regather(self, x, state, carry, comm):
        """The owner's chunk summed in rank order, encoded once, all-gathered."""
        reduced = self._sum_in_rank_order(comm.wait(carry[0])).to(self.call.dtype)
        named = self._named(state)
        payload = self._encode(reduced, self._owner_spec, [named[k] for k in self._owner_names])
        return [comm.all_gather(self.packing.pack(payload))]

    # -- state kept per element of the input (a group whose size changes) ------------------

    def _owned(self, rank: int) -> tuple[int, int]:
        """The input elements ``[lo, hi)`` whose sum rank ``rank`` owns (its chunk, the padding
        left out)."""
        lo = min(rank * self.used, self.call.numel)
        return lo, min(lo + self.used, self.call.numel)

    def state_from_elements(self, elements: dict[str, torch.Tensor],
                            rank: int) -> dict[str, torch.Tensor]:
        """The state :meth:`run` takes on rank ``rank`` of this call's group, made from state
        kept per element of the whole input (:func:`element_state_layout`: it does not depend
        on the group's size): ``residual`` laid out as this rank's ``W`` chunks (their padding
        zero), ``residual_owner``'s entries of the chunk this rank owns. New tensors: write
        them back with :meth:`state_to_elements`."""
        require_elements(self, elements)
        grid = self._rows(elements["residual"]).clone()
        if self.rows or self.chunks == 1:
            out = {"residual": grid.reshape(-1)}
        else:
            out = {f"chunk{j:04d}.residual": grid[j] for j in range(self.chunks)}
        if self.owner_feedback:
            lo, hi = self._owned(rank)
            own = elements["residual_owner"].new_zeros(self.chunk)
            own[:hi - lo] = elements["residual_owner"][lo:hi]
            out["owner.residual"] = own
        return out

    def state_to_elements(self, state: dict[str, torch.Tensor],
                          elements: dict[str, torch.Tensor], rank: int) -> int:
        """Write what :meth:`run` left in ``state`` back into the per-element ``elements``
        (in place). Padding is dropped (its input and residual are zeros). ``residual_owner``
        keeps this rank's chunk only: entries elsewhere belong to chunks another rank owns
        now (the group changed since they were kept) and are dropped; how many nonzero ones
        were dropped is returned (0 while the group stays the same)."""
        if self.rows or self.chunks == 1:
            grid = state["residual"].view(self.chunks, self.chunk)
        else:
            grid = torch.stack([state[f"chunk{j:04d}.residual"] for j in range(self.chunks)])
        residual = elements["residual"]
        residual.copy_(grid[:, :self.used].reshape(-1)[:residual.numel()])
        dropped = 0
        if self.owner_feedback:
            kept, (lo, hi) = elements["residual_owner"], self._owned(rank)
            dropped = int(torch.count_nonzero(kept)) - int(torch.count_nonzero(kept[lo:hi]))
            kept.zero_()
            kept[lo:hi] = state["owner.residual"][:hi - lo]
        return dropped

