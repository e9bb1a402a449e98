"""The fault-tolerance options of ``ccfx.local_steps`` and the tunables of its sync."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError

#: A watched trainer silent this long is dead (a machine that vanished sends no FIN).
WATCH_SILENT_S = 10.0

#: How long shutdown waits for a spare's compile thread to finish.
COMPILE_JOIN_S = 120.0

#: ``ccfx.local_steps`` keywords that configure fault tolerance (not torch.compile options).
KEYS = ("fault_tolerant", "lighthouse", "replica_id", "min_replicas", "quorum_timeout_s",
        "max_retries", "trainers", "slot", "init_sync", "lighthouse_outage_s")


@dataclass(frozen=True)
class ElasticOptions:
    """``lighthouse``: its address (``http://host:port``), else ``TORCHFT_LIGHTHOUSE``;
    ``replica_id``: this replica's name (else ``REPLICA_ID``, else a fresh one);
    ``min_replicas``: the fewest replicas a sync may commit with; ``quorum_timeout_s``: how long
    a sync waits for a quorum (longer than the inner steps between two syncs);
    ``max_retries``: consecutive uncommitted syncs (or failed quorum requests) before giving
    up; ``lighthouse_outage_s``: how long a replica that has joined trains on, its syncs
    skipped, while the lighthouse is unreachable (a restart), before it gives up; ``trainers``: how many
    replicas train (the training places, 0 .. trainers - 1): the others are hot spares
    (:meth:`Elastic.wait_while_spare`); None: every replica trains; ``slot``: the training
    place this replica claims when it joins (None: a free one, else it waits as a spare);
    ``init_sync``: False when every replica builds its model from the same seed: the replicas
    that start together take no heal at step 0 (torchft's init sync sends each the first one's
    whole state, all from that one's link); checked at the first sync (a ConfigError where
    the parameters differ). A replica that joins later heals either way."""

    lighthouse: str | None = None
    replica_id: str | None = None
    min_replicas: int = 1
    quorum_timeout_s: float = 300.0
    max_retries: int = 3
    trainers: int | None = None
    slot: int | None = None
    init_sync: bool = True
    lighthouse_outage_s: float = 300.0


def split_options(options: dict) -> tuple[dict, ElasticOptions | None]:
    """(the local-step options, the fault-tolerance ones or None without ``fault_tolerant``)."""
    rest = {k: v for k, v in options.items() if k not in KEYS}
    mine = {k: options[k] for k in KEYS if k in options}
    if not mine.pop("fault_tolerant", False):
        if mine:
            raise ConfigError(f"{sorted(mine)} configure fault tolerance: pass "
                              "fault_tolerant=True with them")
        return rest, None
    opts = ElasticOptions(**mine)
    if (opts.min_replicas < 1 or opts.max_retries < 0 or opts.quorum_timeout_s <= 0
            or opts.lighthouse_outage_s < 0):
        raise ConfigError(f"fault tolerance options {opts}: min_replicas >= 1, max_retries >= 0, "
                          "quorum_timeout_s > 0 and lighthouse_outage_s >= 0")
    if opts.trainers is None and opts.slot is not None:
        raise ConfigError(f"slot={opts.slot} names a training place: pass trainers=N (how many "
                          "replicas train; the others wait as hot spares)")
    if opts.trainers is not None and (opts.trainers < 1 or not (
            opts.slot is None or 0 <= opts.slot < opts.trainers)):
        raise ConfigError(f"trainers={opts.trainers}, slot={opts.slot}: trainers >= 1 and a "
                          "slot in 0 .. trainers - 1 (or None: take a free place, else wait "
                          "as a spare)")
    return rest, opts
