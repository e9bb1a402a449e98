"""Run a function on N local ranks (gloo on 127.0.0.1), bounded in time.

    from ccfx.runtime.launch import spawn
    results = spawn(train, world_size=2, args=(cfg,), timeout_s=120)   # one result per rank

Each rank is a fresh ``spawn``-ed process that joins a gloo process group on 127.0.0.1 (a
free port picked here), calls ``fn(rank, world_size, *args)`` and sends back its return value.
The parent never waits forever: when a rank raises, the others are given ``grace_s`` to
finish and are then killed, and :class:`RankFailed` carries the failing rank's traceback; when
the deadline passes, :class:`RankTimeout` names the ranks that had not finished. This is what
ccfx's multi-process tests, ``ccfx demo --dp`` and the benchmarks use; ``torchrun`` does the
same job for users' own scripts.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CcfxError


class RankFailed(CcfxError):
    """A rank raised or died; the message holds its traceback. ``results`` holds what the
    other ranks returned before they stopped (rank → value)."""

    def __init__(self, message: str, results: dict[int, Any] | None = None):
        super().__init__(message)
        self.results = dict(results or {})


class RankTimeout(CcfxError):
    """Ranks did not finish within the deadline."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, args, env, pg_timeout_s, results):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(env.get("CCFX_RANK_THREADS", "1")))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises)
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 (already reporting the rank's result)
                pass


def spawn(fn: Callable[..., Any], world_size: int, args: Sequence = (), *,
          timeout_s: float = 300.0, grace_s: float = 10.0, pg_timeout_s: float = 60.0,
          env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their return values,
    in rank order. ``fn`` and ``args`` must be picklable (a module-level function).
    ``pg_timeout_s`` bounds every collective of the default group; ``env`` is added to each
    rank's environment (``CCFX_RANK_THREADS``: torch threads per rank, default 1)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(fn, r, world_size, port, tuple(args), dict(env or {}),
                               pg_timeout_s, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    failure: tuple[int, str] | None = None
    exited: dict[int, float] = {}
    try:
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if failure is not None:
                left = min(left, grace_s)
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r not in done and not p.is_alive():
                        exited.setdefault(r, now)
                # a result may still be in flight a moment after its process ends
                dead = [r for r, t in exited.items() if r not in done and now - t > 2.0]
                if dead and failure is None:
                    why = (f"process exited with code {procs[dead[0]].exitcode} without "
                           "reporting (killed, or crashed in C++)")
                    failure = (dead[0], why)
                    deadline = min(deadline, time.monotonic() + grace_s)
                continue
            if status == "ok":
                done[rank] = value
            elif failure is None:
                failure = (rank, value)
                deadline = min(deadline, time.monotonic() + grace_s)
    finally:
        for p in procs:
            p.join(timeout=0.5 if failure or len(done) < world_size else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failure is not None:
        rank, text = failure
        others = sorted(set(range(world_size)) - set(done) - {rank})
        raise RankFailed(f"rank {rank} of {world_size} failed"
                         + (f" (ranks {others} stopped with it)" if others else "")
                         + f":\n{text}", done)
    if len(done) < world_size:
        missing = sorted(set(range(world_size)) - set(done))
        raise RankTimeout(f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s "
                          f"(finished: {sorted(done)}); a rank is stuck in a collective or compile")
    return [done[r] for r in range(world_size)]
