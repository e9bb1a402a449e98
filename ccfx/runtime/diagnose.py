"""Which rank is slow, which link is slow: a diagnosis from communication timings (after C4,
Alibaba 2024), for ``ccfx.diagnose``.

What is recorded: each rank's DDP comm hook times its own bucket exchanges
(:mod:`ccfx.runtime.timings`): per step, the seconds it spent from "bucket ready" to "average
back", summed over the step's buckets, for the last 64 steps. What is exchanged: only when asked
(or every ``n`` steps, :func:`diagnose_every`), each rank publishes that fixed-size summary in
the c10d store and reads its peers' (:func:`_gather`, bounded by ``timeout_s``); with
``links=True`` the ranks first time every directed link with a small message
(:mod:`ccfx.runtime.link_probe`). No process-group collective is spent on the exchange.

The rule for ranks. A collective ends at about the same moment on every rank (when the last
payload lands), so a rank's wait is the time from its own arrival to that common end: a rank
that comes ``X`` late waits ``X`` less than its peers. Its lateness in a step is the median of
its on-time peers' waits minus its own (its arrival against theirs; "on time": not found late
against all its peers first), computed from durations alone: ranks on different hosts need no
common clock. A rank is **slow** when that lateness is at least ``min_late_s`` in at least
``share`` of the steps and in the median step; its peers then wait about that long for it at
every step (``peers_wait_s``).

The rule for links. Each receiver times a link's bulk from its header's arrival (the sender's
lateness is left out, reported as ``skew_s``). A link is **slow** when its transfer takes at
least ``factor`` times the lower quartile of the other links' and ``min_extra_s`` more (not
their median: every link of one rank is 4 of the 6 links of three ranks). When every link
of one rank is slow, the report says so: that rank's own network.

Limits. Gloo's all-gather and all-reduce hide their hops, so a slow link slows every rank's
exchanges alike: it shows in the timings as longer waits with no late rank, and only the probe
names it. With two ranks the lateness is the difference of the two waits, and a late rank is
told from an early one only by the sign: the one that waits less came last. Ranks late in
turns (each in a few steps) fall under ``share`` and none is named. On CUDA (NCCL) the hook's exchange is
queued on a stream and its wall time is not the collective's: the timings are CPU (gloo) ones.
Compiled ``data_parallel=True`` runs its collectives inside the compiled backward and is not
timed.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from ..errors import CollectiveError, ConfigError
from ..wire.world import dist as _dist
from ..wire.world import store as _store
from ..wire.world import world_ranks
from .comm_hook import CommHookState, hook_state_of
from .timings import Timeline, timeline_of

#: Seconds late a rank must be, per step, to be called slow (by default).
MIN_LATE_S = 0.01
#: Share of the steps in which it must be that late.
SHARE = 0.75
#: A link is slow at this many times the lower quartile of the other links' transfers (and
#: MIN_EXTRA_S more).
FACTOR = 3.0
MIN_EXTRA_S = 0.005


@dataclass
class RankTiming:
    """One rank over the steps every rank recorded: the median of its wait per step, of its
    lateness per step (its arrival against the median of its peers', see the module
    docstring), of its peers' median wait, and in how many steps it was ``min_late_s`` late."""

    rank: int
    steps: int
    wait_s: float
    late_s: float
    peers_wait_s: float
    late_steps: int
    slow: bool = False


@dataclass
class LinkTiming:
    """One directed link as its receiver timed it: ``nbytes`` took ``transfer_s`` from the
    header's arrival; the header came ``skew_s`` after the receiver was ready."""

    src: int
    dst: int
    nbytes: int
    skew_s: float
    transfer_s: float
    slow: bool = False

    @property
    def mbit_s(self) -> float:
        return self.nbytes * 8 / 1e6 / self.transfer_s if self.transfer_s > 0 else float("inf")


@dataclass
class Diagnosis:
    """What :func:`diagnose` found: every rank's timing, every link's when probed, and the
    slow ones (``slow_ranks``, ``slow_links`` as ``(src, dst)`` global ranks)."""

    ranks: list[RankTiming]
    links: list[LinkTiming] = field(default_factory=list)
    min_late_s: float = MIN_LATE_S
    what: str = "the DDP comm hook's exchanges"

    @property
    def slow_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks if r.slow]

    @property
    def slow_links(self) -> list[tuple[int, int]]:
        return [(li.src, li.dst) for li in self.links if li.slow]

    def __str__(self) -> str:
        return "\n".join(_rank_lines(self) + _link_lines(self))


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) >= 1e-3 else f"{s * 1e3:.2f} ms"


def _rank_lines(d: Diagnosis) -> list[str]:
    steps = d.ranks[0].steps if d.ranks else 0
    lines = [f"ccfx diagnose: {len(d.ranks)} rank(s), {steps} step(s) of {d.what}"]
    if not steps:
        return lines
    lines.append(f"  {'rank':>4} {'wait/step':>10} {'late/step':>10} {'late in':>8}")
    for r in d.ranks:
        mark = "  <- slow" if r.slow else ""
        lines.append(f"  {r.rank:>4} {_ms(r.wait_s):>10} {_ms(r.late_s):>10} "
                     f"{r.late_steps:>4}/{r.steps:<3}{mark}")
    for r in d.ranks:
        if r.slow:
            lines.append(f"  slow rank {r.rank}: it arrives {_ms(r.late_s)} late at its "
                         f"exchanges (median step; {r.late_steps} of {r.steps} steps) and its "
                         f"peers wait {_ms(r.peers_wait_s)} a step: its compute (or its input) "
                         "is slow, not its network")
    if not d.slow_ranks:
        lines.append(f"  no rank is late by {_ms(d.min_late_s)} or more in most steps")
    return lines


def _link_lines(d: Diagnosis) -> list[str]:
    if not d.links:
        return []
    lines = [f"  links ({d.links[0].nbytes} bytes each, as the receiver timed them):",
             f"  {'link':>6} {'transfer':>10} {'Mbit/s':>8} {'skew':>9}"]
    for li in d.links:
        mark = "  <- slow" if li.slow else ""
        # under a millisecond the bulk is mostly in before the header is seen: no rate
        rate = f"{li.mbit_s:>8.0f}" if li.transfer_s >= 1e-3 else f"{'fast':>8}"
        lines.append(f"  {li.src:>2}->{li.dst:<2} {_ms(li.transfer_s):>10} {rate} "
                     f"{_ms(li.skew_s):>9}{mark}")
    lines += [f"  slow link {li.src}->{li.dst}: {_ms(li.transfer_s)} for {li.nbytes} bytes "
              f"({li.mbit_s:.0f} Mbit/s) while its sender came {_ms(li.skew_s)} late"
              for li in d.links if li.slow]
    for rank in sorted({r for li in d.links for r in (li.src, li.dst)}):
        own = [li for li in d.links if rank in (li.src, li.dst)]
        if len(d.links) > len(own) and all(li.slow for li in own):
            lines.append(f"  every link of rank {rank} is slow: its own network (NIC, cable, "
                         "switch port)")
    if not d.slow_links:
        lines.append("  no link is slow")
    return lines


# -- the rules -----------------------------------------------------------------------------------


def _rank_timing(summaries: dict, common: list[str], rank: int, peers: list[int],
                 min_late_s: float, share: float) -> RankTiming:
    """``rank``'s timing, its lateness against the median wait of ``peers`` each step."""
    if not common:
        return RankTiming(rank, 0, 0.0, 0.0, 0.0, 0)
    waits, lates, theirs = [], [], []
    for step in common:
        mine = summaries[rank][step][0]
        others = statistics.median(summaries[q][step][0] for q in peers) if peers else mine
        waits.append(mine)
        lates.append(others - mine)
        theirs.append(others)
    late = statistics.median(lates)
    n_late = sum(x >= min_late_s for x in lates)
    return RankTiming(rank, len(common), statistics.median(waits), late,
                      statistics.median(theirs), n_late,
                      slow=late >= min_late_s and n_late >= share * len(common))


def rank_timings(summaries: dict[int, dict[str, list[float]]], min_late_s: float = MIN_LATE_S,
                 share: float = SHARE) -> list[RankTiming]:
    """Each rank's :class:`RankTiming` from every rank's :meth:`Timeline.summary`, over the
    steps all of them recorded (see the module docstring for the rule). Two passes: each rank
    against all its peers, then against its peers that the first pass found on time (so an
    on-time rank is not measured against a late one, and two late ranks are measured against
    the on-time ones)."""
    common = sorted(set.intersection(*(set(s) for s in summaries.values())), key=int) \
        if summaries else []
    ranks = sorted(summaries)

    def timings(on_time: set[int]) -> list[RankTiming]:
        return [_rank_timing(summaries, common, r, [q for q in ranks if q != r and q in on_time]
                             or [q for q in ranks if q != r], min_late_s, share) for r in ranks]

    first = timings(set(ranks))
    return timings({t.rank for t in first if not t.slow})


def link_timings(incoming: dict[int, dict[int, tuple[float, float]]], nbytes: int,
                 factor: float = FACTOR, min_extra_s: float = MIN_EXTRA_S) -> list[LinkTiming]:
    """Every directed link's :class:`LinkTiming` from each receiver's probe (receiver ->
    sender -> (skew_s, transfer_s)); slow against the lower quartile of the *other* links'
    transfers (one rank's links are half of a small group's: a median would be one of them)."""
    links = [LinkTiming(src, dst, nbytes, skew, transfer)
             for dst, row in sorted(incoming.items()) for src, (skew, transfer) in sorted(
                 row.items())]
    for li in links:
        others = sorted(o.transfer_s for o in links if o is not li)
        if others:
            base = others[len(others) // 4]
            li.slow = li.transfer_s >= max(factor * base, base + min_extra_s)
    return links


# -- the exchange --------------------------------------------------------------------------------


def _gather(tag: str, ranks: tuple[int, ...], mine: dict, timeout_s: float) -> dict[int, dict]:
    """Every rank's ``mine`` through the c10d store, under ``ccfx/diagnose/<tag>``: a small
    all-gather that spends no process-group collective; a rank that does not publish within
    ``timeout_s`` is a :class:`CollectiveError` naming it."""
    dist = _dist()
    if dist is None or len(ranks) < 2:
        return {ranks[0]: mine}
    store, me = _store(), dist.get_rank()
    keys = {r: f"ccfx/diagnose/{tag}/{r}" for r in ranks}
    store.set(keys[me], json.dumps(mine).encode())
    try:
        store.wait(list(keys.values()), timedelta(seconds=timeout_s))
    except RuntimeError as e:
        missing = [r for r, k in keys.items() if not store.check([k])]
        raise CollectiveError(
            f"rank {me}: ccfx.diagnose waited {timeout_s:g} s for ranks {missing}'s timings: "
            "every rank of the group must call ccfx.diagnose at the same point of its loop "
            f"(they died, hang, or do not call it) ({str(e).splitlines()[0]})") from e
    return {r: json.loads(store.get(k).decode()) for r, k in keys.items()}


#: Diagnoses run so far, per group (its global ranks): the round a diagnosis publishes under.
#: Every rank of a group runs the same diagnoses in the same order, so the counts agree.
_ROUNDS: dict[tuple[int, ...], int] = {}


def _exchange(ranks: tuple[int, ...], mine: dict, timeout_s: float) -> dict[int, dict]:
    """:func:`_gather` under this group's next round; this rank's key of the round before the
    last is deleted (every peer has read it: it has published the last one)."""
    n = _ROUNDS[ranks] = _ROUNDS.get(ranks, 0) + 1
    group = "-".join(map(str, ranks))
    got = _gather(f"{group}/{n}", ranks, mine, timeout_s)
    dist = _dist()
    if dist is not None and n > 2:
        try:
            _store().delete_key(f"ccfx/diagnose/{group}/{n - 2}/{dist.get_rank()}")
        except (RuntimeError, AttributeError):
            pass  # a store without deletion keeps a few hundred bytes per round
    return got


def _resolve(target) -> CommHookState | None:
    if target is None:
        return None
    state = hook_state_of(target)
    from .delayed import DelayedHookState

    if isinstance(state, DelayedHookState):
        raise ConfigError(
            "ccfx.diagnose: ccfx.delayed_comm_hook's exchanges are waited for a step later, "
            "so their waits do not say which rank came late; diagnose with ccfx.ddp_comm_hook, "
            "or pass None with links=True to probe the links only")
    if state is None:
        raise ConfigError(
            f"ccfx.diagnose({type(target).__name__}): it reads the timings of ccfx's DDP comm "
            "hook: give the DDP model that ccfx.ddp_comm_hook's hook is registered on (or the "
            "hook's state), or None with links=True to probe the links only. Compiled "
            "data_parallel=True models run their collectives inside the compiled backward and "
            "are not timed yet: use the comm hook to diagnose")
    return state


def _check(probe_bytes: int = 1 << 20, repeats: int = 3, timeout_s: float = 60.0,
           min_late_s: float = MIN_LATE_S) -> None:
    for name, v, e in (("probe_bytes", probe_bytes, "bytes (e.g. 1 << 20)"),
                       ("repeats", repeats, "number of probes per link (e.g. 3)")):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name}={v!r}: give a positive {e}")
    for name, v in (("timeout_s", timeout_s), ("min_late_s", min_late_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"{name}={v!r}: give seconds, a positive number")


def diagnose(target=None, *, links: bool = False, probe_bytes: int = 1 << 20,
             repeats: int = 3, timeout_s: float = 60.0,
             min_late_s: float = MIN_LATE_S) -> Diagnosis:
    """Which rank is slow and (``links=True``) which link is slow, over the group of ``target``
    (a DDP model with ccfx's comm hook, or its state; None: the links of the default group).
    Every rank of the group calls it at the same point. See the module docstring."""
    _check(probe_bytes, repeats, timeout_s, min_late_s)
    state = _resolve(target)
    if state is None and not links:
        raise ConfigError("ccfx.diagnose(None): give the DDP model with ccfx's comm hook, or "
                          "links=True to probe the links of the default group")
    group = state.process_group if state is not None else None
    line = timeline_of(state) if state is not None else Timeline()
    if state is not None and not line.steps:
        raise ConfigError("ccfx.diagnose: no exchange of the comm hook timed yet: call it "
                          "after at least one backward (every rank, at the same step)")
    ranks = world_ranks(group)
    incoming = {}
    if links and _dist() is not None and len(ranks) > 1:
        from .link_probe import probe_links

        incoming = probe_links(group, probe_bytes, repeats, timeout_s)
    got = _exchange(ranks, {"steps": line.summary(),
                            "links": {str(s): v for s, v in incoming.items()}}, timeout_s)
    timings = rank_timings({r: g["steps"] for r, g in got.items()}, min_late_s)
    probed = {r: {int(s): tuple(v) for s, v in g["links"].items()} for r, g in got.items()}
    return Diagnosis(timings, link_timings(probed, probe_bytes) if links else [], min_late_s,
                     "the DDP comm hook's exchanges" if state is not None
                     else "exchanges (none timed: the links only)")


def diagnose_every(target, steps: int, on_report: Callable[[Diagnosis], None] | None = None,
                   **options) -> None:
    """Diagnose ``target`` (a DDP model with ccfx's comm hook) every ``steps`` steps, at the
    end of the step's last bucket, and hand each :class:`Diagnosis` to ``on_report`` (default:
    the ``ccfx`` logger, a warning when something is slow); ``steps=0`` stops it. ``options``
    are :func:`diagnose`'s, but not ``links`` (a probe inside the backward would delay it)."""
    state = _resolve(target)
    if state is None:
        raise ConfigError("ccfx.diagnose_every(None, ...): give the DDP model with ccfx's comm "
                          "hook")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"steps={steps!r}: give a number of steps, 0 to stop")
    if "links" in options:
        raise ConfigError("ccfx.diagnose_every: links=True is for ccfx.diagnose, on request "
                          "(the probe would run inside the backward)")
    known = {"timeout_s", "min_late_s"}
    if set(options) - known:
        raise ConfigError(f"ccfx.diagnose_every: unknown options {sorted(set(options) - known)}"
                          f"; it takes {sorted(known)}")
    _check(**options)  # here, not at the first period inside a backward
    report = on_report or _log
    line = timeline_of(state)
    line.every = steps
    line.on_period = (lambda: report(diagnose(state, **options))) if steps else None


def _log(d: Diagnosis) -> None:
    log = logging.getLogger("ccfx")
    (log.warning if d.slow_ranks else log.info)("%s", d)
