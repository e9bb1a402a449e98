""":meth:`Cluster.probe <ccfx.planner.cluster.Cluster.probe>`: a matrix cluster measured on the
live group.

Every ordered pair ``(a, b)`` of the group's ranks is measured in turn by those two ranks alone
(:func:`ccfx.planner.probe.probe_pair`: a ping-pong, then a transfer ``a`` → ``b`` sized to take
about ``seconds``), and every rank waits at a barrier after each pair, so that no two pairs
share the wire while one is timed. ``W (W - 1)`` pairs: at the default 0.05 s, 4 ranks take
about 12 × 0.2 s. Each rank then reports its host and memory, rank 0 makes the Cluster, and its
description is broadcast: every rank gets the same matrix (timings differ between ranks; a
plan must not).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from ..cluster_files import from_dict, to_dict
from ..cluster_spec import ClusterSpec, Device, make_link
from ..errors import ConfigError
from .probe import probe_pair


def _local_memory(backend: str) -> tuple[str, int]:
    """("gpu", this rank's GPU's bytes) under NCCL, else ("host", the host's RAM in bytes)."""
    import torch

    if backend == "nccl" and torch.cuda.is_available():
        return "gpu", torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return "host", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def probe(group=None, *, seconds: float = 0.05, repeats: int = 3, memory=None,
          names: Sequence[str] | None = None, cls=ClusterSpec):
    """The group's matrix cluster, a ``cls`` (``Cluster.probe`` passes the planner's)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError("Cluster.probe needs a process group (dist.init_process_group) over "
                          "the ranks to measure; without one describe the cluster yourself "
                          "(Cluster.from_file, Cluster.nodes, Cluster.homogeneous)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if names is not None and len(names) != world:
        raise ConfigError(f"Cluster.probe: names has {len(names)} names for a group of {world} "
                          "ranks: give one per rank, in group rank order")
    backend = str(dist.get_backend(group))
    transport = "blocking" if backend == "nccl" else "buffered"
    row: list = [None] * world
    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            link = probe_pair(a, b, group, seconds=seconds, repeats=repeats)
            if link is not None:
                row[b] = (link.gbps, link.latency_ms)
            dist.barrier(group=group)
    kind, local = _local_memory(backend)
    mine = {"row": row, "host": socket.gethostname(), "kind": kind, "memory": local}
    src = dist.get_global_rank(group, 0) if group is not None else 0
    reports = [None] * world if rank == 0 else None
    dist.gather_object(mine, reports, dst=src, group=group)
    out = [None]
    if rank == 0:
        out = [to_dict(_cluster(reports, transport, memory, names))]
    dist.broadcast_object_list(out, src=src, group=group)
    return from_dict(out[0], cls)


def _cluster(reports: list[dict], transport: str, memory, names) -> ClusterSpec:
    world = len(reports)
    names = list(names) if names is not None else [f"rank{r}" for r in range(world)]
    per_host: dict[str, int] = {}
    for r in reports:
        per_host[r["host"]] = per_host.get(r["host"], 0) + 1
    devices = []
    for i, r in enumerate(reports):
        # ranks on one host share its memory; a GPU is its rank's own
        mem = memory if memory is not None else (
            r["memory"] if r["kind"] == "gpu" else r["memory"] // per_host[r["host"]])
        devices.append(Device(names[i], mem, None, node=r["host"]))
    matrix = [[None if i == j else make_link(*reports[i]["row"][j], transport,
                                             where=f"probe[{i}][{j}]")
               for j in range(world)] for i in range(world)]
    return ClusterSpec(tuple(devices), matrix=tuple(tuple(r) for r in matrix))
