"""Adaptive compression on the DDP comm hook (ccfx.runtime.adaptive): the spec and its errors,
ACCORDION's rule on exact norm sequences, error feedback across a switch, the ledger's switch
rows, checkpoint/resume, and (2 gloo ranks, in the shared spawn) every rank switching at the
same step with bit-identical gradients."""

import math
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ccfx
from ccfx.runtime import adaptive
from ccfx.runtime.adaptive import HEAVY, LIGHT, AdaptiveExchange, AdaptiveSpec, decide, parse
from ccfx.wire.comm import LocalComm
from ccfx.wire.exchange import BucketLayout, exchange_for

from . import adaptive_workers as workers
from . import ranks
from .dp_workers import batch, loss_fn, mlp

# -- the spec -----------------------------------------------------------------------------------


def test_a_spec_reads_nested_codec_options_and_defaults():
    got = parse("adaptive:light=int8,heavy=topk:ratio=0.05,ef")
    assert got == AdaptiveSpec("int8", "topk:ratio=0.05,ef", 0.5, 50)
    assert got.spec == "adaptive:light=int8,heavy=topk:ratio=0.05,ef,eta=0.5,every=50"
    assert parse(got.spec) == got
    assert parse("Adaptive:heavy=powersgd:rank=2,ef,eta=0.25,light=fp16,every=10") == \
        AdaptiveSpec("fp16", "powersgd:rank=2,ef", 0.25, 10)


@pytest.mark.parametrize("spec, says", [
    ("adaptive:light=int9,heavy=int8", "light='int9': unknown codec 'int9'"),
    ("adaptive:light=int8,heavy=topq:ratio=0.1", "heavy='topq:ratio=0.1': unknown codec"),
    ("adaptive:light=int8", "no heavy= codec; write adaptive:light=<codec>,heavy=<codec>"),
    ("adaptive:int8,heavy=sign", "cannot read 'int8'; write adaptive:light="),
    ("adaptive:light=int8,heavy=int8", "nothing to switch; use ccfx.ddp_comm_hook('int8')"),
    ("adaptive:light=int8,heavy=sign,eta=-1", "eta='-1': give a positive number"),
    ("adaptive:light=int8,heavy=sign,every=0", "every='0': give a step count >= 1"),
    ("adaptive:light=int8,heavy=sign,every=2.5", "every='2.5': give a step count >= 1"),
    ("adaptive:light=int8,heavy=sign,eta=0.5,ef", "cannot read 'ef'"),
    ("adaptive:light=int8,light=fp16,heavy=sign", "light= is given twice"),
    ("adaptive:light=adaptive:light=int8,heavy=sign", "is adaptive itself"),
])
def test_a_bad_spec_is_a_config_error_naming_the_fix(spec, says):
    with pytest.raises(ccfx.ConfigError, match=None) as e:
        ccfx.ddp_comm_hook(spec)
    assert says in str(e.value), str(e.value)


def test_an_adaptive_spec_where_only_fixed_codecs_go_names_the_comm_hook():
    spec = "adaptive:light=int8,heavy=sign"
    with pytest.raises(ccfx.ConfigError, match="compiled backward cannot; it runs on DDP's "
                                               "comm hook"):
        ccfx.Config(data_parallel=True, gradient_codec=spec)
    from ccfx.runtime.comm_hook import CommHookState

    with pytest.raises(ccfx.ConfigError, match=r"register_comm_hook\(\*ccfx.ddp_comm_hook"):
        CommHookState(spec)  # what register_codec(ddp_model, spec) makes


def test_a_light_codec_that_sends_less_than_the_heavy_one_runs_with_a_warning():
    with pytest.warns(ccfx.CcfxWarning, match="Swap light= and heavy="):
        state, _ = ccfx.ddp_comm_hook("adaptive:light=topk:ratio=0.05,ef,heavy=int8")
    assert state.setting.light == "topk:ratio=0.05,ef"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ccfx.CcfxWarning)
        ccfx.ddp_comm_hook("adaptive:light=int8,heavy=topk:ratio=0.01,ef")


# -- the rule -----------------------------------------------------------------------------------


def test_the_rule_is_accordions_relative_norm_change_against_eta():
    assert decide(1.0, 1.5, 0.5, HEAVY) == LIGHT  # change 0.5 >= eta: critical
    assert decide(1.0, 0.5, 0.5, HEAVY) == LIGHT  # a fall counts as a rise does
    assert decide(1.0, 1.25, 0.5, LIGHT) == HEAVY  # 0.25 < eta: stable
    assert decide(0.0, 0.0, 0.5, LIGHT) == HEAVY
    assert decide(0.0, 1e-30, 0.5, HEAVY) == LIGHT  # leaving zero: infinite change
    assert decide(None, 9.0, 0.5, HEAVY) == HEAVY  # no reference: the current codec holds
    assert decide(None, 9.0, 0.5, LIGHT) == LIGHT


def _driven(light, heavy, every, eta, scales, numel=6):
    """An adaptive bucket run locally on gradients ``s * ones``: the codec of each step and the
    switches (step, old, new)."""
    layout = BucketLayout(((numel,),), torch.float32)
    step, switched = [0], []
    ex = AdaptiveExchange(layout, AdaptiveSpec(light, heavy, eta, every),
                          (exchange_for(layout, light), exchange_for(layout, heavy)),
                          lambda: step[0], lambda s, old, new, change: switched.append((s, old, new)))
    state = ex.init_state()
    used = []
    for step[0], s in enumerate(scales):
        used.append(ex.spec)
        ex.run([torch.full((numel,), float(s))], state, LocalComm())
    return used, switched, state


def test_an_exact_norm_sequence_switches_at_interval_ends_and_a_switch_rebases():
    # intervals of 2 steps; fp16 and none carry these small integers exactly
    scales = [1, 1, 1, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4]
    used, switched, state = _driven("none", "fp16", 2, 0.5, scales)
    # [0,1] first interval: reference only; [2,3] change 0 < eta: heavy from step 4;
    # [4,5] after the switch: reference only; [6,7] change 3 >= eta: light from step 8;
    # [8,9] reference; [10,11] change 0: heavy from step 12
    assert switched == [(4, LIGHT, HEAVY), (8, HEAVY, LIGHT), (12, LIGHT, HEAVY)]
    assert used == ["none"] * 4 + ["fp16"] * 4 + ["none"] * 4 + ["fp16"] * 2
    assert float(state["norm"]) == 4 * math.sqrt(6)  # [12,13]: the new reference
    assert int(state["count"]) == 0 and int(state["mode"]) == HEAVY


def test_a_stable_norm_within_eta_stays_heavy():
    _, switched, state = _driven("none", "fp16", 3, 0.5, [2, 2, 2, 2, 2, 2, 3, 3, 3, 2, 2, 2])
    # [6..8] after the switch: reference only; [9..11] 3 -> 2 is a change of 1/3 < eta
    assert switched == [(6, LIGHT, HEAVY)]
    assert float(state["norm"]) == pytest.approx(2 * math.sqrt(6))


def test_the_norm_is_summed_in_an_order_no_thread_count_changes():
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0)) * 1e3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = adaptive.fixed_order_norm(x)
        torch.set_num_threads(2)
        two = adaptive.fixed_order_norm(x)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    assert one == pytest.approx(math.sqrt(math.fsum(v * v for v in x.double().tolist())),
                                rel=1e-14)


# -- error feedback across a switch -------------------------------------------------------------


def _bucket(light, heavy, shapes=((5, 4), (4,))):
    layout = BucketLayout(shapes, torch.float32)
    ex = AdaptiveExchange(layout, AdaptiveSpec(light, heavy, 0.5, 1),
                          (exchange_for(layout, light), exchange_for(layout, heavy)),
                          lambda: 0, lambda *a: None)
    return layout, ex, ex.init_state()


def test_a_residual_carries_over_when_both_codecs_keep_one():
    _, ex, state = _bucket("int8:ef", "topk:ratio=0.1,ef")
    r = torch.randn(24)
    state["light_residual"].copy_(r)
    ex._switch(state, LIGHT, HEAVY)
    assert torch.equal(state["heavy_residual"], r)
    assert not state["light_residual"].any()
    assert "flush" not in state  # both hold all of it: nothing ever waits


def test_a_residual_the_new_codec_cannot_hold_is_sent_with_the_next_gradient():
    layout, ex, state = _bucket("int8", "topk:ratio=0.1,ef")
    r, g = torch.randn(24), torch.randn(24)
    state["heavy_residual"].copy_(r)
    state["mode"].fill_(HEAVY)
    ex._switch(state, HEAVY, LIGHT)
    assert not state["heavy_residual"].any() and int(state["pending"]) == 1
    out = ex.run(layout.unflat(g), state, LocalComm())
    int8 = exchange_for(layout, "int8")
    want = int8.run(layout.unflat(g + r), int8.init_state(), LocalComm())
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert int(state["pending"]) == 0 and not state["flush"].any()


def test_powersgd_holds_its_matrices_part_and_the_rest_is_flushed():
    _, ex, state = _bucket("int8:ef", "powersgd:rank=1,ef", shapes=((6, 5), (5,)))
    r = torch.randn(35)
    state["light_residual"].copy_(r)
    ex._switch(state, LIGHT, HEAVY)
    assert torch.equal(state["heavy_residual0000"], r[:30].view(6, 5))
    assert torch.equal(state["flush"], torch.cat([torch.zeros(30), r[30:]]))
    ex._switch(state, HEAVY, LIGHT)  # back: the flat residual takes all the matrix's part
    assert torch.equal(state["light_residual"], torch.cat([r[:30], torch.zeros(5)]))


# -- on DDP: ledger, plan, checkpoint -----------------------------------------------------------


def _train(model, opt, steps):
    for i in steps:
        loss_fn(model(batch(0, i))).backward()
        opt.step()
        opt.zero_grad()


def test_the_ledger_and_the_plan_show_the_switches(one_rank_group, one_thread):
    model, state, opt = workers.hooked(0, find_unused_parameters=True)
    _train(model, opt, range(8))
    switches = state.ledger.switches
    assert switches, "no switch in 8 steps at eta=0.1, every=1"
    ledger = ccfx.ledger_of(model)
    assert ledger.to_dict()["switches"][0] == dict(vars(switches[0]))
    first = switches[0]
    assert (f"    0, bucket {first.bucket}: step {first.step}, {first.old} -> {first.new}, "
            "gradient-norm change") in str(ledger)
    rows = {b.index: b.codec for b in ccfx.plan_of(model).graphs[0].buckets}
    assert rows == state.modes()
    assert ccfx.plan_of(model).data_parallel.gradient_codec == parse(workers.SPEC).spec


def test_a_resume_keeps_each_buckets_codec_and_norm_history(one_rank_group, one_thread, tmp_path):
    model, state, opt = workers.hooked(0, find_unused_parameters=True)
    _train(model, opt, range(12))
    straight = workers.switches(state), ranks.digest(model.parameters())

    model, state, opt = workers.hooked(0, find_unused_parameters=True)
    _train(model, opt, range(6))
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "hook": state.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    assert {"ddp.bucket0.mode", "ddp.bucket0.norm", "ddp.bucket0.acc"} <= set(ckpt["hook"]["state"])

    model, state, opt = workers.hooked(0, find_unused_parameters=True)
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["hook"])
    _train(model, opt, range(6, 12))
    assert ranks.digest(model.parameters()) == straight[1]  # bit for bit
    assert workers.switches(state) == [s for s in straight[0] if s[1] > 6]
    assert any(s[1] > 6 for s in straight[0]), "no switch after the checkpoint to check"


def test_a_checkpoint_of_another_spec_is_refused(one_rank_group, one_thread):
    model, state, opt = workers.hooked(0, find_unused_parameters=True)
    _train(model, opt, range(1))
    other, _ = ccfx.ddp_comm_hook("adaptive:light=int8,heavy=sign")
    with pytest.raises(ccfx.ConfigError, match="build the hook with the checkpoint's spec"):
        other.load_state_dict(state.state_dict())
    plain, _ = ccfx.ddp_comm_hook("int8")
    with pytest.raises(ccfx.ConfigError, match="for codec 'int8', the checkpoint's is for"):
        plain.load_state_dict(state.state_dict())


# -- two gloo ranks -----------------------------------------------------------------------------

TWO = ranks.Shared(2, [ranks.scenario("watch", workers.train_and_watch, 10)], timeout_s=300)


@pytest.fixture(scope="module")
def two(shared_ranks):
    return shared_ranks[TWO]


@pytest.mark.slow
def test_every_rank_switches_at_the_same_step_with_the_same_gradients(two):
    r0, r1 = two["watch"]
    assert r0["switches"] == r1["switches"]
    kinds = {(old, new) for _, _, old, new in r0["switches"]}
    assert kinds == {("int8", "topk:ratio=0.05,ef"), ("topk:ratio=0.05,ef", "int8")}
    assert r0["grads"] == r1["grads"]  # every step, bit for bit
    assert r0["params"] == r1["params"] and r0["modes"] == r1["modes"]
    assert "codec switches" in r0["ledger"]


def test_ddp_regrouping_its_buckets_starts_them_afresh(one_rank_group, one_thread):
    model = DDP(mlp(seed=0), bucket_cap_mb=0.03)
    state, hook = ccfx.ddp_comm_hook(workers.SPEC)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train(model, opt, range(3))
    assert state.steps == 3 and set(state.modes()) == set(state.buckets)
