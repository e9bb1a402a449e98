"""One pipeline step, simulated the way torch's schedules run it on gloo.

Each rank runs a *program*: the calls ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and
``Schedule1F1B`` make, in their order, reduced to three instructions:

* ``Compute(seconds, label)``: a forward or backward chunk, with the codec's decode of what
  arrived before it and the encode of what leaves after it (both run on the rank's own cores);
* ``Post(messages)``: isend / irecv posted (``batch_isend_irecv``);
* ``Wait(messages)``: the schedule waits for those works.

A message occupies its link for ``latency + bytes / bandwidth`` from the moment it is posted
(``Link.rendezvous``: from the moment both ends have posted it); messages on one link go one
after the other in the order they became ready. A send's work completes as soon as the
transport has the bytes (``Link.buffered_sends``: TCP's socket buffers, what gloo does), a
receive's when the last byte is in. These two defaults are the ones that reproduce the
measured 1F1B steps of bench/pipeline.py on the shaped loopback (1.705 s predicted against
1.684 s measured for mlp4 at 10 Mbit/s; with rendezvous and blocking sends the simulator
predicted 1.92 s). A ``Link`` is one direction of one pair of ranks, or, with
``shared=True``, a single medium every byte crosses (the shaped loopback of bench/shaped.py:
one token bucket on ``lo`` for every rank and both directions).

What comes out (:class:`Timeline`) is the step time, each rank's compute and waiting time, and
for every message when it was ready, sent and waited for: a message is *exposed* when some
rank sat waiting for it, *hidden* when it arrived while its receiver was computing. That is the
critical-path reasoning Optimus-CC applies by hand (the 1F1B cool-down's backward sends are
exposed; most steady-state sends hide), computed for the actual schedule.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

SCHEDULES = ("1F1B", "GPipe")


@dataclass(frozen=True)
class Message:
    """One tensor crossing one hop for one microbatch. ``kind`` is "fwd" (activation, stage
    s → s+1) or "bwd" (its gradient, s+1 → s); ``hop`` is the sender's stage for "fwd" and the
    receiver's for "bwd", i.e. the hop (hop, hop+1)."""

    kind: str
    hop: int
    microbatch: int

    @property
    def src(self) -> int:
        return self.hop if self.kind == "fwd" else self.hop + 1

    @property
    def dst(self) -> int:
        return self.hop + 1 if self.kind == "fwd" else self.hop


@dataclass(frozen=True)
class Compute:
    seconds: float
    label: str


@dataclass(frozen=True)
class Post:
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class Wait:
    messages: tuple[Message, ...]


Instruction = Compute | Post | Wait


@dataclass(frozen=True)
class StageCost:
    """Seconds one stage spends per microbatch: its forward and backward (the loss with the
    last stage's forward), plus the codec work on its sends (encode) and receives (decode)."""

    forward_s: float
    backward_s: float
    encode_fwd_s: float = 0.0  # encoding what it sends forward (stage → stage+1)
    decode_fwd_s: float = 0.0  # decoding what it received forward
    encode_bwd_s: float = 0.0  # encoding the input gradient it sends back
    decode_bwd_s: float = 0.0  # decoding the output gradient it received
    #: the microbatches whose backward send / receive carries the codec (None: all; fewer
    #: under epilogue-only compression)
    encode_bwd_mbs: frozenset[int] | None = None
    decode_bwd_mbs: frozenset[int] | None = None


@dataclass(frozen=True)
class Link:
    """Bandwidth in Gbit/s and one-way latency in ms. ``shared``: every message of every rank
    crosses one medium (a single switch port, the shaped loopback), not a link per pair."""

    gbps: float
    latency_ms: float = 0.05
    shared: bool = False
    #: A message leaves only once its receiver has posted the receive (else: at the send).
    rendezvous: bool = False
    #: A send's work completes when the transport takes the bytes (socket buffers), not when
    #: they arrive: the sender goes on computing while the link drains.
    buffered_sends: bool = True

    def seconds(self, nbytes: float) -> float:
        return self.latency_ms * 1e-3 + nbytes * 8 / (self.gbps * 1e9)


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
# The programs: torch's _step_microbatches, instruction for instruction.


def _fwd_recv(s: int, mb: int) -> tuple[Message, ...]:
    return (Message("fwd", s - 1, mb),) if s > 0 else ()


def _fwd_send(s: int, mb: int, n: int) -> tuple[Message, ...]:
    return (Message("fwd", s, mb),) if s < n - 1 else ()


def _bwd_recv(s: int, mb: int, n: int) -> tuple[Message, ...]:
    return (Message("bwd", s, mb),) if s < n - 1 else ()


def _bwd_send(s: int, mb: int) -> tuple[Message, ...]:
    return (Message("bwd", s - 1, mb),) if s > 0 else ()


def _forward(s: int, mb: int, c: StageCost, n: int) -> Compute:
    seconds = c.forward_s + (c.decode_fwd_s if s > 0 else 0) + (c.encode_fwd_s if s < n - 1 else 0)
    return Compute(seconds, f"F{mb}")


def _backward(s: int, mb: int, c: StageCost, n: int) -> Compute:
    decodes = s < n - 1 and (c.decode_bwd_mbs is None or mb in c.decode_bwd_mbs)
    encodes = s > 0 and (c.encode_bwd_mbs is None or mb in c.encode_bwd_mbs)
    seconds = c.backward_s + (c.decode_bwd_s if decodes else 0) + (c.encode_bwd_s if encodes else 0)
    return Compute(seconds, f"B{mb}")


def gpipe_program(s: int, n: int, m: int, c: StageCost) -> list[Instruction]:
    """ScheduleGPipe: every forward (each send waited at the end), then every backward."""
    prog: list[Instruction] = []
    sends: list[Message] = []
    for mb in range(m):
        prog += [Post(_fwd_recv(s, mb)), Wait(_fwd_recv(s, mb)), _forward(s, mb, c, n),
                 Post(_fwd_send(s, mb, n))]
        sends += _fwd_send(s, mb, n)
    prog.append(Wait(tuple(sends)))
    sends = []
    for mb in range(m):
        prog += [Post(_bwd_recv(s, mb, n)), Wait(_bwd_recv(s, mb, n)), _backward(s, mb, c, n),
                 Post(_bwd_send(s, mb))]
        sends += _bwd_send(s, mb)
    prog.append(Wait(tuple(sends)))
    return prog


def one_f_one_b_program(s: int, n: int, m: int, c: StageCost) -> list[Instruction]:
    """Schedule1F1B as torch writes it: ``n - s`` warm-up forwards (the last one's send joins
    the first backward's receive), then one backward and one forward at a time, then the
    cool-down backwards, each send waited before the next is posted."""
    prog: list[Instruction] = []
    warmup = min(m, n - s)
    send_work: tuple[Message, ...] = ()
    fwd_sends: tuple[Message, ...] = ()
    fwd = bwd = 0
    for _ in range(warmup):
        prog += [Post(_fwd_recv(s, fwd)), Wait(_fwd_recv(s, fwd)), _forward(s, fwd, c, n),
                 Wait(send_work)]
        fwd_sends = _fwd_send(s, fwd, n)
        if fwd != warmup - 1:
            prog.append(Post(fwd_sends))
            send_work = fwd_sends
        fwd += 1
    while True:
        batch = fwd_sends + _bwd_recv(s, bwd, n)
        prog += [Post(batch), Wait(batch), _backward(s, bwd, c, n)]
        bwd_sends = _bwd_send(s, bwd)
        bwd += 1
        if fwd == m:
            break
        batch = bwd_sends + _fwd_recv(s, fwd)
        prog += [Post(batch), Wait(batch), _forward(s, fwd, c, n)]
        fwd_sends = _fwd_send(s, fwd, n)
        fwd += 1
    prog.append(Post(bwd_sends))
    send_work = bwd_sends
    while bwd < m:
        prog += [Post(_bwd_recv(s, bwd, n)), Wait(_bwd_recv(s, bwd, n)), _backward(s, bwd, c, n),
                 Wait(send_work)]
        send_work = _bwd_send(s, bwd)
        prog.append(Post(send_work))
        bwd += 1
    prog.append(Wait(send_work))
    return prog


PROGRAMS: dict[str, Callable[[int, int, int, StageCost], list[Instruction]]] = {
    "1F1B": one_f_one_b_program, "GPipe": gpipe_program}


@functools.cache
def epilogue_backwards(schedule: str, stage: int, num_stages: int,
                       microbatches: int) -> frozenset[int]:
    """The microbatches whose backward ``stage`` runs after its last forward under
    ``schedule``: the cool-down, where nothing overlaps the backward sends (Optimus-CC's
    epilogue-only compression compresses only these)."""
    labels = [i.label for i in PROGRAMS[schedule](stage, num_stages, microbatches,
                                                  StageCost(1.0, 1.0))
              if isinstance(i, Compute)]
    last_forward = max(k for k, label in enumerate(labels) if label.startswith("F"))
    return frozenset(int(label[1:]) for label in labels[last_forward + 1:])


# ---------------------------------------------------------------------------------------------
# The simulator.


def simulate(schedule: str, stages: Sequence[StageCost], microbatches: int,
             nbytes: Callable[[Message], int], link: Link) -> Timeline:
    """The step of ``schedule`` over ``len(stages)`` ranks (one stage each); ``nbytes(message)``
    is what crosses the wire for it (the codec payload)."""
    if schedule not in PROGRAMS:
        raise ValueError(f"schedule {schedule!r}: the planner simulates {', '.join(SCHEDULES)}")
    n = len(stages)
    programs = [PROGRAMS[schedule](s, n, microbatches, stages[s]) for s in range(n)]
    return _run(programs, nbytes, link)


def _run(programs: list[list[Instruction]], nbytes: Callable[[Message], int],
         link: Link) -> Timeline:
    rendezvous, buffered_sends = link.rendezvous, link.buffered_sends
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
            key = "medium" if link.shared else (msg.src, msg.dst)
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
                    sent = len(ends) == 2 or (not rendezvous and r == msg.src)
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
                    return t.ready_s if buffered_sends and r == m.src else t.done_s

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
