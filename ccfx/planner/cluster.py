"""The planner's cluster: a :class:`~ccfx.cluster_spec.ClusterSpec` (devices and the link
between every pair) with what needs the planner or the live group.

What the layout planner plans for (issue 19): which ranks go where, which links carry the
pipeline hops and which the data-parallel collectives, and at what price. The description
itself, its checks and its dict and file forms (:mod:`ccfx.cluster_files`: TOML, JSON, YAML
when PyYAML is installed) sit below :mod:`ccfx.config`, which reads a ``cluster`` option; this
class adds a device's compute rate measured here (:meth:`Cluster.rate`), the measurement of the
live group (:meth:`Cluster.probe`, the only part that needs ``torch.distributed``) and the
fingerprint. See :mod:`ccfx.cluster_spec` for the two ways to give the links and the units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .. import cluster_files as _files
from ..cluster_spec import (
    ClusterSpec,
    Device,
    make_link,  # noqa: F401  (ConfigErrors tell users to build Devices and links from here)
)


class Cluster(ClusterSpec):
    """Devices and the links between them (:class:`~ccfx.cluster_spec.ClusterSpec`: fields,
    checks, ``link``, ``slowest_link``, ``select``, ``homogeneous``, ``nodes``), with the
    compute rate, the probe, the fingerprint, and the dict and file forms."""

    def rate(self, device) -> float:
        """A device's FLOP/s: as given, or (None) a matmul's rate measured on this machine
        (:func:`ccfx.planner.compute.machine_rate`, cached)."""
        flops = self.device(device).flops
        if flops is not None:
            return flops
        from .compute import machine_rate

        return machine_rate()[0]

    def fingerprint(self) -> str:
        """16 hex digits of the description (:func:`ccfx.wire.agree.fingerprint`)."""
        from ..wire.fingerprints import fingerprint

        return fingerprint(self.to_dict())

    def describe(self) -> str:
        """A short human text: the devices by node, and the links."""
        return _files.describe(self)

    # -- dicts and files (ccfx.cluster_files) ----------------------------------------------------

    def to_dict(self) -> dict:
        """Plain data (str, int, float, bool, lists, dicts) that :meth:`from_dict` reads back
        into an equal Cluster; the schema is :mod:`ccfx.cluster_files`'s."""
        return _files.to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Cluster:
        return _files.from_dict(data, cls)

    @classmethod
    def from_file(cls, path) -> Cluster:
        """A cluster from a ``.toml``, ``.json`` or (with PyYAML) ``.yaml`` / ``.yml`` file."""
        return _files.read(path, cls)

    def to_file(self, path) -> None:
        """Write the description as ``.toml``, ``.json`` or (with PyYAML) ``.yaml``."""
        _files.write(self, path)

    @classmethod
    def from_matrix(cls, devices: Sequence[Device], gbps: Sequence[Sequence[float]],
                    latency_ms: Sequence[Sequence[float]], transport: str = "buffered",
                    shared: bool = False) -> Cluster:
        """A matrix cluster: ``gbps[i][j]`` and ``latency_ms[i][j]`` from device i to device j
        (the diagonal is ignored)."""
        return cls(tuple(devices), matrix=_files.matrix_from_dict(
            {"gbps": gbps, "latency_ms": latency_ms, "transport": transport, "shared": shared},
            len(devices)))

    @classmethod
    def probe(cls, group=None, *, seconds: float = 0.05, repeats: int = 3, memory=None,
              names: Sequence[str] | None = None) -> Cluster:
        """Measure the live group: every ordered pair of its ranks in turn, the others waiting
        (:func:`ccfx.planner.probe.probe_pair`, ~``seconds`` of transfer per pair), rank 0's
        matrix broadcast; every rank of ``group`` must call it, and every rank gets the same
        matrix Cluster. Devices are the group's ranks (``rank0`` …, or ``names``), their node
        the host they run on, their memory ``memory`` or measured (a GPU's, or the host's
        memory shared among the ranks on it), their rate None (measure here)."""
        from .cluster_probe import probe

        return probe(group, seconds=seconds, repeats=repeats, memory=memory, names=names,
                     cls=cls)
