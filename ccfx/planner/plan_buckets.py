"""``gradient_codec="auto"`` at compile time: price a backward graph's gradient buckets.

The backward graph (aot_autograd's, before the buckets are spliced in) gives its FLOPs and,
for each bucket, how much of them precede its last gradient: from those, the measured machine
rate and the link, :class:`~ccfx.planner.dp_model.DataParallelModel` predicts the step for a
choice of bucket codecs, and :func:`~ccfx.planner.dp_model.choose_bucket_codecs` picks.
Without a process group (world size 1, the codecs as local round trips) the buckets are
planned for 2 ranks (with a ``placement``, for as many ranks as it places): the plan is for
the deployment.

The link: ``link_gbps`` and friends; or, with the ``cluster`` option, the slowest link among
the data-parallel ranks' devices (rank r on device r, or ``placement[r]``:
:func:`ccfx.planner.links.data_parallel_link`), which the prediction and every decision name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx

from ..config import Config
from ..cost import evaluate, node_flops
from ..plan import Decision, Prediction
from .candidates import candidates
from .compute import machine_rate
from .dp_model import BucketTraffic, DataParallelModel, choose_bucket_codecs
from .links import data_parallel_link
from .plan_edges import describe_link, link_of


def plan_bucket_codecs(gm: torch.fx.GraphModule, buckets: Sequence, config: Config,
                       world: int) -> tuple[dict[int, str], list[Decision], Prediction]:
    nodes = list(gm.graph.nodes)
    flops = []
    for n in nodes:
        try:
            flops.append(float(evaluate(node_flops(n), None)))
        except (ValueError, TypeError):
            flops.append(0.0)  # a symbolic size: the node counts as free
    total = sum(flops) or 1.0
    done_at = []
    acc = 0.0
    for f in flops:
        acc += f
        done_at.append(acc / total)
    ops = sum(1 for n in nodes if n.op == "call_function")
    rate, op_s = machine_rate()
    backward_s = total / rate + ops * op_s
    traffic = [BucketTraffic(b.index, tuple(s.shape for s in b.slots), b.slots[0].dtype,
                             done_at[min(b.ready, len(done_at) - 1)]) for b in buckets]
    cluster = config.cluster_description()
    if world < 2:
        world = len(config.placement) if config.placement and len(config.placement) > 1 else 2
    priced = data_parallel_link(cluster, world, config.placement) if cluster else None
    model = DataParallelModel(backward_s / 2, backward_s, traffic, world,
                              priced.link if priced else link_of(config),
                              collective=config.gradient_collective)
    pool = {b.index: candidates("gradient", config) for b in buckets if b.spec != "none"}
    choice, decisions = choose_bucket_codecs(model, pool, min_gain=config.auto_min_gain)
    if priced is not None:
        on = f" [priced on {', '.join(priced.devices)}: {priced.describe()}]"
        for d in decisions:
            d.reason += on
    prediction = Prediction(
        model.predict({}).step_s, model.predict(choice).step_s,
        describe_link(model.link) if priced is None else
        f"data-parallel group {', '.join(priced.devices)}: {priced.describe()}",
        f"data parallel over {model.world} ranks", 1,
        f"the backward's FLOPs at {rate:.3g} FLOP/s plus {op_s * 1e6:.1f} us per op "
        "(measured on this machine), the forward half of it")
    return choice, decisions, prediction
