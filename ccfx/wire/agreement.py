"""Fingerprint-keyed agreement: ranks meet on a description, or take the first rank's answer.

Every agreement is about a description (a graph's code hash and input shapes, the options,
the participating ranks, a bucket plan, the stage interfaces); its fingerprint
(:func:`ccfx.wire.fingerprints.fingerprint`) is the key under which ranks meet in the c10d
store. Nothing is keyed by a process-wide counter, so a rank that compiles an extra model
publishes other fingerprints and shifts nothing its peers wait on.

* :func:`meet`: every participating rank publishes the fingerprint and waits for the others'.
  Different descriptions are a :class:`Diverged` error naming both fingerprints and what
  differs.
* :func:`from_rank0`: the first participant's answer to a question, keyed by the question's
  fingerprint; asked twice, the same answer. The first participant never waits.

Waiting polls the peers' records (:mod:`ccfx.wire.records`): a peer waiting at the same kind of
agreement with another fingerprint, at one this rank has not reached while this rank waits too
(a deadlock), in a collective step this rank has not entered, or a peer that gave up on this
very wait, is an error within a poll or two naming both sides. A peer that is merely busy
(still compiling: seconds to minutes) is waited for up to ``timeout_s``; when it runs out, the
error says what the peer last published.
"""

from __future__ import annotations

import pickle
import secrets
import time
from collections.abc import Callable, Sequence

from ..errors import CollectiveError, ConfigError, first_line
from .fingerprints import described, fingerprint
from .groups import close_group
from .records import ENTERED, POLL_S, PREFIX, RECORD, read_record, short
from .world import dist as _dist
from .world import store as _store
from .world import world_ranks

#: Some ranks did not reach an agreement within the timeout (a :class:`CollectiveError`).
StoreTimeout = CollectiveError
#: Ranks reached different agreements: they compile different graphs or options (a
#: :class:`ConfigError`, the error of every other option that does not fit).
Diverged = ConfigError

#: What a rank that recompiled for another shape should do (README, data parallel).
SHAPES_HINT = ("Ranks whose batches differ in shape (an uneven last batch, a data-dependent "
               "branch on one rank) compile different graphs: give every rank the same shapes "
               "(DataLoader(drop_last=True), or pad), or compile with dynamic=True")


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
    fp = fingerprint(described(what, desc, ranks))
    if dist is None or len(ranks) < 2:
        return fp
    rank = dist.get_rank()
    store = _store()
    base = f"{PREFIX}/{fp}"
    store.set(f"{base}/{rank}", b"1")
    at = {"what": what, "fp": fp, "desc": desc, "ranks": list(ranks)}
    if about is not None:
        at["about"] = {"what": about[0], "desc": about[1],
                       "fp": fingerprint(described(about[0], about[1], ranks))}
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
    fp = fingerprint(described(what, desc, ranks))
    key = f"{PREFIX}/{fp}/answer"
    store = _store()
    if rank == source:
        if not store.check([key]):
            store.set(key, pickle.dumps(decide()))
        at = {"what": what, "fp": fp, "ranks": list(ranks)}
        RECORD.reached(at)
        RECORD.write(store, rank, "running")
    else:
        at = {"what": what, "fp": fp, "desc": desc, "ranks": list(ranks)}
        _wait(store, rank, at, {source: key}, timeout_s, hint)
    return pickle.loads(store.get(key))


# -- waiting -----------------------------------------------------------------------------------


def _wait(store, rank: int, at: dict, needs: dict[int, str], timeout_s: float, hint: str):
    """Wait until every key of ``needs`` (peer rank → the key it must set) exists, watching the
    peers' records (see the module docstring)."""
    needs_ = {str(r): k for r, k in needs.items()}
    # this wait's own token: a peer that gave up on an earlier wait at the same fingerprint
    # (the same agreement reached again: a retried build, the next test) does not fail this one
    at = {**at, "wait": secrets.token_hex(6)}
    RECORD.write(store, rank, "waiting", at, needs=needs_)
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
        RECORD.write(store, rank, "failed", at, reason=str(e).splitlines()[0],
                     seen=getattr(e, "ccfx_seen", {}))
        for name in getattr(e, "ccfx_close", ()):  # a peer blocked in gloo there: end it now
            close_group(name)
        raise
    except RuntimeError as e:  # the store itself is gone (the rank hosting it ended)
        raise StoreTimeout(
            f"rank {rank}: the c10d store went away while this rank waited at {at['what']} "
            f"(fingerprint {at['fp']}): {first_line(e)}. The rank hosting it (rank 0) ended "
            f"or died; see its own error. {hint}".rstrip()) from e
    RECORD.reached(at)
    RECORD.write(store, rank, "running")


def _wait_id(at: dict) -> str:
    """One wait of one rank: the agreement's fingerprint and the wait's token."""
    return f"{at.get('fp')}#{at.get('wait', '')}"


def _check_peer(store, rank: int, peer: int, key: str, at: dict, hint: str) -> None:
    """Raise if ``peer`` cannot reach this agreement (``key``: what it would set)."""
    rec = read_record(store, peer)
    if rec is None or rec.get("at") is None:
        return
    theirs = rec["at"]
    if theirs.get("fp") == at["fp"]:
        return  # on its way: it is at this very agreement
    if rec["state"] == "waiting" and any(r["fp"] == theirs.get("fp") for r in RECORD.recent):
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
          and int(rec.get("n", -1)) >= ENTERED.get(theirs.get("fp"), 0)
          and not store.check([key])):
        # it waits in a collective this rank has not entered (and cannot while it waits here)
        raise _in_other_collective(rank, peer, at, rec)
    elif (rec["state"] == "failed" and (rec.get("seen") or {}).get(str(rank)) == _wait_id(at)
          and not store.check([key])):  # it gave up because of this very wait
        raise _diverged(rank, peer, at, theirs, hint, same_kind,
                        f" (rank {peer} gave up: {short(rec.get('reason', ''), 200)})")


# -- what the errors say -----------------------------------------------------------------------


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
        out.append(f"{p or 'the description'} ({short(x)} vs {short(y)})")

    walk(a, b, path)
    return out


def _in_other_collective(rank: int, peer: int, at: dict, rec: dict) -> Diverged:
    theirs = rec.get("at") or {}
    mine = RECORD.compiled
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
        f"{head}{extra}. {hint}\n  rank {rank}: {short(mine.get('desc'), 300)}"
        f"\n  rank {peer}: {short(other.get('desc'), 300)}")


def _peer_state(rec: dict) -> str:
    """What a peer's record says it is doing, for a timeout's error."""
    ago = time.time() - float(rec.get("time", time.time()))
    now = rec.get("at") or {}
    if rec["state"] == "waiting":
        return f"waiting at {now.get('what')} {now.get('fp')} for {ago:.0f} s"
    if rec["state"] == "failed":
        return f"gave up on {now.get('what')} {now.get('fp')} {ago:.0f} s ago"
    if rec["state"] == "collective":
        return f"in {now.get('what')} (group {now.get('fp')}) for {ago:.0f} s"
    return f"running (its last agreement {ago:.0f} s ago)"


def _timed_out(store, rank: int, at: dict, missing: dict[int, str], timeout_s: float,
               hint: str) -> StoreTimeout:
    lines = []
    for peer in missing:
        rec = read_record(store, peer)
        if rec is None:
            lines.append(f"rank {peer} has published nothing (it never reached a ccfx "
                         "agreement: it died, hangs, or has not compiled yet)")
            continue
        recent = ", ".join(f"{r['what']} {r['fp']}" for r in rec.get("recent", [])) or "none"
        compiled = f"; {rec['compiled']}" if rec.get("compiled") else ""
        lines.append(f"rank {peer} is {_peer_state(rec)}; its latest agreements: "
                     f"{recent}{compiled}")
    return StoreTimeout(
        f"rank {rank}: {at['what']} (fingerprint {at['fp']}): ranks {sorted(missing)} did not "
        f"reach it within {timeout_s:g} s: " + "; ".join(lines) + ". They died, hang, or "
        f"compiled a different model or options. {hint}".rstrip())
