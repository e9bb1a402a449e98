"""The planner: a cost model of one training step, and ``auto`` codecs chosen from it.

    compiled = torch.compile(model, backend="ccfx", options={
        "stages": 2, "activation_codec": "auto", "link_gbps": 0.1, "microbatches": 8})
    compiled(microbatch)
    print(ccfx.explain(compiled))      # each choice, every candidate's predicted step, why

Pieces, one per module:

* ``schedule``: torch's GPipe / 1F1B programs rank by rank, and a simulator of one step over
  a ``Link`` (which sends are exposed, which hide behind compute, the bubble);
* ``codec_cost``: each codec's encode / decode seconds and payload bytes at a tensor's size,
  measured on this machine once and cached;
* ``compute``: seconds per stage, from FLOPs and a measured machine rate, or a timed profile;
* ``probe``: the link between two ranks, measured;
* ``pipeline_model`` / ``dp_model``: a choice of codecs → the predicted step;
* ``candidates``: the error budget (codecs whose measured effect on the loss is within it);
* ``auto``: the search, and a ``Decision`` per edge, direction and bucket that says why;
* ``plan_edges``: the compile-time glue (a partitioned graph → its edges' codecs).
"""

from .codec_cost import CodecCost, CodecTimer
from .compute import from_flops, machine_rate, profile_stages
from .pipeline_model import EdgeTraffic, PipelineModel, StageCompute, edges_from_plan
from .probe import probe_link
from .schedule import Link, StageCost, Timeline, simulate

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
    "probe_link",
    "profile_stages",
    "simulate",
]
