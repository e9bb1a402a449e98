"""Selective stage compression (Optimus-CC): in PP × DP, compress the data-parallel gradients
only of the stages whose exchange is on the critical path.

Each pipeline rank averages its stage's gradients over its replicas after its part of the
step ends (``ccfx.sync_grads``), and the step ends when the last rank is done. Under 1F1B the
stages do not end together: stage 0 runs the last backward, the last stage finishes early and
its exchange hides in the time the others still compute. So stage ``s`` ends at
``end_s[s] + sync_s[s]``, with ``end_s`` from the schedule simulator and ``sync_s`` the
exchange of its buckets over ``dp`` replicas (:mod:`.dp_model`, nothing to overlap); a stage is
compressed only if that shortens the slowest. Greedy, slowest stage first.

The links: ``link_gbps`` and friends; or, with the ``cluster`` option, each hop on its own link
and each stage's exchange on the slowest link of its data-parallel group (its replicas'
devices; :mod:`ccfx.planner.links`: ranks as a ``("dp", "pp")`` DeviceMesh counts them,
``placement``, NIC contention between groups that leave one node), named in each decision.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import Config
from ..plan import Decision
from ..wire.link import Link
from .candidates import candidates
from .compute import from_flops
from .dp_model import BucketTraffic, DataParallelModel
from .links import hop_links, stage_group_links
from .pipeline_model import PipelineModel, edges_from_plan
from .plan_edges import link_of


def stage_sync_seconds(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, spec: str,
                       dp: int, link: Link, flows: int = 1) -> float:
    """Seconds to average one stage's gradients (one bucket) over ``dp`` replicas (``link``
    as priced: its bandwidth divided among ``flows`` groups)."""
    model = DataParallelModel(0.0, 0.0, [BucketTraffic(0, tuple(shapes), dtype, 0.0)], dp, link,
                              flows=flows)
    return model.predict({0: spec}).step_s


def choose_stage_codecs(end_s: Sequence[float], sync: Sequence[dict[str, float]], *,
                        min_gain: float = 0.02) -> tuple[list[str], list[Decision]]:
    """Per stage, the codec of its gradient exchange: ``sync[s][spec]`` its seconds.

    Starts from the best uniform choice (one codec on every stage: stages whose exchanges end
    the step together gain only when all are compressed, which a stage at a time never sees),
    then, slowest stage first, keeps on each stage the codec that ends the step soonest, or
    ``none`` unless a codec saves ``min_gain`` of the step."""
    chosen = ["none"] * len(end_s)

    def step(choice) -> float:
        return max(e + sync[s][choice[s]] for s, e in enumerate(end_s))

    base = step(chosen)
    for spec in sorted({k for table in sync for k in table} - {"none"}):
        trial = [spec if spec in sync[s] else "none" for s in range(len(end_s))]
        if step(trial) < min(step(chosen), base * (1 - min_gain)):
            chosen = trial
    for s in sorted(range(len(end_s)), key=lambda s: -(end_s[s] + sync[s]["none"])):
        with_ = {spec: step([*chosen[:s], spec, *chosen[s + 1:]]) for spec in sync[s]}
        best = min(with_, key=lambda spec: (with_[spec], spec != "none"))
        chosen[s] = best if with_[best] < with_["none"] * (1 - min_gain) else "none"
    if step(chosen) >= base * (1 - min_gain):
        chosen = ["none"] * len(end_s)
    total = step(chosen)
    decisions = []
    for s, e in enumerate(end_s):
        table = sorted(((spec, step([*chosen[:s], spec, *chosen[s + 1:]])) for spec in sync[s]),
                       key=lambda t: t[1])
        slack = total - (e + sync[s]["none"])
        reason = (f"{chosen[s]}: this stage's exchange ends the step" if chosen[s] != "none"
                  else f"off the critical path: its part of the step ends at {e:.4g} s and its "
                       f"uncompressed exchange still finishes {slack:.4g} s before the step "
                       "does" if slack >= 0 else
                  "compressing this stage's exchange does not shorten the step enough")
        decisions.append(Decision(f"stage {s} gradients", chosen[s], table, reason))
    return chosen, decisions


def plan_stage_codecs(plan, config: Config, dp: int,
                      stage_shapes: Sequence[Sequence[tuple[int, ...]]],
                      world: int | None = None) -> tuple[list[str], list[Decision]]:
    """``gradient_codec="auto"`` under PP × DP: the codec of each stage's exchange;
    ``stage_shapes[s]``: the shapes of stage ``s``'s parameters that its bucket exchange
    may compress (:func:`ccfx.wire.policy.compressible`); ``world``: every rank of the
    pipelines (default: a rank per stage in each of the ``dp`` replicas)."""
    g = plan.graphs[0]
    n = len(g.stages)
    compute = from_flops([s.flops for s in g.stages], [len(s.nodes) for s in g.stages])
    cluster = config.cluster_description()
    if cluster is None:
        links, groups = link_of(config), None
    else:
        p = max((world or n * dp) // dp, 1)
        links = [h.link for h in hop_links(cluster, n, replicas=dp, pipeline_ranks=p,
                                           placement=config.placement)]
        groups = stage_group_links(cluster, n, dp, pipeline_ranks=p, placement=config.placement)
    model = PipelineModel(compute, edges_from_plan(plan), links,
                          schedule=config.pipeline_schedule, microbatches=config.microbatches)
    choice = {e.index: (e.codec, e.grad_codec or "none") for e in g.edges}
    end = model.predict(choice).timeline.end_s
    specs = candidates("gradient", config)
    sync = [{spec: stage_sync_seconds(shapes, torch.float32, spec, dp,
                                      groups[s].link if groups else links,
                                      groups[s].flows if groups else 1) if shapes else 0.0
             for spec in specs} for s, shapes in enumerate(stage_shapes)]
    chosen, decisions = choose_stage_codecs(end, sync, min_gain=config.auto_min_gain)
    if groups is not None:
        for s, d in enumerate(decisions):
            d.reason += f" [priced on {', '.join(groups[s].devices)}: {groups[s].describe()}]"
    return chosen, decisions
