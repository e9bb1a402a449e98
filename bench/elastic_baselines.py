"""The two baselines bench/elastic.py runs beside ccfx (issue #20's Numbers).

``torchft``: torchft's own DiLoCo (``torchft.local_sgd.DiLoCo``) as torchft ships it, on the
same harness as ccfx's replicas (same tiny GPT, AdamW inner steps, shards, sync period,
lighthouse, kills): a ``Manager`` with a gloo process group, the model and the inner
optimizer's state handed to a healing replica (torchft's recipe), its uncompressed
per-parameter all-reduce of the pseudo-gradients. Its outer optimizer is ccfx's (SGD lr 1, no
momentum) unless ``--tf-outer nesterov`` (DiLoCo's lr 0.7, momentum 0.9, Nesterov). One sync
row per ``perform_sync``: whether torchft committed it, and whether this replica healed in it
(a healer's pseudo-gradient is a copy of its peer's, and its own inner steps since its start
are lost: it counts no useful steps).

``ckpt``: the checkpoint-restart floor. ccfx's local steps without fault tolerance (a gloo
process group over the R replicas, the same codec); every replica saves its state (its own
``outer.state_dict()``, the inner optimizer's) every ``--ckpt-every`` syncs; on a kill the
driver SIGKILLs every replica at once (what an elastic agent such as torchrun's does when one
worker dies: no collective timeout is waited for, the floor's best case) and starts them all
again from the newest sync every replica had saved. Lost: every replica's steps since that
checkpoint and the restart of all of them (process start, imports, the process group, loading).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
from datetime import timedelta

from bench.elastic import BATCH, GPT, LR, _start, drain, finished


def tf_replica(name: str, index: int, cfg: dict, stop_at, out, started: float,
               gate=None) -> None:
    """One replica on torchft's DiLoCo (see the module docstring); messages as
    bench.elastic.replica's."""
    # imported before phases["imported"] is stamped: the phases time the imports
    import torch
    import torch.distributed
    import torchft.local_sgd  # noqa: F401 (torchft: its Manager, process groups and DiLoCo)

    import ccfx.models  # noqa: F401
    from bench.local_steps import _data, _evaluate

    phases = {"started": started, "imported": time.time()}
    gpt = cfg.get("gpt", GPT)
    torch.set_num_threads(1)
    train, held_out, vocab = _data(gpt["block_size"], 0, index, BATCH)
    phases["data"] = time.time()
    model, opt, outer_opt = _tf_model(cfg, index, vocab)
    phases["model"] = time.time()
    _start(gate, cfg["timeout_s"])
    healed = [False]
    manager, _store = _tf_manager(name, cfg, model, opt, healed)  # _store: held while it runs
    phases["manager"] = time.time()
    out.put(("phases", name, phases))
    step = _tf_train(name, index, cfg, stop_at, out, started, manager,
                     (model, opt, outer_opt), train, healed)
    numel = sum(p.numel() for p in model.parameters())
    summary = {"wire": None, "raw": None, "steps": step, "numel": numel}
    if index == 0:  # after a sync the model holds the global parameters (fragment_update_alpha 0)
        summary["held_out"] = _evaluate(model, held_out)
    manager.shutdown(wait=False)
    out.put(("done", name, summary))


def _tf_model(cfg: dict, index: int, vocab: int):
    """The replica's model (seeded as ccfx's replicas, bench.elastic._build), its AdamW and
    the outer SGD: ccfx's (lr 1, no momentum) or with ``--tf-outer nesterov`` DiLoCo's."""
    import torch

    from ccfx.models import GPTConfig, TinyGPT

    torch.manual_seed(index if cfg.get("init_sync") else 0)  # as ccfx's replicas (_build)
    model = TinyGPT(GPTConfig(vocab_size=vocab, **cfg.get("gpt", GPT)))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    if cfg.get("tf_outer") == "nesterov":
        outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    else:
        outer_opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    return model, opt, outer_opt


def _tf_manager(name: str, cfg: dict, model, opt, healed: list[bool]):
    """torchft's Manager for this replica and the store it serves (the caller holds it while
    the manager lives): a gloo process group, the model and the inner optimizer's state as
    what a healing replica loads (``healed[0]`` set when it does)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    def load(state):
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["inner"])
        healed[0] = True

    def save():
        return {"model": model.state_dict(), "inner": opt.state_dict()}

    # torchft's collective and checkpoint-lock timeout: a heal of the 10 M model (its weights
    # and AdamW's state) to 3 replicas over 10 Mbit/s takes longer than 60 s
    timeout = timedelta(seconds=cfg.get("tf_timeout_s", 60))
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # its machine's address (--link star)
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load, state_dict=save,
        min_replica_size=2, use_async_quorum=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=300), connect_timeout=timedelta(seconds=30),
        rank=0, world_size=1, store_addr=host, store_port=store.port,
        lighthouse_addr=cfg["lighthouse"], replica_id=name, hostname=host,
        max_retries=20, init_sync=bool(cfg.get("init_sync"))), store


def _tf_train(name, index, cfg, stop_at, out, started, manager, optimised, train,
              healed) -> int:
    """Inner steps under torchft's DiLoCo until :func:`bench.elastic.finished`, a row per
    ``perform_sync`` (its fragment's, wrapped); returns the inner steps taken."""
    import torch
    from torchft.local_sgd import DiLoCo

    model, opt, outer_opt = optimised
    h = cfg["h"]
    step = 0
    with DiLoCo(manager, [model], opt, outer_opt, sync_every=h, pin_memory=False) as diloco:
        frag = diloco._fragments[0]
        perform = frag.perform_sync

        def perform_sync():  # one row per sync, as ccfx's history
            t = time.monotonic()
            committed = perform()
            out.put(("row", name, {
                "step": step, "torchft_step": manager.current_step(),
                "replicas": manager.num_participants(), "committed": committed,
                "healed": healed[0], "weight": 0 if healed[0] else h,
                "seconds": time.monotonic() - t, "time": time.time(), "started": started}))
            healed[0] = False
            return committed

        frag.perform_sync = perform_sync
        while True:
            x, y = next(train)
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()  # DiLoCo's post-hook syncs every h steps
            step += 1
            if diloco._local_step == 0 and finished(index, manager.current_step(), stop_at):
                break
    return step


def ckpt_replica(name: str, index: int, cfg: dict, port: int, resume: int | None, out,
                 started: float) -> None:
    """One replica of the checkpoint-restart baseline: rows ("row", name, {"syncs", "time"}),
    ("saved", name, syncs) after each checkpoint, ("done", name, summary)."""
    try:
        _ckpt_replica(name, index, cfg, port, resume, out, started)
    except Exception:  # noqa: BLE001 (the driver reports it)
        import traceback

        out.put(("error", name, traceback.format_exc()))


def _ckpt_replica(name, index, cfg, port, resume, out, started) -> None:
    import torch
    import torch.distributed as dist

    import ccfx
    from bench.local_steps import _data, _evaluate
    from ccfx.models import GPTConfig, TinyGPT

    gpt = cfg.get("gpt", GPT)
    torch.set_num_threads(1)
    master = cfg["machines"][0]["address"] if cfg.get("machines") else "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=index,
                            world_size=cfg["replicas"], timeout=timedelta(seconds=60))
    # a restart draws other batches than the first run (its data position is not saved)
    _, held_out, vocab = _data(gpt["block_size"], 0, index, BATCH)
    train = _data(gpt["block_size"], 0, index + 97 * (resume or 0), BATCH)[0]
    torch.manual_seed(index)
    model = TinyGPT(GPTConfig(vocab_size=vocab, **gpt))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    outer = ccfx.local_steps(model, opt, sync_every=cfg["h"], outer_codec=cfg["codec"],
                             outer_lr=1.0, outer_momentum=0.0, collective_timeout_s=60.0)
    path = os.path.join(cfg["ckpt_dir"], f"{name}_{{}}.pt")
    if resume is not None:
        saved = torch.load(path.format(resume), weights_only=False)
        opt.load_state_dict(saved["opt"])
        outer.load_state_dict(saved["outer"])
    out.put(("ready", name, {"started": started, "ready": time.time(), "syncs": outer.syncs}))
    syncs = outer.syncs
    while outer.syncs < cfg["syncs"]:
        x, y = next(train)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if outer.syncs != syncs:
            syncs = outer.syncs
            out.put(("row", name, {"syncs": syncs, "time": time.time(), "started": started}))
            if syncs % cfg["ckpt_every"] == 0:
                tmp = path.format(syncs) + ".tmp"
                torch.save({"opt": opt.state_dict(), "outer": outer.state_dict()}, tmp)
                os.replace(tmp, path.format(syncs))
                out.put(("saved", name, syncs))
                old = path.format(syncs - 3 * cfg["ckpt_every"])
                if os.path.exists(old):
                    os.remove(old)
    summary = {"wire": outer.wire_bytes, "raw": outer.raw_bytes, "steps": outer.step}
    if index == 0:
        probe = TinyGPT(GPTConfig(vocab_size=vocab, **gpt))
        probe.load_state_dict(dict(outer.global_parameters()), strict=False)
        summary["held_out"] = _evaluate(probe, held_out)
    outer.close()
    dist.barrier()
    dist.destroy_process_group()
    out.put(("done", name, summary))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ckpt_entry(name, index, cfg, port, resume, out):
    from bench.elastic import _become

    _become(cfg, index)
    ckpt_replica(name, index, cfg, port, resume, out, time.time())


class _CkptFleet:
    """The checkpoint-restart run's replicas, started together and killed together, and what
    they report: r0's rows, r0's readiness per start, each replica's summary."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.ctx = mp.get_context("spawn")
        self.names = [f"r{i}" for i in range(cfg["replicas"])]
        self.procs, self.queues = {}, {}
        self.rows: dict[str, list[dict]] = {}
        self.ready: list[dict] = []
        self.done: dict[str, dict] = {}

    def start_all(self, resume: int | None) -> None:
        port = _free_port()
        for i, n in enumerate(self.names):
            self.queues[n] = self.ctx.Queue()
            self.procs[n] = self.ctx.Process(
                target=_ckpt_entry, args=(n, i, self.cfg, port, resume, self.queues[n]),
                daemon=True)
            self.procs[n].start()

    def take(self, kind, who, data) -> None:
        if kind == "row":
            self.rows.setdefault(who, []).append(data)
        elif kind == "ready":
            if who == "r0":
                self.ready.append(data)
        elif kind != "saved":
            self.done[who] = data

    def pump(self) -> None:
        drain(self.queues, self.take)

    def restart_all(self, syncs: int) -> dict:
        """SIGKILL every replica and start them all again from the newest sync every one of
        them saved; the kill's record."""
        killed_at = time.time()
        for p in self.procs.values():
            os.kill(p.pid, signal.SIGKILL)
        for p in self.procs.values():
            p.join(10)
        # the newest sync every replica saved (os.replace: a file is whole or absent)
        resume = max((k for k in range(syncs + 1) if all(os.path.exists(os.path.join(
            self.cfg["ckpt_dir"], f"{n}_{k}.pt")) for n in self.names)), default=None)
        kill = {"at_sync": syncs, "resume": resume, "time": killed_at,
                "rows_before": len(self.rows.get("r0", []))}
        self.queues.clear()
        self.start_all(resume)
        return kill

    def stop(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()


def inside_ckpt(cfg: dict) -> dict:
    """The checkpoint-restart run, in the namespace (see the module docstring)."""
    from bench.elastic import sent_bytes

    cfg = {**cfg, "ckpt_dir": tempfile.mkdtemp(prefix="ccfx-ckpt-")}
    fleet = _CkptFleet(cfg)
    tx0 = sent_bytes(cfg)
    t0 = time.time()
    fleet.start_all(None)
    try:
        kills = _ckpt_run(cfg, fleet)
    finally:
        fleet.stop()
    return _ckpt_result(cfg, fleet, kills, sent_bytes(cfg) - tx0, t0)


def _ckpt_run(cfg: dict, fleet: _CkptFleet) -> list[dict]:
    """Until every replica is done: every ``kill_every`` inner steps (once r0 has reached the
    sync, ``kill_phase`` into its interval) every replica is killed and restarted."""
    from bench.elastic import _phase_delay

    kills = []
    every = cfg["kill_every"] // cfg["h"]
    next_kill, kill_at = every, None
    deadline = time.monotonic() + cfg["timeout_s"]
    while not all(n in fleet.done for n in fleet.names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"run did not finish in {cfg['timeout_s']} s; done {fleet.done}")
        fleet.pump()
        r0 = fleet.rows.get("r0", [])
        syncs = r0[-1]["syncs"] if r0 else 0
        if (every and syncs >= next_kill and syncs < cfg["syncs"] - 1
                and kill_at is None):
            kill_at = time.time() + _phase_delay(r0, cfg)
        if kill_at and time.time() >= kill_at:
            kill_at = None
            kills.append(fleet.restart_all(syncs))
            next_kill = max(next_kill, kills[-1]["resume"] or 0) + every
        time.sleep(0.05)
    fleet.pump()
    return kills


def _ckpt_result(cfg: dict, fleet: _CkptFleet, kills: list[dict], tx: int, t0: float) -> dict:
    """The run's row, as bench.elastic.inside's: goodput over r0's rows, restarts, lost steps."""
    r0, done = fleet.rows["r0"], fleet.done
    wall = r0[-1]["time"] - r0[0]["time"]
    per_sync = cfg["h"] * cfg["replicas"]
    # the syncs after r0's first row: the wall starts at that row, so the steps before it do
    # not count (as ccfx's runs, whose first row is the join, weight 0)
    useful = per_sync * (r0[-1]["syncs"] - r0[0]["syncs"])
    restart = []
    for k in kills:
        after = r0[k["rows_before"]:]
        if after:
            restart.append(after[0]["time"] - k["time"])
    # the syncs since the checkpoint, and the part of an interval the kill landed in
    lost = sum(per_sync * (k["at_sync"] - (k["resume"] or 0) + cfg.get("kill_phase", 0.5))
               for k in kills)
    return {"run": cfg["run"], "codec": cfg["codec"], "replicas": cfg["replicas"],
            "syncs": r0[-1]["syncs"], "torchft_steps": [], "uncommitted": 0,
            "wall_s": wall, "useful_steps": useful, "goodput": useful / wall,
            "kills": len(kills), "first_commit_s": restart, "lost_steps": lost,
            "ready_s": [r["ready"] - r["started"] for r in fleet.ready[1:]],
            "sent_bytes": tx, "sent_bytes_per_sync": tx / max(len(r0), 1),
            "wire": done["r0"]["wire"], "raw": done["r0"]["raw"],
            "held_out": done["r0"].get("held_out"), "total_s": time.time() - t0}
