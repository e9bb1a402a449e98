"""ccfx's torchft checkpoint transport (ccfx/runtime/heal.py): a healing replica gets the small
head in the quorum and the tensors when it asks; the serving replica never waits for a reader.
One process, the transport's HTTP server on 127.0.0.1; every wait bounded."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from ccfx.runtime import heal


def _state():
    return {"torchft": {"step": 3, "batches_committed": 9},
            "user": {"default": {
                "fingerprint": "0123456789abcdef", "step": 12, "syncs": 4,
                "global": [[torch.arange(6.0).reshape(2, 3), torch.ones(5)]],
                "outer": [{"state": {0: {"momentum_buffer": torch.full((2, 3), 0.5)}},
                           "param_groups": [{"lr": 0.7, "betas": (0.9, 0.99), "params": [0, 1],
                                             "nesterov": True, "foreach": None}]}],
                "codec": {"frag0.part0.residual": torch.zeros(11)}}}}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


class Gadget:
    """Not plain data: pickled by reference to this module."""


@pytest.fixture
def transport():
    t = heal.HealTransport("127.0.0.1", timedelta(seconds=10))
    yield t
    t.shutdown()


def test_split_and_join_are_inverse_and_the_head_holds_no_tensor():
    state = _state()
    head, tensors = heal.split(state)
    assert len(tensors) == 4
    assert "Tensor" not in repr(head)
    assert _equal(heal.join(head, tensors), state)


def test_a_healer_gets_the_head_at_once_and_the_same_tensors_when_it_asks(transport):
    state = _state()
    transport.send_checkpoint([1], step=3, state_dict=state, timeout=timedelta(seconds=10))
    got = transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=10))
    assert got["torchft"] == state["torchft"]
    pending = got["user"]["default"]
    assert isinstance(pending, heal.Pending)
    assert pending.head["step"] == 12 and pending.head["fingerprint"] == "0123456789abcdef"
    assert _equal(pending.result(10), state["user"]["default"])


def test_a_request_for_a_step_not_yet_staged_waits_for_it(transport):
    """The healer asks when its quorum has formed; its source stages in its own quorum
    thread, which may come later."""
    stage = threading.Timer(0.5, transport.send_checkpoint,
                            args=([1], 5, _state(), timedelta(seconds=10)))
    stage.start()
    got = transport.recv_checkpoint(0, transport.metadata(), 5, timedelta(seconds=10))
    assert got["user"]["default"].head["syncs"] == 4
    stage.join()


def test_the_server_does_not_wait_for_a_reader_to_finish(transport, monkeypatch):
    """torchft's HTTP transport takes a write lock in ``disallow_checkpoint`` (called by the
    serving replica's ``should_commit``) that waits for an in-flight download. Here the body's
    serving is held until released, and ``disallow_checkpoint`` and a new step's staging
    return while it is in flight; the reader then gets the step it asked for."""
    release = threading.Event()
    body = heal._Staged.body

    def held(self):
        assert release.wait(10)
        return body(self)

    monkeypatch.setattr(heal._Staged, "body", held)
    state = _state()
    transport.send_checkpoint([1], step=3, state_dict=state, timeout=timedelta(seconds=10))
    pending = transport.recv_checkpoint(0, transport.metadata(), 3,
                                        timedelta(seconds=10))["user"]["default"]
    pending.start()
    time.sleep(0.2)  # the GET is in the server now, held
    started = time.monotonic()
    transport.disallow_checkpoint()
    newer = _state()
    newer["user"]["default"]["step"] = 16
    transport.send_checkpoint([1], step=4, state_dict=newer, timeout=timedelta(seconds=10))
    assert time.monotonic() - started < 1.0
    release.set()
    assert _equal(pending.result(10), state["user"]["default"])


def test_only_the_last_two_steps_stay_staged(transport):
    for step in (1, 2, 3):
        transport.send_checkpoint([1], step=step, state_dict=_state(),
                                  timeout=timedelta(seconds=10))
    with pytest.raises(Exception, match="404"):
        transport.recv_checkpoint(0, transport.metadata(), 1, timedelta(seconds=2))
    transport.recv_checkpoint(0, transport.metadata(), 2, timedelta(seconds=2))


def test_a_head_that_is_not_plain_data_is_refused(transport):
    """Both parts are read with ``weights_only=True``: a peer's bytes cannot run code."""
    state = _state()
    state["user"]["default"]["extra"] = Gadget()
    transport.send_checkpoint([1], step=3, state_dict=state, timeout=timedelta(seconds=10))
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=10))


def test_the_served_state_shares_no_storage_with_the_live_one():
    """What a replica stages for a healer is read after the replica's next outer step (the
    heal's tensors are fetched after the exchange): every tensor of it is a copy, the outer
    optimizer's momentum included (``state_dict()`` returns the live buffers)."""
    import ccfx
    from ccfx.runtime.elastic import Elastic

    from . import elastic_workers as w

    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = ccfx.local_steps(model, opt, sync_every=1, outer_momentum=0.9,
                             outer_codec="int8:ef", compress_min_numel=0)
    w.loss_of(model, 0, 0).backward()
    opt.step()  # a sync: the outer optimizer has a momentum buffer now
    elastic = Elastic.__new__(Elastic)
    elastic.outer, elastic.fingerprint = outer, "0" * 16
    served = heal.split(elastic._recovery_state())[1]
    live = [t for f in outer.fragments for t in f.global_]
    live += [t for f in outer.fragments for s in f.outer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    live += list(outer._codec_state().values())
    assert any(f.outer.state for f in outer.fragments)
    assert not {t.data_ptr() for t in served} & {t.data_ptr() for t in live}
    outer.close()


def test_a_cancelled_fetch_does_not_deliver(transport, monkeypatch):
    """A newer heal replaces one still fetching: the old fetch stops (checked every MB)
    instead of filling the link to the end."""
    release = threading.Event()
    body = heal._Staged.body

    def held(self):
        assert release.wait(10)
        return body(self)

    monkeypatch.setattr(heal._Staged, "body", held)
    transport.send_checkpoint([1], step=3, state_dict=_state(), timeout=timedelta(seconds=10))
    pending = transport.recv_checkpoint(0, transport.metadata(), 3,
                                        timedelta(seconds=10))["user"]["default"]
    pending.start()
    pending.cancel()
    release.set()
    assert pending.done(10)
    with pytest.raises(RuntimeError, match="cancelled"):
        pending.result(10)


def _elastic_of(outer):
    from ccfx.runtime.elastic import Elastic

    elastic = Elastic.__new__(Elastic)  # its state, without torchft's manager and lighthouse
    elastic.outer, elastic.fingerprint = outer, "0" * 16
    elastic.tokens, elastic.since, elastic._healed = 0, 0, False
    return elastic


def test_a_body_cut_off_by_its_source_is_a_clear_error_not_a_corrupt_archive():
    """The source stops mid-transfer (its process ends or dies): the fetch says how much came,
    rather than handing torch.load a truncated archive (seen in the 10 M bench at a run's end:
    "PytorchStreamReader failed reading zip archive")."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))

    def serve_half():
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 400)
        conn.close()

    threading.Thread(target=serve_half, daemon=True).start()
    port = server.getsockname()[1]
    try:
        with pytest.raises(ConnectionError, match="ended after 400 of 1000 bytes"):
            heal._Body(f"http://127.0.0.1:{port}/3/body", 10.0).result(10.0)
    finally:
        server.close()


def test_a_replica_still_healing_serves_no_state_and_its_healer_heals_later():
    """torchft may pick as a heal's source a replica whose own heal is still fetching (it is
    at the quorum's step). That replica has no state to give: it says so, and the healer
    keeps its parameters, drops a fetch of its own in flight, sends nothing and does not
    commit (``_unhealed``): it heals at the next quorum."""
    import ccfx

    from . import elastic_workers as w

    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = ccfx.local_steps(model, opt, sync_every=2, outer_codec="int8:ef",
                             compress_min_numel=0)
    source = _elastic_of(outer)

    class Fetching:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    source._pending = Fetching()
    served = source._recovery_state()
    assert served == {"fingerprint": "0" * 16, "unavailable": True}

    healer = _elastic_of(outer)
    own = Fetching()
    healer._pending, healer._replay = own, [{0: []}]
    before = {k: v.clone() for k, v in outer.global_parameters().items()}
    healer._load(heal.Pending(served, body=None))
    assert healer._unhealed and healer._pending is None and healer._replay == []
    assert own.cancelled and not healer._healed
    assert all(torch.equal(before[k], v) for k, v in outer.global_parameters().items())
    outer.close()


def test_a_watch_sees_a_severed_replica_die_and_a_replica_that_shuts_down_leave():
    """A hot spare's watch (``/alive``): a stream that ends with no goodbye (a killed process)
    or cannot be opened is a death, seen within a beat; a replica that shuts down says
    goodbye and is not. Bounds: the severed stream's end reaches the watch at once; 2 s is
    slack for a loaded machine, against the 10 s after which silence alone would count."""
    killed = heal.HealTransport("127.0.0.1", timedelta(seconds=5))
    leaving = heal.HealTransport("127.0.0.1", timedelta(seconds=5))
    gone = heal.HealTransport("127.0.0.1", timedelta(seconds=5))
    gone.shutdown()  # nobody listens at its port any more
    watch = heal.Watch({"killed": killed.metadata(), "leaving": leaving.metadata(),
                        "gone": gone.metadata()}, silent_s=10.0)
    try:
        assert watch.wait(time.monotonic() + 5.0) == ["gone"]
        time.sleep(2 * heal.BEAT_S)  # both streams beating
        leaving.shutdown()
        started = time.monotonic()
        killed.sever()
        assert watch.wait(started + 5.0, more_than=1) == ["gone", "killed"]
        assert time.monotonic() - started < 2.0
        time.sleep(2 * heal.BEAT_S)
        assert watch.dead == ["gone", "killed"]  # the goodbye was no death
    finally:
        watch.close()
        killed.shutdown()


def test_a_watch_hears_a_peer_in_a_sync_at_its_step_or_later_at_once():
    """``/alive?sync=K`` says when its replica is in a sync at torchft step K or later (the
    byte goes out when the sync starts, not at the next beat): a peer still finishing the sync
    the watcher committed (step K - 1) does not count, one already in the next sync when the
    stream opens does, and a replica that shuts down leaves no stream to hear from. Bounds:
    5 s for what comes at once (slack for a loaded machine)."""
    trainer = heal.HealTransport("127.0.0.1", timedelta(seconds=5))
    other = heal.HealTransport("127.0.0.1", timedelta(seconds=5))
    trainer.announce_sync(3)  # the sync the watcher has just committed, which made it step 4
    other.announce_sync(4)  # already in the next one when the watch opens
    watch = heal.Watch({"trainer": trainer.metadata(), "other": other.metadata()},
                       silent_s=10.0, sync_step=4)
    try:
        assert watch.wait(time.monotonic() + 5.0, or_sync=True) == []
        assert watch.synced == ["other"]
        time.sleep(3 * heal.BEAT_S)
        assert watch.synced == ["other"] and watch.alive()
        trainer.announce_sync(4)
        deadline = time.monotonic() + 5.0
        while len(watch.synced) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.synced == ["other", "trainer"] and watch.dead == []
        trainer.shutdown()
        other.shutdown()
        deadline = time.monotonic() + 5.0
        while watch.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not watch.alive() and watch.dead == []  # goodbyes: no death, no more syncs
    finally:
        watch.close()
        trainer.shutdown()
        other.shutdown()


def _catching_up(at: float, watch=None):
    """An Elastic catching up (after a heal, or a spare in a dead trainer's place) whose
    peers are due at ``at``: only the attributes ``catch_up_due`` reads."""
    from ccfx.runtime.elastic import Elastic

    e = object.__new__(Elastic)
    e.catching_up, e._catch_up_at, e._last_step_end, e._sync_watch = True, at, None, watch
    return e


def test_catching_up_syncs_when_a_watched_peer_starts_its_sync_before_the_estimate():
    """A replica catching up syncs at the step nearest the time estimated from its peers' last
    interval, or at the end of the step in which the first in-step peer starts the sync (its
    stream says so), if that is sooner: after a slower interval the estimate was seconds late,
    and the peers waited."""
    now = time.monotonic()
    assert _catching_up(now - 1.0).catch_up_due()  # no watch: the estimate has passed
    assert not _catching_up(now + 60.0).catch_up_due()
    peer = heal.HealTransport("127.0.0.1", timedelta(seconds=5))
    watch = heal.Watch({0: peer.metadata()}, silent_s=10.0, sync_step=7)
    try:
        e = _catching_up(now + 60.0, watch)
        time.sleep(3 * heal.BEAT_S)  # the stream is open
        assert not e.catch_up_due()
        peer.announce_sync(7)
        watch.wait(time.monotonic() + 5.0, or_sync=True)
        assert e.catch_up_due()  # a minute before the estimate
        assert _catching_up(now - 1.0, heal.Watch({}, 1.0)).catch_up_due()
    finally:
        watch.close()
        peer.shutdown()

