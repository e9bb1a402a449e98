"""ccfx's codecs on torch's own FSDP2 (``fully_shard``): ``register_codec`` installs ccfx's
all-gather and reduce-scatter on every FSDP module, and under HSDP its all-reduce across the
replicas (ccfx/runtime/fsdp2_comms.py).

The 2- and 4-rank tests read scenarios of the spawns the modules share (tests/ranks.py,
``Shared``): a 3-block MLP sharded with fully_shard, 5 AdamW steps (3 compiled). ``"none"``
runs torch's own collectives and must equal plain FSDP2 bit for bit, eager and compiled, and
torch's own HSDP on 2 replicas x 2 shards; int8 gathers with int4:ef reduce-scatters
(ZeRO++'s shape) must train, keep every rank's gathered parameters identical, and stay near
plain FSDP2 (the bound is derived below); a checkpoint with the codec state resumes bit for
bit. The bad-input tests run in this process, on a gloo group of one rank (FSDP2 then calls
no comm: registration and loading alone are tested).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ccfx
from ccfx.integrations import register_codec
from ccfx.runtime import fsdp2_comms
from ccfx.runtime.launch import RankFailed, spawn

from . import fsdp2_workers as w
from .ranks import Shared, scenario

ZERO_PP = {"all_gather": "int8", "reduce_scatter": "int4:ef"}

#: In the 2-rank spawn the modules share (tests/ranks.py, ``Shared``).
TWO = Shared(2, lambda tmp: [
    scenario("plain", w.train, None),
    scenario("none", w.train, "none"),
    scenario("zero_pp", w.train, ZERO_PP),
    scenario("ops", w.reduce_ops),
    scenario("mixed", w.mixed_dtypes),
    scenario("compiled plain", w.train, None, 3, compile=True),
    scenario("compiled none", w.train, "none", 3, compile=True),
    scenario("compiled zero_pp", w.train, ZERO_PP, 3, compile=True),
    scenario("resume", w.resume, str(tmp.mktemp("fsdp2_resume"))),
    scenario("auto slow", w.auto, 0.0001),
    scenario("auto fast", w.auto, 100.0),
], timeout_s=360)

#: 2 replicas x 2 shards, in the 4-rank spawn the modules share.
FOUR = Shared(4, [
    scenario("hsdp native", w.hsdp, None),
    scenario("hsdp none", w.hsdp, "none"),
    scenario("hsdp int8:ef", w.hsdp, {"all_reduce": "int8:ef"}),
], timeout_s=240)


@pytest.fixture(scope="module")
def two(shared_ranks):
    return shared_ranks[TWO]


@pytest.fixture(scope="module")
def four(shared_ranks):
    return shared_ranks[FOUR]


# -- 2 ranks ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_none_is_bit_equal_to_plain_fsdp2(two):
    plain, none = two["plain"], two["none"]
    for rank in range(2):
        assert none[rank]["params"] == plain[rank]["params"]
        assert none[rank]["losses"] == plain[rank]["losses"]
    assert set(none[0]["codecs"].values()) == {"none"}


@pytest.mark.slow
def test_int8_gathers_and_int4_ef_reduce_scatters_train_near_plain_fsdp2(two):
    """Bounds, from one measured run (5 AdamW steps, lr 1e-2, each rank its fixed batch): the
    loss fell by 0.11 on each rank (plain FSDP2: 0.12), and stayed within 3.6 % of plain
    FSDP2's at every step (at most 0.012, at the last step); asserted: a fall of at least
    0.05 and within 10 % (a lost gradient or a wrong average would miss both)."""
    w.assert_trains_like_plain(two["plain"], two["zero_pp"], fall=0.05)


@pytest.mark.slow
def test_compressed_gathers_leave_every_rank_the_same_parameters(two):
    zpp = two["zero_pp"]
    assert len(zpp[0]["gathers"]) == 3 * 5  # every block, every forward
    assert zpp[0]["gathers"] == zpp[1]["gathers"]


@pytest.mark.slow
def test_the_ledger_counts_each_module_and_kind_per_step(two):
    got = two["zero_pp"][0]
    assert got["ledger_is_state"] and got["steps"] == 5
    for module in ("blocks.0", "blocks.1", "blocks.2", "root"):
        assert got["calls"][f"{module}.reduce_scatter"] == 5
        assert got["codecs"][f"{module}.all_gather"] == "int8"
        assert got["codecs"][f"{module}.reduce_scatter"] == "int4:ef"
    # the blocks reshard after forward and gather again in backward; the root does not
    assert got["calls"]["blocks.0.all_gather"] == 10 and got["calls"]["root.all_gather"] == 5
    raw, wire = got["bytes"]["all_gather"]
    assert 0.25 < wire / raw < 0.3, (raw, wire)  # int8 of fp32, plus scales
    raw, wire = got["bytes"]["reduce_scatter"]
    assert 0.125 < wire / raw < 0.2, (raw, wire)  # int4 of fp32, plus scales
    # error feedback's residual per module, named by the codec-state scheme
    assert any(name.startswith("fsdp2.blocks.0.reduce_scatter.") and name.endswith(".residual")
               for name in got["state"]), got["state"]
    assert not any(".all_gather." in name for name in got["state"])


@pytest.mark.slow
def test_the_plan_lists_each_module_s_collectives(two):
    plan = two["zero_pp"][0]["plan"]
    assert "blocks.2" in plan and "root" in plan and "reduce_scatter (avg)" in plan, plan
    assert "8 of 8 compressed" in plan, plan


@pytest.mark.slow
def test_the_reduce_scatter_honours_sum_avg_and_premul_sum(two):
    """int8 (round to nearest, one scale per block): each of the 2 decoded chunks is off by at
    most half a step, peak / 127 / 2, so their sum by at most peak / 127 (1 % added for fp32
    rounding); the same scaled by 1/2 (avg) or by 0.25 (premul_sum)."""
    for got in two["ops"]:
        bound = got["peak"] / 127 * 1.01
        assert got["sum"]["error"] <= bound, got
        assert got["avg"]["error"] <= bound / 2, got
        assert got["premul"]["error"] <= bound / 4, got
        assert {got[k]["codec"] for k in ("sum", "avg", "premul")} == {"int8"}
        assert got["sum"]["work"] is None  # ran to its end inside the call


@pytest.mark.slow
def test_a_mixed_dtype_module_is_gathered_raw_and_the_plan_says_why(two):
    r0, r1 = two["mixed"]
    assert r0["codec"] == "none" and r0["dtype"] == "torch.uint8"
    assert "floating-point" in r0["reason"] and "floating-point" in r0["plan"]
    assert r0["out"] == r1["out"]


@pytest.mark.slow
def test_compiled_blocks_none_is_bit_equal_to_plain_compiled_fsdp2_and_codecs_run(two):
    plain, none, zpp = two["compiled plain"], two["compiled none"], two["compiled zero_pp"]
    for rank in range(2):
        assert none[rank]["params"] == plain[rank]["params"]
        assert none[rank]["losses"] == plain[rank]["losses"]
        assert zpp[rank]["losses"][-1] < zpp[rank]["losses"][0]
    assert zpp[0]["params"] == zpp[1]["params"] != plain[0]["params"]
    raw, wire = zpp[0]["bytes"]["all_gather"]
    assert 0.25 < wire / raw < 0.3, (raw, wire)


@pytest.mark.slow
def test_a_checkpoint_with_the_codec_state_resumes_bit_for_bit(two):
    """3 steps, DCP's save of get_state_dict(model, opt) and ``codecs.save``, 2 steps; a new
    model resumed with ``resume_from=`` takes the same 2 steps to the same bits. Without the
    codec state (error feedback from zero) the steps differ: the state matters."""
    for got in two["resume"]:
        assert got["resumed"] == got["straight"]
        assert got["resumed_params"] == got["params"]
        assert got["fresh"] != got["straight"]
        assert got["pending"] == []  # every saved tensor was loaded at its first call
        assert any(".reduce_scatter." in name for name in got["saved"])


@pytest.mark.slow
def test_auto_prices_each_modules_buffers_and_every_rank_takes_rank_0s_choice(two):
    """At 100 kbit/s every buffer pays for a codec (within the 1 % loss budget: int8 for the
    gathers, bf16 for the gradients); at 100 Gbit/s none does. The sizes priced before the
    first step are the ones FSDP2 then hands over."""
    slow, fast = two["auto slow"], two["auto fast"]
    assert slow[0]["codecs"] == slow[1]["codecs"] and fast[0]["codecs"] == fast[1]["codecs"]
    for name, codec in slow[0]["codecs"].items():
        assert codec == ("int8" if name.endswith("all_gather") else "bf16"), slow[0]["codecs"]
    assert set(fast[0]["codecs"].values()) == {"none"}
    assert slow[0]["priced"] == slow[0]["ran"]
    assert fast[0]["losses"] == two["none"][0]["losses"][:2]
    text = slow[0]["explain"]
    assert "collective 2 (blocks.0 all_gather" in text and "FSDP module blocks.0" in text, text
    assert "predicted step" in text
    # the prediction counts each call as often as a step ran it: the root (FSDP2's default)
    # gathers once, a block twice (forward, and again in backward)
    assert slow[0]["counted"] == slow[0]["calls"], (slow[0]["counted"], slow[0]["calls"])
    assert slow[0]["counted"]["root.all_gather"] == 1
    assert slow[0]["counted"]["blocks.0.all_gather"] == 2
    assert "measured:" in slow[0]["plan"] and "auto predicted" in slow[0]["plan"]


# -- 4 ranks: HSDP, 2 replicas x 2 shards ---------------------------------------------------


@pytest.mark.slow
def test_hsdp_none_through_the_all_reduce_hook_is_bit_equal_to_torchs_hsdp(four):
    native, none = four["hsdp native"], four["hsdp none"]
    for rank in range(4):
        assert none[rank]["losses"] == native[rank]["losses"]
        assert none[rank]["params"] == native[rank]["params"]


@pytest.mark.slow
def test_hsdp_compressing_only_the_replicas_all_reduce_keeps_replicas_identical(four):
    """int8:ef across replicas, the shards' collectives raw: every rank (both replicas) ends
    with the same parameters, which differ from uncompressed HSDP's by a codec's error: each
    loss within 2 % of torch's HSDP (measured: within 0.3 %)."""
    native, int8 = four["hsdp native"], four["hsdp int8:ef"]
    assert len({got["params"] for got in int8}) == 1
    assert int8[0]["params"] != native[0]["params"]
    for rank in range(4):
        for got, want in zip(int8[rank]["losses"], native[rank]["losses"]):
            assert abs(got - want) <= 0.02 * want
    fig = int8[0]
    assert fig["codecs"]["blocks.0.all_reduce"] == "int8:ef"
    assert fig["codecs"]["blocks.0.reduce_scatter"] == "none"
    assert fig["calls"]["blocks.0.all_reduce"] == 5 and fig["steps"] == 5
    raw, wire = fig["bytes"]["all_reduce"]
    assert 0.25 < wire / raw < 0.31, (raw, wire)  # int8 of fp32 plus one scale per block
    assert "all_reduce (avg)" in fig["plan"] and "2 replicas" in fig["plan"]


@pytest.mark.slow
def test_a_dead_rank_is_named_with_the_module_kind_and_codec():
    with pytest.raises(RankFailed) as e:
        spawn(w.dies_mid_step, 2, (), timeout_s=180, grace_s=60)
    survivor = e.value.results[0]
    assert survivor["error"] == "CollectiveError", survivor
    msg = survivor["message"]
    assert "rank 0 of 2: FSDP2's all_gather of module 'root' (int8, step 1) failed" in msg, msg
    assert "Rank 1 (" in msg and "has exited" in msg, msg


@pytest.mark.parametrize("codec", ["int8", "none"])
def test_a_frozen_rank_is_named_within_collective_timeout_s(codec):
    # FSDP's own group keeps torchrun's 30-minute timeout; ccfx's wait on it gives up first
    with pytest.raises(RankFailed) as e:
        spawn(w.freezes_mid_step, 2, (codec, 3.0), timeout_s=120, grace_s=30)
    survivor = e.value.results[0]
    assert survivor["error"] == "CollectiveError", survivor
    msg = survivor["message"]
    assert f"FSDP2's all_gather of module 'root' ({codec}, step 1) failed" in msg, msg
    assert "Rank 1 (" in msg and "is stopped" in msg, msg
    assert "collective_timeout_s (3 s on CPU" in msg, msg
    assert 3.0 <= survivor["since"] < 60, survivor  # not the group's timeout


# -- one process: bad input -------------------------------------------------------------------


def test_a_model_with_neither_fsdp_nor_ddp_is_a_config_error_naming_what_it_holds(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    with pytest.raises(ccfx.ConfigError, match=r"fully_shard.*Sequential holding Linear x2"):
        register_codec(model, ZERO_PP)
    # one spec on several ranks goes DDP's way, and names the same
    monkeypatch.setattr(ccfx.integrations, "_world", lambda group=None: 2)
    with pytest.raises(ccfx.ConfigError, match=r"fully_shard; got a Sequential holding"):
        register_codec(model, "int8")


@pytest.mark.parametrize("value", [0, -1.0, "60", True])
def test_a_collective_timeout_that_is_not_positive_seconds_is_a_config_error(one_rank_group,
                                                                              value):
    with pytest.raises(ccfx.ConfigError, match=r"collective_timeout_s.*positive number"):
        register_codec(w.sharded(1), "int8", options={"collective_timeout_s": value})


def test_registering_twice_is_a_config_error(one_rank_group):
    model = w.sharded(1)
    state = register_codec(model, "int8")
    assert ccfx.ledger_of(model) is state.ledger
    assert "no collective ran yet" in str(ccfx.plan_of(model))
    with pytest.raises(ccfx.ConfigError, match="already registered.*register_codec once"):
        register_codec(model, ZERO_PP)


@pytest.mark.parametrize("spec, message", [
    ({"reduce_scater": "int4:ef"}, "kind 'reduce_scater'.*did you mean 'reduce_scatter'"),
    ({"all_reduce": "int8"}, "no replicas' group was given: pass replicate=mesh"),
    ({"all_gather": "int8:ef"}, "error feedback.*use 'int8' for all_gather"),
    ({"reduce_scatter": "powersgd:rank=4"}, "cannot serve FSDP2's reduce_scatter.*PowerSGD"),
    ("auto", r"'auto'.*needs the link it runs on.*options=\{'link_gbps'"),
    ({"all_gather": "int9"}, "int9"),
])
def test_bad_specs_are_config_errors_saying_what_to_write(one_rank_group, spec, message):
    model = w.sharded(1)
    with pytest.raises(ccfx.ConfigError, match=message):
        register_codec(model, spec)
    register_codec(model, "none")  # nothing was registered by the refused call


def test_a_failed_collective_names_the_rank_module_kind_and_codec(monkeypatch):
    class Group:
        group_name = "fake"

        def size(self):
            return 2

        def rank(self):
            return 0

    class Broken:
        def all_gather(self, t):
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")

    monkeypatch.setattr(fsdp2_comms, "_comm", lambda group, timeout_s=None: Broken())
    state = fsdp2_comms.FSDP2Codecs({"all_gather": "int8"})
    gather = state.add_module("blocks.1")["all_gather"]
    comm = fsdp2_comms.CodecAllGather(state, gather)
    shard = torch.randn(64)
    with pytest.raises(ccfx.CollectiveError, match=r"rank 0 of 2: FSDP2's all_gather of "
                                                   r"module 'blocks.1' \(int8, step 0\) failed: "
                                                   r"\[gloo\] Connection closed"):
        comm(comm.allocate((128,), dtype=torch.float32, device=shard.device), shard, Group())


def test_fsdp_reduce_ops_are_read_as_sum_avg_or_a_premultiplied_sum():
    assert fsdp2_comms._reduce_op(dist.ReduceOp.SUM) == ("sum", None)
    assert fsdp2_comms._reduce_op(dist.ReduceOp.AVG) == ("avg", None)
    assert fsdp2_comms._reduce_op(dist.ReduceOp.PREMUL_SUM(0.5)) == ("sum", 0.5)
    assert fsdp2_comms._reduce_op(dist.ReduceOp.MAX) == ("max", None)


def test_an_all_reduce_codec_on_torchs_own_2d_hsdp_is_a_config_error_saying_how(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = w.sharded(1, mesh=mesh)
    with pytest.raises(ccfx.ConfigError, match=r"2-D mesh.*mesh=mesh\['shard'\]"):
        register_codec(model, {"all_reduce": "int8"}, replicate=mesh["replicate"])
    with pytest.raises(ccfx.ConfigError, match="1-D DeviceMesh.*of 2 dimensions"):
        register_codec(w.sharded(1), "int8", replicate=mesh)


def _saved(model, spec=ZERO_PP, **edit) -> dict:
    """A checkpoint's FSDP2 codec state for ``model`` (one residual), edited."""
    state = register_codec(model, spec).state_dict()
    state["state"] = {"fsdp2.blocks.0.reduce_scatter.chunk0000.residual": torch.zeros(4)}
    return {**state, **edit}


@pytest.mark.parametrize("edit, message", [
    ({"world_size": 2, "rank": 1}, "another place in the job: world_size: the checkpoint's is 2"),
    ({"specs": {"all_gather": "int8", "reduce_scatter": "int8:ef"}},
     "other codecs .reduce_scatter: the checkpoint's is 'int8:ef'"),
    ({"state": {"fsdp2.blocks.9.reduce_scatter.residual": torch.zeros(2)}},
     "channels this model lacks .fsdp2.blocks.9"),
    ({"state": {"fsdp2.root.reduce_scatter.chunk0000.residual": torch.full((2,), float("nan"))}},
     "NaN or ±inf"),
    ({"specs": "int8"}, "cannot be read .'specs' is str"),
])
def test_a_checkpoint_for_another_job_or_damaged_is_a_config_error(one_rank_group, edit,
                                                                     message):
    saved = _saved(w.sharded(1), **edit)
    with pytest.raises(ccfx.ConfigError, match=message):
        register_codec(w.sharded(1), ZERO_PP).load_state_dict(saved)


def test_resume_from_a_folder_without_this_ranks_file_is_a_config_error(one_rank_group,
                                                                        tmp_path):
    with pytest.raises(ccfx.ConfigError, match="no ccfx_fsdp2_rank0.pt there"):
        register_codec(w.sharded(1), ZERO_PP, resume_from=str(tmp_path))
    (tmp_path / "ccfx_fsdp2_rank0.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ccfx.ConfigError, match="ccfx_fsdp2_rank0.pt: .*cannot be read"):
        register_codec(w.sharded(1), ZERO_PP, resume_from=str(tmp_path))
