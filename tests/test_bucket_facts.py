"""grad_buckets leaves typed facts (``BucketFacts``) on the backward graph, read by attribute.

One process, no process group: ``data_parallel=True`` is then world size 1, and the backward
still gets every bucket's exchange spliced in (tests/test_data_parallel.py runs it on ranks).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo

import ccfx
from ccfx import viz
from ccfx.passes.facts import BucketFacts, fact

from . import dp_workers


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_spliced_nodes_and_state_placeholders_carry_bucket_facts():
    model = dp_workers.mlp(seed=0)
    backend = ccfx.backend(data_parallel=True, gradient_codec="int8:ef", lowering="eager",
                           compress_min_numel=0)
    compiled = torch.compile(model, backend=backend)
    dp_workers.loss_fn(compiled(dp_workers.batch(0))).backward()
    plan = ccfx.plan_of(compiled)
    (backward,) = backend.graphs[0].lowered.backward
    tagged = [(n, fact(n, BucketFacts)) for n in backward.graph.nodes
              if fact(n, BucketFacts) is not None]
    assert tagged, backward.code
    buckets = {b.index for b in plan.buckets}
    assert {f.bucket for _, f in tagged} == buckets
    states = [(n, f) for n, f in tagged if f.kind == "ccfx_state"]
    spliced = [(n, f) for n, f in tagged if f.kind == "exchange"]
    # error feedback keeps state: one placeholder per state tensor, named for its bucket
    assert states and all(n.op == "placeholder" and f.phase is None and f.state
                          and n.name == f"ccfx_state_{f.bucket}_{f.state}" for n, f in states)
    assert spliced and all(n.op != "placeholder" and f.state is None and f.phase is not None
                           for n, f in spliced)
    # a frozen dataclass under its key, the only box content grad_buckets writes
    f = tagged[0][1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.bucket = 9
    assert all(set(n.meta["ccfx"]) <= {BucketFacts.key} for n, _ in tagged)
    # the drawing reads them: the spliced nodes are drawn under their bucket
    text = viz.to_dot(compiled, which="backward")
    for b in buckets:
        assert f"gradient bucket {b}" in text
