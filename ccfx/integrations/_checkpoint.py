"""The comm hook's state in the frameworks' checkpoints.

What is saved: :meth:`CommHookState.state_dict` (PowerSGD's Q, error-feedback residuals, the
step counter), per rank, with the world size and rank that wrote it. It is per rank because the
error-feedback residual is what *this* rank's gradient lost to the codec: rank 1's residual
is not rank 0's, and a resumed rank must get its own back.

Two ways to put it in a checkpoint, depending on what the framework offers:

* a file per rank in the checkpoint's folder (``ccfx_comm_hook_rank<global rank>.pt``), when
  the framework hands every rank the folder: the Hugging Face Trainer (``on_save`` event,
  ``checkpoint-<step>``), Accelerate (``save_state`` / ``load_state`` pre-hooks). Every rank
  writes and reads its own file; nothing is gathered.
* every rank's entry gathered into one object (:func:`gathered`), when only rank 0 writes a
  single file that every rank reads back: Lightning's ``.ckpt`` (a Callback's ``state_dict``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..runtime.comm_hook import CommHookState

FORMAT = 1

#: How to resume when this rank's state is damaged.
DROP = ("Resume from an earlier checkpoint, or leave ccfx's state out (delete this rank's file; "
        "in Lightning, the LightningCodecCallback entry of the .ckpt's 'callbacks'): the codec "
        "then starts afresh, error feedback from zero, PowerSGD from a new Q.")


def _ranks(state: CommHookState) -> tuple[int, int, int]:
    """(rank in the hook's group, its world size, global rank); (0, 1, 0) without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, 0
    group = state.process_group
    return dist.get_rank(group), dist.get_world_size(group), dist.get_rank()


def file_name(state: CommHookState) -> str:
    return f"ccfx_comm_hook_rank{_ranks(state)[2]}.pt"


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    return value


def entry(state: CommHookState) -> dict[str, Any]:
    """This rank's state, on the CPU, with who wrote it."""
    rank, world, _ = _ranks(state)
    return {"format": FORMAT, "rank": rank, "world_size": world, "spec": state.spec,
            "hook": _cpu(state.state_dict())}


def load_entry(state: CommHookState, saved: dict[str, Any], where: str) -> None:
    """Restore ``saved`` (an :func:`entry`) into ``state``; another world size or rank is a
    ConfigError (a residual belongs to the rank whose gradients it was taken from), and so is
    damaged state (NaN or ±inf, unreadable entries), each prefixed with ``where`` (the file)."""
    if not isinstance(saved, dict):
        raise ConfigError(f"{where}: not a ccfx comm hook state (a {type(saved).__name__}, not "
                          f"a dict): the file is damaged or not ccfx's. {DROP}")
    rank, world, _ = _ranks(state)
    if saved.get("world_size") != world:
        raise ConfigError(
            f"{where}: ccfx's comm hook state was saved by {saved.get('world_size')} rank(s), "
            f"and {world} run now: its error-feedback residuals and PowerSGD state are per rank. "
            "Resume on as many ranks, or resume without ccfx's state (remove it from the "
            "checkpoint: the codec then starts fresh)")
    if saved.get("rank") != rank:
        raise ConfigError(f"{where}: this is rank {saved.get('rank')}'s comm hook state, and "
                          f"this is rank {rank}: each rank loads its own")
    if not isinstance(saved.get("hook"), dict):
        raise ConfigError(f"{where}: not a ccfx comm hook state (its 'hook' entry is a "
                          f"{type(saved.get('hook')).__name__}, not a dict): the file is damaged "
                          f"or not ccfx's. {DROP}")
    try:
        state.load_state_dict(saved["hook"])
    except ConfigError as e:  # the hook's own checks, told which file
        raise ConfigError(f"{where}: {e}") from None


# -- a file per rank ------------------------------------------------------------------------------


def save_file(state: CommHookState, folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, file_name(state))
    torch.save(entry(state), path)
    return path


def load_file(state: CommHookState, folder: str) -> bool:
    """Load this rank's file from ``folder``; False when there is none."""
    path = os.path.join(folder, file_name(state))
    if not os.path.isfile(path):
        return False
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (damaged bytes fail as EOFError, UnpicklingError,
        # RuntimeError, KeyError, ...: torch.load's failures have no common type)
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise ConfigError(f"{path}: ccfx's comm hook state cannot be read ({type(e).__name__}"
                          f": {first}): the file is damaged (truncated, overwritten). "
                          f"{DROP}") from None
    load_entry(state, saved, path)
    return True


# -- every rank in one object ---------------------------------------------------------------------


def gathered(state: CommHookState) -> dict[str, Any]:
    """Every rank's :func:`entry` on the group's rank 0 (a collective: every rank calls it);
    the other ranks' result holds only their own (they do not write the file)."""
    rank, world, _ = _ranks(state)
    mine = entry(state)
    if world == 1:
        return {"format": FORMAT, "world_size": 1, "ranks": {0: mine}}
    group = state.process_group
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, out, dst=dst, group=group)
    ranks = {r: e for r, e in enumerate(out)} if out is not None else {rank: mine}
    return {"format": FORMAT, "world_size": world, "ranks": ranks}


def load_gathered(state: CommHookState, saved: dict[str, Any], where: str) -> None:
    """Restore this rank's entry of ``saved`` (a :func:`gathered`) into ``state``."""
    rank, world, _ = _ranks(state)
    if not isinstance(saved, dict) or not isinstance(saved.get("ranks", {}), dict):
        raise ConfigError(f"{where}: ccfx's comm hook state cannot be read (not the dict of "
                          f"every rank's state that the callback saves): it is damaged. {DROP}")
    ranks = saved.get("ranks", {})
    if saved.get("world_size") == world and rank not in ranks:
        raise ConfigError(f"{where}: the checkpoint holds no comm hook state for rank {rank} "
                          f"(it has ranks {sorted(ranks)}): it was not written by rank 0 of "
                          "the gathered state")
    load_entry(state, ranks.get(rank, {"world_size": saved.get("world_size")}), where)
