"""The exchange of one sync: each due fragment's weighted pseudo-gradient averaged over the
quorum, the average merged by the outer optimizer, and the codec calls that ran eagerly
compiled after it."""

from __future__ import annotations

import logging
import threading
import time

import torch

from ...codecs._fast import compile_now
from ...errors import ConfigError
from ...wire.collectives import element_state_layout
from ..fragments import InFlight

log = logging.getLogger("ccfx")


class Averaging:
    """The exchange's side of :class:`~ccfx.runtime.elastic.Elastic` (a mixin)."""

    _compiling: threading.Thread | None = None  # a spare's compile after its sync

    def _exchange(self, frag, scale: float, comm) -> list[torch.Tensor]:
        with torch.no_grad():
            if self._nothing_to_send():  # healing: nothing of its own to send; stale params
                delta = [torch.zeros_like(g) for g in frag.global_]
            else:
                delta = [(g - p.detach().float()) * scale
                         for g, p in zip(frag.global_, frag.local)]
        out: list[torch.Tensor | None] = [None] * len(delta)
        for part in frag.parts:
            grads = [delta[i] for i in part.members]
            reduce = self._reduce_for(part, comm.world)
            if reduce is None:
                result = part.exchange.run(grads, part.state, comm)
                self.used.add(part.exchange.collective)
            else:
                layout = part.exchange.layout
                state = reduce.state_from_elements(part.state, comm.rank) if part.state else {}
                result = layout.unflat(reduce.run(layout.flat(grads), state, comm))
                if part.state:
                    self._dropped(part, reduce.state_to_elements(state, part.state, comm.rank),
                                  comm)
                self.used.add("all_to_all+all_gather")
            for i, a in zip(part.members, result, strict=True):
                out[i] = a.float()
        return out

    def _reduce_for(self, part, world: int):
        """On 3 or more replicas, with ``outer_collective="auto"``, a part that would be
        all-gathered (int8, fp8, int4:ef, ...) is averaged by the encoded all-to-all + all-gather
        of :mod:`ccfx.wire.collectives` instead (each chunk's owner sums in rank order and
        re-encodes once; every replica decodes the same bytes): ``2 (W-1)`` chunk payloads
        (about ``2 (W-1) / W`` of a payload) per replica instead of ``W - 1`` payloads. Built
        per quorum size (the chunks are 1/W of the part).

        Codec state: a stateless codec has none. An error-feedback codec (int8:ef) keeps its
        state per element of the part (:func:`ccfx.wire.collectives.element_state_layout`,
        made at start by :meth:`_keep_state_per_element`), the same whatever the quorum, and
        each sync lays it out for the quorum it runs in: ``residual`` (what this replica has
        not sent yet of its own pseudo-gradient, element by element: the all-gather form on 2
        replicas keeps and uses the same one, so the forms alternate with nothing lost) and
        ``residual_owner`` (what this replica's re-encode of the reduced chunk it owns lost,
        fed back into that chunk at the next sync). At a quorum change a replica's chunk moves:
        the owner residual it holds outside its new chunk is dropped (the log says how many
        elements; :attr:`residual_dropped` counts them), the part inside it kept; a heal
        zeroes both (they are this replica's own). None where it does not apply: 2 replicas
        (the all-gather sends the same one payload), a codec with other state (a stochastic
        codec's step), and the ring (needs point to point on a group torchft rebuilds)."""
        if (world < 3 or part.exchange.collective != "all_gather"
                or self.outer.config.outer_collective != "auto"):
            return None
        layout = part.exchange.layout
        per_element = element_state_layout(part.exchange.spec, layout.numel)
        if part.state and (per_element is None or sorted(part.state) != sorted(per_element)):
            return None
        key = (id(part), world)
        if key not in self._reduces:
            self._reduces[key] = _built_reduce(part, world)
        return self._reduces[key]

    def _keep_state_per_element(self) -> None:
        """Give each part whose codec keeps its state per element (error feedback:
        :func:`~ccfx.wire.collectives.element_state_layout`) the owner residual of the
        all-to-all form beside the residual it has, before anything snapshots, sends or saves
        the codec state (so an uncommitted sync puts it back, a heal zeroes it and a
        checkpoint holds it, under ``...part<p>.residual_owner``)."""
        self.residual_dropped = 0
        if self.outer.config.outer_collective != "auto":
            return
        for frag in self.outer.fragments:
            for part in frag.parts:
                layout = part.exchange.layout
                per_element = element_state_layout(part.exchange.spec, layout.numel)
                if (part.exchange.collective == "all_gather" and per_element is not None
                        and sorted(part.state) == ["residual"]):
                    shape, dtype = per_element["residual_owner"]
                    part.state["residual_owner"] = part.state["residual"].new_zeros(
                        shape, dtype=dtype)

    def _dropped(self, part, count: int, comm) -> None:
        if count:
            self.residual_dropped = getattr(self, "residual_dropped", 0) + count
            log.info("ccfx: outer sync at inner step %d: the quorum is %d replicas, this one "
                     "owns chunk %d of %s: dropped the owner error-feedback residual of %d "
                     "elements it no longer owns", self.outer.step, comm.world, comm.rank,
                     part.exchange.spec, count)

    def _merge(self, merged: dict[int, list[torch.Tensor]]) -> None:
        """The outer step of each fragment in ``merged`` with its averaged pseudo-gradient."""
        outer = self.outer
        for frag in outer.fragments:
            if frag.index in merged:
                frag.in_flight = InFlight(outer.step, outer.step, averaged=merged[frag.index])
                outer._merge(frag)

    def _compile(self, calls: list) -> None:
        """Compile the codec calls the last exchange ran eagerly (its row's ``compile_s``). A
        trainer compiles before its next inner step. A spare compiles on a thread of its own:
        it must watch the trainers from the sync's end, and a compile of a large model's
        chunks takes seconds, through which a trainer's death would go unanswered; the calls
        stay eager until compiled (``_fast``)."""
        row, started = self.history[-1], time.monotonic()
        if not self.spare:
            compile_now(calls)
            row["compile_s"] = time.monotonic() - started
            return

        previous = self._compiling  # (chained: shutdown's join of the last covers them all)

        def run() -> None:
            if previous is not None:
                previous.join()  # dynamo compiles one at a time anyway (its compile lock)
            try:
                compile_now(calls)
            except Exception as e:  # noqa: BLE001 (a thread's error reaches nobody: say it)
                log.warning("ccfx: a spare's compile of its exchange's codec calls failed "
                            "(%s): they run eagerly and compile again after the next sync", e)
            row["compile_s"] = time.monotonic() - started

        self._compiling = threading.Thread(target=run, daemon=True, name="ccfx-spare-compile")
        self._compiling.start()


def _built_reduce(part, world: int):
    """The encoded all-to-all + all-gather averaging ``part`` over ``world`` replicas, or None
    where the codec cannot run it or has state the all-gather form does not have."""
    from ...wire.collectives import CollectiveCall, CompressedCollective

    layout = part.exchange.layout
    call = CollectiveCall("all_reduce", (layout.numel,), torch.float32, world, "avg")
    try:
        built = CompressedCollective(call, part.exchange.spec, owner_feedback=bool(part.state))
    except ConfigError:
        built = None
    if built is not None and not part.state and built.state_layout():
        built = None  # state the all-gather form does not have (a codec's step)
    return built
