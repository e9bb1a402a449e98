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
import pickle
import queue
import shlex
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CcfxError, first_line


class RankFailed(CcfxError):
    """A rank raised or died; the message holds its traceback. ``rank`` is the rank that
    failed first; ``results`` holds what the other ranks returned before they stopped
    (rank → value)."""

    def __init__(self, message: str, results: dict[int, Any] | None = None,
                 rank: int | None = None):
        super().__init__(message)
        self.results = dict(results or {})
        self.rank = rank


class RankTimeout(CcfxError):
    """Ranks did not finish within the deadline."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, args, env, pg_timeout_s, results, stacks):
    os.environ.update(env)
    # MASTER_ADDR stays the caller's when given (ranks in network namespaces reach rank 0 at an
    # address the benchmark assigned there); the rest is this launcher's.
    os.environ.update(MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # A compile cache per rank: ranks on one machine otherwise share torch's cache directory,
    # Dynamo's profile-guided shape state (written by one rank while the other compiles)
    # included, and the same model can then compile differently on two ranks.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"ccfx-torch-cache-rank{rank}"))
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a crash in C++ still prints this rank's Python stack
    # The parent asks a rank that does not finish where it is (SIGUSR1), before killing it.
    stack_file = open(stacks, "w")  # noqa: SIM115 (open for the life of the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(int(env.get("CCFX_RANK_THREADS", "1")))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        out = fn(rank, world_size, *args)
        # Pickled here, by value: a tensor put on the queue as is travels as a shared-memory
        # handle, which is gone once this process exits.
        results.put((rank, "ok", pickle.dumps(out), time.time()))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises)
        # The time of the error, taken before this rank tears its process group down (which
        # fails its peers' collectives): the earliest error is the cause, the others follow.
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}",
                     time.time()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 (already reporting the rank's result)
                pass


def spawn(fn: Callable[..., Any], world_size: int, args: Sequence = (), *,
          timeout_s: float = 300.0, grace_s: float = 10.0, pg_timeout_s: float = 60.0,
          env: dict[str, str] | None = None,
          prefix: Sequence[str] | Callable[[int], Sequence[str]] = (),
          rank_env: Callable[[int], dict[str, str]] | None = None,
          watch: Callable[[], str | None] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their return values,
    in rank order. ``fn`` and ``args`` must be picklable (a module-level function).
    ``pg_timeout_s`` bounds every collective of the default group; ``env`` is added to each
    rank's environment (``CCFX_RANK_THREADS``: torch threads per rank, default 1).
    ``prefix``: a command each rank's Python is started under (``["ip", "netns", "exec",
    name]``: a process joins a network namespace only when it starts), or a function of the rank
    giving each its own (ranks of two "nodes" in two namespaces). ``rank_env``: a function of
    the rank giving environment entries for that rank alone (on top of ``env``; a
    ``MASTER_ADDR`` there replaces 127.0.0.1). ``watch``: called about
    once a second while no rank has failed; a string it returns stops the ranks and raises
    :class:`RankTimeout` with it (a benchmark's check that its ranks still make progress)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    tmp = tempfile.TemporaryDirectory(prefix="ccfx-ranks-")
    stacks = [os.path.join(tmp.name, f"rank{r}.stack") for r in range(world_size)]
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(fn, r, world_size, port, tuple(args),
                               {**(env or {}), **(rank_env(r) if rank_env else {})},
                               pg_timeout_s, results, stacks[r]))
             for r in range(world_size)]
    _start_ranks(ctx, procs, prefix, tmp.name)
    done: dict[int, Any] = {}
    errors: dict[int, tuple[float, str]] = {}  # rank → (when it failed, why)
    stopped = None
    try:
        stopped = _collect_results(procs, results, done, errors, timeout_s, grace_s, watch)
    finally:
        where = _stop(procs, stacks, errors, done, world_size)
        tmp.cleanup()
    if errors:
        raise RankFailed(_failure_message(errors, done, world_size, where), done,
                         rank=min(errors, key=lambda r: errors[r][0]))
    if len(done) < world_size:
        missing = sorted(set(range(world_size)) - set(done))
        why = stopped or (f"did not finish within {timeout_s:.0f} s (finished: {sorted(done)}); "
                          "a rank is stuck in a collective or compile")
        raise RankTimeout(f"ranks {missing} of {world_size} {why}"
                          + "".join(f"\n  rank {r} was at:\n{where[r]}" for r in sorted(where)))
    return [done[r] for r in range(world_size)]


def _start_ranks(ctx, procs: list, prefix: Sequence[str] | Callable[[int], Sequence[str]],
                 tmp_dir: str) -> None:
    """Start each rank's process, under its ``prefix`` command where it has one (a script
    in ``tmp_dir`` that execs Python under it, as multiprocessing's "executable")."""
    from multiprocessing import resource_tracker
    from multiprocessing import spawn as mp_spawn

    executable = mp_spawn.get_executable()
    prefix_of = prefix if callable(prefix) else (lambda r: prefix)
    try:
        for r, p in enumerate(procs):
            # multiprocessing starts its "executable": a script that execs Python under prefix
            rank_prefix = list(prefix_of(r))
            if rank_prefix:
                resource_tracker.ensure_running()  # started now, outside the prefix
                python = os.path.join(tmp_dir, f"python{r}")
                with open(python, "w") as f:
                    f.write(f"#!/bin/sh\nexec {shlex.join([*rank_prefix, os.fsdecode(executable)])}"
                            ' "$@"\n')
                os.chmod(python, 0o755)
                ctx.set_executable(python)
            p.start()
            ctx.set_executable(executable)
    finally:
        ctx.set_executable(executable)


def _collect_results(procs: list, results, done: dict[int, Any],
                     errors: dict[int, tuple[float, str]], timeout_s: float, grace_s: float,
                     watch: Callable[[], str | None] | None) -> str | None:
    """Take the ranks' results into ``done`` and ``errors`` until every rank reported, the
    time is up (``grace_s`` after a first failure) or ``watch`` says stop (its reason)."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout_s
    exited: dict[int, float] = {}
    watched, stopped = time.monotonic(), None
    while len(done) + len(errors) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if watch is not None and not errors and time.monotonic() - watched >= 1.0:
            watched, stopped = time.monotonic(), watch()
            if stopped:
                break
        try:
            rank, status, value, when = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            if _note_silent_exits(procs, done, errors, exited):
                deadline = min(deadline, time.monotonic() + grace_s)
            continue
        if status == "ok":
            done[rank] = pickle.loads(value)
        else:
            errors[rank] = (when, value)
            # the other ranks get grace_s to report their own errors (or finish)
            deadline = min(deadline, time.monotonic() + grace_s)
    return stopped


def _note_silent_exits(procs: list, done: dict[int, Any], errors: dict[int, tuple[float, str]],
                       exited: dict[int, float]) -> bool:
    """Record as an error each rank whose process ended over 2 s ago without reporting (a
    result may still be in flight a moment after its process ends); whether one was."""
    now = time.monotonic()
    for r, p in enumerate(procs):
        if r not in done and r not in errors and not p.is_alive():
            exited.setdefault(r, now)
    failed = False
    for r, t in exited.items():
        if r not in done and r not in errors and now - t > 2.0:
            errors[r] = (time.time() - (now - t), (
                f"process exited with code {procs[r].exitcode} without reporting "
                "(killed, or crashed in C++: its stderr has the stack)"))
            failed = True
    return failed


def _stop(procs, stacks: list[str], errors, done, world_size: int) -> dict[int, str]:
    """Join every rank; ask those still running where they are (their Python stacks, the
    innermost frames of the main thread), then kill them."""
    for p in procs:
        p.join(timeout=0.5 if errors or len(done) < world_size else 5)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    if alive:
        time.sleep(1.0)
    where = {}
    for r in alive:
        where[r] = _innermost(stacks[r])
        procs[r].kill()
        procs[r].join(timeout=5)
    return where


def _innermost(path: str, frames: int = 8) -> str:
    """The main thread's innermost ``frames`` frames from a faulthandler dump."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "    (no stack: the rank did not answer)"
    # the signal may land on a C++ thread (gloo's): the main thread is the one running _child
    blocks = [b for b in text.split("\n\n") if b.strip()]
    main = next((b for b in blocks if "in _child" in b),
                max(blocks, key=lambda b: b.count("File"), default=""))
    lines = [ln for ln in main.splitlines() if ln.strip().startswith("File")][:frames]
    return "\n".join(f"    {ln.strip()}" for ln in lines) or "    (no stack: the rank did not answer)"


def _failure_message(errors: dict[int, tuple[float, str]], done: dict[int, Any],
                     world_size: int, where: dict[int, str] | None = None) -> str:
    """The earliest error in full (the cause: a rank that fails tears down its connections,
    and its peers' collectives then fail too), then one line for every other rank."""
    first = min(errors, key=lambda r: errors[r][0])
    lines = [f"rank {first} of {world_size} failed first:"]
    for r in sorted(set(range(world_size)) - {first}):
        if r in errors:
            why = first_line(errors[r][1])
            lines.append(f"  rank {r} failed {errors[r][0] - errors[first][0]:.1f} s later: "
                         f"{why[:300]}")
        elif r not in done:
            at = (where or {}).get(r)
            lines.append(f"  rank {r} did not finish (stopped with it)"
                         + (f"; it was at (innermost first):\n{at}" if at else ""))
    return "\n".join(lines) + f"\n{errors[first][1]}"
