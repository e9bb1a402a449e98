"""A fault-tolerant replica's standing is one state (:mod:`ccfx.runtime.elastic.states`) that
changes in one place: the legal moves succeed, an illegal one raises naming both states, and
the code's own moves (a heal, a stale spare, the meet) go where the sync expects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ccfx.runtime.elastic import TRANSITIONS, Elastic, IllegalTransition, State


def _replica(state: State = State.JOINING) -> Elastic:
    """An Elastic without torchft's manager: only its state."""
    replica = Elastic.__new__(Elastic)
    replica._state = state
    return replica


# sorted: a frozenset of enum members iterates in a per-process order, and xdist's workers
# must collect the same test ids
LEGAL = [(a, b) for a in State for b in State if b in TRANSITIONS[a]]
ILLEGAL = [(a, b) for a in State for b in State if a is not b and b not in TRANSITIONS[a]]


def test_a_new_replica_is_joining_and_every_state_but_closed_can_close():
    assert _replica().state is State.JOINING
    assert all(State.CLOSED in TRANSITIONS[s] for s in State if s is not State.CLOSED)
    assert TRANSITIONS[State.CLOSED] == frozenset()
    assert all(State.JOINING not in targets for targets in TRANSITIONS.values())


@pytest.mark.parametrize("old, new", LEGAL, ids=lambda s: s.name)
def test_legal_transitions_set_the_state(old, new):
    replica = _replica(old)
    replica._become(new, "test")
    assert replica.state is new


@pytest.mark.parametrize("old, new", ILLEGAL, ids=lambda s: s.name)
def test_an_illegal_transition_raises_naming_both_states_and_changes_nothing(old, new):
    replica = _replica(old)
    with pytest.raises(IllegalTransition, match=f"from {old.name} to {new.name}"):
        replica._become(new, "test")
    assert replica.state is old


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.name)
def test_staying_is_always_legal(state):
    replica = _replica(state)
    replica._become(state, "test")
    assert replica.state is state


def test_catching_up_is_the_state_and_setting_it_is_a_transition():
    replica = _replica(State.IN_STEP)
    assert not replica.catching_up
    replica.catching_up = True
    assert replica.state is State.CATCHING_UP and replica.catching_up
    replica.catching_up = False
    assert replica.state is State.IN_STEP


def test_a_stale_step_marks_a_replica_catching_up_unless_it_is_healing():
    replica = _replica(State.IN_STEP)
    replica._stale("test")
    assert replica.state is State.CATCHING_UP
    healing = _replica(State.HEALING)
    healing._stale("test")
    assert healing.state is State.HEALING


def _at_the_meet(state: State, step: int) -> Elastic:
    replica = _replica(state)
    frags = [SimpleNamespace(offset=0, index=0), SimpleNamespace(offset=1, index=1)]
    replica.outer = SimpleNamespace(step=step, sync_every=2, fragments=frags)
    replica._catch_up_at = 1.0
    return replica


@pytest.mark.parametrize("state, after", [
    (State.JOINING, State.IN_STEP), (State.IN_STEP, State.IN_STEP),
    (State.CATCHING_UP, State.IN_STEP), (State.HEALING, State.HEALING),
], ids=lambda s: s.name)
def test_the_meet_puts_a_replica_in_step_unless_its_heal_is_still_coming(state, after):
    """A replica that is behind (catching up or healing) takes the quorum's step and its due
    fragments; only the one whose heal's tensors are still coming stays out of step."""
    replica = _at_the_meet(state, step=3)
    rows = [(5, 4, 0, 1, 0), (0, 3, 0, 1, 1)]
    due = replica._adopt_step(rows, [])
    assert replica.state is after and replica._catch_up_at is None
    if state in (State.CATCHING_UP, State.HEALING):
        assert replica.outer.step == 4 and [f.index for f in due] == [0]


def test_a_lazy_heal_is_healing_until_its_source_turns_out_to_be_healing():
    """A lazy heal's fetch is the HEALING state's data: a newer heal supersedes it, and a
    source that was itself healing drops it (the replica catches up, then heals again)."""

    class Fetch:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    replica = _replica(State.IN_STEP)
    first, second = Fetch(), Fetch()
    replica._start_fetch(first)
    assert replica.state is State.HEALING and replica._pending is first
    replica._start_fetch(second)
    assert first.cancelled and replica._pending is second and replica.state is State.HEALING
    replica._drop_fetch()
    assert second.cancelled and replica._pending is None
    assert replica.state is State.CATCHING_UP


def test_closed_is_final():
    replica = _replica(State.IN_STEP)
    replica._become(State.CLOSED, "test")
    with pytest.raises(IllegalTransition, match="may go to: none"):
        replica._become(State.IN_STEP, "test")
