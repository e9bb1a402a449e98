"""A compressed MoE that one rank alone recompiles (issue: the peers waited out the timeout):
the expert-parallel MoE of tests/moe_workers.py (counts read with ``.tolist()``, torch's
default graph break), 2 gloo ranks, one spawn. At step 1 rank 1 gets one more token, which its
own expert takes (an uneven batch): only rank 1's split sizes change, so rank 1 alone
recompiles the graph after the break (its token count and split sizes symbolic) while rank 0
runs its first graph and waits in its all-to-alls.

Before (measured 2026-12-02, ``collective_codec="auto"`` at 100 kbit/s): auto asked its
question anew for the recompiled graph, and rank 1 waited for rank 0's answer while rank 0
waited in the all-to-all for rank 1: rank 0 failed after the default group's timeout (60 s
there, with gloo's bare "Timed out waiting 60000ms for send operation"), rank 1 when the store
went away with it; a named ``int4:ef`` (refused on symbolic rows) waited the same way.
"""

from __future__ import annotations

import re

import pytest
import torch

from . import moe_workers as w
from .ranks import run_scenarios, scenario

#: The default group's timeout in the ranks (what a peer blocked in gloo waits at most).
PG_TIMEOUT_S = 180
#: A link slow enough (100 kbit/s) that ``auto`` compresses the MoE's all-to-alls.
SLOW_LINK = {"link_gbps": 0.0001, "link_latency_ms": 0.0}


@pytest.fixture(scope="module")
def two():
    return run_scenarios(2, [
        scenario("uneven auto", w.counted, "auto", 2, grow_rank1=True, **SLOW_LINK),
        # last: it leaves the group broken (rank 1 fails, rank 0's all-to-all with it)
        scenario("uneven ef", w.counted_fails, "int4:ef", 2, grow_rank1=True),
    ], timeout_s=360, pg_timeout_s=PG_TIMEOUT_S)


@pytest.mark.slow
def test_auto_takes_the_groups_decision_again_in_a_graph_one_rank_recompiles(two):
    """An uneven batch on rank 1 (one more token, for its own expert): rank 1 alone recompiles
    the graph after ``.tolist()`` (its token count and split sizes symbolic), rank 0 runs its
    first graph and waits in its compressed all-to-alls. auto takes the decisions the group
    made for the first graph again (it would keep symbolic splits raw: those all-to-alls
    would then differ from rank 0's, and rank 1 wait for an agreement rank 0 never comes to),
    so both ranks run, within the bound of the coarsest codec auto may pick. Measured (before
    this, 2026-12-02): rank 1 waited at auto's question until rank 0's gloo timeout ended
    both (60 s, the harness's default group timeout)."""
    r0, r1 = two["uneven auto"]
    assert r0["plan_graphs"] == 2 and r1["plan_graphs"] == 4  # rank 1 alone recompiled both
    first = [c["codec"] for c in r1["plan"] if c["graph"] == 1]
    again = [c for c in r1["plan"] if c["graph"] == 3]
    assert [c["codec"] for c in r0["plan"] if c["graph"] == 1] == first
    assert set(first) - {"none"}, first  # the slow link: auto compressed some
    assert not any(":ef" in codec for codec in first)  # rows are other tokens every step
    assert [c["codec"] for c in again] == first
    assert all("decided for graph 1" in c["reason"] for c in again), again
    assert any(isinstance(c["shape"][0], str) for c in again)  # symbolic rows on rank 1
    e = 1 / 14  # the coarsest half step auto may pick (int4)
    for r in (r0, r1):
        for step in r["steps"]:
            assert 0 <= step["err"] <= 1.1 * (step["w_inf"] * e * step["h_max"] + e), step


@pytest.mark.slow
def test_a_rank_that_recompiles_into_refused_codecs_fails_at_once_naming_what_differs(two):
    """int4:ef named: rank 1's recompiled graph (symbolic rows) cannot keep error feedback, so
    its all-to-alls run raw while rank 0's graph sends int4:ef. Rank 1 sees that rank 0 waits
    in a collective step it has not entered (rank 0 records each call's step): a ConfigError
    naming both ranks, the graph and what differs, within a poll, not after
    collective_timeout_s (300 s); rank 0's all-to-all then fails when rank 1 goes (its
    process group torn down), with a CollectiveError quoting rank 1's reason. Measured: the
    failing step 1.5 s on rank 1 (its two recompiles included), 2.4 s on rank 0 on an idle
    2-core machine (3.7 s and 7.0 s at a load of 14, 17 s and 28 s at 25); before, both
    waited out their timeouts (rank 0 the group's, rank 1 collective_timeout_s, 300 s)."""
    r0, r1 = two["uneven ef"]
    assert r1["error"] == "ConfigError", r1
    assert "rank 1: waits at the collectives of a compiled graph" in r1["message"]
    assert "rank 0 waits in the collectives of the forward of graph 1" in r1["message"]
    assert re.search(r"collective 0 \(all_to_all\) int4:ef there, none here", r1["message"])
    assert "error feedback needs a fixed row count" in r1["message"]
    assert r0["error"] == "CollectiveError", r0
    assert r0["message"].startswith("rank 0 of 2: the forward of graph 1 failed")
    assert "Rank 1 gave up first: rank 1: waits at" in r0["message"]
    for r in (r0, r1):  # not collective_timeout_s, nor the group's timeout
        assert r["step_s"] < PG_TIMEOUT_S / 2, r


def test_auto_offers_an_expert_all_to_all_only_codecs_without_state():
    """Error feedback keeps a residual per row, and an expert all-to-all's rows are other
    tokens at every step (and may turn symbolic, where it is refused): auto leaves it out
    there, and keeps it for an all-to-all of equal chunks."""
    from ccfx.planner.plan_collectives import _pool
    from ccfx.wire.collectives import CollectiveCall

    specs = ["none", "int8", "int4", "int4:ef"]
    rows = CollectiveCall("all_to_all", (11, 16), torch.float32, 2, None, (8, 3), (8, 0))
    even = CollectiveCall("all_to_all", (12, 16), torch.float32, 2)
    assert _pool(rows, specs) == ["none", "int8", "int4"]
    assert _pool(even, specs) == specs
