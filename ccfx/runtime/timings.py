"""When this rank entered and left each of its gradient exchanges: the record ``ccfx.diagnose``
reads (:mod:`ccfx.runtime.diagnose`).

The DDP comm hook notes every bucket exchange (:func:`note_exchange`): a monotonic clock read
when the bucket is ready to send and one when its average is back, two ``time.monotonic()``
calls and a few additions per bucket. A :class:`Timeline` keeps, per step, the sum of this
rank's waits in its exchanges and their count, for the last :data:`WINDOW` steps only: its
summary has a fixed size whatever the run's length. Nothing is sent anywhere until a
diagnosis asks (or a period set by :func:`ccfx.diagnose`'s ``every`` comes round).
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable

#: Steps a timeline remembers (the oldest are dropped first).
WINDOW = 64


class Timeline:
    """This rank's exchange timings of one DDP comm hook, per step (see the module docstring):
    ``steps[k] = [wait seconds summed over the step's exchanges, exchanges, first entry,
    last exit]`` (the two clocks are ``time.monotonic()``, comparable on one host only)."""

    def __init__(self):
        self.steps: OrderedDict[int, list[float]] = OrderedDict()
        #: a diagnosis every ``every`` steps (0: only when asked), handed to ``on_period``
        self.every = 0
        self.on_period: Callable[[], None] | None = None

    def note(self, step: int, entered: float, left: float) -> None:
        row = self.steps.get(step)
        if row is None:
            row = self.steps[step] = [0.0, 0, entered, left]
            while len(self.steps) > WINDOW:
                self.steps.popitem(last=False)
        row[0] += left - entered
        row[1] += 1
        row[3] = left

    def summary(self) -> dict[str, list[float]]:
        """The window as JSON-able data: ``{step: [wait_s, exchanges, entered, left]}``."""
        return {str(k): list(v) for k, v in self.steps.items()}


_TIMELINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def timeline_of(state) -> Timeline:
    """The timeline of a hook state (made at its first exchange)."""
    line = _TIMELINES.get(state)
    if line is None:
        line = _TIMELINES[state] = Timeline()
    return line


def now() -> float:
    """The clock the timings use (monotonic: it never jumps with the wall clock)."""
    return time.monotonic()


def note_exchange(state, step: int, entered: float, last: bool) -> None:
    """The hook's exchange of one bucket at ``step`` ran from ``entered`` until now; after the
    step's ``last`` bucket, a periodic diagnosis runs when one is due."""
    line = timeline_of(state)
    line.note(step, entered, now())
    if last and line.every and line.on_period is not None and (step + 1) % line.every == 0:
        line.on_period()
