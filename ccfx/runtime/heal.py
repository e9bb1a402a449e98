"""Live recovery that the serving replicas do not wait for: a torchft checkpoint transport.

torchft's HTTP transport serves a healing replica the whole state in the quorum, and the
serving peer's ``should_commit`` blocks until that download ends (it takes a write lock that
an in-flight read holds), while the other replicas' exchange waits for the healer to arrive:
on a slow link every survivor stalls for the whole transfer at every join. This transport
splits what it serves in two:

* the **head**: everything but the tensors (the fingerprint, the steps, torchft's own state,
  the optimizer's hyper-parameters), a few kB, received in the quorum as torchft expects;
* the **body**: the tensors, received when the healer asks for them
  (:meth:`Pending.result`), after the exchange it joins with nothing to send.

A staged state is the serving replica's clone (:meth:`Elastic._recovery_state`), never
touched again, so :meth:`disallow_checkpoint` has nothing to wait for; a request for a step not
yet staged waits for it (the healer can ask before its source's quorum thread has staged).
The last two steps stay staged. Both parts travel as ``torch.save`` bytes and are read with
``weights_only=True``: a peer sends tensors and plain containers, nothing that runs code.

The same server tells a hot spare when its replica dies (``/alive``, :class:`Watch`): a stream
of one byte per ``BEAT_S`` that ends with a goodbye byte when the replica shuts down. A killed
process's kernel closes the connection with no goodbye; a machine that vanished stops the
bytes. Either is a death, known in a beat or two, not at the next sync. Asked with
``/alive?sync=K``, the stream also says, at once, when its replica is in a sync at torchft step
``K`` or later (:meth:`HealTransport.announce_sync`; ``K`` is the watcher's own step after the
sync it last committed, so a peer still finishing that same sync does not count): a replica that
must arrive with the others but cannot count their steps (a spare that took a dead trainer's
place mid-interval, one catching up after a heal) syncs when the first of them does, instead of
at a time estimated from the last interval, which is late whenever that interval was slower.
"""

from __future__ import annotations

import io
import logging
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

log = logging.getLogger("ccfx")

_SLOT = "__ccfx_body__"  # a head's placeholder for the body's tensor i: (_SLOT, i)
_KEEP = 2  # staged steps kept (a late request for the previous step still finds it)
BEAT_S = 0.5  # /alive: one byte per beat
_BEAT, _BYE, _SYNC = b".", b"x", b"s"  # alive; shut down; in a sync (?sync=K)


def split(state):
    """(head, tensors): ``state`` with each tensor replaced by ``(_SLOT, i)``."""
    tensors: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return (_SLOT, len(tensors) - 1)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(state), tensors


def join(head, tensors: list[torch.Tensor]):
    """The inverse of :func:`split`."""
    if isinstance(head, tuple) and len(head) == 2 and head[0] == _SLOT:
        return tensors[head[1]]
    if isinstance(head, dict):
        return {k: join(v, tensors) for k, v in head.items()}
    if isinstance(head, (list, tuple)):
        return type(head)(join(v, tensors) for v in head)
    return head


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


class _Staged:
    """One step's state as served: the head's bytes at once, the body's on first request."""

    def __init__(self, state):
        head, self.tensors = split(state)
        self.head = _dumps(head)
        self._body: bytes | None = None
        self._lock = threading.Lock()

    def body(self) -> bytes:
        with self._lock:
            if self._body is None:
                self._body = _dumps(self.tensors)
            return self._body


class Pending:
    """What a healing replica's load function gets in place of a user state: the ``head``
    now (tensors as ``(_SLOT, i)``), the whole state from :meth:`result`, which downloads the
    body (at most once, on a background thread from :meth:`start`)."""

    def __init__(self, head, body: _Body):
        self.head, self._body = head, body

    def start(self) -> None:
        self._body.start()

    def result(self, timeout_s: float):
        return join(self.head, self._body.result(timeout_s))

    def done(self, timeout_s: float | None) -> bool:
        """Whether the tensors are here (or their fetch failed: :meth:`result` raises), after
        waiting up to ``timeout_s`` (None: until then)."""
        return self._body.done(timeout_s)

    def cancel(self) -> None:
        """Stop the fetch (a newer heal replaced it): the link is not spent on it."""
        self._body.cancel()


class _Body:
    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self._future: Future | None = None
        self._lock = threading.Lock()
        self._cancelled = threading.Event()

    def start(self) -> None:
        with self._lock:
            if self._future is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix="ccfx-heal")
                self._future = pool.submit(self._fetch)
                pool.shutdown(wait=False)

    def _fetch(self) -> list[torch.Tensor]:
        chunks = []
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:
            expected = int(response.headers.get("Content-Length", -1))
            while chunk := response.read(1 << 20):  # checked between chunks: cancel()
                if self._cancelled.is_set():
                    raise RuntimeError(f"the fetch of {self.url} was cancelled")
                chunks.append(chunk)
        got = sum(len(c) for c in chunks)
        if 0 <= expected != got:  # http.client ends a cut-off body quietly: say so here
            raise ConnectionError(f"the heal's state from {self.url} ended after {got} of "
                                  f"{expected} bytes: its source closed the connection (it "
                                  "stopped or died)")
        return _loads(b"".join(chunks))

    def cancel(self) -> None:
        self._cancelled.set()

    def result(self, timeout_s: float) -> list[torch.Tensor]:
        self.start()
        return self._future.result(timeout=timeout_s)

    def done(self, timeout_s: float | None) -> bool:
        self.start()
        wait([self._future], timeout=timeout_s)
        return self._future.done()


def _get(url: str, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


class HealTransport:
    """A torchft ``CheckpointTransport`` (``send_checkpoint``, ``recv_checkpoint``,
    ``metadata``, ``disallow_checkpoint``, ``shutdown``) serving ``http://host:port/<step>/head``
    and ``/<step>/body`` (see the module docstring). ``host`` is the address the other replicas
    reach this one at."""

    def __init__(self, host: str, timeout: timedelta):
        self.host, self.timeout_s = host, timeout.total_seconds()
        self._staged: dict[int, _Staged] = {}
        self._changed = threading.Condition()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path, _, query = self.path.partition("?")
                if path == "/alive":
                    sync = query[len("sync="):] if query.startswith("sync=") else ""
                    transport._beat(self, int(sync) if sync.lstrip("-").isdigit() else None)
                    return
                try:
                    step, part = self.path.strip("/").split("/")
                    data = transport._serve(int(step), part)
                except (ValueError, KeyError, TimeoutError) as e:
                    self.send_error(404, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet: the default writes every request to stderr
                pass

        self._closing = threading.Event()  # shutdown: every /alive stream says goodbye
        self._sync_step, self._pulse = None, threading.Condition()  # announce_sync's step
        self._beating, self._streams = 0, threading.Condition()  # /alive streams serving now
        self._severed = False  # sever(): they end with no goodbye, as a killed process's do
        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="ccfx-heal-server")
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def metadata(self) -> str:
        return f"http://{self.host}:{self.port}"

    def announce_sync(self, step: int) -> None:
        """This replica starts a sync at torchft step ``step`` (the step of its last commit):
        every ``/alive?sync=K`` stream with ``K <= step`` says so now, not at its next beat
        (:class:`Watch` ``.synced``)."""
        with self._pulse:
            self._sync_step = step
            self._pulse.notify_all()

    def _in_sync_at(self, step: int) -> bool:
        return self._sync_step is not None and self._sync_step >= step

    def _beat(self, handler, sync: int | None) -> None:
        """Serve ``/alive``: a byte per beat (``sync``: the sync byte instead, once, as soon as
        this replica is in a sync at step ``sync`` or later) until this transport shuts down
        (then the goodbye byte) or the watcher goes away."""
        with self._streams:
            self._beating += 1
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.end_headers()
            told = sync is None
            while not self._closing.is_set():
                with self._pulse:
                    if told or not self._in_sync_at(sync):
                        self._pulse.wait(BEAT_S)  # (a sync or the shutdown notifies)
                    due = not told and self._in_sync_at(sync)
                if self._closing.is_set():
                    break
                handler.wfile.write(_SYNC if due else _BEAT)
                handler.wfile.flush()
                told = told or due
            if not self._severed:
                handler.wfile.write(_BYE)
                handler.wfile.flush()
        except OSError:  # the watcher closed its end
            pass
        finally:
            handler.close_connection = True
            with self._streams:
                self._beating -= 1
                self._streams.notify_all()

    def _serve(self, step: int, part: str) -> bytes:
        with self._changed:
            if not self._changed.wait_for(lambda: step in self._staged or self._newer(step),
                                          timeout=self.timeout_s):
                raise TimeoutError(f"step {step} was not staged within {self.timeout_s:g} s")
            staged = self._staged[step]  # KeyError (404) when a newer step replaced it
        return {"head": lambda: staged.head, "body": staged.body}[part]()

    def _newer(self, step: int) -> bool:
        return any(s > step for s in self._staged)

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout) -> None:
        staged = _Staged(state_dict)
        with self._changed:
            self._staged[step] = staged
            for old in sorted(self._staged)[:-_KEEP]:
                del self._staged[old]
            self._changed.notify_all()

    def disallow_checkpoint(self) -> None:
        """Nothing to wait for: a staged state is a clone nobody writes to."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout):
        timeout_s = timeout.total_seconds()
        head = _loads(_get(f"{metadata}/{step}/head", timeout_s))
        body = _Body(f"{metadata}/{step}/body", timeout_s)
        return {"torchft": head["torchft"],  # torchft's step counters: no tensors
                "user": {key: Pending(value, body) for key, value in head["user"].items()}}

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving; each ``/alive`` stream says goodbye first (up to a second: a process
        that exits right after must not look killed to its watchers)."""
        self._closing.set()
        with self._pulse:
            self._pulse.notify_all()
        with self._streams:
            self._streams.wait_for(lambda: self._beating == 0, timeout=1.0)
        self._server.shutdown()
        self._server.server_close()

    def sever(self) -> None:
        """End every ``/alive`` stream with no goodbye and stop serving: what a watcher sees
        of a replica killed with SIGKILL (tests stand in for a kill with it)."""
        self._severed = True
        self.shutdown()


class Watch:
    """A watch over other replicas' ``/alive`` streams (their :meth:`HealTransport.metadata`
    URLs): :meth:`wait` returns the keys of those that died, in the order their deaths were
    seen. A stream that ends without the goodbye byte, cannot be opened, or is silent for
    ``silent_s`` is a death; one that says goodbye (the replica shut down) is not. With
    ``sync_step``, ``synced`` holds, in order, the keys of the replicas in a sync at that
    torchft step or later. One thread per replica; :meth:`close` ends them."""

    def __init__(self, urls: dict, silent_s: float = 5.0, sync_step: int | None = None):
        self.urls = dict(urls)
        self.dead: list = []
        self.synced: list = []
        self._following = len(self.urls)  # streams still open
        self._changed = threading.Condition()
        self._closed = False
        query = "" if sync_step is None else f"?sync={int(sync_step)}"
        for key, url in urls.items():
            threading.Thread(target=self._follow, args=(key, url + query, silent_s),
                             daemon=True, name=f"ccfx-watch-{key}").start()

    def _follow(self, key, url: str, silent_s: float) -> None:
        died = True
        try:
            base, _, query = url.partition("?")
            with urllib.request.urlopen(f"{base}/alive{'?' + query if query else ''}",
                                        timeout=silent_s) as response:
                while (byte := response.read(1)) in (_BEAT, _SYNC):
                    if self._closed:
                        return
                    if byte == _SYNC and key not in self.synced:
                        with self._changed:
                            self.synced.append(key)
                            self._changed.notify_all()
            died = byte != _BYE
        except (OSError, ValueError):  # refused, reset, silent past silent_s; closed by close()
            pass
        finally:
            with self._changed:
                self._following -= 1
                if died and not self._closed:
                    self.dead.append(key)
                self._changed.notify_all()

    def wait(self, until: float, more_than: int = 0, or_sync: bool = False) -> list:
        """The deaths seen so far, waiting until there are more than ``more_than``, or (with
        ``or_sync``) a watched replica has started a sync, or ``time.monotonic()`` reaches
        ``until``."""
        with self._changed:
            self._changed.wait_for(
                lambda: len(self.dead) > more_than or (or_sync and bool(self.synced)),
                timeout=max(0.0, until - time.monotonic()))
            return list(self.dead)

    def alive(self) -> bool:
        """Whether any watched stream is still open (else no sync can be heard of)."""
        with self._changed:
            return self._following > 0

    def close(self) -> None:
        """Stop watching: each thread ends at its stream's next byte."""
        with self._changed:
            self._closed = True
