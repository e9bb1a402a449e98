"""Deterministic fresh randomness: one generator per (seed, step).

Stochastic codecs keep a step counter as a state tensor, so a run resumed from a checkpoint
draws the same numbers, and every call draws new ones. Mixing with a large odd constant keeps
``(seed, step)`` and ``(seed + 1, step - K)`` from colliding.
"""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def generator(seed: int, step: int, device=None) -> torch.Generator:
    device = torch.device("cpu") if device is None else torch.device(device)
    g = torch.Generator(device=device)
    g.manual_seed(((seed * _MIX) ^ (step * 0xBF58476D1CE4E5B9 + 1)) & _MASK)
    return g


def take_step(state: dict[str, torch.Tensor], key: str = "step") -> int:
    """Read the counter, advance it in place, return the value read."""
    counter = state[key]
    step = int(counter.item())
    counter.add_(1)
    return step


class StepCounter:
    """Mixin for stochastic codecs: a ``step`` state tensor (int64, 0-d) counts encodes.

    Use before a dataclass ``Codec`` base; the subclass declares a ``seed: int = 0`` field.
    Encoding ``k`` draws from ``generator(seed, k)``: fresh every call, identical after a
    checkpoint restores ``step``.
    """

    stateful = True

    def state_layout(self, shape, dtype):
        return {"step": ((), torch.int64)}

    def draw(self, state, device) -> torch.Generator:
        return generator(self.seed, take_step(state), device)
