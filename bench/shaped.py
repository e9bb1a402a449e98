"""Run N gloo ranks on a loopback whose bandwidth is limited for real (Linux tc tbf).

    with shaped_namespace(100) as ns:                     # 100 Mbit/s on a fresh loopback
        results = run_ranks("bench.data_parallel", "train_rank", 2, {"variant": "ddp"},
                            netns=ns, timeout_s=300)      # one JSON dict per rank

Why a network namespace: the benchmarks need a slow link without touching the machine's own
loopback (other jobs use it). A fresh namespace has its own ``lo``; a token-bucket filter on it
limits every byte the ranks exchange on 127.0.0.1 (both directions share it). DESIGN.md
("Verified facts about the toolchain") has the recipe and the check: a socket measured
201 Mbit/s at ``rate 200mbit``. ``rate_mbit=None`` still makes a fresh namespace, unshaped, so
every variant of a benchmark runs the same way.

Why OS processes launched with ``ip netns exec`` (not multiprocessing): a process joins a
namespace at exec time; each rank is ``python -m bench.shaped --worker ...``, which initialises
the gloo group, calls ``func(rank, world_size, **args)`` of an importable module and writes its
JSON result to a file of its own (stdout stays free for logs). The parent enforces a deadline,
kills every rank on failure, timeout or Ctrl-C, and raises with the failing rank's traceback.

``python -m bench.shaped --selftest`` measures socket throughput between two ranks, shaped and
unshaped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NS_PREFIX = "ccfx-"
_ns_counter = itertools.count()


class ShapingUnavailable(RuntimeError):
    """The machine cannot make a shaped namespace; the message says what is missing."""


class RankFailed(RuntimeError):
    """A rank exited with an error. ``rank`` failed first; ``reason`` is one line, ``details``
    holds its traceback (or the tail of its log when it died without one, e.g. a C++ abort)."""

    def __init__(self, rank: int, reason: str, details: str):
        super().__init__(f"rank {rank} failed: {reason}\n{details}")
        self.rank, self.reason, self.details = rank, reason, details


class RankTimeout(RuntimeError):
    """Some ranks did not finish within the deadline, or stopped making progress (all were
    killed). ``reason`` is one line (which ranks, the last progress line, the innermost frame
    of each stuck thread); ``details`` holds their log tails with every thread's stack."""

    def __init__(self, reason: str, details: str):
        super().__init__(f"{reason}\n{details}")
        self.reason, self.details = reason, details


# ---------------------------------------------------------------------------------------------
# The namespace.


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True)


def _check_tools(need_tc: bool) -> None:
    """Fail early, with the fix, instead of a cryptic error from ``ip`` half-way through."""
    if os.geteuid() != 0:
        raise ShapingUnavailable(
            "network namespaces and tc need root: run the benchmark as root (e.g. `sudo "
            f"{sys.executable} -m ...`), or in a container with CAP_NET_ADMIN and CAP_SYS_ADMIN")
    missing = [t for t in (["ip", "tc"] if need_tc else ["ip"]) if shutil.which(t) is None]
    if missing:
        raise ShapingUnavailable(
            f"{' and '.join(missing)} not found on PATH: install iproute2 "
            "(`apt-get install iproute2`)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete ``ccfx-<pid>-<n>`` namespaces whose creating process is gone (a run that was
    SIGKILLed cannot clean up after itself); returns the names removed."""
    out = _run(["ip", "netns", "list"]).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(re.escape(NS_PREFIX) + r"(\d+)-\d+", name)
        if m and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", name])
            removed.append(name)
    return removed


@contextlib.contextmanager
def shaped_namespace(rate_mbit: float | None, burst: str = "256kb",
                     latency: str = "50ms") -> Iterator[str]:
    """A fresh network namespace with ``lo`` up, limited to ``rate_mbit`` Mbit/s by a tbf qdisc
    (``None``: unshaped); yields its name and always deletes it on exit (errors, Ctrl-C).

    ``burst``/``latency`` are tbf's: the bucket size (256 kB lets a TCP window through without
    stalling the shaper) and how long a packet may queue before it is dropped."""
    _check_tools(need_tc=rate_mbit is not None)
    remove_stale_namespaces()
    name = f"{NS_PREFIX}{os.getpid()}-{next(_ns_counter)}"
    made = _run(["ip", "netns", "add", name])
    if made.returncode != 0:
        raise ShapingUnavailable(
            f"`ip netns add {name}` failed: {made.stderr.strip()}. Network namespaces need root "
            "with CAP_SYS_ADMIN (a container may need --privileged or --cap-add SYS_ADMIN "
            "NET_ADMIN) and a writable /run/netns")
    try:
        steps = [["ip", "-n", name, "link", "set", "lo", "up"]]
        if rate_mbit is not None:
            steps.append(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "tbf",
                          "rate", f"{rate_mbit:g}mbit", "burst", burst, "latency", latency])
        for cmd in steps:
            r = _run(cmd)
            if r.returncode != 0:
                raise ShapingUnavailable(
                    f"`{' '.join(cmd)}` failed: {r.stderr.strip()}. The tbf qdisc needs the "
                    "sch_tbf kernel module (`modprobe sch_tbf`) and CAP_NET_ADMIN")
        yield name
    finally:
        _run(["ip", "netns", "del", name])


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so that ``finally`` blocks (namespace deletion, killing the
    ranks) run when a benchmark is stopped by ``kill`` or a timeout, not only by Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


# ---------------------------------------------------------------------------------------------
# Launching ranks.


def free_port() -> int:
    """A TCP port free on this host. Inside a fresh namespace every port is free; this one is
    also free outside it, so ``netns=None`` runs work the same way."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world_size: int, port: int, threads: int,
              extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               CCFX_RANK_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def short_reason(text: str) -> str | None:
    """One line out of a traceback or a C++ abort message, the line worth putting in a table
    (None when there is none): a gloo/c10 enforce message (``what(): ...``), else the last
    ``SomeError: ...`` line, without source paths and DDP's per-future wrapping."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = next((ln.split("what():", 1)[1] for ln in reversed(lines) if "what():" in ln), None)
    if found is None:
        found = next((ln for ln in reversed(lines) if re.match(
            r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Failed|Timeout)\b", ln)), None)
    if found is None:
        return None
    # DDP's reducer wraps a hook's error once per future: keep the innermost one.
    found = re.sub(r"^(\w+Error: Got the following error when running the callback: )+", "",
                   found.strip())
    found = re.sub(r"\[(enforce fail at )?/[^\]]*\]\s*", "", found)  # [/src/pair.cc:537]
    return found[:200]


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each rank's process group (the rank and anything it started), then reap."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


def _failure(rank: int, code: int, out: Path, log: Path) -> RankFailed:
    """The RankFailed of a rank that exited with ``code``: its own traceback when it wrote one,
    else the tail of its log (gloo aborts the process from C++ without a Python traceback)."""
    details = ""
    with contextlib.suppress(OSError, ValueError):
        details = json.loads(out.read_text()).get("error", "")
    if details:
        return RankFailed(rank, short_reason(details) or "raised", details)
    how = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
    details = f"({how}, no Python traceback; log tail:)\n{_tail(log)}"
    reason = short_reason(details)
    return RankFailed(rank, f"{reason} ({how})" if reason else how, details)


_PEER_GONE = re.compile(r"Connection (reset|closed) by peer|Broken pipe|peer.*(closed|gone)",
                        re.IGNORECASE)


def _root_cause(failures: list[RankFailed]) -> RankFailed:
    """The failure to report when several ranks failed: a rank whose own error is "my peer went
    away" is a consequence, so prefer one that failed for another reason, then the lowest rank;
    the others are appended to its details."""
    first = min(failures, key=lambda f: (bool(_PEER_GONE.search(f.reason)), f.rank))
    others = "".join(f"\n(rank {f.rank} also failed: {f.reason})" for f in failures
                     if f is not first)
    return RankFailed(first.rank, first.reason, first.details + others) if others else first


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _hung_report(procs, logs, missing: list[int]) -> tuple[str, str]:
    """(the log tails of the ranks that did not finish, where they are stuck in one line),
    after asking each for the Python stack of every thread (the worker registers faulthandler
    on SIGUSR1)."""
    for r in missing:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    tails = {r: _tail(logs[r], 200) for r in missing}  # stacks are printed innermost first
    frames: list[str] = []
    for text in tails.values():
        # The innermost frame of each thread: the first "File" line after a thread header.
        for m in re.finditer(r"[Tt]hread 0x[0-9a-f]+ \(most recent call first\):\n"
                             r"\s*File \"([^\"]+)\", line (\d+) in (\S+)", text):
            frame = f"{Path(m.group(1)).name}:{m.group(2)} {m.group(3)}"
            if frame not in frames:
                frames.append(frame)
    report = "\n".join(f"--- rank {r} log tail ---\n{t}" for r, t in tails.items())
    return report, ", ".join(frames)


def _wait_all(procs, outs, logs, timeout_s: float, grace_s: float,
              stall_s: float | None) -> None:
    """Wait until every rank exited 0. After the first failure, give the others ``grace_s``
    (they are usually blocked in a collective with the dead rank and fail or finish soon), then
    raise the root cause. With no failure, raise RankTimeout past ``timeout_s``, or as soon as
    no rank's log has grown for ``stall_s`` (ranks that print progress: a hang shows early)."""
    start = time.monotonic()
    deadline = start + timeout_s
    failing = False
    sizes, grew = [0] * len(procs), start
    stalled = False
    while True:
        codes = [p.poll() for p in procs]
        if not failing and any(c not in (None, 0) for c in codes):
            failing = True
            deadline = min(deadline, time.monotonic() + grace_s)
        if all(c is not None for c in codes) or time.monotonic() > deadline:
            break
        now_sizes = [_log_size(lg) for lg in logs]
        if now_sizes != sizes:
            sizes, grew = now_sizes, time.monotonic()
        elif not failing and stall_s is not None and time.monotonic() - grew > stall_s:
            stalled = True
            break
        time.sleep(0.05)
    failures = [_failure(r, c, outs[r], logs[r]) for r, c in enumerate(codes) if c not in (None, 0)]
    if failures:
        raise _root_cause(failures)
    missing = [r for r, c in enumerate(codes) if c is None]
    if missing:
        why = (f"hung: no output for {stall_s:.0f} s" if stalled else
               f"did not finish within {timeout_s:.0f} s (stuck in a collective or a compile? "
               "raise the timeout if the link is just slow)")
        elapsed = time.monotonic() - start
        report, where = _hung_report(procs, logs, missing)
        last = [ln for ln in _tail(logs[missing[0]], 200).splitlines()
                if ln.startswith("[rank ")]  # the progress lines of bench workers
        reason = (f"ranks {missing} of {len(procs)} {why}, {elapsed:.0f} s in"
                  + (f", after {last[-1].split('] ', 1)[-1]!r}" if last else "")
                  + (f"; stuck in {where}" if where else ""))
        raise RankTimeout(reason, report)


def run_ranks(module: str, func: str, world_size: int, args_json: dict, *, netns: str | None,
              timeout_s: float, threads_per_rank: int = 1, env: dict[str, str] | None = None,
              grace_s: float = 10.0, stall_s: float | None = None) -> list[dict]:
    """Run ``module.func(rank, world_size, **args_json)`` on ``world_size`` gloo ranks, each an
    OS process (inside ``netns`` when given), and return their JSON results in rank order.

    Every rank gets RANK/WORLD_SIZE/MASTER_ADDR=127.0.0.1/MASTER_PORT, ``threads_per_rank``
    torch threads, cwd = the repository root, and ``env`` on top of the parent's environment.
    Raises RankFailed (the first failing rank's traceback) or RankTimeout (naming the ranks
    that had not finished after ``timeout_s``, or, with ``stall_s``, as soon as no rank has
    written to stdout/stderr for that long), with the stuck ranks' Python stacks; all ranks
    are killed in every case."""
    port = free_port()
    prefix = ["ip", "netns", "exec", netns] if netns else []
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="ccfx-ranks-") as tmp:
        args_file = Path(tmp, "args.json")
        args_file.write_text(json.dumps(args_json))
        outs = [Path(tmp, f"rank{r}.json") for r in range(world_size)]
        logs = [Path(tmp, f"rank{r}.log") for r in range(world_size)]
        try:
            for r in range(world_size):
                cmd = [*prefix, sys.executable, "-m", "bench.shaped", "--worker",
                       "--module", module, "--func", func, "--args", str(args_file),
                       "--out", str(outs[r]), "--pg-timeout", str(timeout_s)]
                with open(logs[r], "wb") as log:
                    procs.append(subprocess.Popen(
                        cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                        env=_rank_env(r, world_size, port, threads_per_rank, env)))
            _wait_all(procs, outs, logs, timeout_s, grace_s, stall_s)
            return [json.loads(o.read_text())["result"] for o in outs]
        finally:
            _kill(procs)


def _worker(module: str, func: str, args_path: str, out_path: str, pg_timeout_s: float) -> int:
    """One rank: join the gloo group, call the function, write {"result": ...} or {"error":
    traceback} to ``out_path`` (written whole, then renamed, so the parent never reads half)."""
    import importlib

    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks where it hangs
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("CCFX_RANK_THREADS", "1")))
    tmp = out_path + ".tmp"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        kwargs = json.loads(Path(args_path).read_text())
        result = getattr(importlib.import_module(module), func)(rank, world, **kwargs)
        payload, code = {"result": result}, 0
    except BaseException:  # noqa: BLE001 (reported to the parent, which raises)
        payload, code = {"error": traceback.format_exc()}, 1
    Path(tmp).write_text(json.dumps(payload))
    os.replace(tmp, out_path)
    sys.stdout.flush()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return code


# ---------------------------------------------------------------------------------------------
# Self-check: socket throughput between two ranks.


def socket_probe(rank: int, world_size: int, nbytes: int) -> dict:
    """Rank 1 sends ``nbytes`` over a plain TCP socket to rank 0 on 127.0.0.1; rank 0 times from
    the first byte to the last. The port is rank 0's, shared through the gloo group."""
    import torch.distributed as dist

    assert world_size == 2, "the socket probe runs on exactly 2 ranks"
    box: list = [None]
    if rank == 0:
        srv = socket.create_server(("127.0.0.1", 0))
        box = [srv.getsockname()[1]]
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        chunk = b"\0" * (1 << 20)
        with socket.create_connection(("127.0.0.1", box[0])) as s:
            left = nbytes
            while left > 0:
                s.sendall(chunk[:min(left, len(chunk))])
                left -= min(left, len(chunk))
        return {"sent": nbytes}
    conn, _ = srv.accept()
    got, t0 = 0, None
    with conn, srv:
        while got < nbytes:
            data = conn.recv(1 << 20)
            if not data:
                break
            t0 = t0 or time.perf_counter()
            got += len(data)
    secs = time.perf_counter() - t0
    return {"received": got, "seconds": secs, "mbit_s": got * 8 / secs / 1e6}


def selftest(rates: list[float | None]) -> None:
    """Print the measured socket throughput at each rate (``None``: unshaped)."""
    for rate in rates:
        # About 2 s of traffic at the shaped rate; unshaped, 1 GB (a fraction of a second).
        nbytes = int(rate * 1e6 / 8 * 2) if rate else 1 << 30
        with shaped_namespace(rate) as ns:
            res = run_ranks("bench.shaped", "socket_probe", 2, {"nbytes": nbytes}, netns=ns,
                            timeout_s=120)
        got = res[0]
        label = f"rate {rate:g}mbit" if rate else "unshaped"
        print(f"{label:>16}: {got['mbit_s']:9.1f} Mbit/s measured "
              f"({got['received'] / 1e6:.0f} MB in {got['seconds']:.2f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--selftest", action="store_true",
                    help="measure socket throughput between two ranks, shaped and unshaped")
    ap.add_argument("--rates", nargs="+", default=["100", "none"],
                    help="selftest rates in Mbit/s; 'none' for unshaped (default: 100 none)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--module", help=argparse.SUPPRESS)
    ap.add_argument("--func", help=argparse.SUPPRESS)
    ap.add_argument("--args", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--pg-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(a.module, a.func, a.args, a.out, a.pg_timeout)
    if a.selftest:
        exit_cleanly_on_sigterm()
        selftest([None if r.lower() == "none" else float(r) for r in a.rates])
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
