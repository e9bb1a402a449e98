"""The link a data-parallel group's ``gradient_collective="auto"`` is priced on, decided
here, in the compile layer, once per group, and handed to the runtime (the compiled
data-parallel backward, a pipeline rank's ``sync_grads``), which resolves each bucket's
collective on it with the wire layer's one rule (:func:`ccfx.wire.link.choose_collective`).

With the ``cluster`` option the link is the group's slowest, where its ranks' devices sit
(rank r on device r, or ``placement[r]``: :func:`ccfx.planner.links.group_links`, the same
rule the planner prices a group's buckets by, for this group alone: other groups' exchanges
that share a node's way out are not counted, since they divide the ring's and the
all-gather's bandwidth alike); without one, the ``link_gbps`` link. The runtime cannot ask the
planner (the layers point one way: runtime and planner never import each other), and the wire
layer knows only the options' one link, so a group inside a node and one across nodes would
otherwise be priced alike. Each decision names the link in the plan
(:func:`collective_decisions`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ccfx import codecs
from ccfx.config import AUTO, Config
from ccfx.plan import Decision
from ccfx.wire.link import Link, collective_seconds, configured_link


@dataclass(frozen=True)
class GroupLink:
    """The link ``gradient_collective="auto"`` is priced on for one group, and how the plan
    names it (the devices it joins, the level, the bandwidth)."""

    link: Link | None
    text: str


def group_link(config: Config, ranks: Sequence[int]) -> GroupLink | None:
    """The link of the data-parallel group of global ``ranks``; None where nothing is
    priced (``gradient_collective`` is not ``"auto"``, or the group has one rank)."""
    if config.gradient_collective != AUTO or len(ranks) < 2:
        return None
    cluster = config.cluster_description()
    if cluster is None:
        link = configured_link(config)
        if link is None:
            return GroupLink(None, "no link given (link_gbps, or a cluster): decided by bytes")
        return GroupLink(link, f"the link_gbps link, {link.gbps:g} Gbit/s, "
                               f"{link.latency_ms:g} ms")
    from ccfx.planner.links import group_links, rank_devices

    priced = group_links(cluster, [rank_devices(cluster, list(ranks), config.placement)])[0]
    return GroupLink(priced.link, f"{', '.join(priced.devices)}: {priced.describe()} "
                                  "(the group's slowest link, from the cluster option)")


def collective_decisions(where: str, buckets: Sequence[tuple[int, str, str, int, object]],
                         world: int, group: GroupLink | None) -> list[Decision]:
    """One decision per bucket whose codec has a choice of collective (``buckets``: index,
    codec, the collective it got, elements, dtype), saying which link it was priced on and
    the seconds of each collective there; ``where`` prefixes ``what`` ("bucket" or
    "stage 1 bucket")."""
    if group is None:
        return []
    out = []
    for index, spec, chosen, numel, dtype in buckets:
        if spec == "none" or codecs.prototype(spec).reduction == "sum":
            continue  # summable payloads all-reduce: nothing to choose
        table = []
        if group.link is not None:
            seconds = collective_seconds(spec, numel, dtype, world, group.link)
            table = sorted(seconds.items(), key=lambda t: t[1])
        why = ("two ranks: the all-gather (the ring sends the same bytes and quantises "
               "twice)" if world <= 2 else "the cheaper on this link"
               if group.link is not None else "the fewer bytes")
        out.append(Decision(f"{where} {index} collective", chosen, table,
                            f"gradient_collective='auto' over {world} ranks, priced on "
                            f"{group.text}: {why}"))
    return out
