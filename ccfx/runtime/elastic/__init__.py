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

The lighthouse may restart: a replica that has been in a quorum and finds it unreachable
(a connect before the quorum, at most once a second) skips the sync and trains on, its
pseudo-gradient growing as after an uncommitted sync; a request in flight as it died is retried
by torchft (``quorum_retries``, about once a second) up to ``quorum_timeout_s``. The first quorum
after it is back rebuilds the group whatever its id (a restarted lighthouse counts from 1
again). Past ``lighthouse_outage_s`` unreachable, a :class:`~ccfx.CollectiveError` names it; a
request that fails with the lighthouse reachable is skipped too, ``max_retries`` in a row.

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

The package, by concern: :mod:`.options` (the options, :func:`split_options`), :mod:`.states`
(where a replica stands, :class:`State`, and its one transition), :mod:`.comm` (the exchanges'
``Comm`` on torchft's group), :mod:`.meet` (the all-gather of where each member stands and its
checks), :mod:`.exchange` (the averaging, the merge, the compile after it), :mod:`.healing`
(serving and taking heals), :mod:`.catch_up`, :mod:`.spares`, :mod:`.failures`, and
:mod:`.replica`, the :class:`Elastic` façade that runs one sync through them.
"""

from __future__ import annotations

from .comm import TorchftComm
from .meet import fingerprint
from .options import COMPILE_JOIN_S, KEYS, WATCH_SILENT_S, ElasticOptions, split_options
from .replica import Elastic
from .states import TRANSITIONS, IllegalTransition, State

__all__ = ["COMPILE_JOIN_S", "KEYS", "TRANSITIONS", "WATCH_SILENT_S", "Elastic", "ElasticOptions",
           "IllegalTransition", "State", "TorchftComm", "fingerprint", "split_options"]
