"""Naming the ranks a collective failure points at: the process records and the blame.

A rank publishes where it runs (host, addresses, pid) under ``ccfx/agree/proc/<rank>`` when it
makes its first group (:func:`publish_process`). gloo names a dead peer by an address only
(``Connection closed by peer [127.0.0.1]:40123``); :func:`blame` turns that into ranks: a
peer on this host whose process is gone, or a peer whose host has the address gloo names and
that did not report the failure itself within a moment (a survivor writes a ``failed``
record, :func:`gave_up`), is named with its address; a peer on this host that is stopped
(SIGSTOP) is named as frozen.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Sequence

from .records import POLL_S, PREFIX, RECORD, read_record, short
from .world import dist as _dist
from .world import store as _store
from .world import world_ranks


def _proc_key(rank: int) -> str:
    return f"{PREFIX}/proc/{rank}"


_PUBLISHED: set = set()


def publish_process(store=None) -> None:
    """This rank's host, addresses and pid under ``ccfx/agree/proc/<rank>`` (once)."""
    dist = _dist()
    if dist is None or "done" in _PUBLISHED:
        return
    host = socket.gethostname()
    addrs = {"127.0.0.1"}
    try:
        addrs |= {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        pass
    for var in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME_ADDR"):
        if os.environ.get(var):
            addrs.add(os.environ[var])
    store = store if store is not None else _store()
    store.set(_proc_key(dist.get_rank()), json.dumps(
        {"host": host, "pid": os.getpid(), "addrs": sorted(addrs)}).encode())
    _PUBLISHED.add("done")


def gave_up(what: str, reason: str, ranks: Sequence[int] = ()) -> None:
    """Record that this rank's collective ``what`` failed (peers' :func:`blame` reads it:
    a rank that says so is alive)."""
    dist = _dist()
    if dist is None:
        return
    try:
        RECORD.write(_store(), dist.get_rank(), "failed",
                     {"what": what, "fp": "collective", "ranks": list(ranks)},
                     reason=short(reason, 200), seen={})
    except RuntimeError:
        pass  # the store is gone too


def _peer_records(ranks: Sequence[int] | None):
    """(rank, record) of every peer of ``ranks`` (default all) that has one."""
    rank = _dist().get_rank()
    store = _store()
    for r in (ranks if ranks is not None else world_ranks()):
        rec = read_record(store, r) if r != rank else None
        if rec:
            yield r, rec


def peer_failures(ranks: Sequence[int] | None = None) -> dict[int, str]:
    """The peers (of ``ranks``, default all) whose record says they gave up, with why."""
    if _dist() is None:
        return {}
    out = {}
    try:
        for r, rec in _peer_records(ranks):
            if rec.get("state") == "failed":
                out[r] = str(rec.get("reason", ""))
    except RuntimeError:
        pass
    return out


def peer_notes(ranks: Sequence[int] | None = None, failures: bool = True) -> str:
    """Sentences about the peers that recompiled (what and why) and, with ``failures``, that
    gave up (why)."""
    if _dist() is None:
        return ""
    out = []
    try:
        for r, rec in _peer_records(ranks):
            reason = str(rec.get("reason", "")) if failures and rec.get("state") == "failed" \
                else ""
            if rec.get("compiled") and rec["compiled"][1:] not in reason:
                out.append(f"{rec['compiled'][0].upper()}{rec['compiled'][1:]}.")
            if reason:
                out.append(f"Rank {r} gave up first: {rec.get('reason', '').rstrip('.')}.")
    except RuntimeError:
        pass
    return " ".join(out)


def _gloo_address(text: str) -> str | None:
    m = re.search(r"\[([0-9a-fA-F:.]+)\]:(\d+)", text)
    return f"{m.group(1)}:{m.group(2)}" if m else None


def _state(pid: int) -> str:
    """The process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` exited but not reaped:
    a launcher's rank, ``X`` gone), ``"X"`` when there is no such process, ``"?"`` where it cannot be told."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "X"
    except OSError:
        return "?"
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def failed(what: str, error: BaseException, ranks: Sequence[int]) -> tuple[str, str]:
    """For a collective ``what`` over ``ranks`` that failed with ``error``: record that this
    rank gave up on it (:func:`gave_up`), and return the error's first line and a sentence
    naming the peer it points at (``" Rank 2 (…) has exited."``, or ``""``: :func:`blame`)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    gave_up(what, first, ranks)
    who = blame(error, ranks)
    return first, (f" {who[0].upper()}{who[1:]}." if who else "")


def _same_host(procs: dict, states: tuple[str, ...]) -> list:
    """The peers on this host whose process is in one of ``states``."""
    here = socket.gethostname()
    return [r for r, p in procs.items() if p.get("host") == here and _state(p["pid"]) in states]


def _find(store, procs: dict, peers: list, address: str | None,
          settle_s: float) -> tuple[list, str]:
    """The peers a failure points at, and the verb: a peer on this host whose process exited
    (polled for ``settle_s``: gloo sees a killed peer's sockets close a moment before its
    process is gone) or is stopped (SIGSTOP, a debugger), else the peers with gloo's
    ``address`` that do not report a failure within ``settle_s`` (all of them when none
    reports it, which names no one: ``[]``)."""
    candidates = [r for r, p in procs.items()
                  if address is None or address.rsplit(":", 1)[0] in p.get("addrs", ())]
    deadline = time.monotonic() + settle_s
    while True:
        dead = _same_host(procs, ("Z", "X"))
        if dead:
            return dead, "has exited" if len(dead) < 2 else "have exited"
        stopped = _same_host(procs, ("T", "t"))  # it cannot exit on its own meanwhile
        if stopped:
            return stopped, ("is" if len(stopped) < 2 else "are") + \
                " stopped (SIGSTOP, or a debugger): frozen, it never answers"
        candidates = [r for r in candidates
                      if ((read_record(store, r) or {}).get("state") != "failed")]
        if not candidates or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if candidates and len(candidates) < len(peers):
        return candidates, ("did not report this failure itself (it died, hangs or lost its "
                            "network)")
    return [], ""


def blame(error: BaseException | str, ranks: Sequence[int] | None = None,
          settle_s: float = 1.0) -> str:
    """A sentence naming the peer ranks a collective failure points at (see the module
    docstring), e.g. ``"rank 2 (127.0.0.1:40123, pid 4242 on host n1) has exited"``; ``""``
    when nothing can be told (no process group, or no peer stands out)."""
    dist = _dist()
    if dist is None:
        return ""
    address = _gloo_address(str(error))
    rank = dist.get_rank()
    peers = [r for r in (ranks if ranks is not None else world_ranks()) if r != rank]
    try:
        store = _store()
        procs = {}
        for r in peers:
            key = _proc_key(r)
            if store.check([key]):
                procs[r] = json.loads(store.get(key).decode())
    except (RuntimeError, ValueError):
        host0 = "rank 0, which hosts the c10d store"
        where = f" ({address})" if address else ""
        return (f"the c10d store is unreachable too: {host0}{where} has most likely exited "
                "or lost its network")
    dead, verb = _find(store, procs, peers, address, settle_s)
    if not dead:
        return f"gloo names the peer at {address}" if address else ""
    where = f"{address}, " if address and len(dead) == 1 else ""
    names = ", ".join(f"rank {r} ({where}pid {procs[r]['pid']} on host {procs[r]['host']})"
                      for r in dead)
    return f"{names} {verb}"
