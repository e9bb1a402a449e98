"""What a replica does and says when a sync fails: it leaves the failed group at once, it trains
on through a lighthouse's restart (its syncs skipped, up to ``lighthouse_outage_s``) and through
failed quorum requests (up to ``max_retries``), and its errors name the likely cause (no
lighthouse, too few replicas, a joiner's heal on the wire)."""

from __future__ import annotations

import logging
import socket
import time
from urllib.parse import urlparse

from ... import _torch_compat as tc
from ...errors import CollectiveError

log = logging.getLogger("ccfx")

#: While the lighthouse is away, a replica asks for it at most this often (at its syncs).
PROBE_EVERY_S = 1.0


def _reachable(address: str, timeout_s: float = 2.0) -> bool:
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((url.hostname, url.port or 80), timeout=timeout_s):
            return True
    except OSError:
        return False


class Failures:
    """The failures' side of :class:`~ccfx.runtime.elastic.Elastic` (a mixin)."""

    _joined = False  # a quorum has formed with it: from then on it outlives the lighthouse
    _outage_since: float | None = None  # since when the lighthouse is unreachable, None: up
    _probed_at = 0.0  # when it last asked whether the lighthouse is up
    _quorum_failures = 0  # failed quorum requests in a row with the lighthouse reachable

    def _lighthouse_away(self) -> bool:
        """Before a joined replica's quorum: whether the lighthouse is unreachable now (a
        connect, at most every :data:`PROBE_EVERY_S` during an outage): the sync is then
        skipped and the replica trains on; past ``lighthouse_outage_s`` a CollectiveError."""
        now = time.monotonic()
        if self._outage_since is not None and now - self._probed_at < PROBE_EVERY_S:
            self._outage(now)
            return True
        self._probed_at = now
        if _reachable(self.lighthouse):
            if self._outage_since is not None:
                log.warning("ccfx: the torchft lighthouse at %s answers again after %.1f s: "
                            "syncing", self.lighthouse, now - self._outage_since)
            self._outage_since = None
            return False
        self._outage(now)
        return True

    def _outage(self, since: float) -> None:
        """The lighthouse is unreachable (since ``since`` at the latest): log it once, and
        raise once it has been so for longer than ``lighthouse_outage_s``."""
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since = min(since, now)
            tc.torchft_forget_quorum(self.manager, request=False)  # rebuild when it is back
            log.warning("ccfx: the torchft lighthouse at %s is unreachable: replica %s trains "
                        "on, its syncs skipped, until it is back (for up to "
                        "lighthouse_outage_s=%g s)", self.lighthouse,
                        tc.torchft_replica_id(self.manager), self.opts.lighthouse_outage_s)
        away = now - self._outage_since
        if away > self.opts.lighthouse_outage_s:
            replica = tc.torchft_replica_id(self.manager)
            self.shutdown()
            raise CollectiveError(
                f"replica {replica}: the torchft lighthouse at {self.lighthouse} has been "
                f"unreachable for {away:.1f} s, longer than lighthouse_outage_s="
                f"{self.opts.lighthouse_outage_s:g}; this replica's last committed sync was at "
                f"inner step {self.since} ({self.commits} committed). Restart the lighthouse "
                "on the same address (run it under a supervisor that restarts it, on a machine "
                "of its own: docs/guides/local-steps.md), or raise lighthouse_outage_s")

    def _quorum_failed(self, e: BaseException, started: float) -> str:
        """A joined replica's quorum request failed: the request is forgotten and the sync
        skipped (it trains on). The lighthouse unreachable: an outage (:meth:`_outage`, counted
        from the request's start); reachable: a failed request, ``max_retries`` of them in a
        row allowed. Why, for the sync's history row."""
        tc.torchft_forget_quorum(self.manager)
        text = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if not _reachable(self.lighthouse):
            self._probed_at = time.monotonic()
            self._outage(started)
            return f"the lighthouse at {self.lighthouse} is unreachable ({text})"
        self._outage_since = None
        self._quorum_failures += 1
        if self._quorum_failures > self.opts.max_retries:
            self.shutdown()
            raise self._no_quorum(e, f"{self._quorum_failures} quorum requests in a row failed "
                                  f"(max_retries={self.opts.max_retries}; the last at inner "
                                  f"step {self.outer.step})") from e
        log.warning("ccfx: the quorum request at inner step %d failed (%s): training on, asking "
                    "again at the next sync (%d of max_retries=%d)", self.outer.step, text,
                    self._quorum_failures, self.opts.max_retries)
        return f"no quorum: {text}"

    def _leave_group(self) -> None:
        """Abort this quorum's process group at once after a failed exchange, so the peers
        still blocked in it on *this* replica get out now. A SIGKILLed peer's sockets close and
        gloo errors at once for whoever waits on it, but a replica waiting on a live one that
        already left (the all-gather's ring after the all-to-all) would wait until that one
        rebuilt its group at its next quorum, or until ``collective_timeout_s``, miss that
        quorum and heal a sync later, its inner steps lost. torchft rebuilds the group at the
        next quorum (an uncommitted step gives a new quorum id)."""
        pg = tc.torchft_process_group(self.manager)
        if pg is None or tc.torchft_wrapped_group(pg) is None:
            return
        try:
            pg.abort()
        except Exception as e:  # noqa: BLE001 (best effort: the rebuild replaces it anyway)
            log.info("ccfx: aborting the failed sync's process group: %s", e)

    def _no_quorum(self, e: BaseException, what: str) -> CollectiveError:
        text = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if not _reachable(self.lighthouse):
            return CollectiveError(
                f"{what}: the torchft lighthouse at {self.lighthouse} is unreachable ({text}): "
                "start it (torchft_lighthouse --min_replicas N --join_timeout_ms 10000) or point "
                "lighthouse= / TORCHFT_LIGHTHOUSE at it")
        return CollectiveError(
            f"{what}: no quorum formed within quorum_timeout_s={self.opts.quorum_timeout_s:g} s "
            f"({text}): fewer replicas than the lighthouse's --min_replicas (this replica asks "
            f"min_replicas={self.opts.min_replicas}) reached a sync in time; start more "
            "replicas, lower the minimum, or raise quorum_timeout_s above the time between "
            "two syncs")

    def _timeout_hint(self, error: str) -> str:
        """Why a sync may time out with every replica alive: the exchange waits for a joiner's
        heal, whose transfer ``collective_timeout_s`` must cover."""
        if "timed out" not in error.lower() and "timeout" not in error.lower():
            return ""
        state = sum(g.numel() * g.element_size() for f in self.outer.fragments for g in f.global_)
        return (f" (if a replica was joining: the others' exchange waits for its heal, "
                f"{state / 1e6:.1f} MB of global parameters and more from one peer; "
                f"collective_timeout_s={self.outer.config.collective_timeout_s:g} s must cover that "
                "transfer over the slowest link, several times over at step 0, when torchft "
                "sends every replica its copy from one)")
