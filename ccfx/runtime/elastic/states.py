"""Where a fault-tolerant replica stands towards its quorum, and the one place it changes.

A replica is made (``JOINING``), goes through a meet at the quorum's inner step (``IN_STEP``),
and falls out of step when a heal or a spare's new place leaves its step count stale
(``CATCHING_UP``: it takes the peers' step at the next meet and syncs when they do) or while a
lazy heal's tensors are still coming (``HEALING``: nothing of its own to send, the committed
averages kept for after). :meth:`StateMachine._become` is the only writer of the state: it
checks the transition against :data:`TRANSITIONS`, logs it and sets it.

Not states, on purpose: whether a replica is a hot spare is which training place it holds
(``slot``, data every member computes from the meet), and a spare may be healing or catching up
like any replica; ``_healed``, ``_unhealed`` and ``_refused`` say what this sync's quorum did
and are reset at every sync's start (per-sync scratch); a lighthouse outage is a clock
(``_outage_since``, :mod:`.failures`), not a standing: a replica in any state skips its syncs
while the lighthouse is away and keeps its state through them.
"""

from __future__ import annotations

import enum
import logging

from ... import _torch_compat as tc

log = logging.getLogger("ccfx")


class State(enum.Enum):
    """A replica's standing (the meet reports it: 0 in step, 1 catching up, 2 healing)."""

    JOINING = "joining"  # made; not yet through a meet
    IN_STEP = "in step"  # at the quorum's inner step: syncs at its own count of steps
    CATCHING_UP = "catching up"  # its step is stale: takes the peers' at the next meet
    HEALING = "healing"  # a lazy heal's tensors are still coming (``_pending``)
    CLOSED = "closed"  # shut down: its manager stopped


#: The legal moves out of each state; staying in a state is always legal (and does nothing).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.JOINING: frozenset({State.IN_STEP, State.CATCHING_UP, State.HEALING, State.CLOSED}),
    State.IN_STEP: frozenset({State.CATCHING_UP, State.HEALING, State.CLOSED}),
    State.CATCHING_UP: frozenset({State.IN_STEP, State.HEALING, State.CLOSED}),
    State.HEALING: frozenset({State.CATCHING_UP, State.IN_STEP, State.CLOSED}),
    State.CLOSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A replica was asked to move between two states it never moves between (a bug)."""


class StateMachine:
    """The state of one replica (mixed into :class:`~ccfx.runtime.elastic.Elastic`)."""

    _state = State.JOINING  # (a class default: tests build replicas without __init__)

    @property
    def state(self) -> State:
        return self._state

    def _become(self, new: State, why: str) -> None:
        """Move to ``new`` (``why``: the reason, for the log); an :class:`IllegalTransition`
        naming both states where :data:`TRANSITIONS` does not allow it."""
        old = self._state
        if new is old:
            return
        if new not in TRANSITIONS[old]:
            allowed = ", ".join(s.name for s in State if s in TRANSITIONS[old]) or "none"
            raise IllegalTransition(f"a fault-tolerant replica cannot go from {old.name} to "
                                    f"{new.name} ({why}); from {old.name} it may go to: "
                                    f"{allowed}")
        manager = getattr(self, "manager", None)
        log.debug("ccfx: replica %s: %s -> %s (%s)",
                  "?" if manager is None else tc.torchft_replica_id(manager), old.name,
                  new.name, why)
        self._state = new

    @property
    def catching_up(self) -> bool:
        """Whether it syncs at its peers' next sync rather than its own (``CATCHING_UP``);
        setting it is a transition (to ``CATCHING_UP``, or back in step)."""
        return self._state is State.CATCHING_UP

    @catching_up.setter
    def catching_up(self, value: bool) -> None:
        self._become(State.CATCHING_UP if value else State.IN_STEP, "set")

    def _stale(self, why: str) -> None:
        """Its inner step is not the quorum's: take the peers' at the next meet (a healing
        replica already does)."""
        if self._state is not State.HEALING:
            self._become(State.CATCHING_UP, why)
