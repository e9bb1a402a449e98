"""Time every directed link of a group with one small point-to-point message each: what
``ccfx.diagnose(..., links=True)`` adds to the exchange timings (:mod:`ccfx.runtime.diagnose`).

A gloo all-gather or all-reduce hides its hops (the library decides who sends what to whom),
so the collectives' timings can say which rank is late but not which link is slow. The probe
asks every link once, on request: in round ``k`` (1 .. W-1) rank ``r`` sends to ``r+k`` and
receives from ``r-k``, after a barrier, ``repeats`` times. Each message is a one-byte header
followed by ``nbytes`` of bulk, and the *receiver* times both on its own clock:

* ``skew_s``: from posting its receives to the header's arrival: how late the sender came
  (plus one latency);
* ``transfer_s``: from the header to the end of the bulk: the link's own time for ``nbytes``,
  whenever the sender came.

Both are durations on one clock, so ranks on different hosts need no common clock. The median
over the repeats is kept.

:data:`LINK_DELAY_S` is a test seam: seconds a sender waits between a link's header and its
bulk, which to the receiver is exactly a slower link (tests/test_diagnose.py uses it; a real
slow link is made by bench/diagnose.py with tc on network namespaces).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..errors import CollectiveError, ConfigError
from ..wire import agree
from ..wire.comm import wait_work
from ..wire.world import world_ranks

#: The probe's message tags: apart from ccfx's ring (0xCCF) and a user's own traffic.
TAG_HEADER, TAG_BULK = 0xCD1, 0xCD2

#: (sender, receiver) global ranks -> seconds the sender waits before the bulk (tests only).
LINK_DELAY_S: dict[tuple[int, int], float] = {}


def _round(group, ranks: list[int], me: int, k: int, nbytes: int,
           timeout_s: float) -> tuple[int, float, float]:
    """One round ``k``: send to ``me + k``, receive from ``me - k``; (sender, skew, transfer).
    Every wait lasts at most ``timeout_s`` (a peer that never probes is named by the caller)."""
    w = len(ranks)
    dst, src = ranks[(me + k) % w], ranks[(me - k) % w]
    head_in, bulk_in = torch.empty(1, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    head_out, bulk_out = torch.ones(1, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
    wait_work(dist.barrier(group=group, async_op=True), timeout_s)
    posted = time.monotonic()
    r_head = dist.irecv(head_in, src=src, group=group, tag=TAG_HEADER)
    r_bulk = dist.irecv(bulk_in, src=src, group=group, tag=TAG_BULK)
    sends = [dist.isend(head_out, dst=dst, group=group, tag=TAG_HEADER)]
    delay = LINK_DELAY_S.get((ranks[me], dst), 0.0)
    if not delay:
        sends.append(dist.isend(bulk_out, dst=dst, group=group, tag=TAG_BULK))
    wait_work(r_head, timeout_s)
    header = time.monotonic()
    wait_work(r_bulk, timeout_s)
    done = time.monotonic()
    if delay:  # the seam: this link's bulk leaves ``delay`` after the round began
        time.sleep(max(0.0, posted + delay - time.monotonic()))
        sends.append(dist.isend(bulk_out, dst=dst, group=group, tag=TAG_BULK))
    for work in sends:
        wait_work(work, timeout_s)
    return src, header - posted, done - header


def probe_links(group, nbytes: int, repeats: int = 3,
                timeout_s: float = 60.0) -> dict[int, tuple[float, float]]:
    """This rank's incoming links of ``group``: sender's global rank -> (skew_s, transfer_s),
    the medians over ``repeats`` (see the module docstring). Every rank of the group must call
    it; a world of one has no links (``{}``). The probe's tensors are CPU tensors: a gloo
    group only (a ConfigError otherwise); a peer that does not probe within ``timeout_s`` is a
    CollectiveError naming it."""
    backend = str(dist.get_backend(group))
    if backend != "gloo":
        raise ConfigError(f"ccfx.diagnose(links=True) probes with CPU tensors, and the group's "
                          f"backend is {backend}: pass a gloo group's model (or run the probe "
                          "on a gloo group made for it)")
    ranks = list(world_ranks(group))
    me = ranks.index(dist.get_rank())
    seen: dict[int, list[tuple[float, float]]] = {}
    for _ in range(repeats):
        for k in range(1, len(ranks)):
            try:
                src, skew, transfer = _round(group, ranks, me, k, nbytes, timeout_s)
            except RuntimeError as e:
                what = f"ccfx.diagnose's link probe (round {k})"
                first, who = agree.failed(what, e, ranks)
                raise CollectiveError(f"rank {dist.get_rank()}: {what} failed: "
                                      f"{first.rstrip('.!')}.{who} Every rank of the group "
                                      "must call ccfx.diagnose(links=True) at the same point."
                                      ) from e
            seen.setdefault(src, []).append((skew, transfer))
    return {src: (statistics.median(s for s, _ in rows), statistics.median(t for _, t in rows))
            for src, rows in seen.items()}
