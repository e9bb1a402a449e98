import json

import pytest
import torch

import ccfx
from ccfx import Config, ConfigError, codecs


def test_defaults():
    cfg = Config()
    assert cfg.stages == 1 and cfg.activation_codec == "none" and cfg.balance == "flops"
    assert cfg.lowering == "inductor"


@pytest.mark.parametrize("options, words", [
    ({"stage": 4}, ["unknown ccfx option", "'stage'", "stages"]),
    ({"stages": 0}, ["stages must be an integer"]),
    ({"stages": "4"}, ["stages must be an integer"]),
    ({"balance": "speed"}, ["balance", "flops, params, memory"]),
    ({"lowering": "tvm"}, ["lowering", "inductor, eager"]),
    ({"activation_codec": "zip"}, ["unknown codec 'zip'", "int8"]),
    ({"activation_codec": "int8:blok=3"}, ["no parameter 'blok'", "block"]),
    ({"activation_codec": "int8:block=x"}, ["block='x'", "int"]),
    ({"activation_codec": "int8:block=0"}, ["block must be a positive"]),
    ({"split_points": "layers.2"}, ["split_points is a list"]),
    ({"split_points": ["a", "b"], "stages": 4}, ["2 split_points make 3 stages"]),
])
def test_bad_options_name_the_problem_and_the_choices(options, words):
    with pytest.raises(ConfigError) as e:
        Config.from_options(options)
    for w in words:
        assert w in str(e.value)


def test_codec_specs_are_canonical():
    assert Config(activation_codec="INT8:block=256").activation_codec == "int8"
    assert Config(activation_codec="int8:block=128").activation_codec == "int8:block=128"
    assert codecs.parse_spec("topk:ratio=0.01,ef") == ("topk", {"ratio": "0.01", "ef": True})


def test_split_points_set_the_stage_count():
    assert Config(split_points=["layers.2", "layers.5"]).stages == 3
    assert Config(split_points=("a",), stages=2).split_points == ("a",)


def test_options_dict_round_trip():
    cfg = Config(stages=3, activation_codec="bf16", split_points=["x", "y"])
    assert Config.from_options(cfg.to_dict()) == cfg


def test_backend_is_registered_by_entry_point_without_import():
    import subprocess
    import sys

    code = ("import torch, sys; assert 'ccfx' not in sys.modules; "
            "print('ccfx' in torch._dynamo.list_backends())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_bad_options_through_torch_compile_raise_a_ccfx_error():
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="ccfx", options={"stagez": 2})
    with pytest.raises(ccfx.CcfxError, match="unknown ccfx option"):
        compiled(torch.randn(2, 4))


def test_the_plan_shows_a_codec_spec_as_the_user_wrote_it_and_stores_it_canonical():
    from ccfx.plan import DataParallelInfo, Plan

    cfg = Config(data_parallel=True, gradient_codec="powersgd:rank=4,ef")
    assert cfg.gradient_codec == "powersgd:ef"  # compared and stored canonical
    plan = Plan(cfg.to_dict(), [], data_parallel=DataParallelInfo(2, "gloo", cfg.gradient_codec))
    stored = json.loads(plan.to_json())
    assert stored["config"]["gradient_codec"] == stored["data_parallel"]["gradient_codec"] \
        == "powersgd:ef"
    assert "gradient codec powersgd:rank=4,ef" in str(plan)
    Config(activation_codec="int8")  # written canonical: shown canonical
    assert codecs.spelled("int8") == "int8"


def test_a_plan_read_in_another_process_shows_the_spelling_stored_with_it(monkeypatch):
    from ccfx.codecs import registry
    from ccfx.plan import DataParallelInfo, Plan

    cfg = Config(data_parallel=True, gradient_codec="powersgd:rank=4,ef",
                 activation_codec="topk:ratio=0.1")
    plan = Plan(cfg.to_dict(), [], data_parallel=DataParallelInfo(2, "gloo", cfg.gradient_codec))
    text = plan.to_json()
    assert json.loads(text)["spelled"] == {"powersgd:ef": "powersgd:rank=4,ef"}
    # another process: nothing written there yet (its own spelling memory is empty)
    monkeypatch.setattr(registry, "_SPELLED", {})
    assert "gradient codec powersgd:ef," in str(Plan(cfg.to_dict(), [], data_parallel=(
        DataParallelInfo(2, "gloo", cfg.gradient_codec))))
    again = Plan.from_json(text)
    assert again == plan and "gradient codec powersgd:rank=4,ef" in str(again)
    # a plan written before plans stored spellings reads, canonical
    data = json.loads(text)
    del data["spelled"]
    monkeypatch.setattr(registry, "_SPELLED", {})
    assert "gradient codec powersgd:ef," in str(Plan.from_json(json.dumps(data)))


@pytest.mark.parametrize("env, options, words", [
    ('{"stage": 2}', None, ["$CCFX_OPTIONS: unknown ccfx option", "did you mean 'stages'?"]),
    (None, {"stagez": 2}, ["torch.compile(options=...): unknown", "did you mean 'stages'?"]),
    ('{"stages": 0}', {"lowering": "eager"}, ["$CCFX_OPTIONS: stages must be"]),
    ('{"lowering": "eager"}', {"balance": "speed"}, ["torch.compile(options=...): balance"]),
    ('{"split_points": ["a"]}', {"stages": 3},
     ["$CCFX_OPTIONS together with torch.compile(options=...)"]),
    (None, {"activation_codec": "int8,ef"}, ["did you mean 'int8:ef'?"]),
    (None, {"gradient_codec": "in8"}, ["unknown codec 'in8' (did you mean 'int8'?)"]),
    (None, {"activation_codec": "int8:blok=3"}, ["no parameter 'blok' (did you mean 'block'?)"]),
    (None, {"gradient_codec": "qsgd:EF"}, ["no parameter 'EF' (did you mean 'ef'?)"]),
])
def test_an_option_error_says_where_the_option_came_from_and_the_closest_name(env, options,
                                                                              words):
    with pytest.raises(ConfigError) as e:
        Config.resolve(options, {"CCFX_OPTIONS": env} if env else {})
    for w in words:
        assert w in str(e.value)
