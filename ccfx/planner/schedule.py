"""One pipeline step, simulated the way torch's schedules run it on gloo.

Each rank runs a *program* (:mod:`ccfx.wire.schedules`): the calls
``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B`` make, in their
order, reduced to ``Compute``, ``Post`` and ``Wait`` instructions. The ``Link`` is
:class:`ccfx.wire.link.Link`.

A message occupies its link for ``latency + bytes / bandwidth`` from the moment it is posted
(``Link.rendezvous``: from the moment both ends have posted it); messages on one link go one
after the other in the order they became ready. A send's work completes as soon as the
transport has the bytes (``Link.buffered_sends``: TCP's socket buffers, what gloo does), a
receive's when the last byte is in. These two defaults are the ones that reproduce the
measured 1F1B steps of bench/pipeline.py on the shaped loopback (1.705 s predicted against
1.684 s measured for mlp4 at 10 Mbit/s; with rendezvous and blocking sends the simulator
predicted 1.92 s). A ``Link`` is one direction of one pair of ranks, or, with
``shared=True``, a single medium every byte crosses (the shaped loopback of bench/shaped.py:
one token bucket on ``lo`` for every rank and both directions). :func:`simulate` takes one
link for every hop, or a link per hop (``links[s]`` joins stages s and s+1, both directions:
a cluster's links, :mod:`ccfx.planner.links`); hops whose links are equal and ``shared`` go
on one medium, and each message follows its own link's transport (``rendezvous``,
``buffered_sends``).

What comes out (:class:`Timeline`) is the step time, each rank's compute and waiting time, and
for every message when it was ready, sent and waited for: a message is *exposed* when some
rank sat waiting for it, *hidden* when it arrived while its receiver was computing. That is the
critical-path reasoning Optimus-CC applies by hand (the 1F1B cool-down's backward sends are
exposed; most steady-state sends hide), computed for the actual schedule.
"""

from __future__ import annotations

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
    programs = [PROGRAMS[schedule](s, n, microbatches, stages[s]) for s in range(n)]
    return _run(programs, nbytes, links)


def _run(programs: list[list[Instruction]], nbytes: Callable[[Message], int],
         links: Sequence[Link]) -> Timeline:
    n = len(programs)
    clock = [0.0] * n
    pc = [0] * n
    compute = [0.0] * n
    waited = [0.0] * n
    posted: dict[Message, dict[int, float]] = {}
    times: dict[Message, MessageTime] = {}
    link_free: dict[object, float] = {}
    pending: list[tuple[float, int, Message]] = []  # ready messages not yet on a link
    queued: set[Message] = set()
    order = 0

    def schedule_ready(upto: float) -> None:
        # Messages go on their link in the order they became ready, up to time ``upto``
        # (no rank can post anything earlier than the earliest clock still running).
        while pending and pending[0][0] <= upto:
            ready, _, msg = heapq.heappop(pending)
            link = links[msg.hop]
            key = ("medium", link) if link.shared else (msg.src, msg.dst)
            start = max(ready, link_free.get(key, 0.0))
            size = nbytes(msg)
            done = start + link.seconds(size)
            link_free[key] = done
            times[msg] = MessageTime(msg, size, ready, start, done)

    while True:
        runnable = [r for r in range(n) if pc[r] < len(programs[r])]
        if not runnable:
            break
        progressed = False
        for r in sorted(runnable, key=lambda r: clock[r]):
            ins = programs[r][pc[r]]
            if isinstance(ins, Compute):
                clock[r] += ins.seconds
                compute[r] += ins.seconds
            elif isinstance(ins, Post):
                for msg in ins.messages:
                    ends = posted.setdefault(msg, {})
                    ends[r] = clock[r]
                    sent = len(ends) == 2 or (not links[msg.hop].rendezvous and r == msg.src)
                    if sent and msg not in queued:
                        queued.add(msg)
                        heapq.heappush(pending, (max(ends.values()), order, msg))
                        order += 1
            else:
                schedule_ready(clock[r])
                if any(m not in times for m in ins.messages):
                    continue  # blocked: a peer has not posted yet, or its link is busy earlier
                def finished(m: Message, r: int = r) -> float:
                    # a buffered send is done once handed to the transport; a receive once
                    # the bytes are in
                    t = times[m]
                    buffered = links[m.hop].buffered_sends
                    return t.ready_s if buffered and r == m.src else t.done_s

                done = max((finished(m) for m in ins.messages), default=clock[r])
                if done > clock[r]:
                    worst = max(ins.messages, key=finished)
                    # the wait before the message was sent is the pipeline's (its sender was
                    # still computing); after, the link's
                    times[worst].waited_s += done - max(clock[r], times[worst].ready_s)
                    waited[r] += done - clock[r]
                    clock[r] = done
            pc[r] += 1
            progressed = True
            break
        if not progressed:
            # every runnable rank waits: put the earliest ready message on its link
            if not pending:
                stuck = {r: programs[r][pc[r]] for r in runnable}
                raise RuntimeError(f"the simulated schedule deadlocks: {stuck}")
            schedule_ready(pending[0][0])
    return Timeline(max(clock), compute, waited,
                    sorted(times.values(), key=lambda t: t.start_s), list(clock))
