"""One story for codec state (ccfx.codecs.state): explicit tensors, one naming scheme
``<channel>.<state-name>``, checkpoints of the earlier schemes still load, and a checkpoint that
does not fit is a ccfx.ConfigError naming the option."""

from __future__ import annotations

import json
import re

import pytest
import torch

import ccfx
from ccfx import codecs
from ccfx.codecs import state as cs
from ccfx.runtime.comm_hook import CommHookState
from ccfx.wire.format import WireFormat

from . import local_steps_workers as w
from . import toy_models as models
from .util import compile_ccfx, loss_of


def _trained(codec="int8:block=32,ef", grad_codec="powersgd:rank=2", steps=2, **options):
    model = models.MLP(depth=4)
    compiled, _ = compile_ccfx(model, stages=2, activation_codec=codec,
                               activation_grad_codec=grad_codec, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        opt.zero_grad()
        loss_of(compiled(torch.randn(4, 32, generator=torch.Generator().manual_seed(i))))\
            .backward()
        opt.step()
    return compiled


def test_names_build_in_one_place():
    assert cs.edge_channel(0, 3, (1, 2), "fwd") == "graph0.edge3.hop1to2.fwd"
    assert cs.edge_channel(0, 3, (1, 2), "bwd", "send") == "graph0.edge3.hop1to2.bwd.send"
    assert cs.bucket_channel(1, 2) == "graph1.bucket2"
    assert cs.bucket_channel(0, 0, stage=1) == "graph0.stage1.bucket0"
    assert cs.ddp_channel(4) == "ddp.bucket4"
    assert cs.outer_channel(0, 1) == "outer.fragment0.part1"
    assert cs.key("graph0.bucket2", "q0003") == "graph0.bucket2.q0003"
    assert cs.split_key("outer.fragment0.part1.residual") == ("outer.fragment0.part1", "residual")


def test_cut_edge_state_is_named_by_channel_and_lives_in_no_codec_object():
    compiled = _trained()
    saved = ccfx.codec_state(compiled).state_dict()
    # what the state was made for: each channel's codec (meta.codecs, JSON bytes)
    specs = json.loads(bytes(saved["meta.codecs"].tolist()).decode())
    assert set(specs.values()) == {"int8:block=32,ef", "powersgd:rank=2"}, specs
    names = [n for n in saved if not n.startswith("meta.")]
    assert names, "stateful codecs both ways"
    assert {cs.split_key(n)[0] for n in names} == set(specs)
    pattern = re.compile(r"graph0\.edge\d+\.hop0to1\.(fwd\.residual|bwd\.q)$")
    assert all(pattern.match(n) for n in names), names
    assert any(n.endswith("fwd.residual") for n in names)
    assert any(n.endswith("bwd.q") for n in names)
    # the shared codec objects hold nothing: the state is the holder's
    assert codecs.prototype("int8:block=32,ef").__dict__.get("_ccfx_state", {}) == {}
    assert codecs.prototype("powersgd:rank=2").__dict__.get("_ccfx_state", {}) == {}


def test_the_earlier_names_still_load():
    compiled = _trained()
    saved = {k: v.clone() for k, v in ccfx.codec_state(compiled).state_dict().items()
             if not k.startswith("meta.")}  # the earlier scheme recorded no meta
    # graph0.edge3.hop0to1.fwd.residual was graph0_edge3_hop0to1_fwd_residual
    old = {k.replace(".", "_"): v + 1 for k, v in saved.items()}
    again = _trained()
    ccfx.codec_state(again).load_state_dict(old)
    live = {k: v for k, v in ccfx.codec_state(again).state_dict().items()
            if not k.startswith("meta.")}
    assert sorted(live) == sorted(saved)
    assert all(torch.equal(v, saved[k] + 1) for k, v in live.items())


def test_a_checkpoint_of_another_codec_is_a_config_error_naming_the_option():
    saved = ccfx.codec_state(_trained()).state_dict()
    other = _trained(codec="topk:ratio=0.5,ef", grad_codec="powersgd:rank=3")
    with pytest.raises(ccfx.ConfigError, match=r"activation_grad_codec='powersgd:rank=3': q: "
                                               r"the checkpoint's is \(\d+, 2\)"):
        ccfx.codec_state(other).load_state_dict(saved)
    stateless = _trained(codec="int8", grad_codec="none")
    with pytest.raises(ccfx.ConfigError, match="(?s)set by activation_codec.*no codec state"):
        ccfx.codec_state(stateless).load_state_dict(saved)


def test_wire_format_state_is_explicit():
    wire = WireFormat(codecs.prototype("topk:ratio=0.25,ef"), (4, 8), torch.float32)
    state = wire.init_state()
    assert sorted(state) == ["residual"]
    x = torch.randn(4, 8)
    out = torch.empty(4, 8)
    wire.decode_into(wire.encode(x, state), out, state)
    assert torch.equal(state["residual"], x - out)  # updated in place, by the caller's tensors
    reference = codecs.get("topk:ratio=0.25,ef")  # the object face, for comparison
    y = reference.roundtrip(x)
    fresh = wire.init_state()
    assert torch.equal(wire.roundtrip(x, fresh), y)
    assert torch.equal(fresh["residual"], reference.state_dict()["residual"])


def test_local_steps_codec_state_names_and_the_earlier_layout():
    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    options = {"sync_every": 2, "outer_codec": "topk:ratio=0.2,ef", "compress_min_numel": 0}
    outer = ccfx.local_steps(model, opt, **options)
    for i in range(2):
        w.loss_of(model, 0, i).backward()
        opt.step()
        opt.zero_grad()
    state = outer.state_dict()
    outer.close()
    assert state["codec"] and all(re.match(r"outer\.fragment0\.part\d+\.residual$", k)
                                  for k in state["codec"]), list(state["codec"])
    # the earlier layout: each fragment's list of parts' state
    old = {**state, "fragments": [dict(f) for f in state["fragments"]]}
    del old["codec"]
    parts: dict[int, dict] = {}
    for k, t in state["codec"].items():
        channel, name = cs.split_key(k)
        parts.setdefault(int(channel.rsplit("part", 1)[1]), {})[name] = t
    old["fragments"][0]["codec"] = [parts[p] for p in sorted(parts)]
    again = ccfx.local_steps(model, opt, **options)
    again.load_state_dict(old)
    assert all(torch.equal(t, state["codec"][k]) for k, t in again.state_dict()["codec"].items())
    bad = {**state, "codec": {k: t[:1] for k, t in state["codec"].items()}}
    with pytest.raises(ccfx.ConfigError, match="outer_codec='topk"):
        again.load_state_dict(bad)
    again.close()


def test_comm_hook_state_is_named_like_every_other():
    state = CommHookState("powersgd:ef")
    saved = {"spec": "powersgd:rank=4,ef", "steps": 3,
             "buckets": {0: {"shapes": ((8, 16),), "dtype": torch.float32}},
             "state": {"ddp.bucket0.q0000": torch.randn(16, 4),
                       "ddp.bucket0.residual0000": torch.randn(8, 16)}}
    state.load_state_dict(saved)
    again = state.state_dict()
    assert sorted(again["state"]) == sorted(saved["state"])
    assert all(torch.equal(again["state"][k], t) for k, t in saved["state"].items())
    with pytest.raises(ccfx.ConfigError, match="ddp.bucket1"):
        state.load_state_dict({**saved, "state": {"ddp.bucket1.q0000": torch.randn(16, 4)}})


def test_a_stage_module_loads_the_earlier_names_and_refuses_misfits():
    """A pipeline stage's module: ``ccfx_codec_state.edge3_send_fwd_residual`` and
    ``ccfx_grad_state.bucket0_q0000`` were the earlier names."""
    stage = torch.nn.Linear(2, 2)
    holder = cs.state_of(stage)
    assert cs.state_of(stage) is holder and stage.ccfx_codec_state is holder
    edge = holder.add(cs.edge_channel(0, 3, (0, 1), "fwd", "send"), "topk:ef",
                      {"residual": torch.zeros(4)}, legacy="ccfx_codec_state.edge3_send_fwd_")
    bucket = holder.add(cs.bucket_channel(0, 0, stage=0), "powersgd", {"q0000": torch.zeros(3, 1)},
                        legacy="ccfx_grad_state.bucket0_")
    names = sorted(stage.state_dict())
    assert names == ["bias", "ccfx_codec_state.graph0.edge3.hop0to1.fwd.send.residual",
                     "ccfx_codec_state.graph0.stage0.bucket0.q0000",
                     "ccfx_codec_state.meta.codecs", "weight"]
    old = {"weight": stage.weight.detach().clone(), "bias": stage.bias.detach().clone(),
           "ccfx_codec_state.edge3_send_fwd_residual": torch.ones(4),
           "ccfx_grad_state.bucket0_q0000": torch.full((3, 1), 2.0)}
    stage.load_state_dict(old)
    assert torch.equal(edge["residual"], torch.ones(4))
    assert torch.equal(bucket["q0000"], torch.full((3, 1), 2.0))
    new = dict(stage.state_dict())
    new["ccfx_codec_state.graph0.stage0.bucket0.q0000"] = torch.zeros(3, 2)
    with pytest.raises(ccfx.ConfigError, match=r"graph0\.stage0\.bucket0, gradient_codec="):
        stage.load_state_dict(new)
    # a checkpoint of the parameters alone is torch's business (strict=False loads it)
    stage.load_state_dict({"weight": old["weight"], "bias": old["bias"]}, strict=False)


# -- a damaged checkpoint is refused, a good one loads bit-exact --------------------------------


POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _poisoned(saved: dict, value: float, suffix: str = "fwd.residual") -> tuple[dict, str]:
    """``saved`` with one entry of its first ``suffix`` state set to ``value``; its channel."""
    name = next(k for k in sorted(saved) if k.endswith(suffix))
    bad = {k: v.clone() for k, v in saved.items()}
    bad[name].view(-1)[0] = value
    return bad, cs.split_key(name)[0]


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_checkpoint_whose_residual_is_not_finite_is_refused_naming_the_channel(poison):
    """ccfx never keeps NaN or ±inf codec state (error feedback and PowerSGD reset it as they
    run): such a checkpoint is damaged, and loaded it would make the loss NaN from the first
    step. Refused after the first call and before it, and nothing of it is copied in."""
    bad, channel = _poisoned(ccfx.codec_state(_trained()).state_dict(), POISONS[poison])
    again = _trained()
    before = {k: v.clone() for k, v in ccfx.codec_state(again).state_dict().items()}
    pattern = (rf"(?s)holds NaN or ±inf.*{re.escape(channel)} \(activation_codec\): residual "
               r"holds \d NaN and \d ±inf.*Resume from an earlier checkpoint, or leave the "
               r"codec state out")
    with pytest.raises(ccfx.ConfigError, match=pattern):
        ccfx.codec_state(again).load_state_dict(bad)
    after = ccfx.codec_state(again).state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    model = models.MLP(depth=4)  # before the first call: refused at the load, not later
    compiled, _ = compile_ccfx(model, stages=2, activation_codec="int8:block=32,ef",
                               activation_grad_codec="powersgd:rank=2")
    with pytest.raises(ccfx.ConfigError, match=pattern):
        ccfx.codec_state(compiled).load_state_dict(bad)


def test_a_good_checkpoint_still_loads_bit_exact():
    """The checks change nothing for a checkpoint that passes them: every tensor loads bit for
    bit, after the first call and before it (where the state is applied as ccfx makes it)."""
    saved = {k: v.clone() for k, v in ccfx.codec_state(_trained(steps=3)).state_dict().items()}
    again = _trained(steps=1)
    ccfx.codec_state(again).load_state_dict(saved)
    loaded = ccfx.codec_state(again).state_dict()
    assert sorted(loaded) == sorted(saved)
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    model = models.MLP(depth=4)
    compiled, _ = compile_ccfx(model, stages=2, activation_codec="int8:block=32,ef",
                               activation_grad_codec="powersgd:rank=2")
    holder = ccfx.codec_state(compiled)
    holder.load_state_dict(saved)
    loss_of(compiled(torch.randn(4, 32))).backward()  # applied before the first encode
    assert holder.channels() and holder.unclaimed() == []  # every channel took its state


def test_a_stage_s_damaged_codec_state_is_refused_with_the_stage_s_fix():
    stage = torch.nn.Linear(2, 2)
    cs.state_of(stage).add(cs.edge_channel(0, 0, (0, 1), "fwd", "send"), "int8:ef",
                           {"residual": torch.zeros(4)})
    bad = dict(stage.state_dict())
    bad["ccfx_codec_state.graph0.edge0.hop0to1.fwd.send.residual"] = torch.full((4,), torch.inf)
    with pytest.raises(ccfx.ConfigError, match=r"(?s)graph0\.edge0\.hop0to1\.fwd\.send "
                       r"\(activation_codec\): residual holds 0 NaN and 4 ±inf.*without its "
                       r"'ccfx_codec_state\.' entries, with strict=False"):
        stage.load_state_dict(bad)
    assert torch.equal(stage.ccfx_codec_state.channel(
        "graph0.edge0.hop0to1.fwd.send")["residual"], torch.zeros(4))


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_the_comm_hook_refuses_non_finite_state_naming_the_bucket(poison):
    state = CommHookState("powersgd:rank=4,ef")
    q = torch.randn(16, 4)
    q[3, 1] = POISONS[poison]
    saved = {"spec": "powersgd:rank=4,ef", "steps": 3,
             "buckets": {0: {"shapes": ((8, 16),), "dtype": torch.float32}},
             "state": {"ddp.bucket0.q0000": q, "ddp.bucket0.residual0000": torch.zeros(8, 16)}}
    with pytest.raises(ccfx.ConfigError, match=r"(?s)DDP comm hook state holds NaN or ±inf.*"
                       r"ddp\.bucket0 \(the hook's codec.*\): q0000 holds.*earlier checkpoint"):
        state.load_state_dict(saved)
    assert state.steps == 0 and not state.state_dict()["state"]  # nothing was taken


def test_local_steps_refuse_non_finite_codec_state_naming_the_part():
    model = w.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    options = {"sync_every": 2, "outer_codec": "int8:ef", "compress_min_numel": 0}
    outer = ccfx.local_steps(model, opt, **options)
    try:
        for i in range(2):
            w.loss_of(model, 0, i).backward()
            opt.step()
            opt.zero_grad()
        state = outer.state_dict()
        codec, channel = _poisoned(state["codec"], float("nan"), "residual")
        with pytest.raises(ccfx.ConfigError, match=rf"(?s){re.escape(channel)} \(outer_codec\)"
                           r": residual holds 1 NaN.*state\['codec'\] = outer\.state_dict\(\)"):
            outer.load_state_dict({**state, "codec": codec})
        outer.load_state_dict({**state, "codec": outer.state_dict()["codec"]})  # the fix works
        assert outer.step == state["step"]
    finally:
        outer.close()
