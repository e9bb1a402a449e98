"""Heals: what a replica serves a healing peer, and how it takes a heal itself, at once in the
quorum or lazily (the tensors fetched after the exchange, the averages committed meanwhile
merged once they are here)."""

from __future__ import annotations

import logging
import time

import torch

from ..heal import Pending
from .states import State

log = logging.getLogger("ccfx")


def _cloned(state):
    """``state`` with its tensors cloned (an optimizer's ``state_dict()`` holds its live
    buffers, which the next outer step changes in place while a heal may still be reading)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cloned(v) for v in state)
    return state


def _is_residual(name: str) -> bool:
    """A codec state tensor that is this replica's own (error feedback's residuals): zeroed
    on a heal, never taken from a peer."""
    return name.rsplit(".", 1)[-1].startswith("residual")


class Healing:
    """The heals' side of :class:`~ccfx.runtime.elastic.Elastic` (a mixin). ``HEALING`` holds
    exactly while ``_pending`` holds a lazy heal's fetch."""

    _pending: Pending | None = None  # HEALING: the lazy heal's tensors, until _finish_heal
    _replay: list | tuple = ()  # the averages of the syncs committed while HEALING

    def _recovery_state(self) -> dict:
        """What a healing peer takes from this replica (clones: served while we go on). A
        replica whose own heal is still fetching has no state to give (torchft may pick it: it
        is at the quorum's step): it says so, and the peer heals at the next quorum."""
        outer = self.outer
        if self._pending is not None:
            return {"fingerprint": self.fingerprint, "unavailable": True}
        return {"fingerprint": self.fingerprint, "step": outer.step, "syncs": outer.syncs,
                "global": [[g.clone() for g in f.global_] for f in outer.fragments],
                "outer": [_cloned(f.outer.state_dict()) for f in outer.fragments],
                "codec": {k: t.clone() for k, t in outer._codec_state().items()}}

    def _load(self, state) -> None:
        """torchft's load function: ``state`` is a :class:`~ccfx.runtime.heal.Pending` (its
        ``head`` now, its tensors on request) or, from another transport, the whole state."""
        pending = state if isinstance(state, Pending) else None
        head = pending.head if pending is not None else state
        if head["fingerprint"] != self.fingerprint:
            self._refused = head["fingerprint"]  # raised after the all-gather (the meet)
            return
        outer = self.outer
        if head.get("unavailable"):
            self._unhealed = True  # not committed; behind, it heals at the next quorum
            self._drop_fetch()  # an earlier heal's fetch: torchft says it is stale
            log.info("ccfx: the replica torchft chose to heal this one from is itself still "
                     "healing: healing at the next quorum")
            return
        with torch.no_grad():
            for name, t in outer._codec_state().items():
                if _is_residual(name):
                    t.zero_()
        outer.step, outer.syncs = int(head["step"]), int(head["syncs"])
        self.since, self.tokens = outer.step, 0
        self._healed = True
        if pending is not None and self._lazy:
            self._start_fetch(pending)  # fetched after the exchange: _heal
            return
        # the source's step may be one it was catching up from
        self._become(State.CATCHING_UP, "healed in the quorum")
        if pending is None:
            self._apply(state)
        else:  # a shared codec state (PowerSGD's Q, a codec's step) the exchange needs now
            self._apply(pending.result(self.outer.config.collective_timeout_s))

    def _start_fetch(self, pending: Pending) -> None:
        """A lazy heal: its tensors come after the exchange; an earlier heal still fetching is
        superseded, and so are the averages kept for its state."""
        if self._pending is not None:
            self._pending.cancel()
        self._pending, self._replay = pending, []
        self._become(State.HEALING, "its heal's tensors come after the exchange")

    def _drop_fetch(self) -> None:
        """Cancel a lazy heal's fetch that torchft says is stale (its source was healing)."""
        if self._pending is None:
            return
        self._pending.cancel()
        self._pending, self._replay = None, []
        if self.state is State.HEALING:
            self._become(State.CATCHING_UP, "its heal's source was itself healing")

    def _apply(self, state: dict) -> None:
        """The healed tensors: global parameters (and the local ones), the outer optimizers'
        state, the codecs' shared state (residuals were zeroed in :meth:`_load`)."""
        outer = self.outer
        with torch.no_grad():
            for frag, saved, opt_state in zip(outer.fragments, state["global"], state["outer"]):
                for g, p, s in zip(frag.global_, frag.local, saved):
                    g.copy_(s)
                    p.copy_(s)
                frag.outer.load_state_dict(opt_state)
            for name, t in outer._codec_state().items():
                if not _is_residual(name):
                    t.copy_(state["codec"][name])

    def _finish_heal(self, torchft_state: dict) -> str | None:
        """Fetch and apply a lazy heal's tensors (after the exchange, so the serving peer's
        uplink carries them while its replica trains, not while the quorum exchanges); None,
        or why it failed. A failed fetch leaves this replica's parameters unhealed: torchft's
        step is put back (``torchft_state``, from before the quorum) so the next quorum heals
        it again."""
        pending, self._pending = self._pending, None
        replay, self._replay = self._replay, []
        try:
            self._apply(pending.result(self.outer.config.collective_timeout_s))
        except Exception as e:  # noqa: BLE001 (the source died or the link timed out)
            self.manager.load_state_dict(torchft_state)
            error = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log.warning("ccfx: fetching the healed state failed (%s): healing again at the "
                        "next sync", error)
            return f"heal: {error}"
        for merged in replay:
            self._merge(merged)
        return None

    def _heal(self, torchft_state: dict, rows, exchanged: float) -> bool:
        """A lazy heal after its exchange: wait for the tensors, and if they are not here by
        the peers' next sync, take part in it with nothing to send (its average kept for
        later), as many syncs as the fetch takes; then apply the state and merge the kept
        averages in order: the same outer steps on the same values as the peers, so the same
        bits. The joiner stays in every quorum meanwhile, and the peers never wait for it
        longer than its arrival at a sync. Whether the heal succeeded (when the fetch fails,
        the syncs since are not this replica's: uncommitted, and it heals again)."""
        first, started = len(self.history) - 1, exchanged
        error, rows, exchanged = self._fetch_while_syncing(torchft_state, rows, exchanged)
        if error is None:
            error = self._finish_heal(torchft_state)
        self.history[first]["heal_s"] = time.monotonic() - started
        if error is not None:
            if self.state is State.HEALING:
                self._become(State.IN_STEP, "its heal failed: it heals again at the next sync")
            for row in self.history[first:]:
                if row["committed"]:
                    row["committed"], row["error"] = False, error
                    self.commits -= 1
            return False
        self._start_catch_up(rows, exchanged)
        return True

    def _fetch_while_syncing(self, torchft_state: dict, rows, exchanged: float):
        """Wait for the lazy heal's tensors up to the peers' next sync, and sync with them
        (``HEALING``: nothing to send, the peers' step taken) as long as they are not here.
        (an error or None, the last sync's rows, when its exchange ended)."""
        while True:
            at = self._next_sync_at(rows, exchanged)
            wait = None if at is None else max(0.0, at - time.monotonic())
            if self._pending.done(wait):
                return None, rows, exchanged
            self._torchft_step([])  # may heal again: a newer fetch replaces this one (_load)
            if self._pending is None:  # told to heal from a replica still healing:
                self.manager.load_state_dict(torchft_state)  # start over, behind
                return "heal: its source was itself healing", rows, exchanged
            rows, exchanged = self._last_rows, self._last_exchanged
