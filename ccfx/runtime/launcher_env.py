"""Refuse the launched-but-not-joined mistake: a script started by ``torchrun --nproc-per-node
N`` (or any launcher that sets ``WORLD_SIZE``) whose ranks never call
``dist.init_process_group()``.

Without a process group, ``data_parallel=True`` and ``ccfx.local_steps`` run as world size 1 on
purpose (one process shows what a codec does to training). Under a launcher of N ranks that
same fallback would make every rank train its own model, silently, with N times the compute
and nothing averaged: the only sign would be a note in the plan. The launcher's environment
says which case it is, so the second one is an error naming the fix.
"""

from __future__ import annotations

import os

from ..errors import ConfigError


def launched_world_size() -> int:
    """``WORLD_SIZE`` as a launcher (torchrun, ``ccfx run``, ``accelerate launch``) set it; 1
    when unset or unreadable."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def require_group_under_launcher(what: str) -> None:
    """Raise ConfigError when a launcher started several ranks but this process has no
    process group; ``what`` names the feature that would have run alone (option or call)."""
    import torch.distributed as dist

    world = launched_world_size()
    if world <= 1 or (dist.is_available() and dist.is_initialized()):
        return
    raise ConfigError(
        f"{what}: this process was launched as one of {world} ranks (WORLD_SIZE={world}, "
        f"RANK={os.environ.get('RANK', '?')}) but no process group exists, so each rank "
        "would train alone with nothing averaged. Call torch.distributed.init_process_group() "
        "(torchrun's environment needs no arguments) before the first call of the compiled "
        "model; to run one process on purpose, unset WORLD_SIZE")
