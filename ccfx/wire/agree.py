"""Values exchanged between ranks through the c10d store, for what ranks agree on while a
graph compiles.

Ranks reach a compile at moments that differ by however long each takes, and one rank may
compile more graphs than another (a graph break, a recompile). A collective on the default
group issued from inside a compile can then pair with a different collective on another rank:
gloo hangs, or aborts on the size mismatch. A store key names what it is for (the graph, the
check), so it cannot be mistaken for another, and a rank that never comes is an error naming
it after ``timeout_s``.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Sequence

from ..errors import CcfxError


class StoreTimeout(CcfxError):
    """Some ranks did not publish a value within the timeout."""


def exchange(key: str, value: bytes, rank: int, ranks: Sequence[int], timeout_s: float,
             what: str) -> list[bytes]:
    """Publish ``value`` under ``key`` for ``rank``; the values of ``ranks``, in order."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{rank}", value)
    keys = [f"{key}/{r}" for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
        text = str(e).strip().splitlines()
        raise StoreTimeout(
            f"rank {rank}: {what}: ranks {missing} did not reach it within {timeout_s:g} s: "
            "they died, hang, or compiled a different model or different graphs "
            f"({text[0] if text else type(e).__name__})") from e
    return [store.get(k) for k in keys]


def from_rank0(key: str, obj, timeout_s: float, what: str):
    """Rank 0's ``obj`` on every rank (``obj`` itself without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    rank = dist.get_rank()
    mine = pickle.dumps(obj) if rank == 0 else b""
    return pickle.loads(exchange(key, mine, rank, [0], timeout_s, what)[0])
