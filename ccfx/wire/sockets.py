"""Closing one gloo process group's connections, so that its peers' blocked operations fail
at once instead of after the group's timeout.

Why: a rank that gives up for a reason its peers cannot see (it recompiled for an uneven batch,
refused a pipeline microbatch of another shape) records the reason in the c10d store, but a
peer already blocked in a gloo collective or receive on a group with that rank cannot poll the
store: it learns the reason only when gloo's timeout (``collective_timeout_s``) ends the wait.
Shutting down the giving-up rank's TCP connections of that group ends the wait within
milliseconds on every peer ("Connection closed by peer"), and the peer's error then quotes the
recorded reason.

How (measured on torch 2.13's gloo, 2 ranks): neither ``ProcessGroup.abort()`` /
``shutdown()`` nor ``destroy_process_group`` closes a gloo group's sockets while any
reference to the group is alive (the peer still waited the whole timeout); ``shutdown(2)`` on
the group's connected sockets does, and leaves every other group (the default one included)
working. gloo opens a group's sockets when the group is made (one listener and one connection
per peer), so the sockets that appear in ``/proc/self/fd`` across the group's construction are
its own (:func:`opened`). The listener is left alone: gloo's accept loop aborts the process on
an error there. After :func:`shut`, every later operation on that group fails at once on every
rank (the group is finished); other groups and the default one are untouched.

Linux only (``/proc/self/fd``); elsewhere, or with a lazily connected group
(``TORCH_GLOO_LAZY_INIT``), nothing is recorded and peers wait for the timeout.
"""

from __future__ import annotations

import os
import socket

_FD_DIR = "/proc/self/fd"


def snapshot() -> dict[int, str]:
    """This process's open sockets: fd → ``socket:[inode]`` (empty where ``/proc`` is not)."""
    out = {}
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"{_FD_DIR}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(fd)] = link
    return out


def opened(before: dict[int, str]) -> dict[int, str]:
    """The sockets open now that were not in ``before`` (a :func:`snapshot`)."""
    return {fd: link for fd, link in snapshot().items() if before.get(fd) != link}


def shut(sockets: dict[int, str]) -> int:
    """Shut down (both directions) each connected socket of ``sockets`` that is still the same
    socket (fd and inode); listeners are skipped. Returns how many were shut down."""
    done = 0
    for fd, link in sockets.items():
        try:
            if os.readlink(f"{_FD_DIR}/{fd}") != link:
                continue  # closed, and the number reused by another socket
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue  # gloo's listener: an error there aborts the process
            s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass  # not connected (any more)
        finally:
            s.close()  # the duplicate only: gloo's own fd stays open, its socket shut
    return done
