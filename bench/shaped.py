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

How ranks start: through ccfx's own launcher (``ccfx.runtime.launch.spawn``, the one the tests
and ``ccfx demo --dp`` use), each rank's Python started under ``ip netns exec`` (a process joins
a namespace only when it starts). Each rank calls ``func(rank, world_size, **args)`` of an
importable module, writes its stdout and stderr to a log of its own (the parent treats a log
that stops growing as a hang, ``stall_s``) and returns a JSON-able result. The parent enforces
a deadline, kills every rank on failure, timeout or Ctrl-C, and raises with the failing rank's
traceback (or its log's tail when it died in C++).

``python -m bench.shaped --selftest`` measures socket throughput between two ranks, shaped and
unshaped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Two "nodes": network namespaces joined by a shaped veth pair (see :func:`two_nodes`).
    ``namespaces[i]`` holds node i's end of the pair, ``interfaces[i]``, at ``addresses[i]``."""

    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    addresses: tuple[str, str]

    def launch(self, node_of_rank: Sequence[int]) -> tuple[list[str], list[dict[str, str]]]:
        """Each rank's namespace and environment when rank r runs on node ``node_of_rank[r]``:
        gloo binds the node's veth address (traffic inside a node then goes over that
        namespace's loopback, fast; across, over the shaped pair) and every rank meets rank
        0's node at its address."""
        master = self.addresses[node_of_rank[0]]
        return ([self.namespaces[n] for n in node_of_rank],
                [{"GLOO_SOCKET_IFNAME": self.interfaces[n], "MASTER_ADDR": master,
                  "TP_SOCKET_IFNAME": self.interfaces[n]} for n in node_of_rank])


def _run_all(steps: list[list[str]], needs: str) -> None:
    """Run each command; the first that fails is a :class:`ShapingUnavailable` quoting it."""
    for cmd in steps:
        r = _run(cmd)
        if r.returncode != 0:
            raise ShapingUnavailable(f"`{' '.join(cmd)}` failed: {r.stderr.strip()} ({needs})")


@contextlib.contextmanager
def two_nodes(rate_mbit: float | None, delay_ms: float = 0.0, burst: str = "64kb",
              latency: str = "400ms") -> Iterator[Nodes]:
    """Two fresh namespaces joined by a veth pair whose every direction is limited to
    ``rate_mbit`` (tbf) and delayed by ``delay_ms`` one way (netem), DESIGN.md's heterogeneous
    harness: ranks of one namespace talk over its own loopback (fast), ranks of different ones
    over the pair. Both are deleted on exit (the veth pair goes with them).

    Measured here at ``rate_mbit=50``: 48.1 Mbit/s across, 34 Gbit/s inside, round trips 0.05 ms.
    ``delay_ms`` needs the kernel's netem qdisc, which these VMs lack ("Specified qdisc kind is
    unknown"): a delay is then a :class:`ShapingUnavailable`, and latency is left to the
    planner's model (``Link.latency_ms``)."""
    _check_tools(need_tc=rate_mbit is not None or delay_ms > 0)
    remove_stale_namespaces()
    k = next(_ns_counter)
    names = (f"{NS_PREFIX}{os.getpid()}-{k}", f"{NS_PREFIX}{os.getpid()}-{next(_ns_counter)}")
    ifaces = (f"cxa{os.getpid() % 100000}{k}"[:15], f"cxb{os.getpid() % 100000}{k}"[:15])
    addrs = (f"10.77.{k % 250}.1", f"10.77.{k % 250}.2")
    made = []
    try:
        for name in names:
            r = _run(["ip", "netns", "add", name])
            if r.returncode != 0:
                raise ShapingUnavailable(f"`ip netns add {name}` failed: {r.stderr.strip()}; "
                                         "network namespaces need root with CAP_SYS_ADMIN")
            made.append(name)
        steps = [["ip", "link", "add", ifaces[0], "type", "veth", "peer", "name", ifaces[1]]]
        for name, iface, addr in zip(names, ifaces, addrs):
            steps += [["ip", "link", "set", iface, "netns", name],
                      ["ip", "-n", name, "addr", "add", f"{addr}/24", "dev", iface],
                      ["ip", "-n", name, "link", "set", iface, "up"],
                      ["ip", "-n", name, "link", "set", "lo", "up"]]
            parent = ["root"]
            if delay_ms > 0:
                steps.append(["tc", "-n", name, "qdisc", "add", "dev", iface, "root", "handle",
                              "1:", "netem", "delay", f"{delay_ms:g}ms", "limit", "100000"])
                parent = ["parent", "1:1"]
            if rate_mbit is not None:
                steps.append(["tc", "-n", name, "qdisc", "add", "dev", iface, *parent, "handle",
                              "10:", "tbf", "rate", f"{rate_mbit:g}mbit", "burst", burst,
                              "latency", latency])
        _run_all(steps, "veth, netem and tbf need CAP_NET_ADMIN and the sch_netem / sch_tbf "
                 "kernel modules")
        yield Nodes(names, ifaces, addrs)
    finally:
        for name in made:
            _run(["ip", "netns", "del", name])


@dataclasses.dataclass(frozen=True)
class Star:
    """``n`` "machines" on the internet (see :func:`star`): machine i is the namespace
    ``namespaces[i]``, its one link ``interfaces[i]`` at ``addresses[i]``; the links meet at a
    bridge in the ``hub`` namespace (``hub_address``), where ``ports[i]`` is link i's other end."""

    hub: str
    hub_address: str
    namespaces: tuple[str, ...]
    interfaces: tuple[str, ...]
    ports: tuple[str, ...]
    addresses: tuple[str, ...]

    def machine(self, i: int) -> dict:
        """What a process needs to become machine ``i`` (:func:`become_machine`'s argument)."""
        return {"namespace": self.namespaces[i], "interface": self.interfaces[i],
                "address": self.addresses[i]}

    def sent_bytes(self) -> int:
        """Bytes the machines have sent over their links so far (each byte once: what the hub's
        ports received), read from the hub's interface counters."""
        out = _run(["ip", "-n", self.hub, "-s", "-j", "link", "show"])
        if out.returncode != 0:
            raise ShapingUnavailable(f"`ip -n {self.hub} -s -j link show` failed: {out.stderr}")
        ports = set(self.ports)
        return sum(link["stats64"]["rx"]["bytes"] for link in json.loads(out.stdout)
                   if link["ifname"] in ports)


@contextlib.contextmanager
def star(n: int, rate_mbit: float | None, burst: str = "256kb",
         latency: str = "50ms") -> Iterator[Star]:
    """``n`` namespaces, each joined to a hub's bridge by a veth pair limited to ``rate_mbit``
    in each direction (a tbf on both ends: the machine's uplink and its downlink): every machine
    has a link of its own, as replicas training over the internet do, and traffic between two
    machines crosses the sender's uplink and the receiver's downlink. ``burst``/``latency`` are
    :func:`shaped_namespace`'s. Everything is deleted on exit."""
    _check_tools(need_tc=rate_mbit is not None)
    remove_stale_namespaces()
    pid, k = os.getpid(), next(_ns_counter)
    hub = f"{NS_PREFIX}{pid}-{k}"
    names = tuple(f"{NS_PREFIX}{pid}-{next(_ns_counter)}" for _ in range(n))
    leaves = tuple(f"cxl{pid % 100000}x{k}x{i}"[:15] for i in range(n))
    ports = tuple(f"cxp{pid % 100000}x{k}x{i}"[:15] for i in range(n))
    subnet = f"10.79.{k % 250}"
    addrs = tuple(f"{subnet}.{i + 1}" for i in range(n))
    made = []
    try:
        for name in (hub, *names):
            r = _run(["ip", "netns", "add", name])
            if r.returncode != 0:
                raise ShapingUnavailable(f"`ip netns add {name}` failed: {r.stderr.strip()}; "
                                         "network namespaces need root with CAP_SYS_ADMIN")
            made.append(name)
        steps = [["ip", "-n", hub, "link", "set", "lo", "up"],
                 ["ip", "-n", hub, "link", "add", "br0", "type", "bridge"],
                 ["ip", "-n", hub, "addr", "add", f"{subnet}.254/24", "dev", "br0"],
                 ["ip", "-n", hub, "link", "set", "br0", "up"]]
        shape = (["tbf", "rate", f"{rate_mbit:g}mbit", "burst", burst, "latency", latency]
                 if rate_mbit is not None else None)
        for name, leaf, port, addr in zip(names, leaves, ports, addrs):
            steps += [["ip", "link", "add", leaf, "type", "veth", "peer", "name", port],
                      ["ip", "link", "set", leaf, "netns", name],
                      ["ip", "link", "set", port, "netns", hub],
                      ["ip", "-n", hub, "link", "set", port, "master", "br0"],
                      ["ip", "-n", hub, "link", "set", port, "up"],
                      ["ip", "-n", name, "addr", "add", f"{addr}/24", "dev", leaf],
                      ["ip", "-n", name, "link", "set", leaf, "up"],
                      ["ip", "-n", name, "link", "set", "lo", "up"]]
            if shape:
                steps += [["tc", "-n", name, "qdisc", "add", "dev", leaf, "root", *shape],
                          ["tc", "-n", hub, "qdisc", "add", "dev", port, "root", *shape]]
        _run_all(steps, "veth, bridges and tbf need CAP_NET_ADMIN and the sch_tbf kernel module")
        yield Star(hub, f"{subnet}.254", names, leaves, ports, addrs)
    finally:
        for name in made:
            _run(["ip", "netns", "del", name])


def become_machine(namespace: str, interface: str, address: str) -> None:
    """Move this process into a :class:`Star` machine: its network namespace (setns: call it
    first thing in a fresh process, before any thread starts, as threads keep the namespace they
    were started in), gloo bound to its link, and its address as the one it advertises. A
    process on one host resolves the host's name to 127.0.0.1, which inside a machine is that
    machine itself, so ``socket.gethostname`` (torchft's checkpoint transport advertises it)
    returns the machine's address: on real machines the name resolves to each one's own."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise ShapingUnavailable(f"setns into {namespace} failed: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ.update(GLOO_SOCKET_IFNAME=interface, TP_SOCKET_IFNAME=interface,
                      MASTER_ADDR=address)
    socket.gethostname = lambda: address


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so that ``finally`` blocks (namespace deletion, killing the
    ranks) run when a benchmark is stopped by ``kill`` or a timeout, not only by Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


# ---------------------------------------------------------------------------------------------
# Launching ranks.


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


def _rank(rank: int, world_size: int, module: str, func: str, args_json: dict,
          logs: list[str]) -> Any:
    """One rank, under ccfx's ``spawn``: stdout and stderr (a C++ abort's message included) go
    to the rank's log, which the parent watches for progress; the result travels as JSON."""
    import importlib

    fd = os.open(logs[rank], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    result = getattr(importlib.import_module(module), func)(rank, world_size, **args_json)
    sys.stdout.flush()
    return json.loads(json.dumps(result))


class _Progress:
    """``spawn``'s watch: the reason to stop once no rank's log has grown for ``stall_s``."""

    def __init__(self, logs: list[Path], stall_s: float | None):
        self.logs, self.stall_s = logs, stall_s
        self.start = self.grew = time.monotonic()
        self.sizes = [0] * len(logs)

    def __call__(self) -> str | None:
        sizes = [lg.stat().st_size if lg.exists() else 0 for lg in self.logs]
        now = time.monotonic()
        if sizes != self.sizes:
            self.sizes, self.grew = sizes, now
        elif self.stall_s is not None and now - self.grew > self.stall_s:
            last = [ln for lg in self.logs for ln in _tail(lg, 200).splitlines()
                    if ln.startswith("[rank ")]  # the progress lines of bench workers
            return (f"hung: no output for {self.stall_s:.0f} s, {now - self.start:.0f} s in"
                    + (f", after {last[-1].split('] ', 1)[-1]!r}" if last else ""))
        return None


def run_ranks(module: str, func: str, world_size: int, args_json: dict, *,
              netns: str | Sequence[str] | None, timeout_s: float, threads_per_rank: int = 1,
              env: dict[str, str] | None = None, grace_s: float = 10.0,
              stall_s: float | None = None,
              rank_env: Sequence[dict[str, str]] | None = None) -> list[dict]:
    """Run ``module.func(rank, world_size, **args_json)`` on ``world_size`` gloo ranks started by
    ccfx's ``spawn`` (inside ``netns`` when given: each rank's Python is started under ``ip netns
    exec``), and return their results in rank order, as JSON gives them back.

    Every rank gets RANK/WORLD_SIZE/MASTER_ADDR=127.0.0.1/MASTER_PORT, ``threads_per_rank``
    torch threads, ``env`` on top of the parent's environment, and every collective of the
    default group bounded by ``timeout_s``. Raises RankFailed (the first failing rank's
    traceback, or its log's tail when it died in C++) or RankTimeout (naming the ranks that had
    not finished after ``timeout_s``, or, with ``stall_s``, as soon as no rank has written to
    stdout/stderr for that long), with the stuck ranks' Python stacks; all ranks are killed in
    every case. ``netns`` may name one namespace per rank and ``rank_env`` give each rank its own
    entries (:meth:`Nodes.launch`: ranks of two "nodes")."""
    # imported here: a process that only becomes a machine (become_machine) must not import
    # torch before it has entered its namespace
    from ccfx.runtime.launch import RankFailed as LaunchFailed
    from ccfx.runtime.launch import RankTimeout as LaunchTimeout
    from ccfx.runtime.launch import spawn

    threads = str(threads_per_rank)
    base_env = {**(env or {}), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                "CCFX_RANK_THREADS": threads}
    with tempfile.TemporaryDirectory(prefix="ccfx-bench-ranks-") as tmp:
        logs = [Path(tmp, f"rank{r}.log") for r in range(world_size)]
        try:
            return spawn(_rank, world_size, (module, func, args_json, [str(lg) for lg in logs]),
                         timeout_s=timeout_s, grace_s=grace_s, pg_timeout_s=timeout_s,
                         env=base_env, prefix=_prefix(netns),
                         rank_env=(lambda r: rank_env[r]) if rank_env else None,
                         watch=_Progress(logs, stall_s))
        except LaunchFailed as e:
            details = str(e)
            died = re.search(r"exited with code (-?\d+) without reporting", details)
            if died:  # no Python traceback (a C++ abort, a kill): the log has the rest
                code = int(died.group(1))
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                details += f"\n({how}; log tail:)\n{_tail(logs[e.rank])}"
                reason = short_reason(_tail(logs[e.rank]))
                raise RankFailed(e.rank, f"{reason} ({how})" if reason else how, details) from None
            raise RankFailed(e.rank, short_reason(details) or "raised", details) from None
        except LaunchTimeout as e:
            reason, _, stacks = str(e).partition("\n")
            tails = "\n".join(f"--- rank {r} log tail ---\n{_tail(lg)}" for r, lg in enumerate(logs))
            raise RankTimeout(reason, f"{stacks}\n{tails}") from None


def _prefix(netns: str | Sequence[str] | None):
    if not netns:
        return ()
    if isinstance(netns, str):
        return ["ip", "netns", "exec", netns]
    return lambda r: ["ip", "netns", "exec", netns[r]]


# ---------------------------------------------------------------------------------------------
# Self-check: socket throughput between two ranks.


def socket_probe(rank: int, world_size: int, nbytes: int) -> dict:
    """Rank 1 sends ``nbytes`` over a plain TCP socket to rank 0 (at MASTER_ADDR: 127.0.0.1, or
    its node's address); rank 0 times from the first byte to the last, after timing ten 1-byte
    round trips (``rtt_ms``, their median). The port is rank 0's, shared through the group."""
    import torch.distributed as dist

    assert world_size == 2, "the socket probe runs on exactly 2 ranks"
    box: list = [None]
    if rank == 0:
        srv = socket.create_server((os.environ.get("MASTER_ADDR", "127.0.0.1"), 0))
        box = [srv.getsockname()[1]]
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        chunk = b"\0" * (1 << 20)
        with socket.create_connection((os.environ.get("MASTER_ADDR", "127.0.0.1"), box[0])) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(10):
                s.sendall(b"p")
                s.recv(1)
            left = nbytes
            while left > 0:
                s.sendall(chunk[:min(left, len(chunk))])
                left -= min(left, len(chunk))
        return {"sent": nbytes}
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts, t = [], time.perf_counter()
    for _ in range(10):
        conn.recv(1)
        rtts.append(time.perf_counter() - t)
        t = time.perf_counter()
        conn.sendall(b"p")
    got, t0 = 0, None
    with conn, srv:
        while got < nbytes:
            data = conn.recv(1 << 20)
            if not data:
                break
            t0 = t0 or time.perf_counter()
            got += len(data)
    secs = time.perf_counter() - t0
    return {"received": got, "seconds": secs, "mbit_s": got * 8 / secs / 1e6,
            "rtt_ms": sorted(rtts[1:])[len(rtts[1:]) // 2] * 1e3}


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


def selftest_two_nodes(rate: float, delay_ms: float) -> None:
    """Throughput and round trip between two ranks on different "nodes", then on one."""
    nbytes = int(rate * 1e6 / 8 * 2)
    with two_nodes(rate, delay_ms) as nodes:
        for label, placement, n in (("across", [0, 1], nbytes), ("inside", [0, 0], 1 << 30)):
            netns, env = nodes.launch(placement)
            got = run_ranks("bench.shaped", "socket_probe", 2, {"nbytes": n}, netns=netns,
                            rank_env=env, timeout_s=120)[0]
            print(f"{label:>7} (rate {rate:g}mbit, delay {delay_ms:g} ms): {got['mbit_s']:9.1f} "
                  f"Mbit/s, round trip {got['rtt_ms']:.2f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--selftest", action="store_true",
                    help="measure socket throughput between two ranks, shaped and unshaped")
    ap.add_argument("--rates", nargs="+", default=["100", "none"],
                    help="selftest rates in Mbit/s; 'none' for unshaped (default: 100 none)")
    ap.add_argument("--two-nodes", nargs=2, type=float, metavar=("MBIT", "DELAY_MS"),
                    help="selftest two namespaces joined by a shaped veth pair instead")
    a = ap.parse_args(argv)
    if a.selftest and a.two_nodes:
        exit_cleanly_on_sigterm()
        selftest_two_nodes(*a.two_nodes)
        return 0
    if a.selftest:
        exit_cleanly_on_sigterm()
        selftest([None if r.lower() == "none" else float(r) for r in a.rates])
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
