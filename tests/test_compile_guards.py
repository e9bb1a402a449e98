"""Three compile-layer guards (issues 16, 17), single process:

* codec state loaded BEFORE the first call (``ccfx.codec_state(compiled)`` on a model that has
  not run): the holder keeps the checkpoint and applies it as ccfx makes each channel at
  compile time, before the first encode, so a resume is bit-exact; what does not fit is a
  ConfigError when the channel is made, a saved channel never made one at the second call;
* a ccfx-compiled module with stages under DistributedDataParallel while Dynamo's DDP
  optimizer is on is refused at the backend's first call, naming
  ``torch._dynamo.config.optimize_ddp = False``;
* the left-whole warning of a graph that holds no parameters says stages apply to the
  model's *other* graphs (a small graph with parameters: its *larger* ones).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ccfx

from . import toy_models as models
from .util import loss_of

OPTIONS = {"stages": 2, "activation_codec": "int8:block=32,ef",
           "activation_grad_codec": "powersgd:rank=2", "lowering": "eager"}


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(100 + i))


def _compile(model, how: str, **options):
    options = {**OPTIONS, **options}
    if how == "string":  # backend="ccfx": the backend is made at the first compile
        return torch.compile(model, backend="ccfx", options=options)
    return torch.compile(model, backend=ccfx.backend(**options))  # made already


def _train(compiled, model, opt, steps: range) -> None:
    for i in steps:
        opt.zero_grad()
        loss_of(compiled(_batch(i))).backward()
        opt.step()


def _start(seed: int = 0):
    torch.manual_seed(seed)
    model = models.MLP(depth=4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _checkpoint(how: str, steps: int = 2, **options):
    model, opt = _start()
    compiled = _compile(model, how, **options)
    _train(compiled, model, opt, range(steps))
    return ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(),
            {k: v.clone() for k, v in ccfx.codec_state(compiled).state_dict().items()})


def _resumed(how: str, saved, *, load_codec_state: bool = True, **options):
    """A fresh model and compile from ``saved``, codec state loaded before the first call."""
    params, opt_state, codec = saved
    model, opt = _start(seed=1)  # other initial weights: the checkpoint must set them
    model.load_state_dict(params)
    opt.load_state_dict(opt_state)
    compiled = _compile(model, how, **options)
    holder = ccfx.codec_state(compiled)
    if load_codec_state:
        holder.load_state_dict(codec)
    return model, opt, compiled, holder


@pytest.mark.parametrize("how", ["string", "instance"])
def test_codec_state_loaded_before_the_first_call_resumes_bit_for_bit(how):
    model, opt = _start()
    compiled = _compile(model, how)
    _train(compiled, model, opt, range(4))  # the uninterrupted run
    saved = _checkpoint(how)
    assert any(k.endswith("fwd.residual") for k in saved[2]), sorted(saved[2])
    assert any(k.endswith("bwd.q") for k in saved[2]), sorted(saved[2])
    assert any(v.abs().sum() > 0 for k, v in saved[2].items() if k.endswith("residual"))

    again, opt2, compiled2, holder = _resumed(how, saved)
    assert holder.channels() == {}, "nothing made yet: the checkpoint is kept"
    _train(compiled2, again, opt2, range(2, 4))
    assert ccfx.codec_state(compiled2) is holder, "the backend adopted the holder"
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    live = ccfx.codec_state(compiled).state_dict()
    resumed = holder.state_dict()
    assert sorted(live) == sorted(resumed)
    assert all(torch.equal(live[k], resumed[k]) for k in live)

    # the control: the same resume without the codec state drifts (the state matters)
    fresh, opt3, compiled3, _ = _resumed(how, saved, load_codec_state=False)
    _train(compiled3, fresh, opt3, range(2, 4))
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_a_checkpoint_of_another_codec_loaded_early_is_refused_when_the_channel_is_made():
    saved = _checkpoint("string")
    _, _, compiled, _ = _resumed("string", saved, activation_codec="topk:ratio=0.5,ef")
    with pytest.raises(ccfx.ConfigError, match=r"(?s)other codecs.*int8:block=32,ef.*"
                                               r"topk:ratio=0\.5,ef.*activation_codec"):
        compiled(_batch(2))
    _, _, compiled, _ = _resumed("string", saved, activation_grad_codec="powersgd:rank=3")
    with pytest.raises(ccfx.ConfigError, match=r"activation_grad_codec='powersgd:rank=3': q: "
                                               r"the checkpoint's is \(\d+, 2\)"):
        compiled(_batch(2))


def test_a_saved_channel_this_model_never_makes_is_reported_at_the_second_call():
    params, opt_state, codec = _checkpoint("string")
    extra = {**codec, "graph5.edge0.hop0to1.fwd.residual": torch.zeros(4, 32)}
    model, opt, compiled, holder = _resumed("string", (params, opt_state, extra))
    _train(compiled, model, opt, range(2, 3))  # the first call: its channels are claimed
    assert holder.unclaimed() == ["graph5.edge0.hop0to1.fwd"]
    with pytest.raises(ccfx.ConfigError, match=r"(?s)never made.*graph5\.edge0\.hop0to1\.fwd "
                                               r"\(activation_codec=.*strict=False"):
        compiled(_batch(3))
    compiled(_batch(3))  # reported once
    # strict=False drops what this model does not use
    model, opt, compiled, holder = _resumed("string", (params, opt_state, {}))
    holder.load_state_dict(extra, strict=False)
    _train(compiled, model, opt, range(2, 4))
    assert holder.unclaimed() == []


def test_codec_state_of_a_model_ccfx_did_not_compile_is_a_config_error():
    compiled = torch.compile(models.MLP(depth=2), backend="eager")
    with pytest.raises(ccfx.ConfigError, match="was not compiled with backend='ccfx'"):
        ccfx.codec_state(compiled)
    module = models.MLP(depth=2)  # nn.Module.compile(): found through its compiled call
    module.compile(backend="ccfx", options={**OPTIONS})
    holder = ccfx.codec_state(module)
    assert ccfx.codec_state(module) is holder and holder.deferred
    module(_batch(0))
    assert ccfx.codec_state(module) is holder and holder.channels()


# -- DDP with Dynamo's DDP optimizer ----------------------------------------------------------


def test_stages_under_ddp_with_the_ddp_optimizer_are_refused_early(one_rank_group):
    with torch._dynamo.config.patch(optimize_ddp=True):
        _refused_under_ddp()
    with torch._dynamo.config.patch(optimize_ddp=False):
        _whole_under_ddp()


def _refused_under_ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = models.MLP(depth=2)
    ddp = DDP(torch.compile(model, backend=ccfx.backend(stages=2, lowering="eager")))
    with pytest.raises(ccfx.ConfigError, match=r"(?s)inside DistributedDataParallel.*"
                                               r"torch\._dynamo\.config\.optimize_ddp = False"):
        ddp(_batch(0))
    # torch.compile(DDP(model)): the backend is called from DDP's forward as well
    compiled = torch.compile(DDP(models.MLP(depth=2)), backend=ccfx.backend(
        stages=2, lowering="eager"))
    with pytest.raises(ccfx.ConfigError, match=r"optimize_ddp = False"):
        compiled(_batch(0))
    # one stage: nothing to cut, the pieces are fine
    DDP(torch.compile(models.MLP(depth=2), backend=ccfx.backend(lowering="eager")))(_batch(0))


def _whole_under_ddp():
    """With the DDP optimizer off, the graph stays whole and ccfx cuts it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    compiled = torch.compile(models.MLP(depth=2), backend=ccfx.backend(stages=2,
                                                                        lowering="eager"))
    loss_of(DDP(compiled)(_batch(0))).backward()
    assert ccfx.plan_of(compiled).graphs[0].num_stages == 2


# -- the left-whole warning -------------------------------------------------------------------


class _SmallTail(nn.Module):
    """An MLP, a graph break, then a tail WITH a parameter but few FLOPs."""

    def __init__(self):
        super().__init__()
        self.body = models.MLP(32, 8)
        self.tail = nn.Linear(32, 1)

    def forward(self, x):
        h = self.body(x)
        torch._dynamo.graph_break()
        return self.tail(h).sum()


@pytest.mark.parametrize("model, graph, which", [(models.BreakThenMLP, 0, "other"),
                                                (_SmallTail, 1, "larger")])
def test_the_left_whole_warning_says_which_graphs_get_the_stages(model, graph, which):
    compiled = torch.compile(model(), backend=ccfx.backend(stages=2, lowering="eager"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(_batch(0)).sum().backward()
    said = [str(w.message) for w in caught if issubclass(w.category, ccfx.CcfxWarning)
            and "left whole" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"ccfx: graph {graph}: left whole"), said
    assert said[0].endswith(f"(stages=2 applies to the model's {which} graphs)"), said
    assert ("uses no parameters" in said[0]) == (which == "other")


def test_data_parallel_codec_state_loaded_before_the_first_call(one_rank_group):
    """Compiled data parallel (a 1-rank group): the buckets' PowerSGD Q and residuals, made
    when the backward compiles, and the backward count (what ends ``warmup_steps``) resume
    bit for bit; a checkpoint for another world size is refused when ccfx records its own."""
    dp = {"data_parallel": True, "gradient_codec": "powersgd:rank=2,ef",
          "compress_min_numel": 0, "warmup_steps": 1, "stages": 1,
          "activation_codec": "none", "activation_grad_codec": "none"}
    model, opt = _start()
    compiled = _compile(model, "string", **dp)
    _train(compiled, model, opt, range(4))
    params, opt_state, codec = _checkpoint("string", **dp)
    assert any(".bucket" in k and k.endswith("q0000") for k in codec), sorted(codec)
    assert int(codec["meta.graph0.backward_steps"]) == 2
    for load in (True, False):
        again, opt2, compiled2, holder = _resumed("string", (params, opt_state, codec),
                                                  load_codec_state=load, **dp)
        _train(compiled2, again, opt2, range(2, 4))
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
        assert same == load, load
        assert int(holder.state_dict()["meta.graph0.backward_steps"]) == (4 if load else 2)
    other = {**codec, "meta.world_size": torch.tensor(2)}
    _, _, compiled3, holder = _resumed("string", (params, opt_state, other), **dp)
    with pytest.raises(ccfx.ConfigError, match="world_size: the checkpoint's is 2, this run's "
                                               "is 1"):
        compiled3(_batch(2))



def test_a_deferred_holder_translates_earlier_names_and_names_what_is_missing():
    """The holder alone: a checkpoint of the earlier scheme is matched when ``add`` says its
    prefix; a channel the checkpoint lacks is refused (strict) when it is made."""
    from ccfx.codecs import state as cs

    holder = cs.CodecState()
    holder.deferred = True
    holder.load_state_dict({"graph0_edge3_hop0to1_fwd_residual": torch.full((4,), 2.0)})
    assert holder.channels() == {} and holder.unclaimed() == ["graph0_edge3_hop0to1_fwd_residual"]
    live = holder.add(cs.edge_channel(0, 3, (0, 1), "fwd"), "topk:ef",
                      {"residual": torch.zeros(4)}, legacy="graph0_edge3_hop0to1_fwd_")
    assert torch.equal(live["residual"], torch.full((4,), 2.0)) and holder.unclaimed() == []
    with pytest.raises(ccfx.ConfigError, match=r"graph0\.bucket0, gradient_codec='powersgd'"
                                               r": this model needs q0000 \(3, 1\) float32, "
                                               r"the checkpoint has none"):
        holder.add(cs.bucket_channel(0, 0), "powersgd", {"q0000": torch.zeros(3, 1)})
