"""The steps-multiplier table: how many more training steps than uncompressed a codec needs to
reach a loss target, per role (``activation``, ``activation_grad``) and codec.

Plain data, read and checked here, below :mod:`ccfx.config`: the ``steps_multipliers`` option
(a JSON file ``bench/time_to_loss.py`` wrote, JSON text, or a dict) is kept as the canonical
JSON of its table (:func:`canonical_json`), so ranks agree whatever path they read it from.
How ``auto`` prices a choice with it: :mod:`ccfx.planner.steps_model`; the shipped numbers:
:data:`MEASURED`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import codecs
from .errors import ConfigError

#: The roles a table may hold (the pipeline's two directions).
ROLES = ("activation", "activation_grad")

#: Measured on this machine by ``python -m bench.time_to_loss`` (see ``SOURCE``): the tiny GPT
#: with 8 blocks at 8 stages, 300 AdamW steps, seeds 0-7; the target is none's smoothed loss at
#: step 150. Noisy (the loss curve is flat there); int4:ef's is a lower bound (one seed never
#: reached the target). The additive model of :mod:`ccfx.planner.steps_model` predicts int8
#: forward + int4:ef backward as that mix trained (bench/RESULTS.md, Time to loss: 1.19).
MEASURED: dict[str, dict[str, float]] = {
    "activation": {"bf16": 1.0824, "int8": 1.0414},
    "activation_grad": {"bf16": 1.0824, "int8": 1.0414, "int4:ef": 1.1496,
                        "powersgd:rank=16": 1.2606},
}
SOURCE = ("python -m bench.time_to_loss --seeds 0 1 2 3 4 5 6 7 --extra-gbps 0.02 (2026-12-02, "
          "2-core CPU VM, torch 2.13.0+cpu)")


@dataclass(frozen=True)
class StepsTable:
    """role → canonical codec spec → steps multiplier (≥ 0; < 1 is read as 1)."""

    multipliers: Mapping[str, Mapping[str, float]]
    source: str = ""
    _lookup: dict = field(default_factory=dict, compare=False, repr=False)

    def of(self, role: str, spec: str) -> float | None:
        """The multiplier of ``spec`` in ``role`` (``none``: 1), None when not measured."""
        key = (role, spec)
        if key not in self._lookup:
            canon = codecs.canonical(spec) if spec != "none" else "none"
            self._lookup[key] = 1.0 if canon == "none" else self.multipliers.get(role, {}).get(canon)
        return self._lookup[key]

    def specs(self, role: str) -> list[str]:
        return list(self.multipliers.get(role, {}))

    def to_dict(self) -> dict:
        return {"multipliers": {r: dict(m) for r, m in self.multipliers.items()},
                "source": self.source}

    @classmethod
    def from_dict(cls, given: Mapping, where: str = "steps_multipliers") -> StepsTable:
        """From ``{"multipliers": {role: {spec: m}}, "source": ...}`` or the bare
        ``{role: {spec: m}}``; a ConfigError names what is wrong."""
        if not isinstance(given, Mapping):
            raise ConfigError(f"{where}: give a dict such as {{'activation': {{'int8': 1.02}}}} "
                              f"or the path of the JSON bench/time_to_loss.py writes, got "
                              f"{given!r}")
        source = str(given.get("source", "")) if "multipliers" in given else ""
        table = given.get("multipliers", given) if "multipliers" in given else given
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: 'multipliers' is a dict of roles, got {table!r}")
        out: dict[str, dict[str, float]] = {}
        for role, row in table.items():
            if role not in ROLES:
                raise ConfigError(f"{where}: unknown role {role!r}; the roles are "
                                  f"{', '.join(ROLES)} (forward cut edges, their gradients)")
            if not isinstance(row, Mapping):
                raise ConfigError(f"{where}[{role!r}] is a dict codec spec → multiplier, got "
                                  f"{row!r}")
            out[role] = {}
            for spec, m in row.items():
                if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) \
                        or m <= 0:
                    raise ConfigError(f"{where}[{role!r}][{spec!r}] = {m!r}: a multiplier is a "
                                      "positive number (steps to the target over "
                                      "uncompressed's, e.g. 1.05)")
                try:
                    canon = codecs.canonical(spec)
                except ConfigError as e:  # an unknown codec: say which entry
                    raise ConfigError(f"{where}[{role!r}]: {spec!r} is not a codec spec ({e})"
                                      ) from None
                out[role][canon] = float(m)
        return cls(out, source)

    @classmethod
    def from_file(cls, path: str) -> StepsTable:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"steps_multipliers: cannot read {path!r} ({e.strerror}); give "
                              "the JSON file bench/time_to_loss.py wrote (--table), or a dict"
                              ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"steps_multipliers: {path!r} is not JSON ({e})") from None
        return cls.from_dict(data, f"steps_multipliers ({path})")


DEFAULT = StepsTable.from_dict({"multipliers": MEASURED, "source": SOURCE})


def load(given) -> StepsTable:
    """The table a ``steps_multipliers`` option names: None → the shipped one; a dict; JSON
    text; or a file path."""
    if given is None:
        return DEFAULT
    if isinstance(given, StepsTable):
        return given
    if isinstance(given, Mapping):
        return StepsTable.from_dict(given)
    if isinstance(given, str) and given.lstrip().startswith("{"):
        try:
            return StepsTable.from_dict(json.loads(given))
        except json.JSONDecodeError as e:
            raise ConfigError(f"steps_multipliers: {e}; give a file path or a dict") from None
    if isinstance(given, str):
        return StepsTable.from_file(given)
    raise ConfigError(f"steps_multipliers = {given!r}: give the path of the JSON "
                      "bench/time_to_loss.py writes, or a dict {role: {codec: multiplier}}")


def canonical_json(given) -> str:
    """``given`` (a ``steps_multipliers`` option) as canonical JSON: what Config keeps, so ranks
    agree whatever path they read it from."""
    return json.dumps(load(given).to_dict(), sort_keys=True, separators=(",", ":"))
