"""The planner (issue #10): the schedule simulator, the codec timer, ``auto`` and explain."""

import pytest
import torch
from torch import nn

import ccfx
from ccfx.planner import CodecTimer, Link, StageCost, simulate
from ccfx.planner.auto import choose_pipeline_codecs
from ccfx.planner.pipeline_model import EdgeTraffic, PipelineModel, StageCompute
from ccfx.wire.schedules import Compute, gpipe_program, one_f_one_b_program

from . import toy_models as models

NO_WIRE = Link(1e6, 0.0)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize("stages,micro", [(2, 2), (2, 8), (4, 4), (4, 9)])
def test_without_communication_the_step_is_the_textbook_pipeline(schedule, stages, micro):
    # (m + n - 1) slots of forward + backward: the bubble is (n - 1) / (m + n - 1)
    step = simulate(schedule, [StageCost(1.0, 2.0)] * stages, micro, lambda m: 0, NO_WIRE)
    assert step.step_s == pytest.approx((micro + stages - 1) * 3.0)
    assert step.bubble == pytest.approx((stages - 1) / (micro + stages - 1))


def test_the_1f1b_program_is_torchs_order():
    # torch's Schedule1F1B: stage s warms up with n - s forwards, then alternates
    labels = lambda prog: [i.label for i in prog if isinstance(i, Compute)]
    c = StageCost(1.0, 2.0)
    assert labels(one_f_one_b_program(0, 2, 4, c)) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert labels(one_f_one_b_program(1, 2, 4, c)) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert labels(gpipe_program(0, 2, 3, c)) == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_a_slow_link_bounds_the_step_and_compression_shortens_it():
    stages = [StageCost(0.01, 0.02)] * 2
    link = Link(0.01, 0.0, shared=True)  # 10 Mbit/s, one medium
    raw = simulate("1F1B", stages, 8, lambda m: 125_000, link)
    wire_s = 16 * 125_000 * 8 / 1e7  # 8 microbatches, both directions
    assert raw.step_s >= wire_s
    assert raw.exposed_s() > 0
    small = simulate("1F1B", stages, 8, lambda m: 125_000 // 4, link)
    assert small.step_s < raw.step_s / 2


def test_a_fast_link_hides_every_message_behind_compute():
    t = simulate("1F1B", [StageCost(0.01, 0.02)] * 2, 8, lambda m: 1000, Link(100.0, 0.0))
    assert t.exposed_s() < 1e-3 * t.step_s


def test_codec_times_are_measured_once_and_cached(tmp_path):
    path = tmp_path / "times.json"
    timer = CodecTimer(path=path, repeats=2)
    cost = timer.cost("int8", (16, 256), torch.float32)
    assert cost.encode_s > 0 and cost.decode_s > 0
    assert cost.raw_bytes == 16 * 256 * 4
    assert cost.wire_bytes == ccfx.codecs.get("int8").wire_bytes((16, 256), torch.float32)
    assert path.exists()
    again = CodecTimer(path=path)
    again._measure = None  # a second timer must read the cache, not measure
    assert again.cost("int8", (16, 256), torch.float32) == cost
    assert timer.cost("none", (16, 256), torch.float32).encode_s == 0.0


def _two_stage_model(gbps: float, micro: int = 8) -> PipelineModel:
    edges = [EdgeTraffic(0, "h", (64, 1024), torch.float32, ((0, 1),))]
    compute = [StageCompute(0.004, 0.008)] * 2
    # codecs priced at a fixed 1 GB/s: comparisons of predictions hold at any machine load
    return PipelineModel(compute, edges, Link(gbps, 0.05, shared=True), microbatches=micro,
                         timer=CodecTimer(throughput=1e9))


def _pool(edge, direction):
    return ["none", "bf16", "int8"]


def test_auto_compresses_on_a_slow_link_and_says_why():
    decided = choose_pipeline_codecs(_two_stage_model(0.01), _pool)
    assert decided.choice[0][0] != "none" and decided.choice[0][1] != "none"
    assert decided.chosen.step_s < decided.uncompressed.step_s
    fwd = decided.decisions[0]
    assert fwd.what == "edge 0 forward"
    assert {c for c, _ in fwd.candidates} == {"none", "bf16", "int8"}
    assert fwd.candidates == sorted(fwd.candidates, key=lambda c: c[1])
    assert fwd.chosen in fwd.reason and "faster" in fwd.reason


def test_auto_says_no_on_a_fast_link():
    decided = choose_pipeline_codecs(_two_stage_model(100.0), _pool)
    assert decided.choice[0] == ("none", "none")
    for d in decided.decisions:
        assert d.chosen == "none"
        assert any(w in d.reason for w in ("hidden behind compute", "does not pay", "less than"))


def test_a_fixed_direction_is_kept_and_only_the_other_is_searched():
    decided = choose_pipeline_codecs(
        _two_stage_model(0.01), lambda e, d: ["int8"] if d == "bwd" else _pool(e, d))
    assert decided.choice[0][1] == "int8"
    assert [d.what for d in decided.decisions] == ["edge 0 forward"]


def test_auto_needs_the_link():
    with pytest.raises(ccfx.ConfigError, match="link_gbps"):
        ccfx.Config(stages=2, activation_codec="auto")
    with pytest.raises(ccfx.ConfigError, match="pipeline_schedule"):
        ccfx.Config(pipeline_schedule="zigzag")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 256))


@pytest.mark.parametrize("gbps,compressed", [(0.001, True), (1000.0, False)])
def test_compiling_with_auto_records_the_choice_in_the_plan(gbps, compressed):
    x = torch.randn(32, 256)
    model = _mlp()
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options={
        "stages": 2, "activation_codec": "auto", "link_gbps": gbps, "lowering": "eager"})
    out = compiled(x)
    plan = ccfx.plan_of(compiled)
    g = plan.graphs[0]
    assert g.decisions and g.prediction is not None
    chosen = {d.chosen for d in g.decisions}
    assert (chosen != {"none"}) == compressed
    # the edges carry exactly the codecs the decisions name
    assert g.edges[0].codec == g.decisions[0].chosen
    if not compressed:  # identity codec: the same numbers as eager
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert ccfx.Plan.from_json(plan.to_json()) == plan
    text = ccfx.explain(compiled)
    assert "predicted step" in text and "why:" in text and g.decisions[0].chosen in text


def test_explain_without_auto_says_how_to_ask():
    compiled = torch.compile(_mlp(), backend="ccfx", options={"stages": 2, "lowering": "eager"})
    compiled(torch.randn(4, 256))
    assert "'auto'" in ccfx.explain(compiled)


def test_explain_names_the_measured_loss_cost_of_a_hand_picked_codec():
    """PowerSGD without error feedback costs +4.5 % in bench/convergence.py: a user who picks
    it by hand is told, with the error-feedback variant's cost beside it."""
    from ccfx.planner.candidates import MEASURED

    compiled = torch.compile(_mlp(), backend="ccfx", options={
        "data_parallel": True, "gradient_codec": "powersgd:rank=4", "lowering": "eager"})
    compiled(torch.randn(4, 256)).sum().backward()
    text = ccfx.explain(compiled)
    plain, ef = MEASURED["gradient"]["powersgd:rank=4"], MEASURED["gradient"]["powersgd:rank=4,ef"]
    assert f"gradient buckets: powersgd:rank=4: {plain:+.1%} final loss" in text  # as written
    assert f"with error feedback (powersgd:ef) {ef:+.1%}" in text


@pytest.mark.parametrize("gbps,compressed", [(0.005, True), (1000.0, False)])
def test_gradient_codec_auto_prices_every_bucket(gbps, compressed):
    torch.manual_seed(0)
    model = models.two_layer_mlp(256, 1024)
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options={
        "data_parallel": True, "gradient_codec": "auto", "link_gbps": gbps, "lowering": "eager",
        "auto_loss_budget": 0.05})  # PowerSGD with error feedback (+1.7 %) is a candidate
    compiled(torch.randn(16, 256)).sum().backward()
    plan = ccfx.plan_of(compiled)
    decisions = [d for d in plan.graphs[0].decisions if d.what.startswith("bucket")]
    assert decisions, "the compressible bucket was not priced"
    by_index = {b.index: b for b in plan.buckets}
    for d in decisions:
        assert by_index[int(d.what.split()[1])].codec == d.chosen
    assert (decisions[0].chosen != "none") == compressed
    # 1-D parameters (biases) are never candidates
    assert all(b.codec == "none" for b in plan.buckets if "0-d/1-D" in b.reason)
    assert plan.graphs[0].prediction.chosen_s <= plan.graphs[0].prediction.uncompressed_s
    assert "bucket" in ccfx.explain(compiled)


def _grad_sum_error(lazy: bool, calls: int = 16) -> float:
    """Relative error of the stage-0 weight's gradient summed over ``calls`` backward passes
    of one input through an int4 backward cut, against eager's."""
    x = torch.randn(8, 256)
    eager = _mlp()
    eager(x).pow(2).sum().backward()
    exact = eager[0].weight.grad * calls
    model = _mlp()
    compiled = torch.compile(model, backend="ccfx", fullgraph=True, options={
        "stages": 2, "activation_codec": "none", "activation_grad_codec": "int4",
        "lazy_error_propagation": lazy, "lowering": "eager"})
    for _ in range(calls):
        compiled(x).pow(2).sum().backward()
    grad_codecs = {e.grad_codec for e in ccfx.plan_of(compiled).edges}
    assert all(c.endswith("ef") for c in grad_codecs) == lazy, grad_codecs
    return float((model[0].weight.grad - exact).norm() / exact.norm())


def test_lazy_error_propagation_carries_each_hops_residual_to_the_next_call():
    # Error feedback: what int4 drops from one microbatch's gradient is sent with the next,
    # so the sum over calls (what the optimizer integrates) converges to the exact sum.
    plain, lazy = _grad_sum_error(False), _grad_sum_error(True)
    assert lazy < 0.25 * plain, (lazy, plain)


def test_the_cost_model_prices_epilogue_only_between_none_and_all_compressed():
    m = _two_stage_model(0.01)
    every = m.predict({0: ("none", "int8")}).step_s
    none = m.predict({0: ("none", "none")}).step_s
    m.epilogue_only = True
    epi = m.predict({0: ("none", "int8")}).step_s
    assert every < epi < none


def test_selective_stage_compression_compresses_only_the_stage_that_ends_the_step():
    from ccfx.planner.plan_stages import choose_stage_codecs

    # 1F1B: stage 0 runs the last backward; the last stage ends early and its exchange hides
    end = [3.0, 2.0]
    sync = [{"none": 1.0, "powersgd:ef": 0.2}, {"none": 1.0, "powersgd:ef": 0.2}]
    chosen, decisions = choose_stage_codecs(end, sync)
    assert chosen == ["powersgd:ef", "none"]
    assert "off the critical path" in decisions[1].reason
    assert decisions[0].predicted("powersgd:ef") == pytest.approx(3.2)


def test_the_html_report_shows_the_planners_choices(tmp_path):
    from ccfx.viz.report import write_report

    compiled = torch.compile(_mlp(), backend="ccfx", fullgraph=True, options={
        "stages": 2, "activation_codec": "auto", "link_gbps": 0.001, "lowering": "eager"})
    compiled(torch.randn(32, 256))
    html = write_report(tmp_path / "r.html", ccfx.plan_of(compiled)).read_text()
    assert "<h2>Planner</h2>" in html and "edge 0 forward" in html and "predicted step" in html


def test_a_tied_weight_sum_after_the_step_is_priced():
    m = _two_stage_model(0.01)
    alone = m.predict({}).step_s
    m.shared = [((0, 1), 4_000_000)]  # a 1M-parameter fp32 tied embedding on stages 0 and 1
    assert m.predict({}).step_s >= alone + 4_000_000 * 8 / 1e7 * 0.99


def test_the_loss_budget_decides_the_candidates():
    from ccfx.planner.candidates import MEASURED, candidates

    strict, loose = ccfx.Config(), ccfx.Config(auto_loss_budget=0.05)
    for role, measured in MEASURED.items():
        for budget, cfg in ((0.01, strict), (0.05, loose)):
            got = candidates(role, cfg)
            assert got[0] == "none"
            for spec, change in measured.items():
                assert (ccfx.codecs.canonical(spec) in got) == (change <= budget), (role, spec)
    assert "int4" not in candidates("activation", loose)  # +11 %: never a default candidate
    extra = ccfx.Config(auto_candidates=["topk:ratio=0.01,ef"])
    assert candidates("gradient", extra)[-1] == ccfx.codecs.canonical("topk:ratio=0.01,ef")


def test_the_optimizer_step_after_the_schedule_is_priced():
    from ccfx.backends.profile import optimizer_seconds

    compiled = torch.compile(_mlp(), backend="ccfx", fullgraph=True,
                             options={"stages": 2, "lowering": "eager"})
    compiled(torch.randn(8, 256))
    tail = optimizer_seconds(compiled, lambda ps: torch.optim.AdamW(ps), repeats=2)
    assert len(tail) == 2 and all(t > 0 for t in tail)
    m = _two_stage_model(100.0)
    alone = m.predict({}).step_s
    m.tail_s = [0.5, 0.0]
    assert m.predict({}).step_s == pytest.approx(alone + 0.5, rel=0.05)


def test_profile_stages_times_each_stage_forward_and_backward():
    from ccfx.backends.profile import profile_stages

    x = torch.randn(8, 256)
    compiled = torch.compile(_mlp(), backend="ccfx", fullgraph=True,
                             options={"stages": 2, "lowering": "eager"})
    compiled(x)
    times = profile_stages(compiled, x, repeats=2)
    assert len(times) == 2
    assert all(t.forward_s > 0 and t.backward_s > 0 and t.source == "profile" for t in times)


def test_a_data_parallel_plan_header_names_the_gradient_codec_and_the_world():
    """Not "codec none" (the activation codec, which no stage boundary uses) nor
    "world size 2 (undefined)" (torch's name for a group whose backend it cannot say)."""
    from ccfx.plan import DataParallelInfo, GraphPlan, Plan, Stage

    stage = Stage(graph=0, index=0, nodes=["x"], cost=1.0, cost_expr="1", flops=1,
                  param_bytes=4)
    graph = GraphPlan(index=0, requested_stages=1, num_stages=1, balance="flops",
                      stages=[stage], edges=[], shared=[])
    for backend, shown in [("undefined", ""), ("gloo", " (gloo)")]:
        plan = Plan({"activation_codec": "none"}, [graph],
                    data_parallel=DataParallelInfo(2, backend, "powersgd:ef"))
        head = str(plan).splitlines()[0]
        codec = ccfx.codecs.spelled("powersgd:ef")  # as a user in this process wrote it
        assert head == f"ccfx plan: 1 graph(s), gradient codec {codec}, world size 2{shown}"
        assert "undefined" not in str(plan) and "codec none" not in str(plan)


def test_ccfx_run_step_lines_use_kib_and_say_per_step_over_the_microbatches():
    from ccfx.run_pipeline import format_step

    line = format_step(3, 2.5, 0.25, {"0->1 fwd": (8192, 2048), "dp buckets": (4096, 1024)}, 4)
    assert line == ("step   3  loss 2.5000  0.250 s  KiB per step (4 microbatches), wire/raw per "
                    "link: 0->1 fwd 2.0/8.0  dp buckets 1.0/4.0")
    assert "kB" not in line
