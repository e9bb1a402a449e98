"""What each rank runs in tests/test_cluster.py (module level: spawn pickles them by name).

Workers return plain data (a cluster's ``to_dict()``, links as tuples); the assertions are in
the test file."""

from __future__ import annotations

import torch.distributed as dist

from ccfx import Cluster
from ccfx.planner.probe import probe_link


def probe_world(rank: int, world: int, seconds: float) -> dict:
    """The whole group, probed pair by pair: the cluster every rank got."""
    return Cluster.probe(seconds=seconds).to_dict()


def probe_subgroup(rank: int, world: int, members: list[int], seconds: float) -> dict | None:
    """A subgroup's probe (group ranks are not global ranks there): its members' cluster,
    None on the others. Every rank makes the group (torch's rule), only members probe."""
    group = dist.new_group(members)
    if rank not in members:
        return None
    return Cluster.probe(group, seconds=seconds, names=[f"g{r}" for r in members],
                         memory="1GiB").to_dict()


def link_between_0_and_1(rank: int, world: int, seconds: float) -> tuple:
    """probe_link (now probe_pair(0, 1) broadcast): the link every rank got."""
    link = probe_link(seconds=seconds)
    return (link.gbps, link.latency_ms, link.shared, link.rendezvous, link.buffered_sends)
