"""Where this process stands in torch.distributed: the one check for a process group.

Every layer above asks the same question (is there a default process group?) before it
agrees, blames or makes a group; asking it here keeps the answer one answer.
"""

from __future__ import annotations

from .. import _torch_compat as tc


def dist():
    """``torch.distributed`` when a default process group exists, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    d = dist()
    return d.get_rank() if d is not None else 0


def world_ranks(group=None) -> tuple[int, ...]:
    """The global ranks of ``group`` (default: every rank); ``(0,)`` without a process group."""
    d = dist()
    if d is None:
        return (0,)
    if group is None:
        return tuple(range(d.get_world_size()))
    return tuple(d.get_process_group_ranks(group))


def store():
    """The default group's c10d store (where ranks meet and publish their records)."""
    return tc.c10d_default_store()
