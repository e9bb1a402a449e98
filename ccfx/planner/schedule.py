"""One pipeline step, simulated the way torch's schedules run it on gloo.

Each rank runs a *program* (:mod:`ccfx.wire.schedules`): the calls
``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B`` make, in their
order, reduced to ``Compute``, ``Post`` and ``Wait`` instructions. The ``Link`` is
:class:`ccfx.wire.link.Link`.

A message occupies its link for ``latency + bytes / bandwidth`` from the moment it is posted
(``Link.rendezvous``: from the moment both ends have posted it); messages on one link go one
after the other in the order they became ready. A send's work completes as soon as the
transport has the bytes (``Link.buffered_sends``: TCP's socket buffers, what gloo does), a
receive's when the last byte is in. These two defaults are the ones that reproduce the measured
1F1B steps of bench/pipeline.py on the shaped loopback (1.705 s predicted for mlp4 at
10 Mbit/s; bench/RESULTS.md, Pipeline: 1.684 s). A ``Link`` is one direction of one pair of ranks,
or, with ``shared=True``, a single medium every byte crosses (the shaped loopback of
bench/shaped.py: one token bucket on ``lo`` for every rank and both directions).
:func:`simulate` takes one link for every hop, or a link per hop (``links[s]`` joins stages s
and s+1, both directions: a cluster's links, :mod:`ccfx.planner.links`); hops whose links are
equal and ``shared`` go on one medium, and each message follows its own link's transport
(``rendezvous``, ``buffered_sends``).

What comes out (:class:`Timeline`) is the step time, each rank's compute and waiting time, and
for every message when it was ready, sent and waited for: a message is *exposed* when some
rank sat waiting for it, *hidden* when it arrived while its receiver was computing. That is the
critical-path reasoning Optimus-CC applies by hand (the 1F1B cool-down's backward sends are
exposed; most steady-state sends hide), computed for the actual schedule.
"""

from __future__ import annotations

import bisect
import functools
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..wire.link import Link
from ..wire.schedules import (
    PROGRAMS,
    SCHEDULES,
    Compute,
    Instruction,
    Message,
    Post,
    StageCost,
)


@dataclass
class MessageTime:
    message: Message
    nbytes: int
    ready_s: float  # both ends posted
    start_s: float  # its link was free
    done_s: float
    waited_s: float = 0.0  # how long ranks sat in Wait for it after it was sent

    @property
    def exposed(self) -> bool:
        return self.waited_s > 1e-9


@dataclass
class Timeline:
    step_s: float
    compute_s: list[float]  # per rank
    wait_s: list[float]  # per rank: time blocked in Wait
    messages: list[MessageTime] = field(default_factory=list)
    end_s: list[float] = field(default_factory=list)  # per rank: when its program ends

    def exposed_s(self, kind: str | None = None) -> float:
        """Waiting caused by the link for messages (of ``kind``), summed over ranks: time a
        rank sat in a wait after the message had been sent (before, its sender was still
        computing: that is the pipeline's bubble, not the link's)."""
        return sum(m.waited_s for m in self.messages if kind in (None, m.message.kind))

    @property
    def bubble(self) -> float:
        """Fraction of rank-seconds not spent computing."""
        total = self.step_s * len(self.compute_s)
        return 1 - sum(self.compute_s) / total if total else 0.0


# ---------------------------------------------------------------------------------------------
# The simulator.


def hop_links(link: Link | Sequence[Link], num_stages: int) -> list[Link]:
    """One Link per hop (``num_stages - 1``): ``link`` for every hop, or the sequence checked."""
    if isinstance(link, Link):
        return [link] * max(num_stages - 1, 0)
    links = list(link)
    if len(links) != num_stages - 1 or not all(isinstance(x, Link) for x in links):
        raise ConfigError(f"a link per hop: {num_stages} stages need {num_stages - 1} Links "
                         f"(links[s] joins stages s and s+1), got {link!r}")
    return links


def simulate(schedule: str, stages: Sequence[StageCost], microbatches: int,
             nbytes: Callable[[Message], int], link: Link | Sequence[Link]) -> Timeline:
    """The step of ``schedule`` over ``len(stages)`` ranks (one stage each); ``nbytes(message)``
    is what crosses the wire for it (the codec payload); ``link``: one for every hop, or one
    per hop (``link[s]`` between stages s and s+1)."""
    if schedule not in PROGRAMS:
        raise ValueError(f"schedule {schedule!r}: the planner simulates {', '.join(SCHEDULES)}")
    n = len(stages)
    links = hop_links(link, n)
    programs = [_program(schedule, s, n, microbatches, stages[s]) for s in range(n)]
    return _run(programs, nbytes, links)


@functools.lru_cache(maxsize=4096)
def _program(schedule: str, stage: int, num_stages: int, microbatches: int,
             cost: StageCost) -> tuple[Instruction, ...]:
    """A rank's program, made once per (schedule, place, microbatches, cost): a search that
    changes one hop's codec changes the costs of the two stages beside it, and the other
    stages' programs are the ones simulated before (the simulation only reads them)."""
    return tuple(PROGRAMS[schedule](stage, num_stages, microbatches, cost))


def _run(programs: Sequence[Sequence[Instruction]], nbytes: Callable[[Message], int],
         links: Sequence[Link]) -> Timeline:
    """Run every rank's program: each step advances the runnable rank with the earliest
    clock that can move; where all wait, the earliest ready message goes on its link.

    The runnable ranks are kept sorted by (clock, rank). A rank whose wait failed is asked
    again only when asking could change something: every message it waits for is on a link
    now, or a message became ready by its clock (asking puts it on its link). Otherwise
    asking would fail and change nothing, so the order of events is the plain loop's."""
    sim = _Simulation(programs, nbytes, links)
    order = [(0.0, r) for r in range(len(programs)) if programs[r]]
    while order:
        for k, (clock, r) in enumerate(order):
            if sim.missing.get(r) and not (sim.pending and sim.pending[0][0] <= clock):
                continue
            if sim.advance(r):
                del order[k]
                if sim.pc[r] < len(programs[r]):
                    bisect.insort(order, (sim.clock[r], r))
                break
        else:  # every runnable rank waits: put the earliest ready message on its link
            if not sim.pending:
                stuck = {r: programs[r][sim.pc[r]] for _, r in order}
                raise RuntimeError(f"the simulated schedule deadlocks: {stuck}")
            sim.schedule_ready(sim.pending[0][0])
    return Timeline(max(sim.clock), sim.compute, sim.waited,
                    sorted(sim.times.values(), key=lambda t: t.start_s), list(sim.clock))


class _Simulation:
    """A simulated step in progress: each rank's clock, program counter, compute and wait;
    the messages posted, ready but not yet on a link (``pending``), and timed; when each link
    is free again."""

    def __init__(self, programs: Sequence[Sequence[Instruction]], nbytes: Callable[[Message], int],
                 links: Sequence[Link]):
        n = len(programs)
        self.programs, self.nbytes, self.links = programs, nbytes, links
        self.clock = [0.0] * n
        self.pc = [0] * n
        self.compute = [0.0] * n
        self.waited = [0.0] * n
        self.posted: dict[Message, dict[int, float]] = {}
        self.times: dict[Message, MessageTime] = {}
        self.link_free: dict[object, float] = {}
        self.pending: list[tuple[float, int, Message]] = []  # ready messages not yet on a link
        self.queued: set[Message] = set()
        self.order = 0
        #: a blocked rank -> how many of the messages it waits for are not on a link yet
        self.missing: dict[int, int] = {}
        #: a message not on a link yet -> the blocked ranks waiting for it
        self.waiters: dict[Message, set[int]] = {}

    def schedule_ready(self, upto: float) -> None:
        """Put messages on their link in the order they became ready, up to time ``upto``
        (no rank can post anything earlier than the earliest clock still running)."""
        while self.pending and self.pending[0][0] <= upto:
            ready, _, msg = heapq.heappop(self.pending)
            for r in self.waiters.pop(msg, ()):
                self.missing[r] -= 1
            link = self.links[msg.hop]
            key = ("medium", link) if link.shared else (msg.src, msg.dst)
            start = max(ready, self.link_free.get(key, 0.0))
            size = self.nbytes(msg)
            done = start + link.seconds(size)
            self.link_free[key] = done
            self.times[msg] = MessageTime(msg, size, ready, start, done)

    def advance(self, r: int) -> bool:
        """Run rank ``r``'s next instruction; False where it is a wait that cannot finish yet
        (a peer has not posted, or its link is busy earlier)."""
        ins = self.programs[r][self.pc[r]]
        if isinstance(ins, Compute):
            self.clock[r] += ins.seconds
            self.compute[r] += ins.seconds
        elif isinstance(ins, Post):
            self.post(r, ins.messages)
        else:
            self.schedule_ready(self.clock[r])
            untimed = [m for m in ins.messages if m not in self.times]
            if untimed:  # blocked: a peer has not posted yet, or its link is busy earlier
                self.missing[r] = len(untimed)
                for m in untimed:
                    self.waiters.setdefault(m, set()).add(r)
                return False
            self.missing.pop(r, None)
            self.wait(r, ins.messages)
        self.pc[r] += 1
        return True

    def post(self, r: int, messages) -> None:
        """Rank ``r`` posts ``messages``: each is ready once both ends posted it (a send that
        needs no rendezvous: once its sender did)."""
        for msg in messages:
            ends = self.posted.setdefault(msg, {})
            ends[r] = self.clock[r]
            sent = len(ends) == 2 or (not self.links[msg.hop].rendezvous and r == msg.src)
            if sent and msg not in self.queued:
                self.queued.add(msg)
                heapq.heappush(self.pending, (max(ends.values()), self.order, msg))
                self.order += 1

    def wait(self, r: int, messages) -> None:
        """Rank ``r`` waits for ``messages`` (all timed): its clock moves to the last one's
        end, the wait counted as the pipeline's before it was sent and the link's after."""
        def finished(m: Message) -> float:
            # a buffered send is done once handed to the transport; a receive once
            # the bytes are in
            t = self.times[m]
            buffered = self.links[m.hop].buffered_sends
            return t.ready_s if buffered and r == m.src else t.done_s

        clock = self.clock[r]
        done = max((finished(m) for m in messages), default=clock)
        if done > clock:
            worst = max(messages, key=finished)
            # the wait before the message was sent is the pipeline's (its sender was
            # still computing); after, the link's
            self.times[worst].waited_s += done - max(clock, self.times[worst].ready_s)
            self.waited[r] += done - clock
            self.clock[r] = done
