"""A cluster as plain data and files: :mod:`ccfx.cluster_files` (below the config, which reads
a ``cluster`` option), named here too; :func:`from_dict` and :func:`read` here make the
planner's :class:`~ccfx.planner.cluster.Cluster`."""

from __future__ import annotations

from ..cluster_files import (  # noqa: F401  (the names this module has always offered)
    DEVICE_KEYS,
    LEVEL_KEYS,
    MATRIX_KEYS,
    SUFFIXES,
    TOP_KEYS,
    describe,
    dumps_toml,
    link_dict,
    link_from_dict,
    matrix_from_dict,
    to_dict,
    write,
)
from ..cluster_spec import LINK_KEYS  # noqa: F401
from .cluster import Cluster


def from_dict(data) -> Cluster:
    """The Cluster ``data`` describes (:func:`ccfx.cluster_files.from_dict`)."""
    return Cluster.from_dict(data)


def read(path) -> Cluster:
    """The Cluster a file describes (:func:`ccfx.cluster_files.read`)."""
    return Cluster.from_file(path)
