"""Codecs with state (error feedback) on 3+ fault-tolerant replicas (issue #20): the outer
average runs as the encoded all-to-all + all-gather whatever the codec's state, and that state
survives quorum changes because it is kept per element of the part, not per chunk.

Two halves:
* in this process, W ranks simulated in lockstep (:class:`Lockstep`) run
  :class:`~ccfx.wire.collectives.CompressedCollective` with the per-element state of
  :func:`~ccfx.wire.collectives.element_state_layout`, the group size changing between calls:
  the ranks agree bit for bit, nothing error feedback holds is lost (the telescoping sum),
  except the owner residual that moved to another rank's chunk, which is counted;
* 3 torchft replicas (processes, a lighthouse in this process; launcher of
  tests/elastic_workers.py) train with ``int8:ef``: every committed sync among three runs the
  all-to-all form and sends exactly ``2 (W-1)`` chunk payloads per replica, a SIGKILLed
  replica leaves two (the all-gather form, the same residual), and the restarted one heals and
  rejoins; the global parameters are bit-identical after every committed sync.
"""

from __future__ import annotations

import pytest
import torch

from ccfx.errors import ConfigError
from ccfx.wire.collectives import CollectiveCall, CompressedCollective, element_state_layout


class Lockstep:
    """``world`` ranks of one process running a collective's phases in lockstep: phase k on
    every rank, then phase k+1. Each rank's comm records what it issues; a wait answers with
    what the real collective would have delivered to that rank. ``sent[r]``: the bytes rank r
    put on the wire (an all-to-all: the ``W-1`` messages for others; an all-gather: its
    message to each of the ``W-1`` others)."""

    def __init__(self, world: int):
        self.world = world
        self.issued: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(world)]
        self.sent = [0] * world

    class _Comm:
        def __init__(self, group, rank):
            self.group, self.rank, self.world = group, rank, group.world

        def all_to_all(self, t):
            return self._issue("all_to_all", t)

        def all_gather(self, t):
            return self._issue("all_gather", t)

        def _issue(self, kind, t):
            g, t = self.group, t.reshape(-1).clone()
            g.issued[self.rank].append((kind, t))
            own = t.numel() // g.world if kind == "all_to_all" else t.numel()
            g.sent[self.rank] += (g.world - 1) * own * t.element_size()
            return len(g.issued[self.rank]) - 1

        def wait(self, index):
            g = self.group
            kind, _ = g.issued[self.rank][index]
            inputs = [g.issued[src][index][1] for src in range(g.world)]
            if kind == "all_gather":
                return torch.cat(inputs)
            return torch.cat([x.chunk(g.world)[self.rank] for x in inputs])

    def run(self, cc: CompressedCollective, xs, states) -> list[torch.Tensor]:
        comms = [self._Comm(self, r) for r in range(self.world)]
        lists = [[s[k] for k in sorted(cc.state_layout())] for s in states]
        carry: list = [[] for _ in range(self.world)]
        for phase in cc.phases:
            carry = [phase(xs[r], lists[r], carry[r], comms[r]) for r in range(self.world)]
        return [c[0] for c in carry]


def _average(world: int, xs, elements, spec="int8:ef"):
    """One all-reduce (avg) of ``xs`` (one per rank) on ``world`` ranks, state kept per element
    in ``elements`` (one dict per rank, updated): (outputs, bytes sent per rank, dropped)."""
    n = xs[0].numel()
    cc = CompressedCollective(CollectiveCall("all_reduce", (n,), torch.float32, world, "avg"),
                              spec, owner_feedback=True)
    states = [cc.state_from_elements(elements[r], r) for r in range(world)]
    group = Lockstep(world)
    outs = group.run(cc, xs, states)
    dropped = [cc.state_to_elements(states[r], elements[r], r) for r in range(world)]
    return outs, group.sent, dropped, cc


def _fresh(n: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(s, dtype=d)
            for k, (s, d) in element_state_layout("int8:ef", n).items()}


def test_per_element_state_does_not_depend_on_the_group_size():
    assert element_state_layout("int8:ef", 1000) == {
        "residual": ((1000,), torch.float32), "residual_owner": ((1000,), torch.float32)}
    assert element_state_layout("int4:block=32,ef", 7) is not None
    # no error feedback, or an inner codec with state of its own: not kept per element
    assert element_state_layout("int8", 1000) is None
    assert element_state_layout("qsgd:ef", 1000) is None
    with pytest.raises(ConfigError, match="owner_feedback"):
        CompressedCollective(CollectiveCall("all_reduce", (64,), torch.float32, 3, "avg"),
                             "int8", owner_feedback=True)


def test_state_round_trips_through_each_group_size():
    """Laid out for W ranks and written back untouched, the per-element state is what it was
    (the owner residual outside the rank's chunk excepted: that is dropped, and counted)."""
    n = 1000
    torch.manual_seed(0)
    for world in (2, 3, 4, 5):
        cc = CompressedCollective(CollectiveCall("all_reduce", (n,), torch.float32, world,
                                                 "avg"), "int8:ef", owner_feedback=True)
        for rank in range(world):
            elements = {"residual": torch.randn(n), "residual_owner": torch.randn(n)}
            before = {k: v.clone() for k, v in elements.items()}
            state = cc.state_from_elements(elements, rank)
            assert sorted(state) == sorted(cc.state_layout())
            lo, hi = rank * cc.used, min((rank + 1) * cc.used, n)
            assert cc.state_to_elements(state, elements, rank) == n - (hi - lo)
            assert torch.equal(elements["residual"], before["residual"])
            assert torch.equal(elements["residual_owner"][lo:hi],
                               before["residual_owner"][lo:hi])
            assert not elements["residual_owner"][:lo].any()
            assert not elements["residual_owner"][hi:].any()


def test_error_feedback_loses_nothing_across_quorum_changes_but_the_moved_owner_residual():
    """Syncs on 3, 3, 4, 4, 3 ranks (the 2-rank all-gather form is the elastic test's), the
    ranks' inputs random: every rank gets the same bits each time, and error feedback's
    telescoping sum holds: the outputs summed over the syncs equal the exact averages summed,
    plus what the residuals gave (each rank's own residual / W of the sync it entered, the
    owner residuals) net of what they hold after, minus the owner residual dropped because its
    chunk moved to another rank, to fp32 rounding."""
    n, sizes = 1003, (3, 3, 4, 4, 3)
    torch.manual_seed(1)
    elements = [_fresh(n) for _ in range(max(sizes))]
    got = exact = torch.zeros(n, dtype=torch.float64)
    lost = torch.zeros(n, dtype=torch.float64)
    residual_in = torch.zeros(n, dtype=torch.float64)  # what the residuals held entering
    drops = []
    for t, world in enumerate(sizes):
        xs = [torch.randn(n) * (1 + r) for r in range(world)]
        # the owner residual a rank holds outside its new chunk is dropped: measure it
        cc_w = CompressedCollective(CollectiveCall("all_reduce", (n,), torch.float32, world,
                                                   "avg"), "int8:ef", owner_feedback=True)
        for r in range(world):
            lo, hi = cc_w._owned(r)
            outside = elements[r]["residual_owner"].double().clone()
            outside[lo:hi] = 0
            lost += outside
        # the first-stage residual counts 1/W of the rank's, in the W it is spent in
        residual_in += sum(elements[r]["residual"].double() for r in range(world)) / world
        residual_in += sum(elements[r]["residual_owner"].double() for r in range(world))
        outs, sent, dropped, cc = _average(world, xs, elements)
        assert all(torch.equal(o, outs[0]) for o in outs), f"sync {t}: ranks differ"
        drops.append(sum(dropped))
        got = got + outs[0].double()
        exact = exact + sum(x.double() for x in xs) / world
        left = (sum(elements[r]["residual"].double() for r in range(world)) / world
                + sum(elements[r]["residual_owner"].double() for r in range(world)))
        residual_in -= left  # held again at the next sync's entry (re-added there)
        assert sent == [cc.wire_bytes()] * world == [2 * (world - 1) * cc.packing.nbytes] * world
    # residual_in now: what entered minus what was left, over all syncs = what the residuals
    # added to the outputs, net of what they took
    torch.testing.assert_close(got, exact + residual_in - lost, rtol=0, atol=1e-4)
    # the same group keeps everything; 3 -> 4 and 4 -> 3 move every rank's chunk but rank 0's
    # start, and drop the owner residual outside the new chunk
    assert drops[1] == drops[3] == 0 and drops[2] > 0 and drops[4] > 0, drops
    assert lost.abs().max() > 1e-3 and (got - exact).abs().max() > 1e-3  # not vacuous


def test_owner_feedback_keeps_the_ranks_bit_identical_and_changes_the_result():
    """The owner's re-encode with error feedback is decoded by every rank (the same bits), and
    the residual it keeps makes the second sync differ from one without it."""
    n, world = 640, 3
    torch.manual_seed(2)
    xs = [[torch.randn(n) for _ in range(world)] for _ in range(2)]
    with_fb = [_fresh(n) for _ in range(world)]
    call = CollectiveCall("all_reduce", (n,), torch.float32, world, "avg")
    plain = CompressedCollective(call, "int8:ef")
    states = [plain.init_state() for _ in range(world)]
    same = []
    for step in range(2):
        outs, _, _, _ = _average(world, xs[step], with_fb)
        assert all(torch.equal(o, outs[0]) for o in outs)
        ref = Lockstep(world).run(plain, xs[step], states)
        same.append(torch.equal(ref[0], outs[0]))
    assert any(e["residual_owner"].any() for e in with_fb)
    # the first sync starts from zero residuals: the same bits; the second adds the owner's
    assert same == [True, False]


# -- 3 torchft replicas, one killed and restarted -------------------------------------------


@pytest.fixture(scope="module")
def replicas():
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    from . import elastic_stateful_workers as w

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    reps = w.StatefulReplicas(lighthouse.address(), deadline_s=150)
    out = {}
    try:
        for name in ("r0", "r1", "r2"):
            reps.start(name, seed=int(name[1]))
        reps.wait_for("two committed syncs among three",
                      lambda: reps.committed("r2", replicas=3) >= 2)
        reps.kill("r2")
        out["before_kill"] = {n: len(reps.syncs[n]) for n in ("r0", "r1")}
        reps.wait_for("two committed syncs of the survivors alone",
                      lambda: all(reps.committed(n, replicas=2, after=out["before_kill"][n]) >= 2
                                  for n in ("r0", "r1")))
        out["killed_rows"] = len(reps.syncs["r2"])
        reps.start("r2", seed=7)
        reps.wait_for("two committed syncs of the restarted r2 among three",
                      lambda: reps.committed("r2", replicas=3, after=out["killed_rows"]) >= 2)
        reps.stop(("r0", "r1", "r2"))
        out["reps"] = reps
        yield out
    finally:
        reps.close()
        lighthouse.shutdown()


def _committed(reps, name, after=0):
    return [(row, d) for row, d in reps.syncs[name][after:] if row["committed"]]


@pytest.mark.slow
def test_three_replicas_reduce_by_all_to_all_and_two_gather(replicas):
    reps = replicas["reps"]
    forms = {}
    for name in ("r0", "r1"):
        for row, _ in _committed(reps, name):
            if row["fragments"]:
                forms.setdefault(row["replicas"], set()).add(tuple(row["collectives"]))
    assert forms[3] == {("all_reduce", "all_to_all+all_gather")}, forms
    assert forms[2] == {("all_gather", "all_reduce")}, forms


@pytest.mark.slow
def test_bytes_per_sync_are_the_formula(replicas):
    """Each replica's bytes on the wire per committed sync (counted at its comm): the
    compressed part ``2 (W-1) B`` on 3 replicas (B: one chunk's int8 payload, about 1/W of the
    part's), ``(W-1)`` whole payloads on 2; the raw part (the biases) ``2 (W-1)/W`` of its
    fp32 bytes."""
    from . import elastic_stateful_workers as w

    reps = replicas["reps"]
    seen = set()
    for name in ("r0", "r1", "r2"):
        for row, _ in _committed(reps, name):
            if row["fragments"] and not row["join"]:
                world = row["replicas"]
                assert row["sent"] == w.expected_bytes(world), (name, row)
                seen.add(world)
    assert seen == {2, 3}
    # the all-to-all form sends less than the all-gather form would on 3 replicas
    compressed = {form: sum(w.expected_bytes(3, form).values()) - w.BIASES * 4
                  for form in ("all_to_all", "all_gather")}
    assert compressed == {"all_to_all": 1568, "all_gather": 2344}  # 2 x 2 x 392, 2 x 1172


@pytest.mark.slow
def test_globals_bit_identical_after_every_committed_sync_through_kill_and_rejoin(replicas):
    reps = replicas["reps"]
    by_step: dict[int, set[str]] = {}
    for name in ("r0", "r1", "r2"):
        for row, digest in _committed(reps, name):
            by_step.setdefault(row["torchft_step"], set()).add(digest)
    assert len(by_step) >= 6
    assert all(len(d) == 1 for d in by_step.values()), by_step
    # the restarted r2 healed from a peer, then synced among three, equal to both peers
    rows = _committed(reps, "r2", replicas["killed_rows"])
    assert rows[0][0]["healed"]
    three = [row for row, _ in rows if row["replicas"] == 3 and row["fragments"]]
    assert three, rows


@pytest.mark.slow
def test_residual_survives_the_quorum_changes(replicas):
    """The survivors' residual (kept per element) is carried from three replicas to two and
    back: never reset by a quorum change (it is nonzero at every committed sync after the
    first), and the owner residual is dropped only where a replica's chunk moved."""
    reps = replicas["reps"]
    for name in ("r0", "r1"):
        rows = [row for row, _ in _committed(reps, name) if row["fragments"]]
        # (a replica that heals takes zero residuals and sends a zero pseudo-gradient)
        assert all(row["residual_norm"] > 0 for row in rows if not row["healed"]), rows
        owners = [row["owner_norm"] for row in rows if row["replicas"] == 3]
        assert owners and all(v > 0 for v in owners), rows
