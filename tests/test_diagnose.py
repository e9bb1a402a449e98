"""``ccfx.diagnose``: which rank is slow (its compute: it comes late to every exchange, its
peers wait for it) and which link is slow (its transfers take long while its sender came on
time). The rules are checked on exact numbers in one process; three gloo ranks (127.0.0.1)
then check that a rank made late by a sleep, and a link made slow by the probe's test seam
(``ccfx.runtime.link_probe.LINK_DELAY_S``), are named. The workers are in
tests/diagnose_workers.py."""

import pytest
import torch

import ccfx
from ccfx.runtime.diagnose import Diagnosis, link_timings, rank_timings

from . import diagnose_workers as workers
from . import ranks
from .ranks import scenario

#: Seconds the slow rank sleeps before each backward, and the seam's delay on a link.
EXTRA_S = 0.15
THREE = ranks.Shared(3, [
    scenario("slow rank", workers.slow_rank, 1, EXTRA_S, 6),
    scenario("no slow rank", workers.slow_rank, None, 0.0, 6),
    scenario("slow link", workers.slow_link, (0, 2), EXTRA_S, 1 << 16),
    scenario("every", workers.every, 2, EXTRA_S, 4, 2),
], timeout_s=200)


@pytest.fixture(scope="module")
def three(shared_ranks):
    return shared_ranks[THREE]


# -- the rules, on exact numbers ---------------------------------------------------------------


def _steps(*waits: float) -> dict[str, list[float]]:
    """A timeline summary: one step per wait (wait_s, exchanges, entered, left)."""
    return {str(k): [w, 2, 0.0, w] for k, w in enumerate(waits)}


def test_a_rank_that_waits_less_than_its_peers_is_late_by_the_difference():
    # rank 1 comes 100 ms late: its peers wait 100 ms more than it does, every step
    got = rank_timings({0: _steps(0.102, 0.103, 0.101), 1: _steps(0.002, 0.003, 0.001),
                        2: _steps(0.102, 0.103, 0.102)})
    assert [r.slow for r in got] == [False, True, False]
    assert got[1].late_s == pytest.approx(0.1)
    assert got[1].peers_wait_s == pytest.approx(0.102)
    assert got[1].late_steps == 3
    assert got[0].late_s == pytest.approx(0.0)  # against rank 2 (on time), not the late rank 1


def test_lateness_in_too_few_steps_is_not_slowness():
    # late once in four steps (a one-off: a checkpoint, a page fault): under the 75 % share
    got = rank_timings({0: _steps(0.2, 0.002, 0.002, 0.002), 1: _steps(0.001, 0.002, 0.002,
                                                                        0.002)})
    assert [r.slow for r in got] == [False, False]
    assert got[1].late_steps == 1


def test_only_steps_every_rank_recorded_count():
    got = rank_timings({0: {"4": [0.1, 1, 0, 0], "5": [0.1, 1, 0, 0]},
                        1: {"5": [0.0, 1, 0, 0], "6": [0.0, 1, 0, 0]}})
    assert [r.steps for r in got] == [1, 1]
    assert got[1].slow and got[1].late_s == pytest.approx(0.1)


def test_a_link_far_slower_than_the_others_is_slow_and_its_skew_is_kept():
    incoming = {1: {0: (0.0, 0.001), 2: (0.0, 0.0012)}, 2: {0: (0.001, 0.050), 1: (0.0, 0.001)},
                0: {1: (0.0, 0.0011), 2: (0.2, 0.001)}}
    got = {(li.src, li.dst): li for li in link_timings(incoming, 1 << 16)}
    assert [k for k, li in got.items() if li.slow] == [(0, 2)]
    assert got[(2, 0)].skew_s == 0.2 and not got[(2, 0)].slow  # a late sender is no slow link
    assert got[(0, 2)].mbit_s == pytest.approx((1 << 16) * 8 / 1e6 / 0.05)


def test_the_report_names_the_slow_rank_and_a_rank_whose_every_link_is_slow():
    timings = rank_timings({0: _steps(0.1, 0.1), 1: _steps(0.0, 0.0)})
    slow, fast = (0.0, 0.05), (0.0, 0.001)
    links = link_timings({0: {1: slow, 2: fast}, 1: {0: slow, 2: slow}, 2: {0: fast, 1: slow}},
                         1000)
    text = str(Diagnosis(timings, links))
    assert "slow rank 1: it arrives 100.0 ms late" in text
    assert "slow link 0->1: 50.0 ms for 1000 bytes" in text
    assert "every link of rank 1 is slow" in text
    assert "every link of rank 0" not in text


def test_bad_input_is_named():
    with pytest.raises(ccfx.ConfigError, match="DDP comm hook"):
        ccfx.diagnose(torch.nn.Linear(2, 2))
    with pytest.raises(ccfx.ConfigError, match="links=True"):
        ccfx.diagnose()
    state, _ = ccfx.ddp_comm_hook("int8")
    with pytest.raises(ccfx.ConfigError, match="after at least one backward"):
        ccfx.diagnose(state)
    with pytest.raises(ccfx.ConfigError, match="probe_bytes"):
        ccfx.diagnose(state, links=True, probe_bytes=0)
    with pytest.raises(ccfx.ConfigError, match="steps=-1"):
        ccfx.diagnose_every(state, -1)
    with pytest.raises(ccfx.ConfigError, match="timeout_s=0"):  # at once, not in a backward
        ccfx.diagnose_every(state, 10, timeout_s=0)
    with pytest.raises(ccfx.ConfigError, match="links=True is for ccfx.diagnose"):
        ccfx.diagnose_every(state, 10, links=True)
    delayed, _ = ccfx.delayed_comm_hook("int8")  # its waits come a step late: no lateness
    with pytest.raises(ccfx.ConfigError, match="use ccfx.ddp_comm_hook|diagnose with ccfx.ddp"):
        ccfx.diagnose(delayed)


# -- on three ranks ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_rank_that_computes_longer_is_named_with_its_lateness(three):
    for said in three["slow rank"]:  # every rank says the same
        assert said["slow_ranks"] == [1], said["text"]
        assert said["steps"] == 6
        assert 0.5 * EXTRA_S <= said["late_s"][1] <= 2 * EXTRA_S, said["text"]
        assert said["peers_wait_s"][1] >= said["late_s"][1]  # they wait for it


@pytest.mark.slow
def test_no_rank_is_named_when_none_is_slowed(three):
    for said in three["no slow rank"]:
        assert said["slow_ranks"] == [], said["text"]


@pytest.mark.slow
def test_a_slow_link_is_named_by_its_ends_and_no_rank_is_blamed(three):
    for said in three["slow link"]:
        assert said["links"] == 6
        assert said["slow_links"] == [[0, 2]], said["text"]
        assert said["links_only"] == [[0, 2]], said["links_only_text"]
        assert "none timed: the links only" in said["links_only_text"]


@pytest.mark.slow
def test_diagnose_every_reports_each_period(three):
    for reports in three["every"]:
        assert [r["steps"] for r in reports] == [2, 4]
        assert reports[-1]["slow_ranks"] == [2], reports[-1]["text"]
