"""Steps multipliers: how many more training steps than uncompressed a codec needs to reach a
loss target, so that ``auto`` can minimise the time to that loss rather than the step.

A codec that saves bytes but costs steps can lose (the Protocol NanoGPT speedrun's subspace
reference sent 6.4x fewer bytes and needed 3.1x the steps). With ``objective="time_to_loss"``
``auto`` compares its pipeline candidates on T = multiplier(choice) x predicted step.

Where the numbers come from: ``python -m bench.time_to_loss`` (and ``bench.convergence
--target-at``) trains the tiny GPT under each codec over seeds and finds, per seed, the first
step at which the smoothed loss reaches the uncompressed run's smoothed loss at a fraction of
the run; a variant's multiplier is the mean over seeds of its steps over uncompressed's on the
same seed. The table holds one multiplier per role (``activation``: the forward cut edges;
``activation_grad``: their gradients) and codec. A variant that compressed both directions
with one codec gives each role half of its excess (m - 1); a backward-only variant gives its
whole excess to ``activation_grad``.

How a mixed choice is priced (a model, stated rather than measured): excesses add over roles,
and within a role scale with the share of the role's floating-point edges that carry the
codec::

    m(choice) = 1 + sum over roles of  mean over the role's edges of max(0, m[role][spec] - 1)

so a uniform choice gets back the measured multiplier, and a choice compressing 3 of 7 hops
pays 3/7 of the codec's excess. A multiplier under 1 counts as 1: no codec is assumed to train
faster than uncompressed (a measured value under 1 is the seeds' noise). A codec the table
does not hold counts as 1 where the options fix it (it is in every candidate alike);
``candidates`` never offers ``auto`` one.

``steps_multipliers`` (a Config key) gives another table: a JSON file the bench wrote, JSON
text, or a dict ``{"activation": {"int8": 1.02}, "activation_grad": {...}}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .. import codecs
from ..steps_table import ROLES, StepsTable, load

#: ``choose_pipeline_codecs``'s direction → role.
DIRECTION_ROLE = {"fwd": "activation", "bwd": "activation_grad"}


class StepsModel:
    """m(choice) for the edges of one pipeline (see the module docstring)."""

    def __init__(self, table: StepsTable, edges: Sequence):
        self.table = table
        self.edges = list(edges)
        floats = [e for e in self.edges if e.dtype.is_floating_point]
        self._count = {"fwd": len(floats),
                       "bwd": sum(1 for e in floats if getattr(e, "requires_grad", True))}

    def excess(self, direction: str, spec: str) -> float:
        m = self.table.of(DIRECTION_ROLE[direction], spec)
        return 0.0 if m is None else max(0.0, m - 1.0)

    def __call__(self, choice: Mapping[int, tuple[str, str]]) -> float:
        total = 1.0
        for e in self.edges:
            if not e.dtype.is_floating_point:
                continue
            fwd, bwd = choice.get(e.index, ("none", "none"))
            total += self.excess("fwd", fwd) / self._count["fwd"]
            if getattr(e, "requires_grad", True) and self._count["bwd"]:
                total += self.excess("bwd", bwd) / self._count["bwd"]
        return total


def for_config(config, edges: Sequence) -> Callable[[Mapping], float] | None:
    """The steps multiplier ``auto`` minimises T with, or None under ``objective="step"``."""
    if getattr(config, "objective", "step") != "time_to_loss":
        return None
    return StepsModel(load(config.steps_multipliers), edges)


def role_table(variants: Mapping[str, tuple[str, str, float]]) -> dict[str, dict[str, float]]:
    """A table from measured variants ``name → (forward spec, backward spec, multiplier)``: a
    variant with one lossy codec both ways gives each role half its excess, a one-direction
    variant gives that role all of it; a codec measured twice for a role keeps the mean.
    Variants mixing two lossy codecs are skipped (their excess cannot be split)."""
    seen: dict[str, dict[str, list[float]]] = {r: {} for r in ROLES}
    for fwd, bwd, m in variants.values():
        lossy = [(d, s) for d, s in (("fwd", fwd), ("bwd", bwd)) if s != "none"]
        if not lossy or len({s for _, s in lossy}) > 1:
            continue
        share = (m - 1.0) / len(lossy)
        for d, s in lossy:
            seen[DIRECTION_ROLE[d]].setdefault(codecs.canonical(s), []).append(1.0 + share)
    return {r: {s: round(sum(v) / len(v), 4) for s, v in row.items()}
            for r, row in seen.items() if row}
