"""What ``register_codec`` checks about the model a launcher (Accelerate, Lightning) handed over
before choosing between DDP's comm hook and FSDP2's comms.

The one trap: a user who asked Accelerate for FSDP2 on CPU gets a DDP model back without a
word (accelerate takes its FSDP path on GPUs and other accelerators only), then passes it the
codec per collective kind meant for FSDP2. The error says what happened and what to do.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import ConfigError
from . import _fsdp2
from ._ddp import find_ddp


def check_kinds_fit(target: Any, spec: Any) -> None:
    """A :class:`~ccfx.ConfigError` when ``spec`` names a codec per collective kind (FSDP2's
    form) and ``target`` is a DDP model with no FSDP module: DDP has one collective."""
    if not isinstance(spec, dict) or _fsdp2.holds_fsdp(target):
        return
    ddp = find_ddp(target)
    if ddp is None:
        return
    text = (f"register_codec: a codec per collective kind ({spec}) is for a model sharded "
            "with torch's fully_shard (FSDP2), and this is a DistributedDataParallel model "
            f"({type(ddp.module).__name__}): DDP has one collective, the all-reduce of its "
            "gradient buckets. Pass one codec for it (register_codec(model, 'int8')), or "
            "shard the model with fully_shard")
    if "accelerate" in sys.modules:
        text += (". If you asked Accelerate for FSDP2 (FullyShardedDataParallelPlugin): "
                 "accelerate ignores the plugin on CPU and wraps the model in DDP (it takes "
                 "its FSDP path on GPUs and other accelerators only, and `accelerate launch` "
                 "refuses --cpu with --use_fsdp); on CPU shard with fully_shard yourself "
                 "(examples/fsdp2.py) or use Lightning's ModelParallelStrategy "
                 "(examples/lightning_fsdp2.py)")
    raise ConfigError(text)
