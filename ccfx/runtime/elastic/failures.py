"""What a replica does and says when a sync fails: it leaves the failed group at once, and its
errors name the likely cause (no lighthouse, too few replicas, a joiner's heal on the wire)."""

from __future__ import annotations

import logging
import socket
from urllib.parse import urlparse

from ... import _torch_compat as tc
from ...errors import CollectiveError

log = logging.getLogger("ccfx")


def _reachable(address: str, timeout_s: float = 2.0) -> bool:
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((url.hostname, url.port or 80), timeout=timeout_s):
            return True
    except OSError:
        return False


class Failures:
    """The failures' side of :class:`~ccfx.runtime.elastic.Elastic` (a mixin)."""

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
