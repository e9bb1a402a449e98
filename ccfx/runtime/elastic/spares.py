"""Hot spares (``trainers=N``): replicas beyond N training places sync with nothing to send,
watch the trainers between syncs, and take a dead trainer's place at once."""

from __future__ import annotations

import logging
import time

from ... import _torch_compat as tc
from ..heal import Watch
from .meet import _alive_url
from .options import WATCH_SILENT_S
from .states import State

log = logging.getLogger("ccfx")


class Spares:
    """The hot spares' side of :class:`~ccfx.runtime.elastic.Elastic` (a mixin)."""

    @property
    def spare(self) -> bool:
        """A hot spare: in every quorum with nothing to send, applying every committed average
        (so its global parameters, outer optimizer and codec state are the trainers', bit for
        bit), until a training place is free; then it trains at once, with no heal."""
        return self.opts.trainers is not None and self.slot is None

    def wait_while_spare(self) -> None:
        """Sync with the trainers until this replica holds a training place. Between two syncs
        it watches the trainers (:class:`~ccfx.runtime.heal.Watch`): when one dies it takes
        that place at once (:meth:`_take_place`), so the place trains through the rest of the
        interval instead of standing empty until the next sync. Otherwise it joins each sync
        when the first trainer starts it (its stream says so), or at the latest
        ``WATCH_SILENT_S`` after the earliest trainer is due by their last interval: the
        lighthouse counts its grace window from the first replica to arrive, and one waiting
        there early would let a quorum form as soon as a majority has arrived, without the
        trainers that arrive after it. While that interval is unknown (the sync after the
        first join) it joins at once, up to an interval early: the lighthouse's
        ``join_timeout_ms`` must exceed the time between two syncs (as for any replica that
        joins; README)."""
        if not self.spare:
            return
        log.info("ccfx: replica %s is a hot spare (the %d training places are held): it syncs "
                 "with nothing to send until one is free", tc.torchft_replica_id(self.manager),
                 self.opts.trainers)
        while self.spare:
            at = self._next_sync_at(self._last_rows, self._last_exchanged)
            if at is not None:
                slot = self._watch_trainers(at)
                if slot is not None:
                    self._take_place(slot, at)
                    return
            self.sync([])
        self.since, self.tokens = self.outer.step, 0  # it trains from here
        log.info("ccfx: replica %s takes training place %d at inner step %d",
                 tc.torchft_replica_id(self.manager), self.slot, self.outer.step)

    def _watch_trainers(self, until: float) -> int | None:
        """Until the trainers' next sync (the first of them starts it, or ``until`` +
        ``WATCH_SILENT_S``, their estimated time and a margin): the place of a trainer that
        died meanwhile and that this spare takes, or None. The places and the spares' order come
        from the last meet's rows, as every member computes them (:meth:`_assign_slots`): the
        ``j``-th waiting spare takes the ``j``-th death it sees. Deaths seen in another order
        by two spares, or a trainer alive but cut off from this spare, make two claims on a
        place at the next meet: the in-step trainer keeps it, the other member becomes a spare
        again (its steps counted in that sync's average, once). A spare that takes a place
        keeps watching the other trainers: it syncs when they do (:meth:`catch_up_due`)."""
        rows, me = self._last_rows, self._last_rank
        if not rows or not 0 <= me < len(rows):
            return None
        places = {i: self._assign_slots(rows, i) for i in range(len(rows))}
        spares = sorted((i for i, s in places.items() if s is None),
                        key=lambda i: (rows[i][4] == 2, i))
        urls = {s: _alive_url(rows[i]) for i, s in places.items()
                if s is not None and rows[i][8] > 0}
        if me not in spares or not urls:
            return None
        j = spares.index(me)
        watch = Watch(urls, silent_s=WATCH_SILENT_S, sync_step=self.manager.current_step())
        try:
            dead = watch.wait(until + WATCH_SILENT_S, more_than=j, or_sync=True)
            if len(dead) <= j and not watch.synced and watch.alive():
                log.info("ccfx: spare %s heard no trainer start the sync due %.1f s ago: "
                         "joining it", tc.torchft_replica_id(self.manager),
                         time.monotonic() - until)
        except BaseException:
            watch.close()
            raise
        if len(dead) > j and not watch.synced:
            self._sync_watch = watch  # closed when this replica syncs (sync)
            return dead[j]
        watch.close()
        return None

    def _take_place(self, slot: int, at: float) -> None:
        """Train in the place of a trainer that died between syncs, from now: this spare's
        state is the last committed sync's, as the dead trainer's was when it started the
        interval. It syncs when the other trainers do (at ``at``, or when the first of them
        starts the sync, on the streams it watched them by, if that is sooner:
        :meth:`catch_up_due`), its steps since weighted as they are, and claims the place
        there."""
        self.slot = slot
        self._become(State.CATCHING_UP, f"took the place of trainer {slot}, which died")
        self._catch_up_at, self._last_step_end = at, None
        self.since, self.tokens = self.outer.step, 0
        log.info("ccfx: replica %s takes training place %d at inner step %d, %.1f s before "
                 "the next sync: its trainer died", tc.torchft_replica_id(self.manager), slot,
                 self.outer.step, max(0.0, at - time.monotonic()))

    def _assign_slots(self, rows, rank: int) -> int | None:
        """The training place of quorum member ``rank`` after this meet; every member computes
        it from the same rows. A place claimed by several members stays with the first in
        step (not catching up or healing), in quorum order: a trainer that missed a quorum,
        whose place a spare took meanwhile, comes back as a spare. Free places go to the
        members holding none, ready spares first (in quorum order)."""
        trainers = self.opts.trainers
        holder: dict[int, int] = {}
        for i in sorted(range(len(rows)), key=lambda i: (rows[i][4], i)):
            claim = rows[i][5]
            if 0 <= claim < trainers and claim not in holder:
                holder[claim] = i
        placed = set(holder.values())
        waiting = sorted((i for i in range(len(rows)) if i not in placed),
                         key=lambda i: (rows[i][4] == 2, i))
        free = [s for s in range(trainers) if s not in holder]
        holder.update(zip(free, waiting))
        return next((s for s, i in holder.items() if i == rank), None)
