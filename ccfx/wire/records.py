"""A rank's record in the c10d store: what it waits at, reached, entered or gave up on.

Each rank keeps a record under ``ccfx/agree/at/<rank>``: what it is waiting at now (the
fingerprint and description), or the last agreements it reached, or the one it gave up on,
the collective step it entered (:func:`entering`) and what it recompiled last
(:func:`note_compile`). Peers read it to tell a busy rank from a diverged or dead one
(:mod:`ccfx.wire.agreement`, :mod:`ccfx.wire.blame`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence

from .world import dist as _dist
from .world import store as _store

#: Seconds between two looks at the store while waiting (each is one round trip).
POLL_S = 0.1
#: Agreements a rank's record remembers (what it reached last), newest first.
RECENT = 6

PREFIX = "ccfx/agree"


def record_key(rank: int) -> str:
    return f"{PREFIX}/at/{rank}"


def read_record(store, rank: int) -> dict | None:
    """``rank``'s record, or None (none yet, or unreadable: a record is a diagnostic)."""
    key = record_key(rank)
    try:
        if not store.check([key]):
            return None
        return json.loads(store.get(key).decode())
    except (RuntimeError, ValueError):  # a peer's record is a diagnostic: never fail on it
        return None


class Record:
    """This rank's record (see the module docstring), kept in memory and mirrored to the store.

    :meth:`write` sets it in the store at once; :meth:`write_later` hands it to a background
    thread, for the hot path (a compiled graph entering its collectives, once per call: per
    decoded token in tensor-parallel inference), where a store round trip per call (15-60 us on
    this host, a network round trip on a cluster) would be paid by every step. A later
    :meth:`write` supersedes a record not yet written, so the store never goes back to an older
    state."""

    def __init__(self):
        self.recent: list[dict] = []
        #: what this rank recompiled last, and why (see :func:`note_compile`)
        self.compiled: str | None = None
        self._lock = threading.Lock()
        self._pending: tuple | None = None  # (store, rank, value) the thread has yet to write
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None

    def _value(self, state: str, at: dict | None, extra: dict) -> dict:
        return {"state": state, "at": at, "recent": self.recent, "time": time.time(),
                "compiled": self.compiled, **extra}

    def write(self, store, rank: int, state: str, at: dict | None = None, **extra) -> None:
        self.replace(store, rank, self._value(state, at, extra))

    def replace(self, store, rank: int, value: dict) -> None:
        """Set the record to ``value`` now, superseding one not yet written."""
        data = json.dumps(value, default=str).encode()
        with self._lock:
            self._pending = None
            store.set(record_key(rank), data)

    def write_later(self, store, rank: int, state: str, at: dict | None = None,
                    **extra) -> None:
        with self._lock:
            self._pending = (store, rank, self._value(state, at, extra))
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_pending, daemon=True,
                                            name="ccfx-agree-record")
            self._writer.start()
        self._wake.set()

    def _write_pending(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                job, self._pending = self._pending, None
                if job is None:
                    continue
                store, rank, value = job
                try:
                    store.set(record_key(rank), json.dumps(value, default=str).encode())
                except RuntimeError:
                    pass  # the store is gone: the collective will say so

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held) and no writer."""
        self._lock, self._pending = threading.Lock(), None
        self._wake, self._writer = threading.Event(), None

    def reached(self, at: dict) -> None:
        brief = {k: at[k] for k in ("what", "fp", "ranks")}
        self.recent = [brief] + [r for r in self.recent if r["fp"] != at["fp"]][:RECENT - 1]


#: This process's record.
RECORD = Record()
os.register_at_fork(after_in_child=RECORD.after_fork)

#: Collectives this rank entered, by group name (see :func:`entering`).
ENTERED: dict[str, int] = {}


def entering(what: str, group: str, n: int, ranks: Sequence[int]) -> None:
    """Record that this rank enters the ``n``-th (from 0) collective step ``what`` of
    ``group``: a peer waiting at an agreement meanwhile sees that this rank waits for it there
    (a deadlock when it has not entered that step: it recompiled, say), within a poll. Called
    once per call of a compiled graph with agreed collectives: the record is written by a
    background thread (:meth:`Record.write_later`), a moment later, not on this path."""
    dist = _dist()
    ENTERED[group] = n + 1
    if dist is None or len(ranks) < 2:
        return
    RECORD.write_later(_store(), dist.get_rank(), "collective",
                       {"what": what, "fp": group, "ranks": list(ranks)}, n=n)


def note_compile(text: str | None) -> None:
    """What this rank compiled anew and why (``"rank 1 recompiled graph 0 because input 0's
    shape changed (8, 32) -> (5, 32)"``), published in its record for its peers' errors."""
    RECORD.compiled = text
    dist = _dist()
    if dist is None or text is None:
        return
    try:
        store = _store()
        rec = read_record(store, dist.get_rank()) or {}
        rec["compiled"] = text
        RECORD.replace(store, dist.get_rank(), rec)  # not overwritten by an older pending one
    except RuntimeError:
        pass


def short(v, n: int = 60) -> str:
    """``v`` as JSON, cut to ``n`` characters (a value quoted in an error or a record)."""
    text = json.dumps(v, default=str)
    return text if len(text) <= n else text[:n - 1] + "…"
