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

#: role → codec spec → relative change of the final loss against uncompressed, the mean paired
#: difference over seeds 0-2 measured by ``python -m bench.convergence`` (2026-12-01: tiny GPT
#: 0.81 M, 4 stages, 300 AdamW steps; the uncompressed runs themselves spread ±1.6 %). A row
#: compresses one role or both: a backward codec measured with a lossy forward (int4 / int4:ef)
#: carries the forward's error too, an upper bound for the backward alone.
MEASURED: dict[str, dict[str, float]] = {
    "activation": {"int8": -0.0026, "bf16": 0.0061, "int4": 0.1109, "int4:ef": 0.0120},
    "activation_grad": {"int8": -0.0026, "bf16": 0.0061, "int4": 0.1109, "int4:ef": 0.0067,
                        "powersgd:rank=16": 0.0150},
    "gradient": {"bf16": 0.0028, "int8": 0.0119, "powersgd:rank=4": 0.0448,
                 "powersgd:rank=4,ef": 0.0170},
}


def candidates(role: str, config: Config) -> list[str]:
    """``none``, then every codec of ``role`` within the budget, then the user's own."""
    out = ["none"]
    for spec, change in MEASURED[role].items():
        if change <= config.auto_loss_budget and codecs.canonical(spec) not in out:
            out.append(codecs.canonical(spec))
    for spec in config.auto_candidates or ():
        if spec not in out:
            out.append(spec)
    return out
