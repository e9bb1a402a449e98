"""One compiled model, one backend, with a lifetime (issue #8, item 0)."""

import gc
import json

import pytest
import torch

import ccfx
from ccfx.backends.compiler import live_backends
from ccfx.runtime.cut_op import registered_hops

from .toy_models import MLP


def _train_once(compiled, x):
    compiled(x).square().mean().backward()


def test_two_models_three_compiles_three_plans_and_ledgers():
    a, b = MLP(width=16, depth=4), MLP(width=16, depth=4)
    shared = {"stages": 2, "activation_codec": "int8", "lowering": "eager"}
    ca = torch.compile(a, backend="ccfx")  # no options
    cb = torch.compile(b, backend="ccfx")  # no options, the same model class
    ca2 = torch.compile(a, backend="ccfx", options=shared)
    cb2 = torch.compile(b, backend="ccfx", options=shared)  # the same options dict
    x = torch.randn(4, 16)
    for c in (ca, cb, ca2, cb2):
        _train_once(c, x)
    _train_once(ca, x)
    plans = [ccfx.plan_of(c) for c in (ca, cb, ca2, cb2)]
    assert [len(p.graphs) for p in plans] == [1, 1, 1, 1]
    assert [p.num_stages for p in plans] == [1, 1, 2, 2]
    ledgers = [ccfx.ledger_of(c) for c in (ca, cb, ca2, cb2)]
    assert len({id(ledger) for ledger in ledgers}) == 4
    assert [ledger.steps for ledger in ledgers] == [2, 1, 1, 1]
    # the shared options dict still gives each compile its own hops and counts
    assert ledgers[2].totals() == ledgers[3].totals() and ledgers[2].totals()[0] > 0


@pytest.mark.slow
def test_compiling_and_dropping_10_models_leaves_the_registries_as_they_were():
    """A registry that keeps one entry per model shows at 10 models as at 50 (each compile is
    checked to add exactly one live backend while alive), at a fifth of the compiles."""
    gc.collect()
    before = (live_backends(), registered_hops())
    for i in range(10):
        model = MLP(width=8, depth=2)
        compiled = torch.compile(model, backend="ccfx",
                                 options={"stages": 2, "activation_codec": "powersgd:rank=1",
                                          "lowering": "eager"})
        _train_once(compiled, torch.randn(2, 8))
        assert ccfx.plan_of(compiled).num_stages == 2, f"compile {i} did not reach ccfx"
        assert live_backends() == before[0] + 1
        del model, compiled
        gc.collect()
    assert (live_backends(), registered_hops()) == before


def test_a_compiled_function_finds_its_backend():
    def f(x):
        return torch.relu(x) * 2

    cf = torch.compile(f, backend="ccfx", options={"lowering": "eager"})
    cf(torch.randn(3))
    assert ccfx.plan_of(cf).graphs


def test_options_from_the_environment_and_where_each_came_from(monkeypatch):
    monkeypatch.setenv("CCFX_OPTIONS", json.dumps({"stages": 3, "activation_codec": "fp16",
                                                   "lowering": "eager"}))
    compiled = torch.compile(MLP(width=16, depth=6), backend="ccfx",
                             options={"activation_codec": "int8"})
    _train_once(compiled, torch.randn(4, 16))
    plan = ccfx.plan_of(compiled)
    assert plan.num_stages == 3  # from the environment
    assert plan.config["activation_codec"] == "int8"  # explicit options win
    assert plan.option_sources["stages"] == "environment"
    assert plan.option_sources["activation_codec"] == "options"
    assert plan.option_sources["balance"] == "default"
    assert "stages=environment" in str(plan)
    assert ccfx.Plan.from_json(plan.to_json()) == plan


def test_bad_environment_options_name_the_variable(monkeypatch):
    monkeypatch.setenv("CCFX_OPTIONS", "{stages: 3")
    compiled = torch.compile(MLP(width=8, depth=2), backend="ccfx")
    try:
        compiled(torch.randn(2, 8))
    except ccfx.ConfigError as e:
        assert "CCFX_OPTIONS" in str(e) and "JSON" in str(e)
    else:
        raise AssertionError("a malformed $CCFX_OPTIONS was accepted")
