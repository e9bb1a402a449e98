"""``Config``: every option ccfx takes, in one place.

The same keys work as ``torch.compile(..., backend="ccfx", options={...})`` and as
``ccfx.backend(ccfx.Config(...))``. Later features add fields here, nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

BALANCE = ("flops", "params", "memory")
LOWERING = ("inductor", "eager")


@dataclass(frozen=True)
class Config:
    """Options of the ccfx backend.

    stages: number of pipeline stages to cut each graph into (≥ 1).
    activation_codec: codec on every cut edge, forward and backward (a spec, see
        ``ccfx codecs``): "none", "fp16", "bf16", "int8", "int8:block=128", ...
    split_points: module qualified names (``"layers.2"``) to cut before; when given, they are the
        cuts, and ``stages`` is ``len(split_points) + 1``.
    balance: the cost the partitioner balances: "flops", "params" (parameter bytes) or
        "memory" (activation bytes).
    lowering: what runs the partitioned graphs after aot_autograd: "inductor" (default; fastest
        on CPU and CUDA) or "eager" (aten ops one by one: quick to compile, for tests).
    """

    stages: int = 1
    activation_codec: str = "none"
    split_points: tuple[str, ...] | None = None
    balance: str = "flops"
    lowering: str = "inductor"

    def __post_init__(self):
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ConfigError(f"stages must be an integer ≥ 1, got {self.stages!r}")
        if self.balance not in BALANCE:
            raise ConfigError(
                f"balance={self.balance!r} is not valid; choose one of {', '.join(BALANCE)}"
            )
        if self.lowering not in LOWERING:
            raise ConfigError(
                f"lowering={self.lowering!r} is not valid; choose one of {', '.join(LOWERING)}"
            )
        from . import codecs

        object.__setattr__(self, "activation_codec", codecs.canonical(self.activation_codec))
        if self.split_points is not None:
            points = self.split_points
            if isinstance(points, str) or not all(isinstance(p, str) and p for p in points):
                raise ConfigError(
                    "split_points is a list of module qualified names such as ['layers.2'], "
                    f"got {points!r}"
                )
            points = tuple(points)
            object.__setattr__(self, "split_points", points)
            if self.stages == 1:
                object.__setattr__(self, "stages", len(points) + 1)
            elif self.stages != len(points) + 1:
                raise ConfigError(
                    f"{len(points)} split_points make {len(points) + 1} stages, but "
                    f"stages={self.stages}; drop `stages` or give {self.stages - 1} split points"
                )

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> Config:
        """Build from a ``torch.compile(options=...)`` dict; unknown keys are an error."""
        if options is None:
            return cls()
        if isinstance(options, Config):
            return options
        if not isinstance(options, dict):
            raise ConfigError(f"options must be a dict of ccfx options, got {type(options).__name__}")
        unknown = sorted(set(options) - set(cls.keys()))
        if unknown:
            raise ConfigError(
                f"unknown ccfx option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(cls.keys())}"
            )
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["split_points"] is not None:
            d["split_points"] = list(d["split_points"])
        return d

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)


