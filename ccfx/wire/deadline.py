"""A deadline on ccfx's side of a collective's wait, for groups ccfx did not make.

A compressed collective on a user's group (a DeviceMesh's, ``ccfx.shard``'s) waits as long as
that group's own timeout (torchrun's gloo default: 30 minutes) when a peer freezes: the wait
blocks in C++ and nothing of ccfx runs meanwhile. ccfx must not change that group (shorten its
timeout, shut its sockets: the user's own collectives share it), so its compressed collectives
wait through :class:`DeadlineComm` instead: ``wait_tensor`` runs on a helper thread and the
graph's thread waits for it at most ``collective_timeout_s``; on expiry it raises
:class:`Expired` and the caller names the peer from the store's records
(:mod:`ccfx.wire.blame`). The helper thread stays blocked until the group's own timeout ends
it; the group is not touched. Only gloo groups of CPU tensors wait this way (a CUDA wait orders
the waiting thread's streams rather than blocking, and NCCL has its own watchdog), at the cost
of one hand-off to the helper thread and one copy of the (compressed) payload per wait.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from .comm import FunctionalComm


class Expired(RuntimeError):
    """A compressed collective's wait ran past ``collective_timeout_s`` (a peer froze, or is
    far behind); the message names the group and the deadline."""


#: The words every :class:`Expired` message starts with (an error re-raised by torch as a
#: plain RuntimeError is still told by them).
EXPIRED = "ccfx: no reply within collective_timeout_s"


class DeadlineComm(FunctionalComm):
    """:class:`~ccfx.wire.comm.FunctionalComm` whose ``wait`` gives up after ``timeout_s``
    (``ccfx::wait_within``: it traces into graphs as one op)."""

    def __init__(self, group_name: str, world_size: int, timeout_s: float):
        super().__init__(group_name, world_size)
        self.timeout_s = float(timeout_s)

    def wait(self, t: torch.Tensor) -> torch.Tensor:
        return torch.ops.ccfx.wait_within(t, self.group_name, self.timeout_s)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return FunctionalComm.wait(None, t)  # wait_tensor: it reads no attribute of the comm


#: This process's helper thread (pid -> executor: a forked child makes its own).
_HELPER: dict[int, ThreadPoolExecutor] = {}


def _helper() -> ThreadPoolExecutor:
    pid = os.getpid()
    if pid not in _HELPER:
        _HELPER.clear()
        _HELPER[pid] = ThreadPoolExecutor(1, thread_name_prefix="ccfx-wait")
    return _HELPER[pid]


@torch.library.custom_op("ccfx::wait_within", mutates_args=())
def wait_within(t: torch.Tensor, group_name: str, timeout_s: float) -> torch.Tensor:
    """``wait_tensor(t)`` on the helper thread, waited for at most ``timeout_s``: the result
    (a copy: a custom op returns no alias of its input), or :class:`Expired`. One helper: a
    graph waits its collectives one after the other; after an expiry the next wait queues
    behind the blocked one and expires too (the group is broken either way)."""
    pending = _helper().submit(_wait, t)
    try:
        return pending.result(timeout_s).clone()
    except FutureTimeout:
        raise Expired(f"{EXPIRED}={timeout_s:g} s on group {group_name!r} (its own timeout "
                      "is longer; ccfx left the group as it is); should a peer legitimately "
                      "take longer between two collectives, raise collective_timeout_s") from None


@wait_within.register_fake
def _(t, group_name, timeout_s):
    return torch.empty_like(t)
