"""torchft's private names that the fault-tolerant sync reads, each behind one function, so
that a torchft release that renames them breaks here and nowhere else."""

from __future__ import annotations


def _replica_id(manager) -> str | None:
    """The replica id torchft's ``Manager`` runs under (``Manager._replica_id``)."""
    return manager._replica_id


def _process_group(manager):
    """The manager's reconfigurable process group (``Manager._pg``), None where it has none."""
    return getattr(manager, "_pg", None)
