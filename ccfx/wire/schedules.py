"""torch's pipeline schedules as programs: the calls ``torch.distributed.pipelining``'s
``ScheduleGPipe`` and ``Schedule1F1B`` make on each rank, in their order, reduced to three
instructions:

* ``Compute(seconds, label)``: a forward or backward chunk, with the codec's decode of what
  arrived before it and the encode of what leaves after it (both run on the rank's own cores);
* ``Post(messages)``: isend / irecv posted (``batch_isend_irecv``);
* ``Wait(messages)``: the schedule waits for those works.

Two readers: the runtime's pipeline stages (:func:`epilogue_backwards`: which backward sends
Optimus-CC's epilogue-only compression compresses, derived from the program on both ends of a
hop) and the planner's simulator (:func:`ccfx.planner.schedule.simulate`), which runs the
programs over a link.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

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
