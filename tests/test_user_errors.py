"""Natural mistakes of a new user following the README, and the error each one gets: a ccfx
exception that names the problem and the fix. One process, no ranks, eager lowering."""

from __future__ import annotations

import pytest
import torch

import ccfx


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


@pytest.fixture
def no_group(monkeypatch):
    """As in a process that never called init_process_group (whatever other tests did here)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


@pytest.fixture
def launched(monkeypatch, no_group):
    """As torchrun leaves rank 1 of 4 before the script runs."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")


@pytest.mark.parametrize("ask", [ccfx.plan_of, ccfx.ledger_of, ccfx.explain])
def test_asking_for_the_plan_before_the_first_call_says_to_call_it(ask):
    compiled = torch.compile(_mlp(), backend="ccfx", options={"stages": 2, "lowering": "eager"})
    with pytest.raises(ccfx.ConfigError) as e:
        ask(compiled)
    # not "was not compiled by ccfx": it was, it has only not run
    assert "compiled with backend='ccfx' but has not run yet" in str(e.value)
    assert "call it once" in str(e.value)


def test_plan_of_a_model_never_compiled_still_says_how_to_compile():
    with pytest.raises(ccfx.ConfigError, match="was not compiled by ccfx.*torch.compile"):
        ccfx.plan_of(_mlp())


def test_data_parallel_under_a_launcher_without_a_process_group_is_refused(launched):
    compiled = torch.compile(_mlp(), backend="ccfx",
                             options={"data_parallel": True, "lowering": "eager"})
    with pytest.raises(ccfx.ConfigError) as e:
        compiled(torch.randn(8, 32)).sum().backward()
    text = str(e.value)
    assert "data_parallel=True" in text and "one of 4 ranks" in text
    assert "init_process_group()" in text and "unset WORLD_SIZE" in text


def test_local_steps_under_a_launcher_without_a_process_group_is_refused(launched):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ccfx.ConfigError, match="ccfx.local_steps: .* one of 4 ranks.*"
                                               "init_process_group"):
        ccfx.local_steps(model, opt, sync_every=2)


@pytest.mark.parametrize("world", [None, "1"])
def test_one_process_without_a_group_still_runs_as_world_size_one(monkeypatch, no_group, world):
    # the README's "Without a process group data_parallel runs as world size 1" is kept
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    compiled = torch.compile(_mlp(), backend="ccfx",
                             options={"data_parallel": True, "gradient_codec": "int8",
                                      "lowering": "eager"})
    compiled(torch.randn(8, 32)).sum().backward()
    assert "no process group" in str(ccfx.plan_of(compiled))
    model = _mlp()
    outer = ccfx.local_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    assert outer.world == 1


def test_plan_parallel_with_a_batch_too_small_to_split_says_so_not_memory():
    # the README's plan_parallel(model, example_inputs, cluster) with the demo model's batch of
    # 4 on 64 devices: every degree is skipped, none refused for memory
    from ccfx.models.tiny_gpt import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 96, (2, 16))
    cluster = ccfx.Cluster.nodes(2, 4, intra=(100, 0.01), inter=(10, 1), memory="80GiB",
                                 flops=1e12)
    with pytest.raises(ccfx.ConfigError) as e:
        ccfx.plan_parallel(model, (idx, idx), cluster)
    text = str(e.value)
    assert "no layout could be priced on 8 devices" in text and "above 80%" not in text
    assert "splits the batch of 2 over 8 replicas" in text  # the search's own reason
    assert "at least as many samples as devices" in text


def test_a_misspelled_option_in_config_is_a_config_error_with_the_nearest_name():
    # ccfx.backend(ccfx.Config(...)) is the README's Python route: the same error as options=
    for make in (lambda: ccfx.Config(stagez=4), lambda: ccfx.Config().replace(stagez=4)):
        with pytest.raises(ccfx.ConfigError, match=r"'stagez' \(did you mean 'stages'\?\)"):
            make()
    with pytest.raises(ccfx.ConfigError, match=r"torch.compile\(options=...\): unknown ccfx "
                                               r"option\(s\) 'stagez'"):
        ccfx.Config.resolve({"stagez": 4}, environ={})
    assert ccfx.Config(stages=3).replace(stages=2).stages == 2


def _must_not_run(*args, **kwargs):
    raise AssertionError("the command went on to train or launch ranks with a bad option")


@pytest.mark.parametrize("argv,module,name,said", [
    (["demo", "--codec", "in8"], "ccfx.demo", "train", "'in8' (did you mean 'int8'?)"),
    (["demo", "--dp", "2", "--gradient-codec", "powersgd:4"], "ccfx.demo_dp", "run_dp_demo",
     "codec 'powersgd' has no parameter '4'"),
    (["run", "--nproc", "2", "--codec", "in8"], "subprocess", "call",
     "'in8' (did you mean 'int8'?)"),
    (["run", "--nproc", "2", "--grad-codec", "int8:blocks=64"], "subprocess", "call",
     "no parameter 'blocks' (did you mean 'block'?)"),
])
def test_the_cli_refuses_a_codec_typo_in_one_line_before_any_work(
        monkeypatch, capsys, argv, module, name, said):
    # `ccfx demo` trained the whole baseline first, `ccfx run` failed in every rank under
    # torchrun (a ChildFailedError and two tracebacks); now: one line, exit status 2
    import importlib

    from ccfx.cli import main

    monkeypatch.setattr(importlib.import_module(module), name, _must_not_run)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ccfx {argv[0]}: error: ") and said in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def _calls_warned(options, calls):
    import warnings

    compiled = torch.compile(_mlp(), backend="ccfx", options={"lowering": "eager", **options})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(calls):
            compiled(torch.randn(8, 32)).sum().backward()
    return [str(w.message) for w in seen if issubclass(w.category, ccfx.CcfxWarning)]


def test_a_gradient_codec_without_data_parallel_warns_once_in_a_training_loop(no_group):
    # the codec would silently never run (and launched ranks would train apart)
    said = _calls_warned({"gradient_codec": "int8"}, calls=3)
    assert len(said) == 1 and "gradient_codec='int8' is set but data_parallel is not" in said[0]
    assert "data_parallel=True" in said[0] and "ccfx.sync_grads" in said[0]
    # one call (what a PP x DP pipeline makes before ccfx.build_stages), data parallel itself,
    # or no gradient codec: nothing to say
    assert _calls_warned({"gradient_codec": "int8"}, calls=1) == []
    assert _calls_warned({"gradient_codec": "int8", "data_parallel": True}, calls=2) == []
    assert _calls_warned({}, calls=2) == []


def test_ccfx_run_refuses_several_stages_per_rank_under_a_one_stage_schedule(monkeypatch, capsys):
    # `ccfx run --nproc 2 --stages 8` ran the first of each rank's 4 stages under 1F1B: gloo
    # aborted rank 1 ("Received data size doesn't match expected size") and rank 0 failed after
    from ccfx.cli import main

    monkeypatch.setattr(__import__("subprocess"), "call", _must_not_run)
    assert main(["run", "--nproc", "2", "--stages", "8"]) == 2
    err = capsys.readouterr().err
    assert "put 4 stages on each rank" in err and "--schedule Interleaved1F1B" in err
    assert "--stages 2" in err
