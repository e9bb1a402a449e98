"""What ranks agree on, and the process groups ccfx makes: one mechanism, keyed by what is
agreed.

Every agreement is about a description: a small JSON-able dict (a graph's code hash and input
shapes, the options, the participating ranks, a bucket plan, the stage interfaces). Its
**fingerprint** (:func:`fingerprint`, 16 hex digits of a SHA-256 of the canonical JSON) is the
key under which ranks meet in the c10d store, and the name of any process group made for it.
Nothing is keyed by a process-wide counter (a backend's serial, a graph's index, torch's own
group count): a rank that compiles an extra model (an eval copy, a ``no_grad`` helper, a
rank-0-only evaluation) publishes other fingerprints and shifts nothing its peers wait on.

Three operations:

* :func:`meet`: every participating rank publishes the fingerprint and waits for the others'.
  Equal descriptions meet; different ones are a :class:`Diverged` error naming both
  fingerprints and what differs.
* :func:`from_rank0`: the first participant's answer to a question (``auto``'s codec choice,
  measured on that rank), keyed by the fingerprint of the question; asked twice (a second model
  with the same graph and options), the same answer. The first participant never waits.
* :func:`group`: a process group for a description, named ``ccfx-<fingerprint>``, made by the
  participants only (a ``PrefixStore`` under that name), registered under the name for
  functional collectives (``_c10d_functional`` ops in compiled graphs name their group), and
  made once per process (a second model with the same fingerprint shares it). The name is
  known before the group exists (:func:`group_name`): a compiled backward can name its group
  at compile time and the ranks make it at its first run.

Waiting. Each rank keeps a record under ``ccfx/agree/at/<rank>``: what it is waiting at now
(the fingerprint and description), or the last agreements it reached, or the one it gave up on.
A waiting rank polls its peers' records: a peer waiting at the same kind of agreement with
another fingerprint, or at an agreement this rank has not reached while this rank waits too (a
deadlock), or a peer that gave up on one involving this rank, is an error within a poll or two,
naming both sides. A peer that is merely busy (still compiling: the ranks reach a compile
moments apart, by however long each compile takes, seconds to minutes) is waited for up to the
timeout, ``collective_timeout_s`` (default 300 s): a short fixed timeout would fail a slow but
healthy compile, and the divergences it would catch are caught by the records instead. When it
runs out, the error says what the peer last published. A rank entering a group's
collective step records it (:func:`entering`: the group and the step's number), and a rank that
recompiled a graph records what and why (:func:`note_compile`): a peer waiting at an agreement
while this rank waits in a collective step it has not entered (it recompiled for an uneven
batch) fails within a poll, quoting the recompile, and shuts down its connections of the
peer's group (:func:`close_group`): the rank in the collective then fails at once, quoting it.

Naming the dead. A rank publishes where it runs (host, addresses, pid) under
``ccfx/agree/proc/<rank>`` when it makes its first group. gloo names a dead peer by an
address only (``Connection closed by peer [127.0.0.1]:40123``); :func:`blame` turns that into
ranks: a peer on this host whose process is gone, or a peer whose host has the address gloo
names and that did not report the failure itself within a moment (a survivor writes a
``failed`` record, :func:`gave_up`), is named with its address.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle
import secrets
import threading
import time
from collections.abc import Callable, Sequence

from ..errors import CollectiveError, ConfigError
from . import sockets

#: Seconds between two looks at the store while waiting (each is one round trip).
POLL_S = 0.1
#: Agreements a rank's record remembers (what it reached last), newest first.
RECENT = 6

_PREFIX = "ccfx/agree"


#: Some ranks did not reach an agreement within the timeout (a :class:`CollectiveError`).
StoreTimeout = CollectiveError
#: Ranks reached different agreements: they compile different graphs or options (a
#: :class:`ConfigError`, the error of every other option that does not fit).
Diverged = ConfigError


def fingerprint(desc) -> str:
    """16 hex digits of the canonical JSON of ``desc`` (the same on every rank and run)."""
    text = json.dumps(desc, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def code_hash(text: str) -> str:
    """A short hash of a graph's code (what a description carries instead of the code)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_ranks(group=None) -> tuple[int, ...]:
    """The global ranks of ``group`` (default: every rank); ``(0,)`` without a process group."""
    dist = _dist()
    if dist is None:
        return (0,)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _full(what: str, desc: dict, ranks: Sequence[int]) -> dict:
    return {"what": what, "ranks": list(ranks), "desc": desc}


def group_name(what: str, desc: dict, ranks: Sequence[int]) -> str:
    """The name of :func:`group`'s process group for this description (known before it exists)."""
    return f"ccfx-{fingerprint(_full(what, desc, ranks))}"


# -- a rank's record ---------------------------------------------------------------------------


def _record_key(rank: int) -> str:
    return f"{_PREFIX}/at/{rank}"


def _read_record(store, rank: int) -> dict | None:
    key = _record_key(rank)
    try:
        if not store.check([key]):
            return None
        return json.loads(store.get(key).decode())
    except (RuntimeError, ValueError):  # a peer's record is a diagnostic: never fail on it
        return None


class _Record:
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
            store.set(_record_key(rank), data)

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
                    store.set(_record_key(rank), json.dumps(value, default=str).encode())
                except RuntimeError:
                    pass  # the store is gone: the collective will say so

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held) and no writer."""
        self._lock, self._pending = threading.Lock(), None
        self._wake, self._writer = threading.Event(), None

    def reached(self, at: dict) -> None:
        brief = {k: at[k] for k in ("what", "fp", "ranks")}
        self.recent = [brief] + [r for r in self.recent if r["fp"] != at["fp"]][:RECENT - 1]


_RECORD = _Record()
os.register_at_fork(after_in_child=_RECORD.after_fork)


# -- waiting -----------------------------------------------------------------------------------


def _wait(store, rank: int, at: dict, needs: dict[int, str], timeout_s: float, hint: str):
    """Wait until every key of ``needs`` (peer rank → the key it must set) exists, watching the
    peers' records (see the module docstring)."""
    needs_ = {str(r): k for r, k in needs.items()}
    # this wait's own token: a peer that gave up on an earlier wait at the same fingerprint
    # (the same agreement reached again: a retried build, the next test) does not fail this one
    at = {**at, "wait": secrets.token_hex(6)}
    _RECORD.write(store, rank, "waiting", at, needs=needs_)
    start = time.monotonic()
    try:
        while True:
            missing = {r: k for r, k in needs.items() if not store.check([k])}
            if not missing:
                break
            for peer, key in missing.items():
                _check_peer(store, rank, peer, key, at, hint)
            if time.monotonic() - start > timeout_s:
                raise _timed_out(store, rank, at, missing, timeout_s, hint)
            time.sleep(POLL_S)
    except (Diverged, StoreTimeout) as e:
        # seen: the agreement each peer was waiting at when this rank gave up on it: that
        # peer (and only while it still waits there) fails too
        _RECORD.write(store, rank, "failed", at, reason=str(e).splitlines()[0],
                      seen=getattr(e, "ccfx_seen", {}))
        for name in getattr(e, "ccfx_close", ()):  # a peer blocked in gloo there: end it now
            close_group(name)
        raise
    except RuntimeError as e:  # the store itself is gone (the rank hosting it ended)
        raise StoreTimeout(
            f"rank {rank}: the c10d store went away while this rank waited at {at['what']} "
            f"(fingerprint {at['fp']}): {_first_line(e)}. The rank hosting it (rank 0) ended "
            f"or died; see its own error. {hint}".rstrip()) from e
    _RECORD.reached(at)
    _RECORD.write(store, rank, "running")


def _wait_id(at: dict) -> str:
    """One wait of one rank: the agreement's fingerprint and the wait's token."""
    return f"{at.get('fp')}#{at.get('wait', '')}"


def _check_peer(store, rank: int, peer: int, key: str, at: dict, hint: str) -> None:
    """Raise if ``peer`` cannot reach this agreement (``key``: what it would set)."""
    rec = _read_record(store, peer)
    if rec is None or rec.get("at") is None:
        return
    theirs = rec["at"]
    if theirs.get("fp") == at["fp"]:
        return  # on its way: it is at this very agreement
    if rec["state"] == "waiting" and any(r["fp"] == theirs.get("fp") for r in _RECORD.recent):
        return  # still polling at one this rank passed (both arrived): it is on its way here
    involved = rank in theirs.get("ranks", ())
    if not involved:
        return
    same_kind = theirs.get("what") == at["what"]
    if rec["state"] == "waiting":
        need = (rec.get("needs") or {}).get(str(rank))
        if (same_kind or (need is not None and not store.check([need]))) \
                and not store.check([key]):  # it has not passed this one meanwhile
            e = _diverged(rank, peer, at, theirs, hint, same_kind)
            e.ccfx_seen = {str(peer): _wait_id(theirs)}
            raise e
    elif (rec["state"] == "collective" and involved
          and int(rec.get("n", -1)) >= _ENTERED.get(theirs.get("fp"), 0)
          and not store.check([key])):
        # it waits in a collective this rank has not entered (and cannot while it waits here)
        raise _in_other_collective(rank, peer, at, rec)
    elif (rec["state"] == "failed" and (rec.get("seen") or {}).get(str(rank)) == _wait_id(at)
          and not store.check([key])):  # it gave up because of this very wait
        raise _diverged(rank, peer, at, theirs, hint, same_kind,
                        f" (rank {peer} gave up: {_short(rec.get('reason', ''), 200)})")


#: Collectives this rank entered, by group name (see :func:`entering`).
_ENTERED: dict[str, int] = {}


def entering(what: str, group: str, n: int, ranks: Sequence[int]) -> None:
    """Record that this rank enters the ``n``-th (from 0) collective step ``what`` of
    ``group``: a peer waiting at an agreement meanwhile sees that this rank waits for it there
    (a deadlock when it has not entered that step: it recompiled, say), within a poll. Called
    once per call of a compiled graph with agreed collectives: the record is written by a
    background thread (:meth:`_Record.write_later`), a moment later, not on this path."""
    dist = _dist()
    _ENTERED[group] = n + 1
    if dist is None or len(ranks) < 2:
        return
    _RECORD.write_later(_store(), dist.get_rank(), "collective",
                        {"what": what, "fp": group, "ranks": list(ranks)}, n=n)


def note_compile(text: str | None) -> None:
    """What this rank compiled anew and why (``"rank 1 recompiled graph 0 because input 0's
    shape changed (8, 32) -> (5, 32)"``), published in its record for its peers' errors."""
    _RECORD.compiled = text
    dist = _dist()
    if dist is None or text is None:
        return
    try:
        store = _store()
        rec = _read_record(store, dist.get_rank()) or {}
        rec["compiled"] = text
        _RECORD.replace(store, dist.get_rank(), rec)  # not overwritten by an older pending one
    except RuntimeError:
        pass


def peer_notes(ranks: Sequence[int] | None = None, failures: bool = True) -> str:
    """Sentences about the peers that recompiled (what and why) and, with ``failures``, that
    gave up (why)."""
    dist = _dist()
    if dist is None:
        return ""
    rank = dist.get_rank()
    out = []
    try:
        store = _store()
        for r in (ranks if ranks is not None else world_ranks()):
            rec = _read_record(store, r) if r != rank else None
            if not rec:
                continue
            reason = str(rec.get("reason", "")) if failures and rec.get("state") == "failed" \
                else ""
            if rec.get("compiled") and rec["compiled"][1:] not in reason:
                out.append(f"{rec['compiled'][0].upper()}{rec['compiled'][1:]}.")
            if reason:
                out.append(f"Rank {r} gave up first: {rec.get('reason', '').rstrip('.')}.")
    except RuntimeError:
        pass
    return " ".join(out)


#: What a rank that recompiled for another shape should do (README, data parallel).
SHAPES_HINT = ("Ranks whose batches differ in shape (an uneven last batch, a data-dependent "
               "branch on one rank) compile different graphs: give every rank the same shapes "
               "(DataLoader(drop_last=True), or pad), or compile with dynamic=True")


def _in_other_collective(rank: int, peer: int, at: dict, rec: dict) -> Diverged:
    theirs = rec.get("at") or {}
    mine = _RECORD.compiled
    why = f" {mine[0].upper()}{mine[1:]}." if mine and mine.startswith("rank") else ""
    if rec.get("compiled"):
        why += f" {rec['compiled'][0].upper()}{rec['compiled'][1:]}."
    e = Diverged(
        f"rank {rank}: waits at {at['what']} (fingerprint {at['fp']}) while rank {peer} waits "
        f"in {theirs.get('what')} (step {int(rec.get('n', 0)) + 1} on group "
        f"{theirs.get('fp')}), which this rank has not entered: neither can go on.{why} "
        f"{SHAPES_HINT}.")
    e.ccfx_seen = {str(peer): _wait_id(theirs)}
    e.ccfx_close = (theirs.get("fp"),)  # the peer's collective waits on that group
    return e


def _subject(at: dict) -> dict:
    """What an agreement is about (``about`` where given: a broadcast is about its graph)."""
    return at.get("about") or at


def _diverged(rank: int, peer: int, at: dict, theirs: dict, hint: str, same_kind: bool,
              extra: str = "") -> Diverged:
    mine, other = _subject(at), _subject(theirs)
    if same_kind or mine.get("what") == other.get("what"):
        head = (f"rank {rank}: ranks {rank} and {peer} disagree on {mine['what']}: rank {rank} "
                f"has fingerprint {mine['fp']}, rank {peer} has {other.get('fp')}")
        differ = diff(mine.get("desc"), other.get("desc"))
        what = ("; they differ in " + ", ".join(differ)) if differ else ""
    else:
        head = (f"rank {rank}: waits at {at['what']} (fingerprint {at['fp']}) for rank {peer}, "
                f"which waits at {theirs.get('what')} (fingerprint {theirs.get('fp')}) for this "
                "rank: neither can go on (a deadlock)")
        what = ""
    hint = hint or "Every rank must compile the same model with the same ccfx options."
    if what:  # what differs says it: the descriptions themselves are noise
        return Diverged(f"{head}{what}. {hint}")
    return Diverged(
        f"{head}{extra}. {hint}\n  rank {rank}: {_brief(mine.get('desc'))}"
        f"\n  rank {peer}: {_brief(other.get('desc'))}")


def _timed_out(store, rank: int, at: dict, missing: dict[int, str], timeout_s: float,
               hint: str) -> StoreTimeout:
    lines = []
    for peer in missing:
        rec = _read_record(store, peer)
        if rec is None:
            lines.append(f"rank {peer} has published nothing (it never reached a ccfx "
                         "agreement: it died, hangs, or has not compiled yet)")
            continue
        ago = time.time() - float(rec.get("time", time.time()))
        now = rec.get("at") or {}
        recent = ", ".join(f"{r['what']} {r['fp']}" for r in rec.get("recent", [])) or "none"
        if rec["state"] == "waiting":
            state = f"waiting at {now.get('what')} {now.get('fp')} for {ago:.0f} s"
        elif rec["state"] == "failed":
            state = f"gave up on {now.get('what')} {now.get('fp')} {ago:.0f} s ago"
        elif rec["state"] == "collective":
            state = f"in {now.get('what')} (group {now.get('fp')}) for {ago:.0f} s"
        else:
            state = f"running (its last agreement {ago:.0f} s ago)"
        compiled = f"; {rec['compiled']}" if rec.get("compiled") else ""
        lines.append(f"rank {peer} is {state}; its latest agreements: {recent}{compiled}")
    return StoreTimeout(
        f"rank {rank}: {at['what']} (fingerprint {at['fp']}): ranks {sorted(missing)} did not "
        f"reach it within {timeout_s:g} s: " + "; ".join(lines) + ". They died, hang, or "
        f"compiled a different model or options. {hint}".rstrip())


def diff(a, b, path: str = "", limit: int = 6) -> list[str]:
    """Where two descriptions differ: dotted paths with both values (at most ``limit``)."""
    out: list[str] = []

    def walk(x, y, p):
        if len(out) >= limit or x == y:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=str):
                walk(x.get(k), y.get(k), f"{p}.{k}" if p else str(k))
            return
        out.append(f"{p or 'the description'} ({_short(x)} vs {_short(y)})")

    walk(a, b, path)
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _short(v, n: int = 60) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= n else text[:n - 1] + "…"


def _brief(desc, n: int = 300) -> str:
    return _short(desc, n)


# -- the operations ----------------------------------------------------------------------------


def meet(what: str, desc: dict, ranks: Sequence[int] | None = None, *, timeout_s: float,
         hint: str = "", about: tuple[str, dict] | None = None) -> str:
    """Every rank of ``ranks`` (global ranks, default: all) reaches the agreement ``what`` on
    ``desc``; returns its fingerprint. Raises :class:`Diverged` when ranks reach different
    descriptions, :class:`StoreTimeout` when a peer does not come within ``timeout_s``.
    ``about``: the agreement (what, desc) this one belongs to (a graph's first-call broadcast
    belongs to the graph's plan), which an error compares with the peer's."""
    dist = _dist()
    ranks = tuple(ranks) if ranks is not None else world_ranks()
    fp = fingerprint(_full(what, desc, ranks))
    if dist is None or len(ranks) < 2:
        return fp
    rank = dist.get_rank()
    store = _store()
    base = f"{_PREFIX}/{fp}"
    store.set(f"{base}/{rank}", b"1")
    at = {"what": what, "fp": fp, "desc": desc, "ranks": list(ranks)}
    if about is not None:
        at["about"] = {"what": about[0], "desc": about[1],
                       "fp": fingerprint(_full(about[0], about[1], ranks))}
    _wait(store, rank, at, {r: f"{base}/{r}" for r in ranks if r != rank}, timeout_s, hint)
    return fp


def from_rank0(what: str, desc: dict, decide: Callable[[], object], *, timeout_s: float,
               ranks: Sequence[int] | None = None, hint: str = ""):
    """The first of ``ranks``'s (default: rank 0's) ``decide()`` on every rank of ``ranks``,
    keyed by the fingerprint of ``what`` and ``desc`` (the question): the first rank answers
    once and never waits; a second question with the same fingerprint gets the same answer."""
    dist = _dist()
    ranks = tuple(ranks) if ranks is not None else world_ranks()
    if dist is None or len(ranks) < 2:
        return decide()
    rank, source = dist.get_rank(), ranks[0]
    fp = fingerprint(_full(what, desc, ranks))
    key = f"{_PREFIX}/{fp}/answer"
    store = _store()
    if rank == source:
        if not store.check([key]):
            store.set(key, pickle.dumps(decide()))
        at = {"what": what, "fp": fp, "ranks": list(ranks)}
        _RECORD.reached(at)
        _RECORD.write(store, rank, "running")
    else:
        at = {"what": what, "fp": fp, "desc": desc, "ranks": list(ranks)}
        _wait(store, rank, at, {source: key}, timeout_s, hint)
    return pickle.loads(store.get(key))


_GROUPS: dict = {}


def group(what: str, desc: dict, ranks: Sequence[int] | None = None, *, timeout_s: float,
          hint: str = ""):
    """The process group of ``ranks`` for ``desc`` (None without a process group or for one
    rank): the ranks :func:`meet` first, then make it under :func:`group_name`, once per
    process. Only the participants call it."""
    dist = _dist()
    ranks = tuple(sorted(ranks)) if ranks is not None else world_ranks()
    if dist is None or len(ranks) < 2:
        return None
    name = group_name(what, desc, ranks)
    pg = _GROUPS.get(name)
    if pg is not None and name in dist.distributed_c10d._world.pg_names.values():
        # the name leaves the timeout out (how long a rank waits is its own business): a
        # later compile of the same model with another collective_timeout_s reuses the group,
        # and waits as long as it asked
        pg.set_timeout(datetime.timedelta(seconds=timeout_s))
        return pg
    meet(what, desc, ranks, timeout_s=timeout_s, hint=hint)
    pg = _make_group(name, ranks, timeout_s, what)
    _GROUPS[name] = pg
    return pg


#: Stand-ins by name (the registry holds groups weakly: they are kept alive here).
_RESERVED: dict = {}


def torch_c10d_unregister(name: str) -> None:
    from torch._C import _distributed_c10d as c

    c._unregister_process_group(name)


def reserve(name: str, ranks: Sequence[int]) -> None:
    """Register a stand-in under ``name`` until :func:`group` makes the group: inductor reads
    the rank and size of a group that a graph names while it compiles the graph (a backward
    compiles before its ranks make the group). The stand-in has no backend: a collective on
    it fails loudly, never silently."""
    dist = _dist()
    if dist is None or len(ranks) < 2 or name in _RESERVED or name in _GROUPS:
        return
    from torch._C import _distributed_c10d as c

    stand_in = c.ProcessGroup(c.HashStore(), list(ranks).index(dist.get_rank()), len(ranks))
    c._register_process_group(name, stand_in)
    _RESERVED[name] = stand_in


# -- naming the dead ----------------------------------------------------------------------------


def _proc_key(rank: int) -> str:
    return f"{_PREFIX}/proc/{rank}"


_PUBLISHED: set = set()


def publish_process(store=None) -> None:
    """This rank's host, addresses and pid under ``ccfx/agree/proc/<rank>`` (once)."""
    dist = _dist()
    if dist is None or "done" in _PUBLISHED:
        return
    import os
    import socket

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
        _RECORD.write(_store(), dist.get_rank(), "failed",
                      {"what": what, "fp": "collective", "ranks": list(ranks)},
                      reason=_short(reason, 200), seen={})
    except RuntimeError:
        pass  # the store is gone too


def peer_failures(ranks: Sequence[int] | None = None) -> dict[int, str]:
    """The peers (of ``ranks``, default all) whose record says they gave up, with why."""
    dist = _dist()
    if dist is None:
        return {}
    rank = dist.get_rank()
    out = {}
    try:
        store = _store()
        for r in (ranks if ranks is not None else world_ranks()):
            rec = _read_record(store, r) if r != rank else None
            if rec and rec.get("state") == "failed":
                out[r] = str(rec.get("reason", ""))
    except RuntimeError:
        pass
    return out


def _gloo_address(text: str) -> str | None:
    import re

    m = re.search(r"\[([0-9a-fA-F:.]+)\]:(\d+)", text)
    return f"{m.group(1)}:{m.group(2)}" if m else None


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:  # an exited child its parent has not reaped yet (a launcher's rank) is a zombie
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def failed(what: str, error: BaseException, ranks: Sequence[int]) -> tuple[str, str]:
    """For a collective ``what`` over ``ranks`` that failed with ``error``: record that this
    rank gave up on it (:func:`gave_up`), and return the error's first line and a sentence
    naming the peer it points at (``" Rank 2 (…) has exited."``, or ``""``: :func:`blame`)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    gave_up(what, first, ranks)
    who = blame(error, ranks)
    return first, (f" {who[0].upper()}{who[1:]}." if who else "")


def blame(error: BaseException | str, ranks: Sequence[int] | None = None,
          settle_s: float = 1.0) -> str:
    """A sentence naming the peer ranks a collective failure points at (see the module
    docstring), e.g. ``"rank 2 (127.0.0.1:40123, pid 4242 on host n1) has exited"``; ``""``
    when nothing can be told (no process group, or no peer stands out)."""
    dist = _dist()
    if dist is None:
        return ""
    import socket

    text = str(error)
    address = _gloo_address(text)
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
    here = socket.gethostname()
    dead = [r for r, p in procs.items() if p.get("host") == here and not _alive(p["pid"])]
    if not dead:  # elsewhere: the peers with gloo's address that do not report a failure
        candidates = [r for r, p in procs.items()
                      if address is None or address.rsplit(":", 1)[0] in p.get("addrs", ())]
        deadline = time.monotonic() + settle_s
        while candidates and time.monotonic() < deadline:
            candidates = [r for r in candidates
                          if ((_read_record(store, r) or {}).get("state") != "failed")]
            time.sleep(POLL_S)
        if len(candidates) < len(peers):
            dead = candidates
        if not dead:
            return f"gloo names the peer at {address}" if address else ""
        verb = "did not report this failure itself (it died, hangs or lost its network)"
    else:
        verb = "has exited"

    def one(r):
        p = procs[r]
        where = f"{address}, " if address and len(dead) == 1 else ""
        return f"rank {r} ({where}pid {p['pid']} on host {p['host']})"

    names = ", ".join(one(r) for r in dead)
    if len(dead) > 1:
        verb = verb.replace("has exited", "have exited")
    return f"{names} {verb}"


def _make_group(name: str, ranks: tuple[int, ...], timeout_s: float, what: str):
    """A process group over ``ranks`` named ``name``: torch's own construction
    (``_new_process_group_helper``: a ``PrefixStore`` under the name, the backend of the
    default group, registered for ``_c10d_functional``), with a name of ccfx's choosing
    (``dist.new_group`` names groups by a process-wide count, or by a hash of the ranks and the
    number of groups made so far: either depends on what the process made before)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if name in _RESERVED:  # the stand-in makes way for the group
        torch_c10d_unregister(name)
        del _RESERVED[name]
    default = c10d._get_default_group()
    backend, store = c10d._world.pg_map[default]
    rank = dist.get_rank()
    publish_process()
    before = sockets.snapshot() if str(backend) == "gloo" else None
    pg, _ = c10d._new_process_group_helper(
        len(ranks), ranks.index(rank), list(ranks), c10d.Backend(backend), store, name,
        timeout=datetime.timedelta(seconds=timeout_s), group_desc=f"ccfx {what}")
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    if before is not None:  # gloo connected the group as it was made: its sockets
        _SOCKETS[name] = sockets.opened(before)
    return pg


#: Each gloo group's own sockets, by name (:func:`close_group`).
_SOCKETS: dict[str, dict[int, str]] = {}


def close_group(name: str | None) -> int:
    """Shut down this rank's connections of ccfx's group ``name`` (:mod:`ccfx.wire.sockets`):
    a peer blocked on it fails at once instead of after the group's timeout. Call it only after
    recording why this rank gives up (:func:`gave_up`, or a failed wait): the peer's error
    quotes that record. The group is finished afterwards. Returns the sockets shut down."""
    return sockets.shut(_SOCKETS.pop(name, {})) if name else 0
