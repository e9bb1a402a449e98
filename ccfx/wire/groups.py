"""The process groups ccfx makes, named by the fingerprint of what they are for.

A group is named ``ccfx-<fingerprint>`` (:func:`group_name`), made by the participants only
(a ``PrefixStore`` under that name), registered under the name for functional collectives
(``_c10d_functional`` ops in compiled graphs name their group) and made once per process (a
second model with the same fingerprint shares it). The name is known before the group exists:
a compiled backward can name its group at compile time (:func:`reserve` holds a stand-in
there) and the ranks make it at its first run (:func:`make`). The private torch names this
needs (torch's registry of named groups, its construction of one) are reached through
:mod:`ccfx._torch_compat`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from .. import _torch_compat as tc
from . import sockets
from .blame import publish_process
from .fingerprints import described, fingerprint
from .world import dist as _dist

#: Groups made, by name (once per process).
_GROUPS: dict = {}
#: Stand-ins by name (the registry holds groups weakly: they are kept alive here).
_RESERVED: dict = {}
#: Each gloo group's own sockets, by name (:func:`close_group`).
_SOCKETS: dict[str, dict[int, str]] = {}


def group_name(what: str, desc: dict, ranks: Sequence[int]) -> str:
    """The name of the process group for this description (known before it exists)."""
    return f"ccfx-{fingerprint(described(what, desc, ranks))}"


# -- making groups ---------------------------------------------------------------------------


def existing(name: str, timeout_s: float):
    """The group made under ``name`` in this process while torch still knows it, else None.
    Its timeout becomes ``timeout_s``: the name leaves the timeout out (how long a rank waits
    is its own business), so a later compile with another ``collective_timeout_s`` reuses the
    group and waits as long as it asked."""
    pg = _GROUPS.get(name)
    if pg is None or name not in tc.c10d_registered_names():
        return None
    pg.set_timeout(datetime.timedelta(seconds=timeout_s))
    return pg


def reserve(name: str, ranks: Sequence[int]) -> None:
    """Register a stand-in under ``name`` until the group is made: inductor reads the rank and
    size of a group that a graph names while it compiles the graph (a backward compiles before
    its ranks make the group). The stand-in has no backend: a collective on it fails loudly,
    never silently."""
    dist = _dist()
    if dist is None or len(ranks) < 2 or name in _RESERVED or name in _GROUPS:
        return
    stand_in = dist.ProcessGroup(dist.HashStore(), list(ranks).index(dist.get_rank()),
                                 len(ranks))
    tc.c10d_register_group(name, stand_in)
    _RESERVED[name] = stand_in


def make(name: str, ranks: tuple[int, ...], timeout_s: float, what: str):
    """A process group over ``ranks`` named ``name``, kept for :func:`existing`: torch's own
    construction (a ``PrefixStore`` under the name, the backend of the default group,
    registered for ``_c10d_functional``), with a name of ccfx's choosing (``dist.new_group``
    names groups by a process-wide count, or by a hash of the ranks and the number of groups
    made so far: either depends on what the process made before)."""
    import torch.distributed as dist

    if name in _RESERVED:  # the stand-in makes way for the group
        tc.c10d_unregister_group(name)
        del _RESERVED[name]
    backend, store = tc.c10d_default_backend_and_store()
    publish_process()
    before = sockets.snapshot() if str(backend) == "gloo" else None
    pg = tc.c10d_new_group(ranks, dist.get_rank(), backend, store, name, timeout_s,
                           f"ccfx {what}")
    tc.c10d_set_group_ranks(pg, ranks)
    if before is not None:  # gloo connected the group as it was made: its sockets
        _SOCKETS[name] = sockets.opened(before)
    _GROUPS[name] = pg
    return pg


def close_group(name: str | None) -> int:
    """Shut down this rank's connections of ccfx's group ``name`` (:mod:`ccfx.wire.sockets`):
    a peer blocked on it fails at once instead of after the group's timeout. Call it only after
    recording why this rank gives up (:func:`ccfx.wire.blame.gave_up`, or a failed wait): the
    peer's error quotes that record. The group is finished afterwards. Returns the sockets
    shut down."""
    return sockets.shut(_SOCKETS.pop(name, {})) if name else 0
