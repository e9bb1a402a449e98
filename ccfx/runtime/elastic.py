"""Local steps that survive their replicas: the outer sync on a torchft ``Manager``.

    outer = ccfx.local_steps(compiled, opt, fault_tolerant=True)  # lighthouse: TORCHFT_LIGHTHOUSE

Each replica (one process; its own torchft replica group of size 1) owns a torchft
``Manager`` with a reconfigurable gloo process group. Every outer sync is one torchft step:

1. ``start_quorum()`` (synchronous): the lighthouse forms a quorum of the replicas alive now;
   a replica behind the others (restarted, or one that missed a commit) *heals* in it from a
   live peer, over ccfx's checkpoint transport (:mod:`ccfx.runtime.heal`), what
   :meth:`Elastic._recovery_state` holds: the global parameters (which become its own), the
   outer optimizer's momentum, every codec state tensor, the inner step. Error-feedback
   residuals are zeroed, never taken: a residual is what *its* replica has not sent yet, and
   counting it twice would bias the average. In the quorum the healer gets only the head (the
   steps, the fingerprint: a few kB); when every codec state is a residual it joins the
   exchange with nothing to send and fetches the tensors *after* it (the survivors train on
   meanwhile: they never wait for a heal's megabytes), then merges the same averaged
   pseudo-gradient onto them, bit-identical to its peers. A shared codec state (PowerSGD's Q,
   a random codec's step) is needed by the exchange, so those codecs fetch it in the quorum,
   before the exchange, as torchft's own transport does.
2. One small all-gather on the quorum's group: each replica's tokens since its last committed
   sync, its inner step, its last interval between syncs, whether it is catching up, and the
   fingerprint of what it syncs (the parameters' names, shapes
   and dtypes and the outer options). A replica whose fingerprint is not the quorum's (the one
   most replicas hold; ties: the one at the highest step, then the lowest quorum rank) raises
   :class:`~ccfx.ConfigError` naming both fingerprints and leaves; the others do not commit
   this sync and go on without it.
3. Each due fragment's pseudo-gradient, scaled by ``tokens_i · W / Σ tokens``, is averaged by
   ccfx's own exchanges (:mod:`ccfx.wire.exchange`; on 3 or more replicas a codec that would
   be all-gathered, int8 or int8:ef, by the encoded all-to-all + all-gather of
   :mod:`ccfx.wire.collectives`, error feedback's state kept per element so that it survives
   quorum changes: :meth:`Elastic._reduce_for`) over the quorum's group: the same bytes on every replica, so the same global parameters, bit for
   bit. Tokens are what a replica reports
   with ``outer.add_tokens(n)``; a replica that never reports counts its inner steps. A replica
   that has just healed contributes zero tokens (its pseudo-gradient is zero).
4. ``should_commit()``: only if this replica got through (no error reported, at least
   ``min_replicas`` in the quorum) does the outer optimizer step; otherwise the codec state is
   put back as it was, the pseudo-gradient keeps growing to the next sync, and its global
   parameters do not move. torchft decides per replica: a peer dying inside an exchange fails
   it for every member, and a replica that misses a commit its peers made is a step behind and
   heals at the next quorum. A replica whose exchange failed aborts the quorum's group at once:
   a peer blocked on *it* (not on the dead one) gets out now instead of at the timeout, and
   reaches the next quorum with the others (torchft rebuilds the group there).
   ``max_retries`` consecutive uncommitted syncs raise :class:`~ccfx.CollectiveError`.

Joining is a sync at :func:`~ccfx.local_steps` time with nothing to send: a replica started
late waits there (up to ``quorum_timeout_s``) for the others' next sync, heals in it and trains
from its result. After a heal that fetched after the exchange it *catches up*: having spent
the fetch's seconds not training, it syncs next when its peers' last interval between syncs
has passed since that exchange (each member reports its interval in the all-gather of step 2),
or when the first of them starts it (their ``/alive`` streams say so, :class:`Watch`), if that
is sooner, whatever its own count of steps, and takes its peers' inner step there; at its own
count it would arrive the fetch's length late, and the others would wait for it up to the grace
window, then go on without it (it would heal again). Stragglers: the lighthouse's ``join_timeout_ms`` is the grace window (a quorum
waits that long for replicas that are alive but not yet at the sync); a straggler that misses
it joins the next quorum and heals there, its local steps since its last sync discarded.

Hot spares (``trainers=N``): N training places; a replica joins claiming ``slot`` (or any free
place), and one that finds every place held is a spare. A spare is in every quorum with nothing
to send (weight 0) and applies every committed average, so its global parameters, outer
optimizer and codec state stay the trainers' bit for bit; it blocks in ``local_steps`` until a
place is free and trains from then on, with no heal. Between syncs it watches the trainers
(each serves a stream of beats, :class:`~ccfx.runtime.heal.Watch`, at the address it gives in
the meet): when one dies (its stream ends with no goodbye, or falls silent) the spare takes
its place at once, from the last committed sync's state, the dead trainer's own starting point
for that interval, and syncs with the trainers at their next sync with its steps since. A
place freed otherwise (a trainer missed the quorum, shut down, or could not be watched) is
taken at the sync's meet. Places are assigned at every meet from the all-gathered claims
(:meth:`Elastic._assign_slots`), so every member decides the same. What a spare costs: a
member's share of each exchange's traffic on its own link, its wait at every sync, and one
watching connection per trainer.

Addresses: each replica serves a TCP store (the quorum's process group meets in one of them)
and its manager at ``MASTER_ADDR`` (default 127.0.0.1, replicas on one machine); across
machines set it to an address the other replicas reach (torchft's checkpoint transport
advertises ``socket.gethostname()``, which must resolve there too).

Not supported here (each a :class:`~ccfx.ConfigError` or documented): ``fragment_delay`` > 0
(an exchange in flight across a quorum change), ``outer_collective="ring"`` (point to point on
a group that changes under it), a replica spanning several ranks (PP × DP stages).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch

from ..codecs._fast import compile_later, compile_now
from ..errors import CollectiveError, ConfigError
from ..wire.collectives import element_state_layout
from .heal import HealTransport, Pending, Watch

log = logging.getLogger("ccfx")

#: A watched trainer silent this long is dead (a machine that vanished sends no FIN).
WATCH_SILENT_S = 10.0

#: How long shutdown waits for a spare's compile thread to finish.
COMPILE_JOIN_S = 120.0

#: ``ccfx.local_steps`` keywords that configure fault tolerance (not torch.compile options).
KEYS = ("fault_tolerant", "lighthouse", "replica_id", "min_replicas", "quorum_timeout_s",
        "max_retries", "trainers", "slot", "init_sync")


@dataclass(frozen=True)
class ElasticOptions:
    """``lighthouse``: its address (``http://host:port``), else ``TORCHFT_LIGHTHOUSE``;
    ``replica_id``: this replica's name (else ``REPLICA_ID``, else a fresh one);
    ``min_replicas``: the fewest replicas a sync may commit with; ``quorum_timeout_s``: how long
    a sync waits for a quorum (longer than the inner steps between two syncs);
    ``max_retries``: consecutive uncommitted syncs before giving up; ``trainers``: how many
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
    if opts.min_replicas < 1 or opts.max_retries < 0 or opts.quorum_timeout_s <= 0:
        raise ConfigError(f"fault tolerance options {opts}: min_replicas >= 1, max_retries >= 0 "
                          "and quorum_timeout_s > 0")
    if opts.trainers is None and opts.slot is not None:
        raise ConfigError(f"slot={opts.slot} names a training place: pass trainers=N (how many "
                          "replicas train; the others wait as hot spares)")
    if opts.trainers is not None and (opts.trainers < 1 or not (
            opts.slot is None or 0 <= opts.slot < opts.trainers)):
        raise ConfigError(f"trainers={opts.trainers}, slot={opts.slot}: trainers >= 1 and a "
                          "slot in 0 .. trainers - 1 (or None: take a free place, else wait "
                          "as a spare)")
    return rest, opts


def fingerprint(fragments, options: dict) -> str:
    """16 hex digits naming what a replica syncs: parameters (names, shapes, dtypes) and the
    outer options. Replicas with different ones must not average."""
    desc = {"params": [[n, list(p.shape), str(p.dtype)] for f in fragments
                       for n, p in zip(f.names, f.local)], "options": options}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


class TorchftComm:
    """The exchanges' ``Comm`` (:mod:`ccfx.wire.comm`) on a torchft process group: its size is
    the current quorum's. gloo's torchft group has no reduce-scatter, and point to point (the
    ring) is not offered on a group that is rebuilt at every quorum change."""

    def __init__(self, pg):
        self.pg = pg
        self.world = pg.size()
        self.rank = pg.parent.rank()  # this replica's place in the quorum (its chunk)

    def all_reduce(self, t):
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        out = t.detach().clone(memory_format=torch.contiguous_format)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return self.pg.allreduce([out], opts), lambda: out

    def all_gather(self, t):
        from torch.distributed.distributed_c10d import AllgatherOptions

        flat = t.detach().reshape(-1).contiguous()
        outs = [torch.empty_like(flat) for _ in range(self.world)]
        return self.pg.allgather([outs], [flat], AllgatherOptions()), lambda: torch.cat(outs)

    def all_to_all(self, t, output_splits=None, input_splits=None):
        from torch.distributed.distributed_c10d import AllToAllOptions

        inp = t.detach().contiguous()
        out = torch.empty_like(inp) if output_splits is None else inp.new_empty(
            (sum(output_splits), *inp.shape[1:]))
        work = self.pg.alltoall_base(out, inp, list(output_splits or []),
                                     list(input_splits or []), AllToAllOptions())
        return work, lambda: out

    def reduce_scatter(self, t):
        raise ConfigError("torchft's gloo process group has no reduce-scatter")

    def ring(self, flat, spec, state):
        raise ConfigError("outer_collective='ring' is not supported with fault_tolerant=True")

    def wait(self, handle):
        work, result = handle
        work.wait()
        return result()


def _cloned(state):
    """``state`` with its tensors cloned (an optimizer's ``state_dict()`` holds its live
    buffers, which the next outer step changes in place while a heal may still be reading)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cloned(v) for v in state)
    return state


def _is_residual(name: str) -> bool:
    """A codec state tensor that is this replica's own (error feedback's residuals): zeroed
    on a heal, never taken from a peer."""
    return name.rsplit(".", 1)[-1].startswith("residual")


def _ipv4_columns(host: str, port: int) -> tuple[int, int]:
    """``host``:``port`` for the meet's rows (IPv4 as an int, port); (0, 0) when ``host`` has
    no IPv4 address (no spare watches this replica then: it takes the place at the next
    sync)."""
    try:
        return int.from_bytes(socket.inet_aton(socket.gethostbyname(host)), "big"), port
    except OSError:
        return 0, 0


def _alive_url(row) -> str:
    """A meet row's ``/alive`` address (its IPv4 and port columns) as the transport's URL."""
    return f"http://{socket.inet_ntoa(row[7].to_bytes(4, 'big'))}:{row[8]}"


def _reachable(address: str, timeout_s: float = 2.0) -> bool:
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((url.hostname, url.port or 80), timeout=timeout_s):
            return True
    except OSError:
        return False


class Elastic:
    """The torchft side of one replica's :class:`~ccfx.runtime.local_steps.LocalSteps` (see the
    module docstring). Made by ``LocalSteps`` when ``fault_tolerant=True``; joins at once."""

    _pending: Pending | None = None  # a lazy heal's tensors, until _finish_heal
    _replay: list | tuple = ()  # the averages of the syncs committed while _pending (merged after)
    _in_heal = False  # inside _heal's syncs
    _unhealed = False  # this sync's heal came from a replica still healing (_load)
    _last_rows: list | tuple = ()  # the last sync's all-gathered rows, and when its exchange ended
    _last_exchanged = 0.0
    _last_rank = -1  # this replica's rank in the last sync's quorum
    _address = (0, 0)  # this replica's /alive address in the meet (_ipv4_columns)
    catching_up = False  # healed lazily: sync at the peers' next sync (catch_up_due)
    _catch_up_at: float | None = None
    _last_end: float | None = None  # when this replica's last sync ended
    _compiling: threading.Thread | None = None  # a spare's compile after its sync
    _last_step_end: float | None = None  # when catch_up_due was last asked (an inner step)
    _sync_watch: Watch | None = None  # while catching up: the in-step peers' /alive streams

    def __init__(self, outer, opts: ElasticOptions, options: dict):
        try:
            import torchft
        except ImportError as e:
            raise ConfigError("fault_tolerant=True needs torchft: pip install 'ccfx[ft]' "
                              "(torchft 0.2.0)") from e
        config = outer.config
        if config.fragment_delay:
            raise ConfigError("fault_tolerant=True syncs each fragment within one torchft "
                              "step: set fragment_delay=0 (an exchange in flight cannot cross "
                              "a quorum change)")
        if config.outer_collective == "ring":
            raise ConfigError("outer_collective='ring' is not supported with "
                              "fault_tolerant=True: use 'all_gather' or 'auto'")
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
        self._healed = False
        self._refused: str | None = None  # a healer's peer's fingerprint, when it differs
        # a heal's tensors, fetched after the exchange it joins (_finish_heal); only when every
        # codec state is a residual, which a heal zeroes (the exchange needs nothing from it)
        self._lazy = all(_is_residual(name) for name in outer._codec_state())
        self._reduces: dict = {}  # (part, quorum size) -> CompressedCollective (_reduce_for)
        self.used: set[str] = set()  # the collectives the exchanges ran
        timeout = timedelta(seconds=config.collective_timeout_s)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        from torch.distributed import TCPStore

        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self._transport = HealTransport(host, timeout)
        self._address = _ipv4_columns(host, self._transport.port)
        replica_id = opts.replica_id or os.environ.get("REPLICA_ID")
        try:
            self.manager = torchft.Manager(
                pg=torchft.ProcessGroupGloo(timeout=timeout), load_state_dict=self._load,
                state_dict=self._recovery_state, min_replica_size=opts.min_replicas,
                use_async_quorum=False, timeout=timeout,
                checkpoint_transport=self._transport,
                quorum_timeout=timedelta(seconds=opts.quorum_timeout_s),
                connect_timeout=timedelta(seconds=min(opts.quorum_timeout_s, 30.0)),
                rank=0, world_size=1, store_addr=host, store_port=self._store.port,
                lighthouse_addr=self.lighthouse, replica_id=replica_id, hostname=host,
                max_retries=opts.max_retries, init_sync=opts.init_sync)
        except Exception as e:
            raise self._no_quorum(e, "starting torchft's manager") from e
        self._keep_state_per_element()  # before the join: a heal sends it
        self.sync([])  # join: heal from a live peer if the others are ahead
        self.wait_while_spare()

    # -- hot spares (trainers=N) --------------------------------------------------------------

    @property
    def spare(self) -> bool:
        """A hot spare: in every quorum with nothing to send, applying every committed average
        (so its global parameters, outer optimizer and codec state are the trainers', bit for
        bit), until a training place is free; then it trains at once, with no heal."""
        return self.opts.trainers is not None and self.slot is None

    def wait_while_spare(self) -> None:
        """Sync with the trainers until this replica holds a training place. Between two syncs
        it watches the trainers (:class:`~ccfx.runtime.heal.Watch`): when one dies it takes
        that place at once (:meth:`_take_place`), so the place trains through the rest of the
        interval instead of standing empty until the next sync. Otherwise it joins each sync
        when the first trainer starts it (its stream says so), or at the latest
        ``WATCH_SILENT_S`` after the earliest trainer is due by their last interval: the
        lighthouse counts its grace window from the first replica to arrive, and one waiting
        there early would let a quorum form as soon as a majority has arrived, without the
        trainers that arrive after it. While that interval is unknown (the sync after the
        first join) it joins at once, up to an interval early: the lighthouse's
        ``join_timeout_ms`` must exceed the time between two syncs (as for any replica that
        joins; README)."""
        if not self.spare:
            return
        log.info("ccfx: replica %s is a hot spare (the %d training places are held): it syncs "
                 "with nothing to send until one is free", self.manager._replica_id,
                 self.opts.trainers)
        while self.spare:
            at = self._next_sync_at(self._last_rows, self._last_exchanged)
            if at is not None:
                slot = self._watch_trainers(at)
                if slot is not None:
                    self._take_place(slot, at)
                    return
            self.sync([])
        self.since, self.tokens = self.outer.step, 0  # it trains from here
        log.info("ccfx: replica %s takes training place %d at inner step %d",
                 self.manager._replica_id, self.slot, self.outer.step)

    def _watch_trainers(self, until: float) -> int | None:
        """Until the trainers' next sync (the first of them starts it, or ``until`` +
        ``WATCH_SILENT_S``, their estimated time and a margin): the place of a trainer that
        died meanwhile and that this spare takes, or None. The places and the spares' order come
        from the last meet's rows, as every member computes them (:meth:`_assign_slots`): the
        ``j``-th waiting spare takes the ``j``-th death it sees. Deaths seen in another order
        by two spares, or a trainer alive but cut off from this spare, make two claims on a
        place at the next meet: the in-step trainer keeps it, the other member becomes a spare
        again (its steps counted in that sync's average, once). A spare that takes a place
        keeps watching the other trainers: it syncs when they do (:meth:`catch_up_due`)."""
        rows, me = self._last_rows, self._last_rank
        if not rows or not 0 <= me < len(rows):
            return None
        places = {i: self._assign_slots(rows, i) for i in range(len(rows))}
        spares = sorted((i for i, s in places.items() if s is None),
                        key=lambda i: (rows[i][4] == 2, i))
        urls = {s: _alive_url(rows[i]) for i, s in places.items()
                if s is not None and rows[i][8] > 0}
        if me not in spares or not urls:
            return None
        j = spares.index(me)
        watch = Watch(urls, silent_s=WATCH_SILENT_S, sync_step=self.manager.current_step())
        try:
            dead = watch.wait(until + WATCH_SILENT_S, more_than=j, or_sync=True)
            if len(dead) <= j and not watch.synced and watch.alive():
                log.info("ccfx: spare %s heard no trainer start the sync due %.1f s ago: "
                         "joining it", self.manager._replica_id, time.monotonic() - until)
        except BaseException:
            watch.close()
            raise
        if len(dead) > j and not watch.synced:
            self._sync_watch = watch  # closed when this replica syncs (sync)
            return dead[j]
        watch.close()
        return None

    def _take_place(self, slot: int, at: float) -> None:
        """Train in the place of a trainer that died between syncs, from now: this spare's
        state is the last committed sync's, as the dead trainer's was when it started the
        interval. It syncs when the other trainers do (at ``at``, or when the first of them
        starts the sync, on the streams it watched them by, if that is sooner:
        :meth:`catch_up_due`), its steps since weighted as they are, and claims the place
        there."""
        self.slot = slot
        self.catching_up, self._catch_up_at, self._last_step_end = True, at, None
        self.since, self.tokens = self.outer.step, 0
        log.info("ccfx: replica %s takes training place %d at inner step %d, %.1f s before "
                 "the next sync: its trainer died", self.manager._replica_id, slot,
                 self.outer.step, max(0.0, at - time.monotonic()))

    def _assign_slots(self, rows, rank: int) -> int | None:
        """The training place of quorum member ``rank`` after this meet; every member computes
        it from the same rows. A place claimed by several members stays with the first in
        step (not catching up or healing), in quorum order: a trainer that missed a quorum,
        whose place a spare took meanwhile, comes back as a spare. Free places go to the
        members holding none, ready spares first (in quorum order)."""
        trainers = self.opts.trainers
        holder: dict[int, int] = {}
        for i in sorted(range(len(rows)), key=lambda i: (rows[i][4], i)):
            claim = rows[i][5]
            if 0 <= claim < trainers and claim not in holder:
                holder[claim] = i
        placed = set(holder.values())
        waiting = sorted((i for i in range(len(rows)) if i not in placed),
                         key=lambda i: (rows[i][4] == 2, i))
        free = [s for s in range(trainers) if s not in holder]
        holder.update(zip(free, waiting))
        return next((s for s, i in holder.items() if i == rank), None)

    # -- tokens -------------------------------------------------------------------------------

    def add_tokens(self, n: int) -> None:
        self.counts_tokens = True
        self.tokens += int(n)

    def _weight(self) -> int:
        return self.tokens if self.counts_tokens else self.outer.step - self.since

    # -- recovery (torchft calls these) -------------------------------------------------------

    def _recovery_state(self) -> dict:
        """What a healing peer takes from this replica (clones: served while we go on). A
        replica whose own heal is still fetching has no state to give (torchft may pick it: it
        is at the quorum's step): it says so, and the peer heals at the next quorum."""
        outer = self.outer
        if self._pending is not None:
            return {"fingerprint": self.fingerprint, "unavailable": True}
        return {"fingerprint": self.fingerprint, "step": outer.step, "syncs": outer.syncs,
                "global": [[g.clone() for g in f.global_] for f in outer.fragments],
                "outer": [_cloned(f.outer.state_dict()) for f in outer.fragments],
                "codec": {k: t.clone() for k, t in outer._codec_state().items()}}

    def _load(self, state) -> None:
        """torchft's load function: ``state`` is a :class:`~ccfx.runtime.heal.Pending` (its
        ``head`` now, its tensors on request) or, from another transport, the whole state."""
        pending = state if isinstance(state, Pending) else None
        head = pending.head if pending is not None else state
        if head["fingerprint"] != self.fingerprint:
            self._refused = head["fingerprint"]  # raised after the all-gather (step 2)
            return
        outer = self.outer
        if head.get("unavailable"):
            self._unhealed = True  # not committed; behind, it heals at the next quorum
            if self._pending is not None:  # an earlier heal's fetch: torchft says it is stale
                self._pending.cancel()
                self._pending, self._replay = None, []
            log.info("ccfx: the replica torchft chose to heal this one from is itself still "
                     "healing: healing at the next quorum")
            return
        with torch.no_grad():
            for name, t in outer._codec_state().items():
                if _is_residual(name):
                    t.zero_()
        outer.step, outer.syncs = int(head["step"]), int(head["syncs"])
        self.since, self.tokens = outer.step, 0
        self._healed = True
        self.catching_up = True  # the source's step may be one it was catching up from
        if pending is None:
            self._apply(state)
        elif self._lazy:
            if self._pending is not None:  # an earlier heal still fetching: superseded
                self._pending.cancel()
            self._pending = pending  # fetched after the exchange: _heal
            self._replay = []  # averages kept for an earlier heal's state: superseded
        else:  # a shared codec state (PowerSGD's Q, a codec's step) the exchange needs now
            self._apply(pending.result(self.outer.config.collective_timeout_s))

    def _apply(self, state: dict) -> None:
        """The healed tensors: global parameters (and the local ones), the outer optimizers'
        state, the codecs' shared state (residuals were zeroed in :meth:`_load`)."""
        outer = self.outer
        with torch.no_grad():
            for frag, saved, opt_state in zip(outer.fragments, state["global"], state["outer"]):
                for g, p, s in zip(frag.global_, frag.local, saved):
                    g.copy_(s)
                    p.copy_(s)
                frag.outer.load_state_dict(opt_state)
            for name, t in outer._codec_state().items():
                if not _is_residual(name):
                    t.copy_(state["codec"][name])

    def _finish_heal(self, torchft_state: dict) -> str | None:
        """Fetch and apply a lazy heal's tensors (after the exchange, so the serving peer's
        uplink carries them while its replica trains, not while the quorum exchanges); None,
        or why it failed. A failed fetch leaves this replica's parameters unhealed: torchft's
        step is put back (``torchft_state``, from before the quorum) so the next quorum heals
        it again."""
        pending, self._pending = self._pending, None
        replay, self._replay = self._replay, []
        try:
            self._apply(pending.result(self.outer.config.collective_timeout_s))
        except Exception as e:  # noqa: BLE001 (the source died or the link timed out)
            self.manager.load_state_dict(torchft_state)
            error = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log.warning("ccfx: fetching the healed state failed (%s): healing again at the "
                        "next sync", error)
            return f"heal: {error}"
        for merged in replay:
            self._merge(merged)
        return None

    def catch_up_due(self) -> bool:
        """After a lazy heal, whether to sync now rather than at this replica's own next sync
        step: it spent the fetch's seconds not training, and at its own count of steps it
        would reach the sync that long after its peers (who would wait for it, up to the
        lighthouse's join timeout, and then go on without it). It syncs when its peers' last
        interval between syncs has passed since the exchange it healed in, and takes their
        inner step there (:meth:`sync`). Called once per inner step: it syncs at the step
        that ends nearest that time (a step earlier when less than half a step is left).
        Where it watches its in-step peers' streams (:class:`~ccfx.runtime.heal.Watch`), it
        also syncs at the end of the step in which the first of them starts the sync, if that
        comes first: the time is the last interval's, and after a slower interval (a heal's
        transfer on the shared cores of the 10 M bench) it arrived seconds after everyone
        else, who waited for it."""
        now, last = time.monotonic(), self._last_step_end
        self._last_step_end = now
        if not self.catching_up or self._catch_up_at is None:
            return False
        if self._sync_watch is not None and self._sync_watch.synced:
            return True  # a peer has started the sync: this step's end is the soonest
        half_step = (now - last) / 2 if last is not None else 0.0
        return now + half_step >= self._catch_up_at

    # -- one sync -----------------------------------------------------------------------------

    def sync(self, due: list) -> bool:
        """One torchft step over the fragments ``due`` (see the module docstring); whether it
        was committed."""
        outer = self.outer
        started = time.monotonic()
        interval = started - self._last_end if self._last_end is not None else None
        self.used = set()
        self._healed, self._refused, self._unhealed = False, None, False
        # a spare or a peer catching up that watches this replica joins now too
        self._transport.announce_sync(self.manager.current_step())
        self._close_sync_watch()
        if self.spare:  # its step is stale: it takes the trainers' (_adopt_step)
            self.catching_up = True
        torchft_state = self.manager.state_dict()  # put back if a lazy heal's fetch fails
        try:
            self.manager.start_quorum()
        except Exception as e:
            self.shutdown()  # this replica stops here: its heartbeats must stop too
            raise self._no_quorum(e, f"the outer sync at inner step {outer.step}") from e
        quorum_s = time.monotonic() - started  # the quorum, the group's rebuild, a heal
        # what an uncommitted sync puts back (taken after a heal: the healed state stays)
        snapshot = {k: t.clone() for k, t in outer._codec_state().items()}
        if self._healed:  # the fragments the peers sync now, at the step we took from them
            due = [f for f in outer.fragments
                   if outer.step > 0 and outer.step % outer.sync_every == f.offset]
        comm = None
        averaged: dict[int, list[torch.Tensor]] = {}
        later: list = []  # codec calls run eagerly in the exchange, compiled after the sync
        own = 0 if self._unhealed or self.spare else self._weight()
        total, error, rows = 0, None, []
        try:
            # inside the try: when the group's rebuild failed in the quorum (torchft reports it
            # and leaves the group unset), this sync is uncommitted like any failed exchange
            comm = TorchftComm(self.manager._pg)
            rows = self._meet(comm, own, interval)
            self._last_rank = comm.rank
            self._check_fingerprints(rows, comm)
            self._check_start(rows)
            due = self._adopt_step(rows, due)
            if self.opts.trainers is not None:
                self.slot = self._assign_slots(rows, comm.rank)
            total = sum(r[0] for r in rows)
            if total > 0:
                scale = own * comm.world / total
                with compile_later() as later:  # the quorum waits on this exchange, not on a
                    for frag in due:  # compile: new shapes (a joiner's first) run eagerly
                        averaged[frag.index] = self._exchange(frag, scale, comm)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 (a peer died or hung: this sync is not committed)
            error = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log.warning("ccfx: outer sync at inner step %d failed (%s): not committed%s",
                        outer.step, error, self._timeout_hint(error))
            self.manager.report_error(e)
            self._leave_group()
        if self._unhealed:  # its heal's source was healing: it must not count this sync
            error = error or "its heal's source was itself healing"
            self.manager.report_error(RuntimeError(error))
        try:
            committed = self.manager.should_commit()
            if self._unhealed:  # behind again (torchft set the quorum's step at the heal)
                self.manager.load_state_dict(torchft_state)
        except RuntimeError as e:
            raise CollectiveError(
                f"replica {self.manager._replica_id}: {self.opts.max_retries + 1} outer syncs in "
                f"a row were not committed (the last at inner step {outer.step}): replicas "
                "keep dying or fewer than min_replicas="
                f"{self.opts.min_replicas} are alive") from e
        world = comm.world if comm is not None else 0
        exchanged = self._last_exchanged = time.monotonic()
        self._last_rows = rows
        merged = {f.index: averaged[f.index] for f in due if f.index in averaged}
        if committed:
            if self._pending is not None:  # merged once the healed state is here (_heal)
                self._replay.append(merged)
            else:
                self._merge(merged)
            self.commits += 1
            self.since, self.tokens = outer.step, 0
        else:
            for k, t in outer._codec_state().items():
                t.copy_(snapshot[k])
        self.history.append({
            "step": outer.step, "torchft_step": self.manager.current_step(),
            "replicas": world, "committed": committed, "healed": self._healed,
            "weight": total,  # the quorum's tokens (or inner steps) in this sync
            "own": own,  # this replica's part of it (0 for a replica that has just healed)
            "slot": self.slot,  # its training place after this sync (trainers=N; None: spare)
            "error": error,  # why the exchange failed (the first line), else None
            "fragments": [f.index for f in due if f.index in averaged],
            "collectives": sorted(self.used),
            "seconds": time.monotonic() - started, "quorum_s": quorum_s,
            "heal_s": None})  # a lazy heal's fetch after the exchange (set by _heal)
        self._last_end = time.monotonic()
        if later:  # after the sync: this replica's time, not the quorum's
            if self._pending is not None:  # a lazy heal's fetch first: the link is idle now,
                self._pending.start()  # and a compile before it delayed the fetch into the
            self._compile(list(later))  # peers' next sync, whose exchange shared its downlink
        if self._pending is not None and not self._in_heal:
            committed = self._heal(torchft_state, rows, exchanged) and committed
        return committed

    def _compile(self, calls: list) -> None:
        """Compile the codec calls the last exchange ran eagerly (its row's ``compile_s``). A
        trainer compiles before its next inner step. A spare compiles on a thread of its own:
        it must watch the trainers from the sync's end, and a trainer that died during an 8-15 s
        compile (a 10 M model's chunks) had its place taken only when the compile ended
        (bench/README, session 19); the calls stay eager until compiled (``_fast``)."""
        row, started = self.history[-1], time.monotonic()
        if not self.spare:
            compile_now(calls)
            row["compile_s"] = time.monotonic() - started
            return

        previous = self._compiling  # (chained: shutdown's join of the last covers them all)

        def run() -> None:
            if previous is not None:
                previous.join()  # dynamo compiles one at a time anyway (its compile lock)
            try:
                compile_now(calls)
            except Exception as e:  # noqa: BLE001 (a thread's error reaches nobody: say it)
                log.warning("ccfx: a spare's compile of its exchange's codec calls failed "
                            "(%s): they run eagerly and compile again after the next sync", e)
            row["compile_s"] = time.monotonic() - started

        self._compiling = threading.Thread(target=run, daemon=True, name="ccfx-spare-compile")
        self._compiling.start()

    def _merge(self, merged: dict[int, list[torch.Tensor]]) -> None:
        """The outer step of each fragment in ``merged`` with its averaged pseudo-gradient."""
        from .local_steps import _InFlight

        outer = self.outer
        for frag in outer.fragments:
            if frag.index in merged:
                frag.in_flight = _InFlight(outer.step, outer.step, averaged=merged[frag.index])
                outer._merge(frag)

    def _heal(self, torchft_state: dict, rows, exchanged: float) -> bool:
        """A lazy heal after its exchange: wait for the tensors, and if they are not here by
        the peers' next sync, take part in it with nothing to send (its average kept for
        later), as many syncs as the fetch takes; then apply the state and merge the kept
        averages in order: the same outer steps on the same values as the peers, so the same
        bits. The joiner stays in every quorum meanwhile, and the peers never wait for it
        longer than its arrival at a sync. Whether the heal succeeded (when the fetch fails,
        the syncs since are not this replica's: uncommitted, and it heals again)."""
        first, started, error = len(self.history) - 1, exchanged, None
        self._in_heal = True
        try:
            while True:
                at = self._next_sync_at(rows, exchanged)
                wait = None if at is None else max(0.0, at - time.monotonic())
                if self._pending.done(wait):
                    break
                self.catching_up = True  # take the peers' step and fragments (_adopt_step)
                self.sync([])  # may heal again: a newer fetch replaces this one (_load)
                if self._pending is None:  # told to heal from a replica still healing:
                    self.manager.load_state_dict(torchft_state)  # start over, behind
                    error = "heal: its source was itself healing"
                    break
                rows, exchanged = self._last_rows, self._last_exchanged
            if error is None:
                error = self._finish_heal(torchft_state)
        finally:
            self._in_heal = False
        self.history[first]["heal_s"] = time.monotonic() - started
        if error is not None:
            for row in self.history[first:]:
                if row["committed"]:
                    row["committed"], row["error"] = False, error
                    self.commits -= 1
            return False
        self._start_catch_up(rows, exchanged)
        return True

    def _timeout_hint(self, error: str) -> str:
        """Why a sync may time out with every replica alive: the exchange waits for a joiner's
        heal, whose transfer ``collective_timeout_s`` must cover."""
        if "timed out" not in error.lower() and "timeout" not in error.lower():
            return ""
        state = sum(g.numel() * g.element_size() for f in self.outer.fragments for g in f.global_)
        return (f" (if a replica was joining: the others' exchange waits for its heal, "
                f"{state / 1e6:.1f} MB of global parameters and more from one peer; "
                f"collective_timeout_s={self.outer.config.collective_timeout_s:g} s must cover that "
                "transfer over the slowest link, several times over at step 0, when torchft "
                "sends every replica its copy from one)")

    def _meet(self, comm: TorchftComm, own: int, interval: float | None) -> list[tuple]:
        """Every member's (tokens, inner step, fingerprint as an int, milliseconds from its
        previous sync's end to this one's start or -1, where it stands: 0 in step, 1 catching
        up or a spare, 2 healing (its state not here yet), the training place it claims or
        -1, with ``init_sync=False`` at inner step 0 a digest of its global parameters or 0,
        its ``/alive`` address for hot spares: IPv4 as an int and port, or 0 and 0)."""
        healing = self._pending is not None or self._unhealed
        mine = torch.tensor([own, self.outer.step, int(self.fingerprint, 16) - (1 << 63),
                             -1 if interval is None else int(interval * 1000),
                             2 if healing else int(self.catching_up),
                             -1 if self.slot is None else self.slot,
                             self._start_digest(healing), *self._address], dtype=torch.int64)
        rows = comm.wait(comm.all_gather(mine)).view(comm.world, len(mine))
        return [tuple(int(x) for x in row) for row in rows.tolist()]

    def _start_catch_up(self, rows, exchanged: float) -> None:
        """After a lazy heal: sync next when the peers do, whatever this replica's own step
        count (:meth:`catch_up_due`)."""
        self.catching_up = True
        self._catch_up_at = self._next_sync_at(rows, exchanged)
        self._close_sync_watch()
        if self._catch_up_at is not None and not self.spare:  # (a spare: _watch_trainers)
            self._sync_watch = self._watch_in_step(rows)

    def _watch_in_step(self, rows) -> Watch | None:
        """A watch on the ``/alive`` streams of the meet's members that trained in step
        through their last interval (not this replica), told of a sync at torchft's current
        step or later; None when no such member has a stream."""
        urls = {i: _alive_url(r) for i, r in enumerate(rows)
                if i != self._last_rank and r[0] > 0 and not r[4] and r[8] > 0}
        if not urls:
            return None
        return Watch(urls, silent_s=WATCH_SILENT_S, sync_step=self.manager.current_step())

    def _close_sync_watch(self) -> None:
        if self._sync_watch is not None:
            self._sync_watch.close()
            self._sync_watch = None

    @staticmethod
    def _next_sync_at(rows, exchanged: float) -> float | None:
        """When the earliest of the peers that trained through their last interval will reach
        the next sync: that interval, counted from this sync's exchange; None if unknown."""
        intervals = [r[3] for r in rows if r[0] > 0 and r[3] >= 0 and not r[4]]
        return exchanged + min(intervals) / 1000 if intervals else None

    def _adopt_step(self, rows, due: list) -> list:
        """Every member leaves the meet at one inner step and so exchanges the same fragments:
        the step of the members in step (not catching up; the highest should they differ),
        else the highest of all. A member elsewhere takes it: one catching up after a heal,
        one healed from a peer that was itself catching up (it reports that peer's step), one
        whose ghost sync passed no fragments. Its own steps since the heal still count as its
        weight. Every member computes the same rule on the same rows: no extra round."""
        catching_up = self.catching_up
        self.catching_up, self._catch_up_at = False, None
        steps = [r[1] for r in rows if not r[4]] or [r[1] for r in rows]
        outer = self.outer
        if outer.step == max(steps) and not catching_up:
            return due
        outer.step = max(steps)
        return [f for f in outer.fragments
                if outer.step > 0 and outer.step % outer.sync_every == f.offset]

    def _start_digest(self, healing: bool) -> int:
        """With ``init_sync=False``, at inner step 0: a digest of the global parameters (the
        replicas must have been built alike), else 0 (nothing to check)."""
        if self.opts.init_sync or self.outer.step != 0 or healing:
            return 0
        h = hashlib.sha256()
        for frag in self.outer.fragments:
            for g in frag.global_:
                flat = g.detach().cpu().contiguous().reshape(-1)
                h.update(flat.view(torch.uint8).numpy().tobytes())
        return int.from_bytes(h.digest()[:8], "big") - (1 << 63) or 1

    def _check_start(self, rows) -> None:
        """``init_sync=False``: the members at step 0 must start from the same parameters."""
        digests = {r[6] for r in rows if r[6] != 0}
        if len(digests) > 1:
            self.shutdown()
            raise ConfigError(
                f"init_sync=False, but the {len(rows)} replicas of the first sync start from "
                f"{len(digests)} different parameters: build the model from the same seed on "
                "every replica (torch.manual_seed before building it), or leave init_sync=True "
                "(torchft then sends every replica the first one's state at step 0)")

    def _check_fingerprints(self, rows, comm) -> None:
        prints = [f"{r[2] + (1 << 63):016x}" for r in rows]
        if len(set(prints)) == 1 and self._refused is None:
            return
        counts = {p: prints.count(p) for p in prints}
        steps = {p: max(r[1] for r, q in zip(rows, prints) if q == p) for p in prints}
        ref = min(prints, key=lambda p: (-counts[p], -steps[p], prints.index(p)))
        if self.fingerprint != ref:
            self.shutdown()
            raise ConfigError(
                f"this replica syncs other parameters or options (fingerprint "
                f"{self.fingerprint}) than the replicas it joined (fingerprint {ref}): start it "
                "with the same model and the same local-step options")
        odd = sorted({p for p in prints if p != ref} | {self._refused} - {None})
        raise RuntimeError(f"a replica with fingerprint {', '.join(odd)} (ours: {ref}) was "
                           "refused: this sync is not committed")

    def _exchange(self, frag, scale: float, comm) -> list[torch.Tensor]:
        with torch.no_grad():
            if self._pending is not None or self._unhealed:  # healing: nothing of its own to
                delta = [torch.zeros_like(g) for g in frag.global_]  # send; stale parameters
            else:
                delta = [(g - p.detach().float()) * scale
                         for g, p in zip(frag.global_, frag.local)]
        out: list[torch.Tensor | None] = [None] * len(delta)
        for part in frag.parts:
            grads = [delta[i] for i in part.members]
            reduce = self._reduce_for(part, comm.world)
            if reduce is None:
                result = part.exchange.run(grads, part.state, comm)
                self.used.add(part.exchange.collective)
            else:
                layout = part.exchange.layout
                state = reduce.state_from_elements(part.state, comm.rank) if part.state else {}
                result = layout.unflat(reduce.run(layout.flat(grads), state, comm))
                if part.state:
                    self._dropped(part, reduce.state_to_elements(state, part.state, comm.rank),
                                  comm)
                self.used.add("all_to_all+all_gather")
            for i, a in zip(part.members, result, strict=True):
                out[i] = a.float()
        return out

    def _reduce_for(self, part, world: int):
        """On 3 or more replicas, with ``outer_collective="auto"``, a part that would be
        all-gathered (int8, fp8, int4:ef, ...) is averaged by the encoded all-to-all + all-gather
        of :mod:`ccfx.wire.collectives` instead (each chunk's owner sums in rank order and
        re-encodes once; every replica decodes the same bytes): ``2 (W-1)`` chunk payloads
        (about ``2 (W-1) / W`` of a payload) per replica instead of ``W - 1`` payloads. Built
        per quorum size (the chunks are 1/W of the part).

        Codec state: a stateless codec has none. An error-feedback codec (int8:ef) keeps its
        state per element of the part (:func:`ccfx.wire.collectives.element_state_layout`,
        made at start by :meth:`_keep_state_per_element`), the same whatever the quorum, and
        each sync lays it out for the quorum it runs in: ``residual`` (what this replica has
        not sent yet of its own pseudo-gradient, element by element: the all-gather form on 2
        replicas keeps and uses the same one, so the forms alternate with nothing lost) and
        ``residual_owner`` (what this replica's re-encode of the reduced chunk it owns lost,
        fed back into that chunk at the next sync). At a quorum change a replica's chunk moves:
        the owner residual it holds outside its new chunk is dropped (the log says how many
        elements; :attr:`residual_dropped` counts them), the part inside it kept; a heal
        zeroes both (they are this replica's own). None where it does not apply: 2 replicas
        (the all-gather sends the same one payload), a codec with other state (a stochastic
        codec's step), and the ring (needs point to point on a group torchft rebuilds)."""
        if (world < 3 or part.exchange.collective != "all_gather"
                or self.outer.config.outer_collective != "auto"):
            return None
        layout = part.exchange.layout
        per_element = element_state_layout(part.exchange.spec, layout.numel)
        if part.state and (per_element is None or sorted(part.state) != sorted(per_element)):
            return None
        key = (id(part), world)
        if key not in self._reduces:
            from ..wire.collectives import CollectiveCall, CompressedCollective

            call = CollectiveCall("all_reduce", (layout.numel,), torch.float32, world, "avg")
            try:
                built = CompressedCollective(call, part.exchange.spec,
                                             owner_feedback=bool(part.state))
            except ConfigError:
                built = None
            if built is not None and not part.state and built.state_layout():
                built = None  # state the all-gather form does not have (a codec's step)
            self._reduces[key] = built
        return self._reduces[key]

    def _keep_state_per_element(self) -> None:
        """Give each part whose codec keeps its state per element (error feedback:
        :func:`~ccfx.wire.collectives.element_state_layout`) the owner residual of the
        all-to-all form beside the residual it has, before anything snapshots, sends or saves
        the codec state (so an uncommitted sync puts it back, a heal zeroes it and a
        checkpoint holds it, under ``...part<p>.residual_owner``)."""
        self.residual_dropped = 0
        if self.outer.config.outer_collective != "auto":
            return
        for frag in self.outer.fragments:
            for part in frag.parts:
                layout = part.exchange.layout
                per_element = element_state_layout(part.exchange.spec, layout.numel)
                if (part.exchange.collective == "all_gather" and per_element is not None
                        and sorted(part.state) == ["residual"]):
                    shape, dtype = per_element["residual_owner"]
                    part.state["residual_owner"] = part.state["residual"].new_zeros(
                        shape, dtype=dtype)

    def _dropped(self, part, count: int, comm) -> None:
        if count:
            self.residual_dropped = getattr(self, "residual_dropped", 0) + count
            log.info("ccfx: outer sync at inner step %d: the quorum is %d replicas, this one "
                     "owns chunk %d of %s: dropped the owner error-feedback residual of %d "
                     "elements it no longer owns", self.outer.step, comm.world, comm.rank,
                     part.exchange.spec, count)

    # -- failures -----------------------------------------------------------------------------

    def _leave_group(self) -> None:
        """Abort this quorum's process group at once after a failed exchange, so the peers
        still blocked in it on *this* replica get out now. A SIGKILLed peer's sockets close and
        gloo errors at once for whoever waits on it, but a replica waiting on a live one that
        already left (the all-gather's ring after the all-to-all) waited until that one
        rebuilt its group at its next quorum, or until ``collective_timeout_s``, missed that
        quorum and healed a sync later, its inner steps lost (bench/README: elastic). torchft
        rebuilds the group at the next quorum (an uncommitted step gives a new quorum id)."""
        pg = getattr(self.manager, "_pg", None)
        if pg is None or getattr(pg, "_pg", None) is None:
            return
        try:
            pg.abort()
        except Exception as e:  # noqa: BLE001 (best effort: the rebuild replaces it anyway)
            log.info("ccfx: aborting the failed sync's process group: %s", e)

    def _no_quorum(self, e: BaseException, what: str) -> CollectiveError:
        text = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if not _reachable(self.lighthouse):
            return CollectiveError(
                f"{what}: the torchft lighthouse at {self.lighthouse} is unreachable ({text}): "
                "start it (torchft_lighthouse --min_replicas N --join_timeout_ms 10000) or point "
                "lighthouse= / TORCHFT_LIGHTHOUSE at it")
        return CollectiveError(
            f"{what}: no quorum formed within quorum_timeout_s={self.opts.quorum_timeout_s:g} s "
            f"({text}): fewer replicas than the lighthouse's --min_replicas (this replica asks "
            f"min_replicas={self.opts.min_replicas}) reached a sync in time; start more "
            "replicas, lower the minimum, or raise quorum_timeout_s above the time between "
            "two syncs")

    def shutdown(self) -> None:
        """Stop the manager (its heartbeats: the lighthouse drops this replica)."""
        self._close_sync_watch()
        if self._compiling is not None:  # a daemon thread inside inductor at exit can crash
            self._compiling.join(COMPILE_JOIN_S)
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.shutdown(wait=False)
            self.manager = None
