"""Which codecs ``auto`` may choose: the error budget.

A faster step is worth nothing if the model trains worse, and no cost model predicts a loss.
So the budget is stated in loss and backed by measurement: ``MEASURED`` holds, for each role
(forward activations, their gradients, data-parallel gradient buckets) and codec, the change
of the final loss that bench/convergence.py measured (tiny GPT, 4 stages, 300 AdamW steps,
mean over 3 seeds, relative to uncompressed). ``auto`` considers the codecs whose measured
change is within ``auto_loss_budget`` (default 1 %), plus any the user lists in
``auto_candidates`` (their own responsibility: a codec never measured is never chosen
otherwise). ``none`` is always a candidate.
"""

from __future__ import annotations

from .. import codecs
from ..config import Config
from ..errors import ConfigError

#: role → codec spec → relative change of the final loss against uncompressed, the mean paired
#: difference over seeds 0-2 measured by ``python -m bench.convergence`` (bench/RESULTS.md,
#: Convergence: tiny GPT 0.81 M, 4 stages, 300 AdamW steps). A row
#: compresses one role or both: a backward codec measured with a lossy forward (int4 / int4:ef)
#: carries the forward's error too, an upper bound for the backward alone.
MEASURED: dict[str, dict[str, float]] = {
    "activation": {"int8": -0.0026, "bf16": 0.0061, "int4": 0.1109, "int4:ef": 0.0120},
    "activation_grad": {"int8": -0.0026, "bf16": 0.0061, "int4": 0.1109, "int4:ef": 0.0067,
                        "powersgd:rank=16": 0.0150},
    "gradient": {"bf16": 0.0028, "int8": 0.0119, "powersgd:rank=4": 0.0448,
                 "powersgd:rank=4,ef": 0.0170},
}


def candidates(role: str, config: Config, *, steps: bool = False) -> list[str]:
    """``none``, then every codec of ``role`` within the budget, then the user's own.

    ``steps=True`` (the pipeline's edges, which ``auto`` prices on the time to a loss target
    under ``objective="time_to_loss"``): under that objective the pool is every codec the
    steps-multiplier table holds for ``role`` instead, with no loss budget (T pays for the
    lost steps), and a user's candidate without a multiplier is a ConfigError."""
    if steps and config.objective == "time_to_loss":
        return _steps_candidates(role, config)
    out = ["none"]
    for spec, change in MEASURED[role].items():
        if change <= config.auto_loss_budget and codecs.canonical(spec) not in out:
            out.append(codecs.canonical(spec))
    for spec in config.auto_candidates or ():
        if spec not in out:
            out.append(spec)
    return out


def _steps_candidates(role: str, config: Config) -> list[str]:
    from ..steps_table import load

    table = load(config.steps_multipliers)
    out = ["none", *(s for s in table.specs(role) if s != "none")]
    for spec in config.auto_candidates or ():
        if table.of(role, spec) is None:
            raise ConfigError(
                f"auto_candidates: {spec!r} has no steps multiplier for {role} in the "
                "steps_multipliers table, and objective='time_to_loss' prices every candidate "
                "by one; measure it (python -m bench.time_to_loss) and give the table, or add "
                f"{{{role!r}: {{{spec!r}: <multiplier>}}}} to steps_multipliers")
        if spec not in out:
            out.append(spec)
    return out
