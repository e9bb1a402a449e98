"""What both demos share: their sizes, the demo GPT's shape and one run's result.

``ccfx.demo`` (the pipeline demo, and the ``ccfx demo`` command that dispatches ``--dp``) and
``ccfx.demo_dp`` (the data-parallel demo) both import it, so neither imports the other's
module to get them.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

from ccfx.models import GPTConfig

DEMO_STEPS = 120
DP_DEMO_STEPS = 100
DEMO_BATCH_SIZE = 16
DEMO_LR = 3e-3
BASELINES = ("eager", "ccfx")


def demo_model_config(vocab_size: int) -> GPTConfig:
    """The demo's GPT: 4 layers, width 256, 4 heads, context 64 (about 3.2 M parameters)."""
    return GPTConfig(vocab_size=vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=256)


@dataclass
class RunResult:
    """One training run: loss per step and wall times (seconds)."""

    name: str
    losses: list[float]
    step_times: list[float]
    #: Per step, bytes that crossed stage boundaries (ledger): raw, and on the wire.
    raw_bytes: list[int] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    #: The loss on held-out batches after training, where measured.
    eval_loss: float | None = None

    @property
    def total_s(self) -> float:
        return sum(self.step_times)

    @property
    def first_step_s(self) -> float:
        """The first step, which includes compilation for a compiled model."""
        return self.step_times[0] if self.step_times else 0.0

    @property
    def steady_step_s(self) -> float:
        """Median time of the steps after the first."""
        rest = self.step_times[1:] or self.step_times
        return statistics.median(rest) if rest else 0.0

    def curve(self, points: int = 12) -> list[float]:
        """The loss curve in ``points`` windows: the mean loss of each consecutive window."""
        n = len(self.losses)
        points = min(points, n)
        if points < 1:
            return []
        bounds = [round(i * n / points) for i in range(points + 1)]
        return [sum(self.losses[a:b]) / (b - a) for a, b in itertools.pairwise(bounds)]

    def final_loss(self, last: int = 10) -> float:
        """Mean loss over the last ``last`` steps."""
        tail = self.losses[-last:]
        return sum(tail) / len(tail)
