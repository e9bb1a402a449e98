"""The façade: one replica's fault-tolerant outer sync, orchestrating the meet, the exchange,
heals, catching up and hot spares (each a mixin of its own module) around torchft's steps."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

from ... import _torch_compat as tc
from ...codecs._fast import compile_later
from ...errors import CollectiveError, ConfigError
from ..heal import HealTransport
from .catch_up import CatchUp
from .comm import TorchftComm
from .exchange import Averaging
from .failures import Failures
from .healing import Healing, _is_residual
from .meet import Meet, _ipv4_columns, fingerprint
from .options import COMPILE_JOIN_S, ElasticOptions
from .spares import Spares
from .states import State, StateMachine

log = logging.getLogger("ccfx")


@dataclass
class _Round:
    """One sync's scratch, handed from phase to phase of :meth:`Elastic._torchft_step`."""

    due: list
    started: float
    interval: float | None
    torchft_state: dict = field(default_factory=dict)  # put back if a lazy heal's fetch fails
    quorum_s: float = 0.0  # the quorum, the group's rebuild, a heal
    snapshot: dict = field(default_factory=dict)  # what an uncommitted sync puts back
    comm: TorchftComm | None = None
    rows: list = field(default_factory=list)
    averaged: dict = field(default_factory=dict)
    later: list = field(default_factory=list)  # codec calls run eagerly, compiled after
    reached: int = 0  # the inner step this replica had trained to (before taking the quorum's)
    own: int = 0
    total: int = 0
    error: str | None = None
    committed: bool = False
    exchanged: float = 0.0


class Elastic(StateMachine, Meet, Averaging, Healing, CatchUp, Spares, Failures):
    """The torchft side of one replica's :class:`~ccfx.runtime.local_steps.LocalSteps` (see
    :mod:`ccfx.runtime.elastic`). Made by ``LocalSteps`` when ``fault_tolerant=True``; joins
    at once. Its standing is :attr:`state` (:mod:`~ccfx.runtime.elastic.states`)."""

    _last_rows: list | tuple = ()  # the last sync's all-gathered rows, and when its exchange ended
    _last_exchanged = 0.0
    _last_rank = -1  # this replica's rank in the last sync's quorum
    _address = (0, 0)  # this replica's /alive address in the meet (_ipv4_columns)
    _last_end: float | None = None  # when this replica's last sync ended
    # per-sync scratch (what this sync's quorum did; reset at each sync's start), not state:
    _healed = False  # it healed in this sync's quorum
    _unhealed = False  # its heal came from a replica still healing (_load): no commit
    _refused: str | None = None  # a healer's peer's fingerprint, when it differs

    def __init__(self, outer, opts: ElasticOptions, options: dict):
        torchft = _import_torchft()
        _check_supported(outer.config)
        self.lighthouse = opts.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not self.lighthouse:
            raise ConfigError("fault_tolerant=True needs a torchft lighthouse: start one "
                              "(torchft_lighthouse --min_replicas 2 --join_timeout_ms 10000) "
                              "and pass lighthouse='http://host:29510' or set "
                              "TORCHFT_LIGHTHOUSE")
        self.outer = outer
        self.opts = opts
        if opts.trainers is not None:  # every member must count the same places
            options = {**options, "trainers": opts.trainers}
        if not opts.init_sync:  # and agree on whether step 0 heals
            options = {**options, "init_sync": False}
        self.fingerprint = fingerprint(outer.fragments, options)
        self.slot = opts.slot  # the training place held (trainers=N), None: a spare
        self.tokens = 0  # reported since the last committed sync (add_tokens)
        self.counts_tokens = False
        self.since = 0  # inner step of the last committed sync (or of the heal)
        self.commits = 0
        self.history: list[dict] = []  # one row per sync: step, quorum, committed, ...
        self._state = State.JOINING
        # a heal's tensors, fetched after the exchange it joins (_finish_heal); only when every
        # codec state is a residual, which a heal zeroes (the exchange needs nothing from it)
        self._lazy = all(_is_residual(name) for name in outer._codec_state())
        self._reduces: dict = {}  # (part, quorum size) -> CompressedCollective (_reduce_for)
        self.used: set[str] = set()  # the collectives the exchanges ran
        self.manager = self._start_manager(torchft, opts)
        self._keep_state_per_element()  # before the join: a heal sends it
        self.sync([])  # join: heal from a live peer if the others are ahead
        self.wait_while_spare()

    def _start_manager(self, torchft, opts: ElasticOptions):
        """This replica's TCP store, heal transport and torchft ``Manager``."""
        timeout = timedelta(seconds=self.outer.config.collective_timeout_s)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        from torch.distributed import TCPStore

        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self._transport = HealTransport(host, timeout)
        self._address = _ipv4_columns(host, self._transport.port)
        replica_id = opts.replica_id or os.environ.get("REPLICA_ID")
        try:
            return torchft.Manager(
                pg=torchft.ProcessGroupGloo(timeout=timeout), load_state_dict=self._load,
                state_dict=self._recovery_state, min_replica_size=opts.min_replicas,
                use_async_quorum=False, timeout=timeout,
                checkpoint_transport=self._transport,
                quorum_timeout=timedelta(seconds=opts.quorum_timeout_s),
                connect_timeout=timedelta(seconds=min(opts.quorum_timeout_s, 30.0)),
                rank=0, world_size=1, store_addr=host, store_port=self._store.port,
                lighthouse_addr=self.lighthouse, replica_id=replica_id, hostname=host,
                max_retries=opts.max_retries, init_sync=opts.init_sync,
                # a request in flight when the lighthouse dies asks it again every second or
                # so (torchft waits quorum_timeout / (retries + 1) after a failed connection)
                # until quorum_timeout_s: a restart within that joins the next quorum
                quorum_retries=max(1, int(opts.quorum_timeout_s)))
        except Exception as e:
            raise self._no_quorum(e, "starting torchft's manager") from e

    # -- tokens -------------------------------------------------------------------------------

    def add_tokens(self, n: int) -> None:
        self.counts_tokens = True
        self.tokens += int(n)

    def _weight(self) -> int:
        return self.tokens if self.counts_tokens else self.outer.step - self.since

    # -- one sync -----------------------------------------------------------------------------

    def sync(self, due: list) -> bool:
        """One torchft step over the fragments ``due`` (see :mod:`ccfx.runtime.elastic`), then,
        when it began a lazy heal, the heal's fetch (:meth:`_heal`); whether it was
        committed."""
        r = self._torchft_step(due)
        if self._pending is not None:
            return self._heal(r.torchft_state, r.rows, r.exchanged) and r.committed
        return r.committed

    def _torchft_step(self, due: list) -> _Round:
        """The quorum (a heal in it), the meet, the exchange, the commit or the rollback."""
        r = self._begin_sync(due)
        if not self._quorum(r):  # skipped: nothing exchanged or committed; it trains on
            self._last_exchanged = time.monotonic()  # (a heal's or a spare's wait: from now)
            self._end_sync(r)
            return r
        if self._healed:  # the fragments the peers sync now, at the step we took from them
            outer = self.outer
            r.due = [f for f in outer.fragments
                     if outer.step > 0 and outer.step % outer.sync_every == f.offset]
        r.own = 0 if self._unhealed or self.spare else self._weight()
        self._meet_and_exchange(r)
        self._commit(r)
        self._end_sync(r)
        return r

    def _begin_sync(self, due: list) -> _Round:
        """Reset the per-sync scratch, tell the watchers this replica is in a sync, and note
        what a failed heal puts back (torchft's state)."""
        started = time.monotonic()
        interval = started - self._last_end if self._last_end is not None else None
        r = _Round(due, started, interval, reached=self.outer.step)
        self.used = set()
        self._healed, self._refused, self._unhealed = False, None, False
        # a spare or a peer catching up that watches this replica joins now too
        self._transport.announce_sync(self.manager.current_step())
        self._close_sync_watch()
        if self.spare:  # its step is stale: it takes the trainers' (_adopt_step)
            self._stale("a spare's sync")
        r.torchft_state = self.manager.state_dict()
        return r

    def _quorum(self, r: _Round) -> bool:
        """torchft's quorum (a heal from a peer may run in it: :meth:`_load`); False: this
        sync is skipped, the lighthouse away or the request failed (:meth:`_lighthouse_away`,
        :meth:`_quorum_failed`, each bounded). A replica that has never been in a quorum stops
        here if none forms."""
        if self._joined and self._lighthouse_away():
            r.error = f"the lighthouse at {self.lighthouse} is unreachable"
            return False
        try:
            self.manager.start_quorum()
        except Exception as e:
            if self._joined:
                r.error = self._quorum_failed(e, r.started)
                return False
            self.shutdown()  # this replica stops here: its heartbeats must stop too
            raise self._no_quorum(e, f"the outer sync at inner step {self.outer.step}") from e
        self._joined, self._quorum_failures, self._outage_since = True, 0, None
        r.quorum_s = time.monotonic() - r.started
        # taken after a heal: the healed state stays
        r.snapshot = {k: t.clone() for k, t in self.outer._codec_state().items()}
        return True

    def _meet_and_exchange(self, r: _Round) -> None:
        """The meet, its checks, the places, and each due fragment's exchange; a failure (a
        peer died or hung) is reported to torchft and leaves this sync uncommitted."""
        try:
            # inside the try: when the group's rebuild failed in the quorum (torchft reports it
            # and leaves the group unset), this sync is uncommitted like any failed exchange
            r.comm = comm = TorchftComm(tc.torchft_process_group(self.manager))
            r.rows = rows = self._meet(comm, r.own, r.interval)
            self._last_rank = comm.rank
            self._check_fingerprints(rows, comm)
            self._check_start(rows)
            r.due = self._adopt_step(rows, r.due)
            if self.opts.trainers is not None:
                self.slot = self._assign_slots(rows, comm.rank)
            r.total = sum(row[0] for row in rows)
            if r.total > 0:
                scale = r.own * comm.world / r.total
                with compile_later() as r.later:  # the quorum waits on this exchange, not on
                    for frag in r.due:  # a compile: new shapes (a joiner's first) run eagerly
                        r.averaged[frag.index] = self._exchange(frag, scale, comm)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 (a peer died or hung: not committed)
            r.error = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log.warning("ccfx: outer sync at inner step %d failed (%s): not committed%s",
                        self.outer.step, r.error, self._timeout_hint(r.error))
            self.manager.report_error(e)
            self._leave_group()

    def _commit(self, r: _Round) -> None:
        """torchft's verdict; committed: the outer step (kept for later while healing),
        else the codec state put back."""
        outer = self.outer
        if self._unhealed:  # its heal's source was healing: it must not count this sync
            r.error = r.error or "its heal's source was itself healing"
            self.manager.report_error(RuntimeError(r.error))
        try:
            r.committed = self.manager.should_commit()
            if self._unhealed:  # behind again (torchft set the quorum's step at the heal)
                self.manager.load_state_dict(r.torchft_state)
        except RuntimeError as e:
            raise CollectiveError(
                f"replica {tc.torchft_replica_id(self.manager)}: "
                f"{self.opts.max_retries + 1} outer syncs in a row were not committed (the last "
                f"at inner step {outer.step}): replicas keep dying or fewer than min_replicas="
                f"{self.opts.min_replicas} are alive") from e
        r.exchanged = self._last_exchanged = time.monotonic()
        self._last_rows = r.rows
        merged = {f.index: r.averaged[f.index] for f in r.due if f.index in r.averaged}
        if r.committed:
            if self.state is State.HEALING:  # merged once the healed state is here (_heal)
                self._replay.append(merged)
            else:
                self._merge(merged)
            self.commits += 1
            self.since, self.tokens = outer.step, 0
        else:
            for k, t in outer._codec_state().items():
                t.copy_(r.snapshot[k])

    def _end_sync(self, r: _Round) -> None:
        """The sync's history row; then the compile of the codec calls it ran eagerly (after a
        lazy heal's fetch has started: the link is idle now, and a compile before it delayed
        the fetch into the peers' next sync, whose exchange shared its downlink)."""
        self.history.append({
            "step": self.outer.step, "torchft_step": self.manager.current_step(),
            "replicas": r.comm.world if r.comm is not None else 0,
            "committed": r.committed, "healed": self._healed,
            "weight": r.total,  # the quorum's tokens (or inner steps) in this sync
            "own": r.own,  # this replica's part of it (0 for a replica that has just healed)
            "reached": r.reached,  # its own inner step: below `step` where it took the quorum's
            "slot": self.slot,  # its training place after this sync (trainers=N; None: spare)
            "error": r.error,  # why the exchange failed (the first line), else None
            "fragments": [f.index for f in r.due if f.index in r.averaged],
            "collectives": sorted(self.used),
            "seconds": time.monotonic() - r.started, "quorum_s": r.quorum_s,
            "heal_s": None})  # a lazy heal's fetch after the exchange (set by _heal)
        self._last_end = time.monotonic()
        if r.later:  # after the sync: this replica's time, not the quorum's
            if self._pending is not None:
                self._pending.start()
            self._compile(list(r.later))

    def shutdown(self) -> None:
        """Stop the manager (its heartbeats: the lighthouse drops this replica)."""
        self._close_sync_watch()
        if self._compiling is not None:  # a daemon thread inside inductor at exit can crash
            self._compiling.join(COMPILE_JOIN_S)
        manager = getattr(self, "manager", None)
        if manager is not None:
            self._become(State.CLOSED, "shut down")
            manager.shutdown(wait=False)
            self.manager = None


def _import_torchft():
    try:
        import torchft
    except ImportError as e:
        raise ConfigError("fault_tolerant=True needs torchft: pip install 'ccfx[ft]' "
                          "(torchft 0.2.0)") from e
    return torchft


def _check_supported(config) -> None:
    """What fault tolerance cannot run: an exchange in flight across a quorum change, the ring."""
    if config.fragment_delay:
        raise ConfigError("fault_tolerant=True syncs each fragment within one torchft "
                          "step: set fragment_delay=0 (an exchange in flight cannot cross "
                          "a quorum change)")
    if config.outer_collective == "ring":
        raise ConfigError("outer_collective='ring' is not supported with "
                          "fault_tolerant=True: use 'all_gather' or 'auto'")
