"""Replicas for tests/test_elastic_stateful.py: ``int8:ef`` local steps on torchft, each
replica counting the bytes its outer exchanges put on the wire and reporting its residuals.

The launcher is tests/elastic_workers.py's (:class:`~tests.elastic_workers.Replicas`: a
process per replica, killed and restarted by the test), started with :func:`replica` here.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from . import elastic_workers, ranks

#: One fragment, synced every 2 steps; the matrices (16·48 + 48·8 = 1152 elements) through
#: int8 with error feedback, the biases (48 + 8) raw in a part of their own.
OPTIONS = {"sync_every": 2, "outer_codec": "int8:ef", "compress_min_numel": 0,
           "collective_timeout_s": 10.0}
MATRICES, BIASES, BLOCK = 16 * 48 + 48 * 8, 48 + 8, 256


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 8))


def _int8_bytes(n: int) -> int:
    """int8's payload of ``n`` elements: a byte each, an fp32 scale per block of 256, padded
    to 4 bytes as a message (the all-to-all form's packing)."""
    return -(-(n + 4 * math.ceil(n / BLOCK)) // 4) * 4


def expected_bytes(world: int, form: str | None = None) -> dict[str, int]:
    """What one replica sends per sync, by collective (an all-reduce: its input's bytes).
    ``form``: the compressed part's, else the one ccfx picks (all_to_all from 3 replicas)."""
    form = form or ("all_to_all" if world >= 3 else "all_gather")
    raw = {"all_reduce": BIASES * 4}
    if form == "all_gather":  # every payload tensor all-gathered whole: codes, then scales
        return {**raw, "all_gather": (world - 1) * (MATRICES + 4 * math.ceil(MATRICES / BLOCK))}
    chunk = _int8_bytes(math.ceil(MATRICES / world))
    return {**raw, "all_to_all": (world - 1) * chunk, "all_gather": (world - 1) * chunk}


class _Counting:
    """A ``Comm`` that forwards to the exchange's own and counts what this replica sends: an
    all-to-all's messages to the ``W-1`` others, an all-gather's message to each of them, an
    all-reduce's input."""

    def __init__(self, comm, sent: dict):
        self.comm, self.sent = comm, sent
        self.world, self.rank = comm.world, comm.rank

    def _count(self, kind, nbytes):
        self.sent[kind] = self.sent.get(kind, 0) + nbytes

    def all_to_all(self, t, *args):
        self._count("all_to_all", t.numel() * t.element_size() * (self.world - 1) // self.world)
        return self.comm.all_to_all(t, *args)

    def all_gather(self, t):
        self._count("all_gather", t.numel() * t.element_size() * (self.world - 1))
        return self.comm.all_gather(t)

    def all_reduce(self, t):
        self._count("all_reduce", t.numel() * t.element_size())
        return self.comm.all_reduce(t)

    def wait(self, handle):
        return self.comm.wait(handle)


def replica(name: str, seed: int, lighthouse: str, options: dict, stop_at, events,
            step_sleep_s: float) -> None:
    """tests/elastic_workers.replica's contract (("sync", name, row, digest) after every sync,
    ("done" | "error", ...) at the end), each row with ``sent`` (bytes by collective, this
    sync; the join's, inside ``local_steps``, is not counted) and the norms of the compressed
    part's ``residual`` and ``residual_owner``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    import ccfx

    try:
        model = mlp(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        outer = ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse,
                                 replica_id=name, min_replicas=1, quorum_timeout_s=20.0,
                                 max_retries=5, **options)
        exchange, sent = outer.elastic._exchange, {}

        def counted(frag, scale, comm):
            sent[outer.step] = {}
            return exchange(frag, scale, _Counting(comm, sent[outer.step]))

        outer.elastic._exchange = counted
        part = next(p for p in outer.fragments[0].parts if p.state)
        seen = 0

        def report():
            nonlocal seen
            for k, row in enumerate(outer.elastic.history[seen:], seen):
                digest = ranks.digest(outer.global_parameters().values())
                events.put(("sync", name, {
                    **row, "join": k == 0,  # inside local_steps: before counting began
                    "sent": sent.get(row["step"], {}),
                    "residual_norm": float(part.state["residual"].norm()),
                    "owner_norm": float(part.state["residual_owner"].norm())}, digest))
            seen = len(outer.elastic.history)

        report()
        steps = elastic_workers.train(model, opt, outer, lambda i: _batch(seed, i), stop_at,
                                      report, step_sleep_s)
        events.put(("done", name, {"steps": steps}, None))
    except Exception as e:  # noqa: BLE001 (the test asserts on it)
        events.put(("error", name, f"{type(e).__name__}: {e}", None))


def _batch(seed: int, step: int):
    g = ranks.rng(seed, step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


class StatefulReplicas(elastic_workers.Replicas):
    """The launcher of tests/elastic_workers.py, its replicas running :func:`replica`."""

    replica = staticmethod(replica)
    default_options = OPTIONS
