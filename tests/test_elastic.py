"""Fault-tolerant local steps on torchft (issue #20): replicas die, join and recover from a live
peer; nobody restarts from a checkpoint.

One scenario group (the module fixture ``run``) starts a torchft lighthouse in this process and
replicas as processes on 127.0.0.1 (tests/elastic_workers.py says why not tests/ranks.py):
three train (two streamed fragments, int8 with error feedback), one is SIGKILLed mid-training, the other two go on, the killed one is started
again and recovers, then a replica with other options tries to join and is refused. The
failures that need no peer (lighthouse unreachable, too few replicas) run in this process.
Every wait is bounded."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ccfx

pytest.importorskip("torchft")

from . import elastic_workers as w


@pytest.fixture(scope="module")
def run():
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    reps = w.Replicas(lighthouse.address(), deadline_s=300)  # 200 s at load ~36
    out = {}
    try:
        for name in ("r0", "r1", "r2"):
            reps.start(name, seed=int(name[1]))
        reps.wait_for("r2's second committed sync among three",
                      lambda: reps.committed("r2", replicas=3) >= 2)
        reps.kill("r2")
        out["before_kill"] = {n: len(reps.syncs[n]) for n in ("r0", "r1")}
        reps.wait_for("two committed syncs of the survivors alone",
                      lambda: all(reps.committed(n, replicas=2, after=out["before_kill"][n]) >= 2
                                  for n in ("r0", "r1")))
        out["killed_rows"] = len(reps.syncs["r2"])
        reps.start("r2", seed=7)
        reps.wait_for("the restarted r2's first committed sync",
                      lambda: reps.committed("r2", after=out["killed_rows"]) >= 1)
        reps.start("odd", seed=0, options={**w.STREAMED, "outer_lr": 0.5},
                   may_fail=True)
        reps.wait_for("the replica with other options to end", lambda: "odd" in reps.ends)
        reps.stop(("r0", "r1", "r2"))
        out["reps"] = reps
        yield out
    finally:
        reps.close()
        lighthouse.shutdown()


@pytest.mark.slow
def test_survivors_keep_committing_after_a_sigkill(run):
    reps = run["reps"]
    for name in ("r0", "r1"):
        after = reps.syncs[name][run["before_kill"][name]:]
        alone = [row for row, _ in after if row["committed"] and row["replicas"] == 2]
        assert len(alone) >= 2, after
        assert reps.ends[name][0] == "done"


@pytest.mark.slow
def test_restarted_replica_heals_bit_identical_at_its_first_sync(run):
    reps = run["reps"]
    rows = reps.syncs["r2"][run["killed_rows"]:]
    healed = next(row for row, _ in rows if row["committed"])
    assert healed["healed"]  # it took the state from a live peer, not its own seed-7 model
    assert healed["own"] == 0 < healed["weight"]  # its own steps count from here on
    # it joined the peers' sync of one streamed fragment, and synced that same fragment
    assert len(healed["fragments"]) == 1, healed
    # the first parameters it trained from (after the heal, and any syncs the heal's fetch
    # spanned: merged at its end) are its peers' after the same sync, bit for bit
    first = next((row, digest) for row, digest in rows if digest is not None)
    assert first[0]["committed"] and first[0]["torchft_step"] >= healed["torchft_step"], first
    for name in ("r0", "r1"):
        peer = {row["torchft_step"]: (row, d) for row, d in reps.syncs[name] if row["committed"]}
        row, digest = peer[healed["torchft_step"]]
        assert row["fragments"] == healed["fragments"] and row["replicas"] == 3, row
        row, digest = peer[first[0]["torchft_step"]]
        assert digest == first[1], name


@pytest.mark.slow
def test_globals_equal_after_every_committed_sync(run):
    reps = run["reps"]
    by_step: dict[int, set[str]] = {}
    for name in ("r0", "r1", "r2"):
        for row, digest in reps.syncs[name]:
            if row["committed"] and digest is not None:
                by_step.setdefault(row["torchft_step"], set()).add(digest)
    assert len(by_step) >= 6
    assert all(len(d) == 1 for d in by_step.values()), by_step


@pytest.mark.slow
def test_each_commit_counts_the_steps_of_its_members_since_their_last_commit(run):
    """What goodput counts (bench/elastic sums r0's ``weight``): a committed sync's weight is
    the sum of its members' own inner steps since their last committed sync (none of the
    killed replica's after its last commit; 0 for one that has just healed), checked at every
    torchft step whose members all reported it."""
    reps = run["reps"]
    by_step: dict[int, list[dict]] = {}
    for name in ("r0", "r1", "r2"):
        for row, _ in reps.syncs[name]:
            if row["committed"]:
                by_step.setdefault(row["torchft_step"], []).append(row)
    whole = {s: rows for s, rows in by_step.items() if len(rows) == rows[0]["replicas"]}
    assert len(whole) >= 6, sorted(by_step)
    for rows in whole.values():
        assert len({r["weight"] for r in rows}) == 1, rows
        assert sum(r["own"] for r in rows) == rows[0]["weight"], rows
        assert all(r["own"] == 0 for r in rows if r["healed"]), rows
    # r0 and r1 train on while r2 is dead: their steps are counted as before
    alone = [rows for rows in whole.values() if rows[0]["replicas"] == 2]
    assert any(all(r["own"] > 0 for r in rows) for rows in alone), alone


@pytest.mark.slow
def test_replica_with_other_options_is_refused_naming_both_fingerprints(run):
    reps = run["reps"]
    kind, message = reps.ends["odd"]
    assert kind == "error" and message.startswith("ConfigError"), message
    ours = reps.fingerprints["r0"]
    assert ours in message
    theirs = message.split("(fingerprint ")[1].split(")")[0]
    assert theirs != ours and len(theirs) == 16, message


@pytest.mark.slow
def test_lighthouse_unreachable_is_a_clear_error_within_a_bound():
    from ccfx.runtime.launch import free_port

    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    address = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ccfx.CollectiveError, match="lighthouse at .* is unreachable") as e:
        ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=address,
                         quorum_timeout_s=2.0, **w.OPTIONS)
    assert address in str(e.value)
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_too_few_replicas_is_a_clear_error_within_a_bound():
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    try:
        model = w.mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        start = time.monotonic()
        with pytest.raises(ccfx.CollectiveError, match="no quorum formed within "
                                                       "quorum_timeout_s=2 s"):
            ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse.address(),
                             quorum_timeout_s=2.0, **w.OPTIONS)
        assert time.monotonic() - start < 30
    finally:
        lighthouse.shutdown()


#: The lighthouse outage the replicas of ``outage`` outlive: its first outage (the lighthouse
#: restarted once every replica has skipped a sync) is a few seconds, its last never ends.
OUTAGE_S = 15.0
OUTAGE_NAMES = ("l0", "l1", "l2")


OUTAGE_OPTIONS = {**w.OPTIONS, "sync_every": 4, "lighthouse_outage_s": OUTAGE_S}


def _skipped(row) -> bool:
    return not row["committed"] and "is unreachable" in (row["error"] or "")


def _kill_between_syncs(reps, lighthouse) -> float:
    """SIGKILL the lighthouse just after a sync every replica committed (0.1 s of a 0.4 s
    interval): none has a quorum request in flight, which would wait in it (torchft asking
    again) up to quorum_timeout_s instead of training on. When it died."""
    step = reps.torchft_step()
    reps.wait_for("a commit of every replica", lambda: all(
        any(row["committed"] and row["torchft_step"] > step for row, _ in reps.syncs[n])
        for n in OUTAGE_NAMES))
    time.sleep(0.1)
    lighthouse.kill()
    lighthouse.wait()
    return time.monotonic()


@pytest.fixture(scope="module")
def outage():
    """Three replicas and a lighthouse process: the lighthouse is SIGKILLed mid-run, started
    again on the same port once every replica has skipped a sync and trained on, then killed
    for good. The seconds from each kill to the first commit / to every replica's error are
    measured as they are seen (pumped every 0.1 s)."""
    from ccfx.runtime.launch import free_port

    port = free_port()
    lighthouse = w.lighthouse_process(port)
    reps = w.Replicas(f"http://127.0.0.1:{port}", deadline_s=300, step_sleep_s=0.1)
    names, out = OUTAGE_NAMES, {"reps": reps, "url": f"http://127.0.0.1:{port}"}
    try:
        for k, name in enumerate(names):
            reps.start(name, seed=k, options=OUTAGE_OPTIONS)
        reps.wait_for("two committed syncs among three",
                      lambda: all(reps.committed(n, replicas=3) >= 2 for n in names))
        killed = _kill_between_syncs(reps, lighthouse)
        out["before"] = before = {n: len(reps.syncs[n]) for n in names}
        # (a replica whose quorum request was in flight waits in it: torchft asks again)
        reps.wait_for("two replicas to skip two syncs while the lighthouse is away", lambda: sum(
            sum(map(_skipped, (row for row, _ in reps.syncs[n][before[n]:]))) >= 2
            for n in names) >= 2)
        lighthouse = w.lighthouse_process(port)
        out["restarted_s"] = time.monotonic() - killed
        reps.wait_for("a commit after the restart",
                      lambda: any(reps.committed(n, after=before[n]) for n in names))
        out["first_commit_s"] = time.monotonic() - killed
        reps.wait_for("two committed syncs among three after the restart", lambda: all(
            reps.committed(n, replicas=3, after=before[n]) >= 2 for n in names))
        out["after"] = {n: len(reps.syncs[n]) for n in names}
        reps.may_fail.update(names)
        killed = _kill_between_syncs(reps, lighthouse)
        reps.wait_for("every replica's error", lambda: all(n in reps.ends for n in names))
        out["error_s"] = time.monotonic() - killed
        print(f"\nlighthouse outage: restarted {out['restarted_s']:.1f} s after its kill, "
              f"first commit {out['first_commit_s']:.1f} s after it; killed for good: every "
              f"replica's error {out['error_s']:.1f} s after (lighthouse_outage_s={OUTAGE_S:g})")
        yield out
    finally:
        reps.close()
        lighthouse.kill()


@pytest.mark.slow
def test_replicas_train_through_a_lighthouse_restart_and_commit_again_bit_identical(outage):
    reps, before, after = outage["reps"], outage["before"], outage["after"]
    by_step: dict[int, set[str]] = {}
    trained_on = 0
    for name in OUTAGE_NAMES:
        rows = [row for row, _ in reps.syncs[name][before[name]:after[name]]]
        skipped = [row for row in rows if _skipped(row)]
        # it trained on: its skipped syncs are at later and later inner steps
        assert not skipped or skipped[-1]["step"] > skipped[0]["step"], rows
        trained_on += len(skipped) >= 2
        for row, digest in reps.syncs[name][before[name]:after[name]]:
            if row["committed"] and digest is not None:
                by_step.setdefault(row["torchft_step"], set()).add(digest)
    assert trained_on >= 2  # (one in a quorum request as the lighthouse died waits in it)
    assert by_step and all(len(d) == 1 for d in by_step.values()), by_step


@pytest.mark.slow
def test_the_first_commit_after_a_lighthouse_restart_counts_the_steps_trained_meanwhile(outage):
    """Nothing is lost: a replica's first commit after the outage weighs every inner step since
    its last commit before the kill (one that healed in between, having missed a quorum or
    failed the group's rebuild, counts from its heal instead)."""
    reps, before = outage["reps"], outage["before"]
    counted = 0
    for name in OUTAGE_NAMES:  # (the rows up to the second, final kill)
        rows = [row for row, _ in reps.syncs[name][:outage["after"][name]]]
        at = next(i for i in range(before[name], len(rows)) if rows[i]["committed"]
                  and rows[i]["step"] > max((r["step"] for r in rows[:i] if _skipped(r)),
                                            default=-1))
        first = rows[at]  # the first commit after its skipped syncs
        last = max(i for i in range(at) if rows[i]["committed"])
        if not any(row["healed"] for row in rows[last + 1:at + 1]):
            # (one that waited in a quorum request trained fewer steps and took the quorum's)
            own = first["reached"] - rows[last]["step"]
            assert first["own"] == own > OUTAGE_OPTIONS["sync_every"], first
            counted += 1
    assert counted >= 1


@pytest.mark.slow
def test_a_lighthouse_away_past_lighthouse_outage_s_is_an_error_naming_it(outage):
    reps = outage["reps"]
    for name in OUTAGE_NAMES:
        kind, message = reps.ends[name]
        assert kind == "error" and message.startswith("CollectiveError"), message
        assert f"lighthouse at {outage['url']} has been unreachable for" in message, message
        away = float(message.split("unreachable for ")[1].split(" s")[0])
        # past the bound (one whose quorum request was in flight as the lighthouse died waits
        # in it, torchft asking again, up to quorum_timeout_s, then counts from its start); the
        # message prints tenths, so a wait of 15.04 s reads 15.0
        assert away >= OUTAGE_S and "lighthouse_outage_s" in message, message


def test_fault_tolerance_options_are_checked():
    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ccfx.ConfigError, match="fault_tolerant=True"):
        ccfx.local_steps(model, opt, sync_every=2, min_replicas=2)
    with pytest.raises(ccfx.ConfigError, match="lighthouse_outage_s >= 0"):
        ccfx.local_steps(model, opt, sync_every=2, fault_tolerant=True,
                         lighthouse="http://127.0.0.1:1", lighthouse_outage_s=-1)
    with pytest.raises(ccfx.ConfigError, match="fragment_delay=0"):
        ccfx.local_steps(model, opt, sync_every=4, fragments=2, fragment_delay=1,
                         fault_tolerant=True, lighthouse="http://127.0.0.1:1")
    with pytest.raises(ccfx.ConfigError, match="ring"):
        ccfx.local_steps(model, opt, sync_every=2, outer_collective="ring",
                         fault_tolerant=True, lighthouse="http://127.0.0.1:1")
    outer = ccfx.local_steps(model, opt, sync_every=2)
    with pytest.raises(ccfx.ConfigError, match="add_tokens"):
        outer.add_tokens(5)
    outer.close()


def _members(step, catching_up=False):
    """What :meth:`Elastic._adopt_step` reads of a replica: its inner step, two streamed
    fragments (synced at steps 0 and 25 mod 50) and whether it is catching up after a heal."""
    from types import SimpleNamespace

    from ccfx.runtime.elastic import Elastic, State

    frags = [SimpleNamespace(offset=0, index=0), SimpleNamespace(offset=25, index=1)]
    me = Elastic.__new__(Elastic)
    me.outer = SimpleNamespace(step=step, sync_every=50, fragments=frags)
    me._state = State.CATCHING_UP if catching_up else State.IN_STEP
    me._catch_up_at = 1.0
    return me


@pytest.mark.parametrize("rows, want_step, want_fragment", [
    # in step: nothing changes (its own due fragments are the others')
    ([(5, 150, 0, 1, 0), (5, 150, 0, 1, 0)], 150, [0]),
    # catching up after a heal: it takes the step of the members in step
    ([(5, 150, 0, 1, 0), (3, 137, 0, 1, 1)], 150, [0]),
    # healed from a peer that was itself catching up (it reported that peer's step 122, a
    # cascade of heals): the step of the members in step wins, fragments agree
    ([(5, 150, 0, 1, 0), (0, 122, 0, 1, 1), (4, 150, 0, 1, 0)], 150, [0]),
    # in-step members that disagree all take the highest, so every member exchanges the same
    ([(5, 175, 0, 1, 0), (5, 150, 0, 1, 0)], 175, [1]),
    # everyone catching up: the highest step of all
    ([(0, 100, 0, 1, 1), (0, 125, 0, 1, 1)], 125, [1]),
])
def test_every_member_leaves_the_meet_at_one_step_and_one_set_of_fragments(rows, want_step,
                                                                         want_fragment):
    from ccfx.runtime.elastic import Elastic

    results = set()
    for i, row in enumerate(rows):
        me = _members(row[1], catching_up=bool(row[4]))
        own_due = [f for f in me.outer.fragments if row[1] % 50 == f.offset]
        due = Elastic._adopt_step(me, rows, own_due if not row[4] else [])
        results.add((me.outer.step, tuple(f.index for f in due)))
        assert me.state.name == "IN_STEP" and me._catch_up_at is None
    assert results == {(want_step, tuple(want_fragment))}


def _placing(trainers):
    from types import SimpleNamespace

    return SimpleNamespace(opts=SimpleNamespace(trainers=trainers))


# a meet's rows as _assign_slots reads them: (tokens, step, fingerprint, interval, where it
# stands: 0 in step / 1 catching up or spare / 2 healing, the place it claims or -1)
@pytest.mark.parametrize("stands_claims, want", [
    # every trainer holds its place; the spare stays one
    ([(0, 0), (0, 1), (1, -1)], [0, 1, None]),
    # trainer 1 died (absent from the meet): the spare takes place 1
    ([(0, 0), (1, -1)], [0, 1]),
    # two spares, one place free: the first in quorum order takes it
    ([(1, -1), (0, 0), (1, -1)], [1, 0, None]),
    # a ready spare before one still healing, whatever their quorum order
    ([(2, -1), (0, 0), (1, -1)], [None, 0, 1]),
    # a trainer that missed a quorum (healing) claims the place a spare took meanwhile: the
    # member in step keeps it, the late one becomes a spare
    ([(0, 0), (0, 1), (2, 1)], [0, 1, None]),
    # at the first join nobody holds a place: claims first, then quorum order
    ([(0, -1), (0, 1), (0, -1), (0, -1)], [0, 1, None, None]),
    # a claim beyond the places (another job's slot) is not a place
    ([(0, 5), (0, -1)], [0, 1]),
])
def test_training_places_go_to_claims_in_step_then_to_ready_spares(stands_claims, want):
    from ccfx.runtime.elastic import Elastic

    rows = [(0, 10, 0, 1, stands, claim) for stands, claim in stands_claims]
    got = [Elastic._assign_slots(_placing(2), rows, rank) for rank in range(len(rows))]
    assert got == want
    held = [s for s in got if s is not None]
    assert len(held) == len(set(held)), "a place is held once"


def test_trainers_and_slot_are_checked():
    from ccfx.runtime.elastic import split_options

    with pytest.raises(ccfx.ConfigError, match="pass trainers=N"):
        split_options({"fault_tolerant": True, "slot": 0})
    with pytest.raises(ccfx.ConfigError, match="slot in 0 .. trainers - 1"):
        split_options({"fault_tolerant": True, "trainers": 2, "slot": 2})
    with pytest.raises(ccfx.ConfigError, match="trainers >= 1"):
        split_options({"fault_tolerant": True, "trainers": 0})
    _, opts = split_options({"fault_tolerant": True, "trainers": 4})
    assert opts.trainers == 4 and opts.slot is None


class _UnsetGroupManager:
    """torchft's manager after a quorum whose process-group rebuild failed: torchft reported
    the error and left the group unset (``size()`` asserts), so this sync cannot commit."""

    class _Group:
        def size(self):
            raise AssertionError("process group not initialized")

    _pg = _Group()
    _replica_id = "r0"

    def __init__(self):
        self.errors = []

    def start_quorum(self):
        pass

    def report_error(self, e):
        self.errors.append(e)

    def should_commit(self):
        return not self.errors

    def current_step(self):
        return 3

    def state_dict(self):
        return {"step": 3, "batches_committed": 6}


def test_sync_after_a_failed_group_rebuild_is_uncommitted_not_a_crash():
    from ccfx.runtime.elastic import Elastic, ElasticOptions

    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = ccfx.local_steps(model, opt, sync_every=2)
    before = {k: v.clone() for k, v in outer.global_parameters().items()}
    elastic = Elastic.__new__(Elastic)  # its state, without torchft's manager and lighthouse
    elastic.outer, elastic.manager = outer, _UnsetGroupManager()
    elastic.tokens, elastic.counts_tokens, elastic.since, elastic.commits = 0, False, 0, 0
    elastic.history, elastic._reduces = [], {}
    elastic.opts, elastic.slot = ElasticOptions(), None
    elastic._transport = _Silent()  # no replica watches this one
    assert elastic.sync(list(outer.fragments)) is False
    assert len(elastic.manager.errors) == 1 and elastic.commits == 0
    row = elastic.history[-1]
    assert not row["committed"] and row["replicas"] == 0 and row["fragments"] == []
    assert all(torch.equal(before[k], v) for k, v in outer.global_parameters().items())
    outer.close()


class _NoQuorumManager(_UnsetGroupManager):
    """A quorum request that fails (the lighthouse away, or no quorum in time)."""

    _quorum_future = "the failed request"
    _quorum_id = 4

    def start_quorum(self):
        raise RuntimeError('status: Cancelled, message: "Timeout expired"')

    def shutdown(self, wait=True):
        pass


def _joined_replica(outer, lighthouse, **opts):
    from ccfx.runtime.elastic import Elastic, ElasticOptions

    elastic = Elastic.__new__(Elastic)  # its state, without torchft's manager and lighthouse
    elastic.outer, elastic.manager, elastic.lighthouse = outer, _NoQuorumManager(), lighthouse
    elastic.tokens, elastic.counts_tokens, elastic.since, elastic.commits = 0, False, 0, 0
    elastic.history, elastic._reduces, elastic._joined = [], {}, True
    elastic.opts, elastic.slot = ElasticOptions(**opts), None
    elastic._transport = _Silent()
    return elastic


def test_failed_quorum_requests_are_skipped_syncs_then_an_error_past_max_retries():
    import socket

    model = w.mlp(0)
    outer = ccfx.local_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    with socket.socket() as lighthouse:  # reachable: the failure is not the lighthouse's
        lighthouse.bind(("127.0.0.1", 0))
        lighthouse.listen()
        elastic = _joined_replica(outer, f"http://127.0.0.1:{lighthouse.getsockname()[1]}",
                                  max_retries=2)
        for _ in range(2):
            assert elastic.sync(list(outer.fragments)) is False
            assert elastic.history[-1]["error"].startswith("no quorum: status: Cancelled")
            assert elastic.manager._quorum_future is None  # the next sync asks again
            elastic.manager._quorum_future = "the failed request"
        with pytest.raises(ccfx.CollectiveError, match="3 quorum requests in a row failed "
                                                       r"\(max_retries=2"):
            elastic.sync(list(outer.fragments))
    outer.close()


def test_an_unreachable_lighthouse_skips_syncs_then_is_an_error_naming_it():
    from ccfx.runtime.launch import free_port

    model = w.mlp(0)
    outer = ccfx.local_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    address = f"http://127.0.0.1:{free_port()}"
    elastic = _joined_replica(outer, address, lighthouse_outage_s=0.5)
    assert elastic.sync(list(outer.fragments)) is False  # trains on
    assert elastic.history[-1]["error"] == f"the lighthouse at {address} is unreachable"
    assert elastic.manager._quorum_id == -1  # its next quorum rebuilds the group
    time.sleep(0.6)
    with pytest.raises(ccfx.CollectiveError, match=f"lighthouse at {address} has been "
                                                   "unreachable for .* lighthouse_outage_s=0.5"):
        elastic.sync(list(outer.fragments))
    outer.close()


def test_a_spare_compiles_after_its_sync_on_a_thread_a_trainer_before_its_next_step():
    """A spare watches the trainers from its sync's end: a trainer that died during a compile
    of several seconds would have its place taken only after it. So a spare compiles on a
    thread of its own; a trainer, before it trains on."""
    from ccfx.runtime.elastic import Elastic, ElasticOptions

    release = threading.Event()

    def compiling(*args):  # a kept codec call that compiles until the test releases it
        assert release.wait(30.0)

    compiling.ready = set()
    spare = Elastic.__new__(Elastic)
    spare.opts, spare.slot, spare.history = ElasticOptions(trainers=2), None, [{}]
    started = time.monotonic()
    spare._compile([(compiling, (), {}, "shape")])
    assert time.monotonic() - started < 5.0 and spare._compiling.is_alive()
    assert compiling.ready == set()  # until then the call runs eagerly
    release.set()
    spare._compiling.join(30.0)
    assert compiling.ready == {"shape"} and spare.history[-1]["compile_s"] > 0

    trainer = Elastic.__new__(Elastic)
    trainer.opts, trainer.slot, trainer.history = ElasticOptions(trainers=2), 0, [{}]
    compiling.ready.clear()
    trainer._compile([(compiling, (), {}, "shape")])
    assert trainer._compiling is None and compiling.ready == {"shape"}


class _Silent:
    """A checkpoint transport's sync announcement, with nobody listening."""

    def announce_sync(self, step):
        pass


class _TimedOutManager(_UnsetGroupManager):
    """A quorum whose exchange timed out with every member alive: what the survivors see
    while a joiner's heal outlasts ``collective_timeout_s``."""

    class _Group:
        def size(self):
            raise RuntimeError("[gloo] Timed out waiting 60000ms for recv operation to complete")

    _pg = _Group()


def test_a_timed_out_sync_says_the_timeout_must_cover_a_joiners_heal(caplog):
    from ccfx.runtime.elastic import Elastic, ElasticOptions

    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = ccfx.local_steps(model, opt, sync_every=2, collective_timeout_s=60)
    elastic = Elastic.__new__(Elastic)
    elastic.outer, elastic.manager = outer, _TimedOutManager()
    elastic.tokens, elastic.counts_tokens, elastic.since, elastic.commits = 0, False, 0, 0
    elastic.history, elastic._reduces = [], {}
    elastic.opts, elastic.slot = ElasticOptions(), None
    elastic._transport = _Silent()  # no replica watches this one
    with caplog.at_level("WARNING", logger="ccfx"):
        assert elastic.sync(list(outer.fragments)) is False
    mb = sum(p.numel() * 4 for p in model.parameters()) / 1e6
    assert f"{mb:.1f} MB of global parameters" in caplog.text
    assert "collective_timeout_s=60 s must cover that transfer" in caplog.text
    # a failure that is not a timeout gets no such hint
    assert "must cover" not in elastic._timeout_hint("Connection closed by peer")
    outer.close()


@pytest.fixture
def lighthouse2():
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=200,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    yield lighthouse.address()
    lighthouse.shutdown()


@pytest.mark.slow
def test_average_is_weighted_by_the_tokens_each_replica_reports(lighthouse2):
    """Two replicas (threads of this process), 3 and 1 tokens per step: codec none, outer SGD
    lr 1, no momentum, so the global parameters after the sync are start - Σ w_k (start -
    local_k) / Σ w_k, each local_k what plain SGD makes of the start on replica k's batches."""
    tokens, steps = (3, 1), 2
    a, b = w.in_threads([lambda k=k: w.weighted_replica(k, lighthouse2, tokens[k], steps)
                         for k in range(2)], timeout_s=60)
    assert [r["committed"] for r in a["history"]] == [True, True]
    for name in a["start"]:
        assert torch.equal(a["start"][name], b["start"][name])  # joined from one replica
        assert torch.equal(a["global"][name], b["global"][name])
    expected = dict(a["start"])
    deltas = []
    for k in range(2):
        probe = w.mlp(0)
        probe.load_state_dict(a["start"])
        opt = torch.optim.SGD(probe.parameters(), lr=0.05)
        for i in range(steps):
            w.loss_of(probe, k, i).backward()
            opt.step()
            opt.zero_grad()
        deltas.append({n: a["start"][n] - p.detach() for n, p in probe.named_parameters()})
    for name in expected:
        avg = (tokens[0] * deltas[0][name] + tokens[1] * deltas[1][name]) / sum(tokens)
        torch.testing.assert_close(a["global"][name], a["start"][name] - avg, rtol=0, atol=1e-6)
        plain = (deltas[0][name] + deltas[1][name]) / 2  # the weights must matter here
        assert (a["global"][name] - (a["start"][name] - plain)).abs().max() > 1e-5


@pytest.mark.slow
def test_failed_sync_is_committed_nowhere_and_changes_nothing(lighthouse2):
    """Replica 1's exchange fails at inner step 2: neither replica commits that sync, the
    global parameters and the codec state (error-feedback residuals) stay as they were, and the
    next sync commits on both, counting the inner steps of the failed one. Replica 0, blocked
    in the exchange on replica 1 (alive: it left the exchange), gets out because replica 1
    aborts the group, not at collective_timeout_s (its error is a closed or reset connection,
    not a timeout: before the abort it waited the timeout and missed the next quorum)."""
    a, b = w.in_threads([lambda k=k: w.failing_replica(k, lighthouse2, 2 if k else 0, 4)
                         for k in range(2)], timeout_s=90)
    for r in (a, b):
        assert [(h["step"], h["committed"]) for h in r["history"]] == [
            (0, True), (2, False), (4, True)], r["history"]
        failed = r["rows"][1]
        assert failed["step"] == 2 and failed["after"] == failed["before"]
        assert r["rows"][3]["after"] != r["rows"][3]["before"]
        # the steps of the uncommitted sync are not lost: the next commit counts all four
        assert [(h["own"], h["weight"]) for h in r["history"][1:]] == [(2, 4), (4, 8)]
    assert a["rows"][3]["after"][0] == b["rows"][3]["after"][0]
    assert b["history"][1]["error"].startswith("injected"), b["history"][1]
    peer = a["history"][1]["error"]
    assert "connection" in peer.lower() and "timed out" not in peer.lower(), peer


@pytest.mark.slow
def test_stateless_codec_on_three_replicas_reduces_by_all_to_all_bit_identically():
    """int8 (no codec state) on 3 replicas: the outer average runs as the encoded all-to-all +
    all-gather (2 (W-1) / W of a payload per replica, not W - 1), and the global parameters
    are bit-identical on the three after every sync; so does int8:ef (its residual kept per
    element: tests/test_elastic_stateful.py)."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=3, join_timeout_ms=200,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    try:
        # the vectors (biases) travel raw, all-reduced, in a part of their own
        for codec, collective in (("int8", "all_to_all+all_gather"),
                                  ("int8:ef", "all_to_all+all_gather")):
            runs = w.in_threads([lambda k=k, c=codec: w.codec_replica(k, lighthouse.address(), c, 4)
                                 for k in range(3)], timeout_s=90)
            for r in runs:
                synced = [h for h in r["history"] if h["fragments"]]
                assert len(synced) == 2 and all(h["committed"] and h["replicas"] == 3
                                                for h in synced), r["history"]
                assert all(h["collectives"] == sorted(["all_reduce", collective])
                           for h in synced), (codec, [h["collectives"] for h in synced])
                assert r["digests"] == runs[0]["digests"]
            assert len(set(runs[0]["digests"])) == 2  # the syncs moved the parameters
    finally:
        lighthouse.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("grace_ms, waited", [(5000, True), (300, False)])
def test_grace_window_for_a_straggler_is_the_lighthouse_join_timeout(grace_ms, waited):
    """3 replicas, min_replicas 2; replica 2 reaches the first sync after the join 1.5 s late.
    Within the lighthouse's join_timeout_ms the quorum waits for it (all three sync); past it
    the other two sync without it, and the straggler heals at a later sync and commits. The
    replicas train to torchft step 5, so the straggler meets its peers again whatever the
    machine's load did to the timing (a CI run at step 3 left it alone: its peers had
    stopped)."""
    import threading

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=grace_ms,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=3000)
    start, finished, done = threading.Barrier(3), threading.Event(), threading.Barrier(3)
    try:
        rows = w.in_threads([lambda k=k: w.straggler_replica(
            k, lighthouse.address(), 1.5 if k == 2 else 0.0, 5, start=start, finished=finished,
            all_done=done) for k in range(3)], timeout_s=90)
    finally:
        lighthouse.shutdown()
    synced = {k: [r for r in rows[k][1:] if r["committed"]] for k in (0, 1)}  # after the join
    assert all(synced.values()), rows
    if waited:
        assert all(r["replicas"] == 3 for k in (0, 1) for r in synced[k]), synced
        assert not any(r["healed"] for r in rows[2][1:]), rows[2]
    else:
        assert all(any(r["replicas"] == 2 for r in synced[k]) for k in (0, 1)), synced
        # it heals at a later sync (after the join, which may heal too) and commits there: with
        # a 300 ms window a peer slowed by the machine's load may miss that quorum as well
        late = [r for r in rows[2][1:] if r["healed"]]
        assert late and late[0]["replicas"] >= 2 and late[0]["committed"], rows[2]


@pytest.mark.slow
@pytest.mark.parametrize("delay, spans", [(3.0, False), (7.0, True)])
def test_a_joiners_heal_is_fetched_after_the_exchange_and_it_catches_up(monkeypatch, delay,
                                                                       spans):
    """r0 and r1 train (a step every 0.8 s, a sync every 4 steps: ~3.2 s between syncs); j2
    starts 8 s later and heals from a live peer. Every staged body (the heal's tensors) is
    served ``delay`` s late: a big model over a slow link.

    * The survivors do not wait for the fetch: their sync in which j2 heals takes less than
      ``delay`` once its quorum has formed (with torchft's own transport the healer fetched
      inside the quorum, before the exchange the survivors wait in, so that part took at least
      ``delay``; 3 s is ~10x the tiny model's sync on a loaded 2-core machine).
    * j2 fetches after that exchange (``heal_s`` >= ``delay``). A fetch longer than the
      peers' interval (7 s) spans their next syncs: j2 is in those quorums with nothing to
      send (own 0, committed, all 3 replicas) and merges their averages once the state is
      here. Then it syncs at its peers' next sync, however many steps it took since (short of 4
      unless its fetch ended right at a peers' sync): it takes the peers' inner step there,
      its own steps weighted as they are.
    * The global parameters are bit-identical at every committed sync (after a spanning
      heal: at the last sync it spanned, when the merges are done)."""
    import itertools
    import threading

    from torchft.coordination import LighthouseServer

    from ccfx.runtime import heal

    body = heal._Staged.body

    def slow_body(self):
        time.sleep(delay)
        return body(self)

    monkeypatch.setattr(heal._Staged, "body", slow_body)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=3000)
    finished = threading.Event()
    try:
        out = w.in_threads([lambda k=k: w.late_joiner_replica(
            k, lighthouse.address(), 8.0 if k == 2 else 0.0, 0.8, 7, finished)
            for k in range(3)], timeout_s=180)
    finally:
        lighthouse.shutdown()
    committed = {k: {row["torchft_step"]: (row, d) for row, d in out[k] if row["committed"]}
                 for k in range(3)}
    for step in set().union(*committed.values()):
        digests = {committed[k][step][1] for k in range(3) if step in committed[k]} - {None}
        assert len(digests) == 1, step

    rows = [row for row, _ in out[2]]
    heals = [i for i, row in enumerate(rows)
             if row["healed"] and row["committed"] and row["heal_s"] is not None]
    assert heals, rows
    caught_up = spanned = False
    for i in heals:
        healed = rows[i]
        assert healed["heal_s"] >= delay and healed["own"] == 0, healed
        for k in (0, 1):
            peer, _ = committed[k].get(healed["torchft_step"], (None, None))
            if peer is not None:  # it synced with j2 there: it did not wait for the fetch
                assert peer["seconds"] - peer["quorum_s"] < delay, (peer, healed)
        ghosts = list(itertools.takewhile(lambda r: r["own"] == 0 and not r["healed"],
                                          rows[i + 1:]))
        if ghosts:
            assert all(g["committed"] and g["replicas"] == 3 for g in ghosts), ghosts
            spanned = True
        nxt = rows[i + 1 + len(ghosts)] if i + 1 + len(ghosts) < len(rows) else None
        if nxt is not None and nxt["committed"] and not nxt["healed"]:
            peer, _ = committed[0].get(nxt["torchft_step"], (None, None))
            # at most a full interval: a fetch that ends right at a peers' sync leaves j2 a
            # whole interval to train before the next one (own 4), in step with its peers
            assert 0 < nxt["own"] <= 4 and nxt["replicas"] == 3, nxt
            assert peer is not None and peer["step"] == nxt["step"], (peer, nxt)
            caught_up = True
    assert caught_up, rows
    if spans:
        assert spanned, rows


@pytest.mark.slow
def test_a_hot_spare_takes_a_dead_trainers_place_when_it_dies_without_a_heal():
    """Two training places (``trainers=2``): p0 and p1 train (a step every 0.3 s, a sync every
    6 steps); p2, started 2 s later, heals lazily at its join and finds both places held: a
    spare. It syncs with the trainers, sending nothing (own 0) and applying every average.
    p1 dies an inner step after torchft step 4, mid-interval (its ``/alive`` streams end
    with no goodbye and its manager stops, as a SIGKILL would).

    * p2 takes place 1 at the death, not at the next sync: its ``local_steps`` returns within
      1 s of it (the stream's end reaches the spare at once; the bound is slack for a loaded
      2-core machine, against the 1.5 s left in the interval), and the next sync carries its
      own steps for place 1. From then on it trains; it never heals after its join (it had
      the state all along).
    * Its global parameters are the trainers' bit for bit at every committed sync it shares
      with them."""
    import threading

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    finished = threading.Event()
    try:
        out = w.in_threads([lambda k=k: w.spare_scenario_replica(
            k, lighthouse.address(), k == 2, 0.3, 4 if k == 1 else None, 9, finished)
            for k in range(3)], timeout_s=180)
    finally:
        lighthouse.shutdown()
    trainer, dead, spare = out
    assert trainer["slot"] == 0 and dead["slot"] == 1 and spare["slot"] == 1
    assert dead["died_at"] is not None
    assert 0 <= spare["placed_at"] - dead["died_at"] < 1.0
    rows = [row for row, _ in spare["rows"]]
    placed = next(i for i, row in enumerate(rows) if row["slot"] == 1)
    assert placed > 0 and rows[placed]["committed"] and rows[placed]["own"] > 0, rows
    assert all(row["own"] == 0 and row["slot"] is None for row in rows[1:placed]), rows
    assert not any(row["healed"] for row in rows[1:]), rows

    committed = [{row["torchft_step"]: d for row, d in r["rows"] if row["committed"]}
                 for r in out]
    shared = set(committed[0]) & set(committed[2])
    assert rows[placed]["torchft_step"] in shared
    for step in shared:
        if committed[0][step] is not None and committed[2][step] is not None:
            assert committed[0][step] == committed[2][step], step
    assert committed[2][rows[placed]["torchft_step"]] is not None


@pytest.mark.slow
def test_replicas_built_alike_skip_the_step_0_heal_and_a_late_one_still_heals():
    """``init_sync=False``: i0 and i1, built from the same seed, start together and sync with
    no heal at step 0 (torchft's init sync would send i1 all of i0's state through i0's link);
    i2, built from another seed, joins 3 s later and
    still heals (it is behind), so every committed sync's global parameters agree."""
    import threading

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    finished = threading.Event()
    try:
        out = w.in_threads([lambda k=k: w.same_start_replica(
            k, lighthouse.address(), 0 if k < 2 else 5, 3.0 if k == 2 else 0.0,
            30 if k < 2 else 10, finished) for k in range(3)], timeout_s=120)
    finally:
        lighthouse.shutdown()
    joins = [r["rows"][0][0] for r in out]
    assert not joins[0]["healed"] and not joins[1]["healed"], joins
    assert joins[0]["step"] == joins[1]["step"] == 0
    assert any(row["healed"] for row, _ in out[2]["rows"]), out[2]["rows"]
    committed = [{row["torchft_step"]: d for row, d in r["rows"] if row["committed"]}
                 for r in out]
    for step in set().union(*committed):
        assert len({c[step] for c in committed if step in c}) == 1, step


@pytest.mark.slow
def test_replicas_built_differently_with_init_sync_false_are_refused_at_the_first_sync():
    """Without torchft's init sync, replicas whose parameters differ at step 0 would average
    different models: every one of them raises a ConfigError saying how to fix it."""
    import threading

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    try:
        out = w.in_threads([lambda k=k: w.same_start_replica(
            k, lighthouse.address(), k, 0.0, 4, threading.Event()) for k in range(2)],
            timeout_s=60)
    finally:
        lighthouse.shutdown()
    for message in out:
        assert isinstance(message, str) and "different parameters" in message, out
        assert "same seed" in message
