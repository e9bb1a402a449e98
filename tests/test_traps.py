"""Traps that used to do nothing, or answer in torch's words, on one process (issue 36): an
override that matches no collective, a codec that expands what it encodes, an option error
under Dynamo's bug-report trailer, a drawing's "tied grad" arrow the model does not have, too
few microbatches under ``ccfx run``. Each now answers with a ccfx error or warning that names
the fix."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

import ccfx
from ccfx import viz
from ccfx.plan import Collective

from . import toy_models, util


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


# -- collective_overrides that match nothing -----------------------------------------------------


class FuncolMLP(torch.nn.Module):
    """Two collectives: the forward's all-reduce (collective 0) and its backward (1)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol

        return self.b(funcol.all_reduce(self.a(x), "sum", dist.group.WORLD).relu())


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    """A gloo group of one rank in this process (collectives trace and run on it)."""
    with util.group_of_one(tmp_path_factory.mktemp("pg")):
        yield
    torch._dynamo.reset()


def _train(overrides: dict, calls: int = 3):
    compiled = torch.compile(FuncolMLP(), backend="ccfx", options={
        "lowering": "eager", "collective_codec": "int8", "collective_overrides": overrides})
    for _ in range(calls):
        compiled(torch.randn(4, 8)).sum().backward()
    return compiled


@pytest.mark.parametrize("key", ["collective 7", "reduce_scatter"])
def test_an_override_that_matches_no_collective_is_a_config_error_listing_them(
        group_of_one, key):
    with pytest.raises(ccfx.ConfigError) as e:
        _train({key: "none"})
    text = str(e.value)
    assert f"collective_overrides key(s) {key!r} match no collective of this model" in text
    assert "collective 0: all_reduce (sum), graph 0 forward" in text
    assert "collective 1: all_reduce (sum), graph 0 backward" in text
    assert "Write 'collective N' with N one of those indices" in text and "all_gather" in text


def test_overrides_that_match_a_collective_train_on(group_of_one):
    compiled = _train({"collective 1": "none", "all_reduce": "int8"})
    assert [c.index for c in ccfx.plan_of(compiled).collectives] == [0, 1]


def test_unmatched_overrides_are_judged_over_every_graph_compiled():
    from ccfx.backends.collectives import unmatched_overrides

    def row(graph, index, kind):
        return Collective(graph=graph, index=index, part="forward", kind=kind, group="0",
                          group_size=2, shape=[4, 8], dtype="torch.float32", codec="none",
                          raw_bytes=128, wire_bytes=128)

    rows = [row(0, 0, "all_gather"), row(1, 0, "all_reduce"), row(1, 1, "reduce_scatter")]
    ok = ccfx.Config(collective_overrides={"collective 1": "none", "all_reduce": "int8"})
    assert unmatched_overrides(ok, rows) is None  # collective 1 exists in graph 1 only
    bad = ccfx.Config(collective_overrides={"collective 2": "none", "all_to_all": "int8"})
    assert "'all_to_all', 'collective 2'" in str(unmatched_overrides(bad, rows))
    none = str(unmatched_overrides(bad, []))
    assert "no functional collective was compiled" in none


# -- a codec that expands its input ------------------------------------------------------------


def _warned(options: dict, calls: int = 3) -> tuple[list[str], str]:
    compiled = torch.compile(_mlp(), backend="ccfx",
                             options={"stages": 2, "lowering": "eager", **options})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(calls):
            compiled(torch.randn(8, 32)).sum().backward()
    said = [str(w.message) for w in seen if issubclass(w.category, ccfx.CcfxWarning)]
    return said, str(ccfx.plan_of(compiled))


def test_a_codec_that_expands_an_edge_warns_once_per_direction_and_the_plan_says_so():
    said, plan = _warned({"activation_codec": "int8:block=1"})
    # int8 with a 4-byte scale per element: 5 bytes for every 4 of float32
    assert len(said) == 2, said  # three calls: the forward and backward hop, once each
    for direction, text in zip(("forward", "backward"), said):
        assert f"edge 0 (stage 0 -> 1, {direction})" in text
        assert "'int8:block=1' sends 1.25x the raw bytes (1280 B on the wire for 1024 B)" in text
        assert "write 'int8' (0.25x) instead" in text
        assert f"note: {text[len('ccfx: '):]}" in plan


def test_a_codec_that_shrinks_its_input_says_nothing():
    said, plan = _warned({"activation_codec": "int8"})
    assert said == [] and "raw bytes" not in plan


def test_the_better_spelling_keeps_the_codec_and_its_error_feedback():
    from ccfx.codecs.expansion import better_spec, ratio

    f32 = torch.float32
    assert ratio("topk:ratio=0.9,ef", (8, 32), f32) > 1
    assert better_spec("topk:ratio=0.9,ef", (8, 32), f32)[0] == "topk:ef"
    assert better_spec("int4:block=1", (8, 32), f32) == ("int4", ratio("int4", (8, 32), f32))
    assert better_spec("bf16", (8, 32), torch.bfloat16)[0] == "none"  # nothing smaller
    assert ratio("int8", ("s0", 32), f32) is None  # a symbolic shape is not priced


# -- option errors through torch.compile -----------------------------------------------------


@pytest.mark.parametrize("options,said", [
    ({"stages": 0}, "stages must be an integer ≥ 1, got 0"),
    ({"activation_codec": "int9"}, "unknown codec 'int9' (did you mean 'int8'?)"),
])
def test_an_option_error_reaches_the_user_as_ccfx_error_without_dynamos_trailer(options, said):
    compiled = torch.compile(_mlp(), backend="ccfx", options={"lowering": "eager", **options})
    with pytest.raises(ccfx.ConfigError) as e:
        compiled(torch.randn(8, 32))
    shown = "".join(traceback.format_exception(e.value))
    assert said in str(e.value)
    assert "reporting a bug" not in shown and "for the internal stack trace" not in shown
    assert "BackendCompilerFailed" not in shown
    # the traceback is cut to ccfx's frame: none of Dynamo's tracing (it was ~90 lines)
    assert "convert_frame.py" not in shown and "output_graph.py" not in shown, shown
    assert len(shown.splitlines()) < 30, shown


@pytest.mark.parametrize("make", [lambda: ccfx.backend(stages=0),
                                  lambda: ccfx.backend(ccfx.Config(activation_codec="int9"))])
def test_ccfx_backend_refuses_a_bad_option_when_it_is_built(make):
    with pytest.raises(ccfx.ConfigError):  # before torch.compile, before any call
        make()


# -- the drawing shows only real edges ---------------------------------------------------------


def _tied_grad_arrows(compiled) -> list[int | None]:
    return [d for d in (None, 1, 2)
            if 'label="tied grad"' in viz.to_dot(compiled, which="backward", depth=d)]


@pytest.mark.inductor
def test_a_plain_mlps_backward_draws_no_tied_grad_under_inductor():
    # inductor shares one constant zero between the stages' ReLU backwards: no tied weight,
    # and nothing crosses between the stages for it
    import torch._functorch.config

    class MLP3(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(32, 64), torch.nn.Linear(64, 64),
                                            torch.nn.Linear(64, 32))

        def forward(self, x):
            return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    torch.manual_seed(0)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(MLP3(), backend="ccfx", options={"stages": 2})
        compiled(torch.randn(8, 32)).pow(2).mean().backward()
    full = viz.to_dot(compiled, which="backward", depth=None)
    assert "full_default" in full  # the shared constant is drawn, as a plain arrow
    assert _tied_grad_arrows(compiled) == []
    assert 'label="no codec"' not in full


def test_a_tied_model_still_draws_its_tied_grad():
    torch.manual_seed(0)
    compiled = torch.compile(toy_models.TiedLM(depth=4), backend="ccfx",
                             options={"stages": 2, "lowering": "eager"})
    compiled(torch.randint(0, 64, (2, 8))).float().square().mean().backward()
    assert ccfx.plan_of(compiled).shared
    assert _tied_grad_arrows(compiled) == [None, 1, 2]


# -- too few microbatches ------------------------------------------------------------------


def test_ccfx_run_refuses_fewer_microbatches_than_stages_naming_the_schedule(monkeypatch, capsys):
    from ccfx.cli import main

    def must_not_run(*args, **kwargs):
        raise AssertionError("ccfx run launched ranks with too few microbatches")

    monkeypatch.setattr(__import__("subprocess"), "call", must_not_run)
    assert main(["run", "--nproc", "2", "--microbatches", "1", "--schedule", "1F1B"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ccfx run: error: --schedule 1F1B with 2 pipeline stages needs at "
                          "least 2 microbatches, got 1") and "--microbatches 2" in err
    assert len(err.splitlines()) == 1


def test_a_stage_refuses_fewer_microbatches_than_stages_as_a_config_error():
    from ccfx.runtime.pipeline import check_microbatches

    with pytest.raises(ccfx.ConfigError, match=r"GPipe with 4 pipeline stages needs at least 4 "
                                               r"microbatches, got 3 .* n_microbatches >= 4"):
        check_microbatches("GPipe", 3, 4)
    check_microbatches("GPipe", 4, 4)  # enough: nothing said
