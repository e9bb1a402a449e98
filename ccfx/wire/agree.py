"""What ranks agree on, and the process groups ccfx makes: the names callers use.

One mechanism, keyed by what is agreed: a description's fingerprint
(:mod:`ccfx.wire.fingerprints`) is the key under which ranks meet in the c10d store
(:mod:`ccfx.wire.agreement`: :func:`meet`, :func:`from_rank0`) and the name of any process
group made for it (:mod:`ccfx.wire.groups`). Each rank's record in the store
(:mod:`ccfx.wire.records`) lets a waiting peer tell a busy rank from a diverged one, and the
process records name the ranks a collective failure points at (:mod:`ccfx.wire.blame`).

:func:`group` is the one operation that joins them: the ranks meet on the description, then
make the group under :func:`group_name`, once per process. It looks :func:`meet` up here, so
a caller that stands in for the agreement (a single-process test) stands in for it here.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import groups
from .agreement import SHAPES_HINT, Diverged, StoreTimeout, diff, from_rank0, meet
from .blame import blame, failed, gave_up, peer_failures, peer_notes, publish_process
from .fingerprints import code_hash, fingerprint, short_hash
from .fingerprints import described as _full
from .groups import close_group, group_name, reserve
from .records import POLL_S, RECENT, entering, note_compile
from .world import dist as _dist
from .world import rank as _rank
from .world import store as _store
from .world import world_ranks

__all__ = [
    "POLL_S", "RECENT", "SHAPES_HINT", "Diverged", "StoreTimeout", "_dist", "_full", "_rank",
    "_store", "blame", "close_group", "code_hash", "diff", "entering", "failed", "fingerprint",
    "from_rank0", "gave_up", "group", "group_name", "meet", "note_compile", "peer_failures",
    "peer_notes", "publish_process", "reserve", "short_hash", "world_ranks",
]


def group(what: str, desc: dict, ranks: Sequence[int] | None = None, *, timeout_s: float,
          hint: str = ""):
    """The process group of ``ranks`` for ``desc`` (None without a process group or for one
    rank): the ranks :func:`meet` first, then make it under :func:`group_name`, once per
    process. Only the participants call it."""
    dist = _dist()
    ranks = tuple(sorted(ranks)) if ranks is not None else world_ranks()
    if dist is None or len(ranks) < 2:
        return None
    name = group_name(what, desc, ranks)
    pg = groups.existing(name, timeout_s)
    if pg is not None:
        return pg
    meet(what, desc, ranks, timeout_s=timeout_s, hint=hint)
    return groups.make(name, ranks, timeout_s, what)
