"""The planner: a cost model of one training step, and ``auto`` codecs chosen from it.

    compiled = torch.compile(model, backend="ccfx", options={
        "stages": 2, "activation_codec": "auto", "link_gbps": 0.1, "microbatches": 8})
    compiled(microbatch)
    print(ccfx.explain(compiled))      # each choice, every candidate's predicted step, why

Pieces, one per module:

* ``schedule``: a simulator of one step of torch's GPipe / 1F1B programs
  (:mod:`ccfx.wire.schedules`) over a ``Link`` (:mod:`ccfx.wire.link`): which sends are
  exposed, which hide behind compute, the bubble;
* ``codec_cost``: each codec's encode / decode seconds and payload bytes at a tensor's size,
  measured on this machine once and cached;
* ``compute``: seconds per stage, from FLOPs and a measured machine rate, or timed stage
  modules (``ccfx.backends.profile.profile_stages`` times a compiled model's);
* ``probe``: the link between two ranks, measured;
* ``pipeline_model`` / ``dp_model`` / ``local_model`` / ``collective_model``: a choice of
  codecs → the predicted step (a collective's: its exposed time on the link plus its codec's);
* ``candidates``: the error budget (codecs whose measured effect on the loss is within it);
* ``auto``: the search, and a ``Decision`` per edge, direction and bucket that says why;
* ``cluster`` (+ ``cluster_probe``): devices and the links between them (the description
  and its files: :mod:`ccfx.cluster_spec`, :mod:`ccfx.cluster_files`);
  ``links``: which link each hop, data-parallel group and collective crosses under a
  placement, and how flows leaving one node share it;
* ``steps_model``: steps multipliers per codec and role, for ``objective="time_to_loss"``;
* ``model_facts`` / ``memory_model`` / ``layout`` / ``layout_search`` / ``layout_result``: the
  layout planner (``ccfx.plan_parallel``): a model's per-block facts, peak memory per stage,
  a layout's predicted step, the search over pp × dp (× tp) and placements, the explanation;
* ``plan_edges`` / ``plan_buckets`` / ``plan_stages`` / ``plan_collectives``: what the backend
  calls at compile time (a partitioned graph → its edges' codecs; a backward's buckets →
  theirs; PP × DP stages → theirs; a forward, backward or inference graph's collectives →
  theirs).

The planner imports the wire layer (``ccfx.wire``), never the runtime or the backend: the
backend is its only caller and writes each decision into the Plan.
"""

from ..wire.link import Link
from ..wire.schedules import StageCost
from .codec_cost import CodecCost, CodecTimer
from .compute import from_flops, machine_rate, time_optimizer, time_stages
from .local_model import predict_local_steps, predict_outer
from .pipeline_model import EdgeTraffic, PipelineModel, StageCompute, edges_from_plan
from .probe import probe_link
from .schedule import Timeline, simulate

__all__ = [
    "CodecCost",
    "CodecTimer",
    "EdgeTraffic",
    "Link",
    "PipelineModel",
    "StageCompute",
    "StageCost",
    "Timeline",
    "edges_from_plan",
    "from_flops",
    "machine_rate",
    "predict_local_steps",
    "predict_outer",
    "probe_link",
    "simulate",
    "time_optimizer",
    "time_stages",
]
