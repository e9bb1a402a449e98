"""Codec state records what it was made for (issue #17 part 4): pipeline stages, the DDP comm
hook and local steps refuse a checkpoint made for another stage, replica, rank or world size
with a ConfigError saying what differs (compiled data parallel's codec_state: in
test_data_parallel.py); a codec of the same state shape is refused too; codec_state before the
first call says what to do. And ranks whose pipeline codecs differ are told which edge and
direction (part 6). Same-world resumes stay bit-exact: the resume tests of test_pipeline.py,
test_comm_hook.py, test_local_steps.py and test_data_parallel.py load the same checkpoints
with the meta in them."""

from __future__ import annotations

import re

import pytest
import torch

import ccfx
from ccfx.codecs import state as cs
from ccfx.runtime.comm_hook import CommHookState

from . import local_steps_workers as lw
from . import state_meta_workers as w
from . import toy_models as models
from .ranks import run_scenarios, scenario
from .util import compile_ccfx, loss_of


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("state-meta") / "ckpt")
    got = run_scenarios(2, [
        scenario("pipeline", w.pipeline_places, path),
        scenario("pp x dp", w.pipeline_dp_places, path),
        scenario("hook", w.hook_places, path),
        scenario("local steps", w.local_steps_places, path),
        scenario("join", w.ddp_join, "int8:ef"),
        scenario("codecs differ", w.pipeline_codecs_differ),  # fails the agreement: last
    ], timeout_s=300)
    return got, path


def _refused(got: dict, *needles: str) -> None:
    assert got["error"] == "ConfigError", got
    for needle in needles:
        assert needle in got["message"], (needle, got["message"])


# -- one process ------------------------------------------------------------------------------


def _trained(codec: str) -> torch.nn.Module:
    model = models.MLP(depth=4)
    compiled, _ = compile_ccfx(model, stages=2, activation_codec=codec)
    loss_of(compiled(torch.randn(4, 32))).backward()
    return compiled


def test_a_checkpoint_of_another_codec_whose_state_has_the_same_shape_is_refused():
    """int8 and top-k with error feedback both keep a residual of the tensor's shape: only the
    recorded spec tells them apart."""
    saved = ccfx.codec_state(_trained("int8:block=32,ef")).state_dict()
    other = ccfx.codec_state(_trained("topk:ratio=0.5,ef"))
    with pytest.raises(ccfx.ConfigError, match=r"(?s)graph0\.edge\d+\.hop0to1\.fwd: the "
                       r"checkpoint's state is for 'int8:block=32,ef', this model runs "
                       r"'topk:ratio=0.5,ef' \(activation_codec\).*leave the codec state out"):
        other.load_state_dict(saved)
    # a checkpoint without the record (saved before ccfx kept it) loads unchecked
    other.load_state_dict({k: v for k, v in saved.items() if k != "meta.codecs"})


def test_a_stage_holder_refuses_another_stage_and_loads_an_unrecorded_one():
    def stage(index: int) -> torch.nn.Module:
        module = torch.nn.Linear(2, 2)
        holder = cs.state_of(module)
        holder.add(cs.edge_channel(0, 0, (0, 1), "fwd", "send"), "int8:ef",
                   {"residual": torch.zeros(4)})
        for name, value in (("stage", index), ("num_stages", 2), ("dp_world_size", 1),
                            ("dp_rank", 0)):
            holder.set_meta(name, value)
        return module

    saved = stage(0).state_dict()
    with pytest.raises(ccfx.ConfigError,
                       match="stage: the checkpoint's is 0, this run's is 1.*one pipeline stage"):
        stage(1).load_state_dict(saved)
    stage(1).load_state_dict({k: v for k, v in saved.items() if ".meta." not in k})


def test_hook_state_of_another_world_is_refused_and_unrecorded_state_loads():
    state = CommHookState("powersgd:rank=4,ef")
    saved = {"spec": "powersgd:rank=4,ef", "steps": 3, "world_size": 2, "rank": 1,
             "buckets": {0: {"shapes": ((8, 16),), "dtype": torch.float32}},
             "state": {"ddp.bucket0.q0000": torch.randn(16, 4)}}
    with pytest.raises(ccfx.ConfigError, match="world_size: the checkpoint's is 2, this run's "
                                               "is 1; rank: the checkpoint's is 1"):
        state.load_state_dict(saved)
    state.load_state_dict({k: v for k, v in saved.items() if k not in ("world_size", "rank")})
    assert state.steps == 3
    assert (state.state_dict()["world_size"], state.state_dict()["rank"]) == (1, 0)


# -- two ranks (one spawn) -----------------------------------------------------------------------


@pytest.mark.slow
def test_uneven_inputs_under_ddp_with_the_comm_hook_join_as_torch_s_join(two):
    """ccfx has no join of its own for compiled data parallel (README, "When things fail");
    eager DDP with ccfx's hook takes torch's Join: the rank out of data shadows the others'
    steps through the hook, and both end with the same parameters."""
    got, _ = two
    r0, r1 = got["join"]
    assert r0["params"] == r1["params"]
    assert r0["steps"] == r1["steps"] == 5  # rank 0 ran 3 steps and shadowed 2


@pytest.mark.slow
def test_a_pipeline_stage_refuses_another_stage_or_plan(two):
    got, _ = two
    for rank, r in enumerate(got["pipeline"]):
        assert r["meta"] == sorted(f"ccfx_codec_state.meta.{k}" for k in (
            "codecs", "dp_rank", "dp_world_size", "num_stages", "stage")), r["meta"]
        _refused(r["peer's"], f"stage: the checkpoint's is {1 - rank}, this run's is {rank}",
                 "same stages")
        _refused(r["other plan"], "num_stages: the checkpoint's is 2, this run's is 4")
        assert r["own"]["error"] is None, r["own"]


@pytest.mark.slow
def test_a_pp_x_dp_stage_refuses_the_other_replicas_state(two):
    got, _ = two
    for rank, r in enumerate(got["pp x dp"]):
        _refused(r["peer's"], f"dp_rank: the checkpoint's is {1 - rank}, this run's is {rank}")
        assert r["own"]["error"] is None, r["own"]


@pytest.mark.slow
def test_the_comm_hook_refuses_another_rank_or_world(two):
    got, path = two
    for rank, r in enumerate(got["hook"]):
        assert r["place"] == (2, rank)
        _refused(r["peer's"], f"rank: the checkpoint's is {1 - rank}, this run's is {rank}",
                 "DDP comm hook state", "same number of ranks")
        assert r["unrecorded"]["error"] is None and r["own"]["error"] is None, r
    # the 2-rank checkpoint resumed on one process (world size 1)
    with pytest.raises(ccfx.ConfigError, match="world_size: the checkpoint's is 2, this run's "
                                               "is 1"):
        CommHookState("int8:ef").load_state_dict(torch.load(f"{path}.hook0"))


@pytest.mark.slow
def test_local_steps_refuse_another_replica_world_or_shape(two):
    got, path = two
    for rank, r in enumerate(got["local steps"]):
        assert r["place"] == (2, rank)
        _refused(r["peer's"], f"rank: the checkpoint's is {1 - rank}, this run's is {rank}",
                 "local-steps state")
        _refused(r["shapes"], "0.weight: the checkpoint's is (2, 32, 8), this model's (32, 8)")
        assert r["own"]["error"] is None, r["own"]
    model = lw.mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, **w.OUTER)
    try:
        with pytest.raises(ccfx.ConfigError, match="world_size: the checkpoint's is 2, this "
                                                   "run's is 1"):
            outer.load_state_dict(torch.load(f"{path}.outer0"))
    finally:
        outer.close()


@pytest.mark.slow
def test_ranks_whose_pipeline_codecs_differ_are_told_the_edge_and_direction(two):
    got, _ = two
    for rank, r in enumerate(got["codecs differ"]):
        assert r["error"] == "ConfigError", r
        mine, theirs = ("int8", "fp8") if rank == 0 else ("fp8", "int8")
        edge = r["edges"][0]
        assert re.search(rf'edge {edge} \(stage 0 -> 1\), forward \("{mine}" vs "{theirs}"\)',
                         r["message"]), r["message"]
        assert "this rank's value vs the peer's" in r["message"]
        assert "backward (" not in r["message"]  # what agrees is not listed


# -- unreadable meta is refused, not passed over --------------------------------------------------


GARBAGE = {
    "not utf-8": torch.tensor([0xFF, 0xFE, 0x00, 0x7B], dtype=torch.uint8),
    "not json": torch.tensor(list(b"{int8:ef"), dtype=torch.uint8),
    "a json list": torch.tensor(list(b'["int8:ef"]'), dtype=torch.uint8),
    "float bytes": torch.rand(12),
}


@pytest.mark.parametrize("garbage", sorted(GARBAGE))
def test_unreadable_meta_codecs_is_a_config_error_not_a_silent_pass(garbage):
    """``meta.codecs`` is what refuses another codec's state of the same shape: garbage there
    used to turn that check off silently. Refused, naming the channels it describes, after the
    first call and before it."""
    saved = ccfx.codec_state(_trained("int8:block=32,ef")).state_dict()
    bad = {**saved, "meta.codecs": GARBAGE[garbage]}
    pattern = (r"(?s)unreadable meta\.codecs \(it describes the state of graph0\.edge\d+\.hop0to1"
               r"\.bwd, graph0\.edge\d+\.hop0to1\.fwd\).*Resume from an earlier checkpoint, or "
               r"leave the codec state out")
    with pytest.raises(ccfx.ConfigError, match=pattern):
        ccfx.codec_state(_trained("topk:ratio=0.5,ef")).load_state_dict(bad)
    model = models.MLP(depth=4)
    compiled, _ = compile_ccfx(model, stages=2, activation_codec="int8:block=32,ef")
    with pytest.raises(ccfx.ConfigError, match=pattern):  # before the first call: at the load
        ccfx.codec_state(compiled).load_state_dict(bad)


def test_unreadable_place_meta_is_a_config_error_naming_the_entry():
    module = torch.nn.Linear(2, 2)
    holder = cs.state_of(module)
    holder.add(cs.edge_channel(0, 0, (0, 1), "fwd", "send"), "int8:ef",
               {"residual": torch.zeros(4)})
    holder.set_meta("stage", 0)
    saved = module.state_dict()
    for value, why in ((torch.tensor([0, 1]), r"a \(2,\) int64 tensor"),
                       (torch.tensor(0.5), r"a \(\) float32 tensor")):
        with pytest.raises(ccfx.ConfigError, match=rf"unreadable meta\.stage \(it describes the "
                           rf"state of graph0\.edge0\.hop0to1\.fwd\.send\): {why}"):
            module.load_state_dict({**saved, "ccfx_codec_state.meta.stage": value})
    module.load_state_dict(saved)


def test_an_unreadable_hook_state_is_a_config_error_not_a_key_error():
    state = CommHookState("int8:ef")
    with pytest.raises(ccfx.ConfigError, match="DDP comm hook state cannot be read .'steps' is "
                                               "missing; 'buckets' is missing"):
        state.load_state_dict({"spec": "int8:ef"})
    with pytest.raises(ccfx.ConfigError, match="not a dict"):
        state.load_state_dict([1, 2, 3])
    with pytest.raises(ccfx.ConfigError, match=r"unreadable meta\.world_size: a str"):
        state.load_state_dict({"spec": "int8:ef", "steps": 0, "buckets": {}, "world_size": "2"})
