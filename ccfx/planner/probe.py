"""Measure the link between ranks: what ``auto`` needs when ``link_gbps`` is not given.

Ranks 0 and 1 of the group time two things with the same point-to-point ops the pipeline
uses (``dist.send`` / ``dist.recv`` on the group's backend): a ping-pong of one byte (half the
round trip is the latency) and a tensor sent one way, sized from a first small transfer so that
it takes about ``seconds`` (the bandwidth: bytes over the time after the latency). Every rank
of the group calls :func:`probe_link` and gets rank 0's answer. :func:`probe_pair` is the same
measurement between any two ranks ``a`` → ``b`` of the group (what ``Cluster.probe`` runs for
every ordered pair).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..wire.link import Link


def probe_link(group=None, *, seconds: float = 0.3, repeats: int = 3,
               shared: bool = False) -> Link:
    """The link between the group's ranks 0 and 1, as every rank of ``group`` sees it."""
    if not dist.is_initialized():
        from ..errors import ConfigError

        raise ConfigError("probe_link needs a process group (dist.init_process_group); without "
                          "one give link_gbps yourself")
    world = dist.get_world_size(group)
    out = [probe_pair(0, 1, group, seconds=seconds, repeats=repeats, shared=shared)
           if world >= 2 else None]
    if world > 1:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(out, src=src, group=group)
    return out[0]


def probe_pair(a: int, b: int, group=None, *, seconds: float = 0.3, repeats: int = 3,
               shared: bool = False) -> Link | None:
    """The link from group rank ``a`` to group rank ``b`` (a ping-pong for the latency, a
    transfer ``a`` → ``b`` sized to take about ``seconds`` for the bandwidth), measured by those
    two ranks: ``a`` returns it, ``b`` and every other rank return None at once (they do not
    take part)."""
    rank = dist.get_rank(group)
    if rank not in (a, b) or a == b:
        return None
    role = 0 if rank == a else 1  # 0 sends and measures, 1 receives and acknowledges
    other = b if role == 0 else a
    peer = dist.get_global_rank(group, other) if group is not None else other
    pings = [_ping(peer, role, group) for _ in range(repeats)]
    latency = statistics.median(pings) / 2
    small = 1 << 20
    first = _one_way(peer, role, small, group)
    # the sender sizes the real transfer and tells the receiver: from the whole first
    # transfer's time, latency included (subtracting a noisy latency from a fast transfer's
    # time can leave ~0 and size the transfer at the 256 MiB cap: seconds, not ``seconds``)
    size = torch.tensor([0], dtype=torch.int64)
    if role == 0:
        per_s = small / max(first, 1e-6)
        size[0] = int(min(max(per_s * seconds, small), 1 << 28))
        dist.send(size, peer, group=group)
    else:
        dist.recv(size, peer, group=group)
    nbytes = int(size[0])
    best = min(_one_way(peer, role, nbytes, group) for _ in range(repeats))
    if role != 0:
        return None
    # the fastest transfer less the fastest round trip (both minima: a ping delayed by a busy
    # core must not eat the transfer's time), and at most twice the raw rate: a transfer as
    # short as a round trip says little, and must not read as an absurd bandwidth
    gbps = nbytes * 8 / max(best - min(pings), best / 2) / 1e9
    return Link(gbps, latency * 1e3, shared)


def _ping(peer: int, rank: int, group) -> float:
    """One byte there and back: twice the latency."""
    return _one_way(peer, rank, 1, group)


def _one_way(peer: int, rank: int, nbytes: int, group) -> float:
    """Seconds from the sender's (``rank`` 0's) send to its receipt of the receiver's (``rank``
    1's) one-byte acknowledgement (the transfer plus one round trip of latency), as the sender
    measures it. ``rank`` is the role in the pair, ``peer`` the other's global rank."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    start = time.perf_counter()
    if rank == 0:
        dist.send(t, peer, group=group)
        dist.recv(ack, peer, group=group)
    else:
        dist.recv(t, peer, group=group)
        dist.send(ack, peer, group=group)
    return time.perf_counter() - start
