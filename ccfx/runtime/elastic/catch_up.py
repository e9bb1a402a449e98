"""Catching up: a replica whose step count is stale (after a heal, or a spare in a dead
trainer's place) syncs when its peers do, and every member leaves the meet at one step."""

from __future__ import annotations

import time

from ..heal import Watch
from .meet import _alive_url
from .options import WATCH_SILENT_S
from .states import State


class CatchUp:
    """The catching-up side of :class:`~ccfx.runtime.elastic.Elastic` (a mixin)."""

    _catch_up_at: float | None = None  # CATCHING_UP: when the peers are due at their sync
    _last_step_end: float | None = None  # when catch_up_due was last asked (an inner step)
    _sync_watch: Watch | None = None  # while catching up: the in-step peers' /alive streams

    def catch_up_due(self) -> bool:
        """Whether to sync now rather than at this replica's own next sync step (it is
        ``CATCHING_UP``: it spent a heal's fetch not training, or took a dead trainer's place
        mid-interval). It syncs when its peers' last interval between syncs has passed since
        the exchange it healed in, and takes their inner step there (:meth:`_adopt_step`).
        Called once per inner step: it syncs at the step that ends nearest that time (a step
        earlier when less than half a step is left). Where it watches its in-step peers'
        streams (:class:`~ccfx.runtime.heal.Watch`), it also syncs at the end of the step in
        which the first of them starts the sync, if that comes first: the estimate is the last
        interval's, late whenever this one runs slower."""
        now, last = time.monotonic(), self._last_step_end
        self._last_step_end = now
        if self.state is not State.CATCHING_UP or self._catch_up_at is None:
            return False
        if self._sync_watch is not None and self._sync_watch.synced:
            return True  # a peer has started the sync: this step's end is the soonest
        half_step = (now - last) / 2 if last is not None else 0.0
        return now + half_step >= self._catch_up_at

    def _start_catch_up(self, rows, exchanged: float) -> None:
        """After a lazy heal: sync next when the peers do, whatever this replica's own step
        count (:meth:`catch_up_due`)."""
        self._become(State.CATCHING_UP, "its heal's state is here")
        self._catch_up_at = self._next_sync_at(rows, exchanged)
        self._close_sync_watch()
        if self._catch_up_at is not None and not self.spare:  # (a spare: _watch_trainers)
            self._sync_watch = self._watch_in_step(rows)

    def _watch_in_step(self, rows) -> Watch | None:
        """A watch on the ``/alive`` streams of the meet's members that trained in step
        through their last interval (not this replica), told of a sync at torchft's current
        step or later; None when no such member has a stream."""
        urls = {i: _alive_url(r) for i, r in enumerate(rows)
                if i != self._last_rank and r[0] > 0 and not r[4] and r[8] > 0}
        if not urls:
            return None
        return Watch(urls, silent_s=WATCH_SILENT_S, sync_step=self.manager.current_step())

    def _close_sync_watch(self) -> None:
        if self._sync_watch is not None:
            self._sync_watch.close()
            self._sync_watch = None

    @staticmethod
    def _next_sync_at(rows, exchanged: float) -> float | None:
        """When the earliest of the peers that trained through their last interval will reach
        the next sync: that interval, counted from this sync's exchange; None if unknown."""
        intervals = [r[3] for r in rows if r[0] > 0 and r[3] >= 0 and not r[4]]
        return exchanged + min(intervals) / 1000 if intervals else None

    def _adopt_step(self, rows, due: list) -> list:
        """Every member leaves the meet at one inner step and so exchanges the same fragments:
        the step of the members in step (not catching up; the highest should they differ),
        else the highest of all. A member elsewhere takes it: one catching up after a heal,
        one healed from a peer that was itself catching up (it reports that peer's step), one
        whose ghost sync passed no fragments. Its own steps since the heal still count as its
        weight. Every member computes the same rule on the same rows: no extra round. A
        replica catching up is in step from here; one healing stays so (and takes the step)."""
        catching_up = self.state in (State.CATCHING_UP, State.HEALING)
        if self.state is not State.HEALING:
            self._become(State.IN_STEP, "took the quorum's step at the meet")
        self._catch_up_at = None
        steps = [r[1] for r in rows if not r[4]] or [r[1] for r in rows]
        outer = self.outer
        if outer.step == max(steps) and not catching_up:
            return due
        outer.step = max(steps)
        return [f for f in outer.fragments
                if outer.step > 0 and outer.step % outer.sync_every == f.offset]
