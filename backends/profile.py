"""Timed profiles of a compiled model's pipeline stages: what the planner's ``compute``
measurements need from the compile (the split stage modules, lowered as they will run).

    compiled = torch.compile(model, backend="ccfx", options={"stages": 2})
    compiled(microbatch)
    profile_stages(compiled, microbatch)     # [StageCompute(forward_s, backward_s, "profile")]

The timing itself is the planner's (:func:`ccfx.planner.compute.time_stages`,
:func:`ccfx.planner.compute.time_optimizer`); this module finds the stages.
"""

from __future__ import annotations

from ccfx.planner.compute import time_optimizer, time_stages
from ccfx.planner.pipeline_model import StageCompute
from ccfx.runtime.pipeline import lower_stage

from .compiler import backend_of


def profile_stages(compiled, *inputs, lowering: str | None = None, repeats: int = 5,
                   graph: int = 0) -> list[StageCompute]:
    """Time each pipeline stage of a compiled model (compiled and called once at the
    microbatch shape) forward and backward, on its own: stage 0 on ``inputs`` (a microbatch,
    as the model takes it: token ids stay valid ids), later stages on Gaussian tensors of their
    ports' shapes."""
    backend = backend_of(compiled)
    parent = backend.graphs[graph].split()
    lowering = lowering or backend.config.lowering
    interfaces = parent.meta["ccfx"]["interfaces"]
    modules = [lower_stage(getattr(parent, f"stage_{i.index}"), lowering) for i in interfaces]
    return time_stages(modules, interfaces, inputs, repeats)


def optimizer_seconds(compiled, make_optimizer, *, repeats: int = 5,
                      graph: int = 0) -> list[float]:
    """Per stage, the seconds of one ``make_optimizer(params).step()`` over the stage's own
    parameters (gradients set to random values): the part of a step after the schedule."""
    parent = backend_of(compiled).graphs[graph].split()
    params = [list(getattr(parent, f"stage_{i.index}").parameters())
              for i in parent.meta["ccfx"]["interfaces"]]
    return time_optimizer(params, make_optimizer, repeats=repeats)
