"""Replicas for tests/test_elastic.py and the small launcher that starts, kills and restarts them.

Why not tests/ranks.py: its ranks form one torch.distributed world that lives and dies
together (a rank that dies fails the spawn). Fault-tolerant replicas are separate torchft
replica groups, each its own process with its own store, meeting only through the lighthouse;
the test must SIGKILL one and start it again while the others train on. So each replica here
is a plain ``spawn``-ed process that reports what it does on a queue as it goes (its rows
arrive even if it is killed later), and the parent (:class:`Replicas`) decides when to kill,
restart and stop, bounded by a deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
from torch import nn

from . import ranks

#: Local-step options every replica of the tests uses (int8 with error feedback: a residual
#: per replica, so recovery's handling of codec state is exercised).
OPTIONS = {"sync_every": 2, "outer_codec": "int8:ef", "compress_min_numel": 0,
           "collective_timeout_s": 10.0}
#: The kill-and-restart scenario streams two fragments (one syncs at inner steps 2, 6, ...,
#: the other at 4, 8, ...): a replica that heals must sync the fragment its peers sync then.
STREAMED = {**OPTIONS, "sync_every": 4, "fragments": 2}


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def replica(name: str, seed: int, lighthouse: str, options: dict, stop_at, events,
            step_sleep_s: float) -> None:
    """One replica: trains until its torchft step reaches ``stop_at.value`` (a shared int the
    parent sets), reporting ("sync", name, row, digest of the global parameters) after every
    sync and ("done" | "error", name, ...) at the end. The model starts from ``seed``: a
    replica that joins must take the others' parameters, not its own."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    torch.set_num_threads(1)
    import ccfx

    try:
        model = mlp(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        started = time.monotonic()
        outer = ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse,
                                 replica_id=name, min_replicas=1, quorum_timeout_s=20.0,
                                 max_retries=5, **options)
        seen = 0

        def report():
            nonlocal seen
            rows = outer.elastic.history[seen:]
            for i, row in enumerate(rows):  # the parameters now are those after the last row
                digest = (ranks.digest(outer.global_parameters().values())
                          if i == len(rows) - 1 else None)
                events.put(("sync", name, {**row, "since_start": time.monotonic() - started},
                            digest))
            seen = len(outer.elastic.history)

        report()
        events.put(("fingerprint", name, outer.elastic.fingerprint, None))
        steps = train(model, opt, outer, lambda i: _batch(seed, i), stop_at, report,
                      step_sleep_s)
        events.put(("done", name, {"steps": steps}, None))
    except Exception as e:  # noqa: BLE001 (the test asserts on the type and message)
        events.put(("error", name, f"{type(e).__name__}: {e}", None))


def train(model, opt, outer, batch, stop_at, report, step_sleep_s: float) -> int:
    """Inner steps on ``batch(i)`` until the torchft step reaches ``stop_at`` (at most 2000),
    ``report()`` after each; closes ``outer`` and returns the steps taken."""
    i = 0
    while outer.elastic.manager.current_step() < stop_at.value and i < 2000:
        x, y = batch(i)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        report()
        i += 1
        time.sleep(step_sleep_s)
    outer.close()
    return i


def _batch(seed: int, step: int):
    g = ranks.rng(seed, step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


class Replicas:
    """The parent side: start replicas, collect their events, kill and restart them. A
    subclass runs another replica function by setting ``replica`` and ``default_options``."""

    replica = staticmethod(replica)
    default_options = STREAMED

    def __init__(self, lighthouse: str, deadline_s: float, step_sleep_s: float = 0.02):
        self.ctx = mp.get_context("spawn")
        self.lighthouse = lighthouse
        # A queue per replica: a replica SIGKILLed while writing to a shared queue would leave
        # its lock held and silence every other replica.
        self.queues: dict[str, object] = {}
        self.stop_at = self.ctx.Value("i", 10**9)
        self.procs: dict[str, mp.Process] = {}
        self.syncs: dict[str, list[tuple[dict, str]]] = {}  # name -> [(row, digest)]
        self.ends: dict[str, tuple[str, object]] = {}
        self.fingerprints: dict[str, str] = {}
        self.may_fail: set[str] = set()
        self.deadline = time.monotonic() + deadline_s
        self.step_sleep_s = step_sleep_s

    def start(self, name: str, seed: int, options: dict | None = None,
              may_fail: bool = False) -> None:
        """Start replica ``name``; one that ``may_fail`` (the test expects its error) does not
        stop the waits."""
        if may_fail:
            self.may_fail.add(name)
        self.queues[name] = self.ctx.Queue()
        p = self.ctx.Process(target=self.replica, args=(
            name, seed, self.lighthouse, options or self.default_options, self.stop_at,
            self.queues[name],
            self.step_sleep_s), daemon=True)
        p.start()
        self.procs[name] = p
        self.ends.pop(name, None)

    def kill(self, name: str) -> None:
        """SIGKILL ``name``; its queue is dropped unread (a message cut in half would block)."""
        self.pump()
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.queues.pop(name)
        self.procs[name].join(10)
        self.ends[name] = ("killed", None)

    def pump(self, idle_s: float = 0.1) -> None:
        got = False
        for q in list(self.queues.values()):
            try:
                while True:
                    kind, name, data, digest = q.get_nowait()
                    got = True
                    if kind == "sync":
                        self.syncs.setdefault(name, []).append((data, digest))
                    elif kind == "fingerprint":
                        self.fingerprints[name] = data
                    else:
                        self.ends[name] = (kind, data)
            except queue.Empty:
                pass
        if not got:
            time.sleep(idle_s)

    def wait_for(self, what: str, cond) -> None:
        """Pump events until ``cond()``; AssertionError naming ``what`` past the deadline."""
        while not cond():
            if time.monotonic() > self.deadline:
                raise AssertionError(f"timed out waiting for {what}; ends {self.ends}")
            errors = {n: e for n, e in self.ends.items()
                      if e[0] == "error" and n not in self.may_fail}
            if errors:
                raise AssertionError(f"a replica failed while waiting for {what}: {errors}")
            self.pump()

    def committed(self, name: str, replicas: int | None = None, after: int = 0) -> int:
        return sum(1 for row, _ in self.syncs.get(name, [])[after:] if row["committed"]
                   and (replicas is None or row["replicas"] == replicas))

    def torchft_step(self) -> int:
        return max((row["torchft_step"] for rows in self.syncs.values() for row, _ in rows),
                   default=0)

    def stop(self, names) -> None:
        """Every replica in ``names`` stops after the same torchft step, a few ahead."""
        self.stop_at.value = self.torchft_step() + 3
        self.wait_for("the replicas to stop", lambda: all(n in self.ends for n in names))

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)


def lighthouse_process(port: int, join_timeout_ms: int = 3000) -> subprocess.Popen:
    """A ``torchft_lighthouse`` process (the binary torchft installs beside this Python) on
    127.0.0.1:``port``, listening when this returns: unlike the in-process ``LighthouseServer``
    a test can SIGKILL it and start another on the same port. ``join_timeout_ms`` well above
    a step: the replicas coming back from an outage all make its first quorum."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    exe = exe if os.path.exists(exe) else shutil.which("torchft_lighthouse")
    proc = subprocess.Popen([exe, "--bind", f"127.0.0.1:{port}", "--min_replicas", "2",
                             "--join_timeout_ms", str(join_timeout_ms), "--quorum_tick_ms", "20",
                             "--heartbeat_timeout_ms", "1000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"torchft_lighthouse did not listen on port {port} within 60 s "
                         f"(exit code {proc.poll()})")


# -- replicas as threads of the test process (no spawn: the cheap scenarios) ----------------------


def in_threads(fns, timeout_s: float) -> list:
    """Run each ``fn()`` in its own thread (replicas of one process: each its own torchft
    Manager); their results, or the first error raised. A thread still running after
    ``timeout_s`` is an AssertionError."""
    import threading

    results: list = [None] * len(fns)
    errors: list = []

    def run(k):
        try:
            results[k] = fns[k]()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"replica threads still running after {timeout_s} s"
    return results


def loss_of(model, seed: int, step: int) -> torch.Tensor:
    x, y = _batch(seed, step)
    return nn.functional.mse_loss(model(x), y)


def weighted_replica(k: int, lighthouse: str, tokens: int, steps: int) -> dict:
    """Replica ``k`` reports ``tokens`` per step; codec none, outer SGD lr 1 without momentum:
    the global parameters after a sync are the token-weighted mean of the replicas'."""
    import ccfx

    model = mlp(k)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse,
                             replica_id=f"w{k}", quorum_timeout_s=20.0, sync_every=steps,
                             outer_codec="none", outer_lr=1.0, outer_momentum=0.0)
    start = {n: g.clone() for n, g in outer.global_parameters().items()}
    for i in range(steps):
        loss_of(model, k, i).backward()
        outer.add_tokens(tokens)  # before opt.step(): the step that syncs counts them
        opt.step()
        opt.zero_grad()
    out = {"start": start, "global": {n: g.clone() for n, g in outer.global_parameters().items()},
           "history": list(outer.elastic.history)}
    outer.close()
    return out


def failing_replica(k: int, lighthouse: str, fail_at: int, steps: int) -> dict:
    """Replica ``k``; if ``fail_at`` > 0 its exchange raises at that inner step (before any
    collective of the exchange). Per sync: the global parameters' digest and the codec state's
    digest before and after."""
    import ccfx

    model = mlp(k)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse,
                             replica_id=f"f{k}", quorum_timeout_s=20.0, max_retries=2,
                             **{**OPTIONS, "collective_timeout_s": 20.0})
    exchange = outer.elastic._exchange

    def maybe_failing(frag, scale, comm):
        if outer.step == fail_at:
            raise RuntimeError("injected: this replica's exchange failed")
        return exchange(frag, scale, comm)

    outer.elastic._exchange = maybe_failing
    rows = []
    for i in range(steps):
        before = (ranks.digest(outer.global_parameters().values()),
                  ranks.digest(outer._codec_state().values()))
        loss_of(model, k, i).backward()
        opt.step()
        opt.zero_grad()
        after = (ranks.digest(outer.global_parameters().values()),
                 ranks.digest(outer._codec_state().values()))
        rows.append({"step": outer.step, "before": before, "after": after})
    out = {"rows": rows, "history": list(outer.elastic.history)}
    outer.close()
    return out


def codec_replica(k: int, lighthouse: str, codec: str, steps: int) -> dict:
    """Replica ``k`` of an ``outer_codec=codec`` run: per committed sync the global
    parameters' digest, and the history (which collectives ran)."""
    import ccfx

    model = mlp(k)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse,
                             replica_id=f"c{k}", quorum_timeout_s=20.0,
                             **{**OPTIONS, "outer_codec": codec})
    digests = []
    for i in range(steps):
        loss_of(model, k, i).backward()
        opt.step()
        opt.zero_grad()
        if outer.step % outer.sync_every == 0:
            digests.append(ranks.digest(outer.global_parameters().values()))
    out = {"digests": digests, "history": list(outer.elastic.history),
           "wire": outer.wire_bytes, "raw": outer.raw_bytes}
    outer.close()
    return out


def straggler_replica(k: int, lighthouse: str, delay_s: float, stop_at: int,
                      step_s: float = 0.6, start=None, finished=None,
                      all_done=None) -> list[dict]:
    """Replica ``k``, sync every 2 steps, a step every ``step_s``, trains until its torchft
    step reaches ``stop_at``; it sleeps ``delay_s`` more before its step 2 (the first sync
    after the join): a straggler. ``start``: a barrier the replicas pass together before they
    join (a replica built late on a loaded machine would otherwise miss the join quorum and
    shift every later sync). ``finished``: an event the first replica to reach ``stop_at`` sets;
    a replica one sync behind then finds no quorum at its last sync, the run's end rather than
    a failure. ``all_done``: a barrier every replica passes before it closes, so that a peer
    that finished keeps serving a heal the straggler is still fetching from it (closed, its
    source would fail that heal, uncommitted: seen under load when the heal came at the last
    sync). Its sync rows."""
    import ccfx

    model = mlp(k)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if start is not None:
        start.wait(timeout=30)

    def leave():
        if all_done is not None:
            try:
                all_done.wait(timeout=60)
            except threading.BrokenBarrierError:
                pass  # a peer failed: its own error says why

    outer = ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse,
                             replica_id=f"s{k}", quorum_timeout_s=8.0, **OPTIONS)
    i = 0
    while outer.elastic.manager.current_step() < stop_at and i < 50:
        if finished is not None and finished.is_set():
            break  # its peers stopped: a sync now would wait out quorum_timeout_s for nothing
        loss_of(model, k, i).backward()
        time.sleep(step_s + (delay_s if i == 1 else 0.0))
        try:
            opt.step()
        except ccfx.CollectiveError:
            if finished is None or not finished.is_set():
                raise
            leave()
            return list(outer.elastic.history)  # its peers stopped: the run is over
        opt.zero_grad()
        i += 1
    if finished is not None:
        finished.set()
    rows = list(outer.elastic.history)
    leave()
    outer.close()
    return rows


def late_joiner_replica(k: int, lighthouse: str, start_after_s: float, step_s: float,
                        stop_at: int, finished) -> list[tuple[dict, str]]:
    """Replica ``k`` of the lazy-heal scenario: it starts ``start_after_s`` late, takes an
    inner step every ``step_s`` and trains until its torchft step reaches ``stop_at`` (or a
    peer got there: ``finished``). Its sync rows, each with the digest of the global
    parameters after it (None for a row that the same inner step's call followed with
    another: a heal that spanned several syncs merges them all at its end)."""
    import ccfx

    model = mlp(k)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    time.sleep(start_after_s)
    outer = ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse,
                             replica_id=f"j{k}", quorum_timeout_s=20.0, max_retries=5,
                             **{**OPTIONS, "sync_every": 4, "collective_timeout_s": 20.0})
    out, seen = [], 0

    def report():
        nonlocal seen
        rows = outer.elastic.history[seen:]  # the parameters now are those after the last
        digest = ranks.digest(outer.global_parameters().values())
        out.extend((row, digest if i == len(rows) - 1 else None) for i, row in enumerate(rows))
        seen = len(outer.elastic.history)

    report()
    i = 0
    while outer.elastic.manager.current_step() < stop_at and not finished.is_set() and i < 60:
        loss_of(model, k, i).backward()
        time.sleep(step_s)
        if not stepped(opt, finished):
            break
        report()
        i += 1
    finished.set()
    outer.close()
    return out


def stepped(opt, finished) -> bool:
    """``opt.step()`` (a sync when one is due) and ``zero_grad``; False when that sync failed
    because a peer has already finished (``finished`` is set): the run is over, not broken."""
    import ccfx

    try:
        opt.step()
    except ccfx.CollectiveError:
        if not finished.is_set():
            raise
        return False
    opt.zero_grad()
    return True


def spare_scenario_replica(k: int, lighthouse: str, spare: bool, step_s: float,
                           die_at: int | None, stop_at: int, finished) -> dict:
    """Replica ``k`` of the hot-spare scenario (two training places, a sync every 6 inner
    steps): a trainer claims place ``k``; a spare (started 2 s late, so the trainers hold both
    places) blocks in ``local_steps`` until a place is free. A replica with ``die_at`` dies an
    inner step after its torchft step reaches it, mid-interval: its ``/alive`` streams end
    with no goodbye and its manager stops, what a SIGKILL does to a process. The others train
    until ``stop_at`` (or a peer got there: ``finished``). Its sync rows, each with the digest
    of the global parameters after it (None where a later row of the same call followed), and
    when ``local_steps`` returned (the spare: when it took a place) and which place."""
    import ccfx

    model = mlp(k)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if spare:
        time.sleep(2.0)
    outer = ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse,
                             replica_id=f"p{k}", quorum_timeout_s=20.0, max_retries=5,
                             trainers=2, slot=None if spare else k,
                             **{**OPTIONS, "sync_every": 6, "collective_timeout_s": 20.0})
    out = {"rows": [], "placed_at": time.monotonic(), "slot": outer.slot, "died_at": None}
    seen = 0

    def report():
        nonlocal seen
        rows = outer.elastic.history[seen:]
        digest = ranks.digest(outer.global_parameters().values())
        out["rows"].extend((row, digest if i == len(rows) - 1 else None)
                           for i, row in enumerate(rows))
        seen = len(outer.elastic.history)

    report()
    i, doomed = 0, None
    while not finished.is_set() and i < 120:
        step = outer.elastic.manager.current_step()
        if step >= stop_at:
            break
        if die_at is not None and step >= die_at:
            doomed = i + 1 if doomed is None else doomed
            if i >= doomed:
                out["died_at"] = time.monotonic()
                outer.elastic._transport.sever()
                break
        loss_of(model, 10 + (outer.slot or 0), i).backward()  # the place's data, not k's
        time.sleep(step_s)
        if not stepped(opt, finished):
            break
        report()
        i += 1
    if outer.elastic.manager.current_step() >= stop_at:
        finished.set()
    outer.close()
    return out


_SEEDING = threading.Lock()


def same_start_replica(k: int, lighthouse: str, seed: int, start_after_s: float, steps: int,
                       finished) -> dict | str:
    """Replica ``k`` with ``init_sync=False`` built from ``seed``; it starts ``start_after_s``
    late and takes ``steps`` inner steps (0.2 s each, a sync every 2), or stops when a peer has
    finished. Its sync rows with the digest after each, or the ConfigError's message."""
    import ccfx

    with _SEEDING:  # threads share torch's global generator: built one at a time, alike
        model = mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    time.sleep(start_after_s)
    try:
        outer = ccfx.local_steps(model, opt, fault_tolerant=True, lighthouse=lighthouse,
                                 replica_id=f"i{k}", quorum_timeout_s=20.0, max_retries=5,
                                 init_sync=False, **{**OPTIONS, "collective_timeout_s": 20.0})
    except ccfx.ConfigError as e:
        return str(e)
    rows = []

    def report():
        rows.extend((row, ranks.digest(outer.global_parameters().values()))
                    for row in outer.elastic.history[len(rows):])

    report()
    for i in range(steps):
        if finished.is_set():
            break
        loss_of(model, k, i).backward()
        time.sleep(0.2)
        if not stepped(opt, finished):
            break
        report()
    finished.set()
    outer.close()
    return {"rows": rows}
