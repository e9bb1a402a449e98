"""The pieces of parameters that local steps sync: fragments, their exchanges, an exchange in
flight. Shared by the outer loop (:mod:`ccfx.runtime.local_steps`) and its fault-tolerant sync
(:mod:`ccfx.runtime.elastic`), which both build and merge them; neither imports the other's
internals for it."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

from ..wire.exchange import Exchange


@dataclass
class Part:
    """One exchange of a fragment: its parameters' indices (into the fragment) and codec state."""

    members: list[int]
    exchange: Exchange
    state: dict[str, torch.Tensor]


@dataclass
class InFlight:
    """A fragment's exchange started at inner step ``started`` and merged at ``merge_at``."""

    started: int
    merge_at: int
    future: concurrent.futures.Future | None = None
    averaged: list[torch.Tensor] | None = None  # set once the exchange has finished


@dataclass
class Fragment:
    """Parameters synced together: the replica's (``local``), the fp32 global copies every
    replica agrees on, the outer optimizer stepping them, the exchanges averaging them."""

    index: int
    names: list[str]
    local: list[torch.nn.Parameter]
    global_: list[torch.Tensor]
    outer: torch.optim.Optimizer
    offset: int  # syncs at inner steps t with t % sync_every == offset
    parts: list[Part] = field(default_factory=list)
    in_flight: InFlight | None = None

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.local)
