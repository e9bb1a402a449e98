"""Fault-tolerant local steps on torchft over a shaped link: goodput with replicas killed and
restarted against a run without failures (issue #20).

R replicas (default 4) of the tiny GPT, each ``ccfx.local_steps(model, opt,
fault_tolerant=True, sync_every=H, outer_codec=...)`` with FedAvg's outer step (lr 1, no
momentum: from a random init it beats DiLoCo's Nesterov, bench/README), AdamW inner steps as
bench/local_steps.py, each replica its own shard of the corpus. Every replica is a process in
a "machine" of its own with one link limited to ``--rate`` Mbit/s each way (``--link star``,
the default: bench/shaped.star, a network namespace per replica joined by a shaped veth pair
to a hub's bridge, as replicas on the internet each have an uplink and a downlink); ``--link
shared`` puts every replica in one namespace whose loopback is limited to ``--rate`` (one
medium for every byte). The torchft lighthouse
runs in the driver, in the hub (min_replicas 2, join_timeout_ms
``--grace-ms``, 1000 by default, heartbeat timeout ``--heartbeat-ms``, 300 by default: enough
for the tiny GPT, whose syncs never keep a link full; README recommends 3000 over slow links
that stay full, as the 10 M model's do). Every replica stops after the same committed sync
(``--syncs`` torchft steps, the join's included); r0, never killed, ends the run (a replica
restarted just before the end, with no sync left to join, is stopped).

Runs (each in a fresh namespace):
  free       no failures, outer codec ``--codec``
  failures   the same, and every ``--kill-every`` inner steps one replica (r1, r2, ... in
             turn; never r0, which evaluates) is SIGKILLed and started again at once; it joins
             and heals from a live peer at the others' next sync. How it comes back
             (``--restart``, one failures run per choice): ``cold``, a new process, as a
             supervisor (torchrun, k8s) restarts one: process start, imports, model;
             ``standby`` (row ``failures_standby``), a warm standby process started ahead
             (torch, ccfx and torchft imported, the model and AdamW built) takes its place at
             once; both join and heal the same way. The run starts one standby per kill it
             will make, all ready before the replicas start (a deployment's spares run on
             machines of their own; starting one on the cores the replicas share would slow
             the survivors, which a replacement on its own machine does not); ``spare`` (row
             ``failures_spare``): ``trainers=R`` and one hot spare more, on a machine of its
             own, in every quorum from the start with nothing to send: it watches the
             trainers and takes a killed one's training place (and reads its shard) when it
             dies, with no heal (``placed_s``: kill -> place taken); the victim's machine's
             warm standby then joins as the next spare
             (it heals, off the trainers' path). R + 1 machines against the free run's R
  raw        no failures, outer codec none (bytes and loss against the codec)
  tf_free, tf_failures   torchft's own DiLoCo, uncompressed (bench/elastic_baselines.py)
  ckpt       the checkpoint-restart floor: on a kill every replica restarts from the last
             checkpoint (bench/elastic_baselines.py)

A kill lands ``--kill-phase`` of the way into r0's sync interval after the kill is due (0.5:
where a failure lands on average). Each kill's time is split (``splits``: the victim's inner
steps since its last commit, its spawn, imports, data, model, torchft's manager, the join's
quorum and sync; a standby's spawn, imports and model are ~0: its ``imports`` is the wait
for the standby to be ready) and r0's sync rows say what the survivors waited
(``r0_quorum_s``).

Reported per run: wall time from r0's first to last committed sync; useful replica-steps, the
sum over committed syncs of the inner steps the quorum's replicas contributed (the ``weight``
of r0's sync rows: a killed replica's steps since its last commit are lost, a joiner
contributes 0); goodput = useful steps per second, and its ratio to ``free``; time from a
restarted replica's process start (before importing torch; a standby's activation) to its
first committed sync; bytes the replicas sent over the run and per committed sync (every
replica's traffic, the recovery's HTTP transfer included: star, what the hub's ports
received; shared, the loopback's) and ccfx's own count of
payload against raw fp32 bytes;
r0's held-out loss of the final global parameters (32 batches of the last 10 % of the corpus).

    python -m bench.elastic                                   # 4 replicas, 10 Mbit/s
    python -m bench.elastic --syncs 8 --kill-every 20 --replicas 3     # quicker
    python -m bench.elastic --runs free failures --restart cold standby
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import time

RUNS = ("free", "failures", "raw", "tf_free", "tf_failures", "ckpt")
GPT = {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32}  # bench/local_steps' "tiny"
LR, BATCH = 6e-3, 8


def drain(queues: dict, take) -> None:
    """Every message the replicas have put on their queues so far, to ``take(kind, name,
    data)``; a replica's ``"error"`` message raises here with its traceback."""
    for q in list(queues.values()):
        try:
            while True:
                kind, name, data = q.get_nowait()
                if kind == "error":
                    raise RuntimeError(f"replica {name} failed:\n{data}")
                take(kind, name, data)
        except queue.Empty:
            pass

def finished(index: int, step: int, stop_at) -> bool:
    """Whether replica ``index``, at torchft step ``step``, stops. ``stop_at`` is a shared pair:
    the last step of the run, and r0's step. r0 stops at the last step; the others train and
    sync on until r0 has reached it, then the driver stops them. (Each stopping at its own last
    step left an r0 that missed a quorum one step behind, alone in a quorum that never formed,
    until the run's timeout.)"""
    if index == 0:
        stop_at[1] = step
        return step >= stop_at[0]
    return stop_at[1] >= stop_at[0]


def replica(name: str, index: int, cfg: dict, stop_at, out, gate=None, spare=False) -> None:
    """One replica: trains until :func:`finished` says so; ``gate``: a barrier the first
    replicas pass together once each has imported and built its model (see :func:`_start`;
    a restarted one has none); puts
    ("row", name, sync row) after each sync and ("done", name, summary) at the end (or
    ("error", name, traceback))."""
    started = time.time()
    try:
        _become(cfg, index)
        if cfg.get("impl") == "torchft":
            from bench.elastic_baselines import tf_replica

            tf_replica(name, index, cfg, stop_at, out, started, gate)
        else:
            _replica(name, index, cfg, stop_at, out, started, gate=gate, spare=spare)
    except Exception:  # noqa: BLE001 (the driver reports it)
        import traceback

        out.put(("error", name, traceback.format_exc()))


def _become(cfg: dict, index: int) -> None:
    """Move this fresh process onto replica ``index``'s machine (``--link star``)."""
    if cfg.get("machines"):
        from bench.shaped import become_machine

        become_machine(**cfg["machines"][index])


def standby(cfg: dict, stop_at, go, out, index: int = 1) -> None:
    """A warm standby (``--restart standby``): a process started ahead of any failure that
    imports torch, ccfx and torchft, builds the model and AdamW and takes one throwaway step
    (torch's first-call costs), then waits on ``go`` for the name and shard of the replica it
    replaces. It does not start torchft's manager before then: a manager heartbeats, and the
    lighthouse would wait for it at every quorum. It waits on the machine of the replica it
    will replace (``index``: the kills' order is known ahead), idle: it sends nothing until it
    takes over. Then it is that replica (:func:`_replica`):
    it joins at the others' next sync and heals from a live peer, like a cold restart, without
    the process start, the imports and the model. What torchft's design allows (spares join
    the quorum) and what a deployment buys with an idle process per spare."""
    started = time.time()
    try:
        _become(cfg, index)
        import torch
        import torchft  # noqa: F401

        import ccfx  # noqa: F401 (what the replica imports: paid here, not after the kill)
        from bench.local_steps import _data

        torch.set_num_threads(1)
        model, opt = _build(cfg, 0, _data(cfg.get("gpt", GPT)["block_size"], 0, 0, BATCH)[2])
        x, y = torch.randint(0, model.config.vocab_size,
                             (2, BATCH, cfg.get("gpt", GPT)["block_size"]))
        model(x, y)[1].backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        opt = _adamw(model)  # a fresh optimizer: the throwaway step leaves no state behind
        out.put(("standby", None, {"started": started, "ready": time.time()}))
        name, taken, sent, spare = go.get()
        if taken != index:
            raise RuntimeError(f"standby on r{index}'s machine asked to be r{taken}")
        _replica(name, index, cfg, stop_at, out, sent, warm=(model, opt), spare=spare)
    except Exception:  # noqa: BLE001 (the driver reports it)
        import traceback

        out.put(("error", "standby", traceback.format_exc()))


def _adamw(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _build(cfg: dict, index: int, vocab: int):
    """The replica's model and its AdamW (whose first construction imports torch._dynamo).
    Every replica builds it from seed 0 (``init_sync=False``: no heal at step 0; a replica
    that joins later still heals), or with ``--init-sync`` from seed ``index`` (torchft sends
    every replica the first one's state at step 0, and a joiner must take the others')."""
    import torch

    from ccfx.models import GPTConfig, TinyGPT

    torch.manual_seed(index if cfg.get("init_sync") else 0)
    model = TinyGPT(GPTConfig(vocab_size=vocab, **cfg.get("gpt", GPT)))
    return model, _adamw(model)


def _start(gate, timeout_s: float) -> None:
    """The first replicas meet before their first sync: started together, they reach the join
    seconds apart (imports and models built on shared cores), and the join forms without the
    late ones, which heal at the next sync (a full model through the shaped link each): the
    run starts out of step. They meet once torchft's manager exists (ccfx's replicas: in
    ``Elastic``, just before the join), because the lighthouse waits ``join_timeout_ms`` only
    for replicas whose manager already heartbeats: meeting before ``ccfx.local_steps`` left
    the first quorum to whichever two managers started first (with the 10 M model two
    replicas missed the join and healed together at the next sync). A deployment starts its
    replicas ahead of the job the same way; a restarted replica joins alone, as it would."""
    if gate is not None:
        gate.wait(timeout_s)


def _replica(name, index, cfg, stop_at, out, started, warm=None, gate=None,
             spare=False) -> None:
    """Replica ``index`` (its data shard; with ``--restart spare``, its training place, or
    none for a ``spare``, which reads the shard of the place it takes once it has one)."""
    import torch

    import ccfx
    import ccfx.models  # imported before phases["imported"]: the phases time the imports
    from bench.local_steps import _data

    phases = {"started": started, "imported": time.time()}
    if cfg.get("keep_failed_group"):  # the behaviour before the abort, to measure it
        from ccfx.runtime.elastic import Elastic

        Elastic._leave_group = lambda self: None
    gpt = cfg.get("gpt", GPT)
    torch.set_num_threads(1)
    train, held_out, vocab = _data(gpt["block_size"], 0, index, BATCH)
    phases["data"] = time.time()
    model, opt = warm or _build(cfg, index, vocab)
    phases["model"] = time.time()
    if gate is not None:  # meet once torchft's manager heartbeats, just before the join
        _meet_before_join(gate, cfg["timeout_s"])
    places = ({"trainers": cfg["replicas"], "slot": None if spare else index}
              if cfg.get("restart") == "spare" else {})
    outer = ccfx.local_steps(
        model, opt, fault_tolerant=True, lighthouse=cfg["lighthouse"], replica_id=name,
        min_replicas=2, quorum_timeout_s=300.0, max_retries=20, sync_every=cfg["h"],
        outer_codec=cfg["codec"], outer_lr=1.0, outer_momentum=0.0,
        collective_timeout_s=cfg.get("collective_timeout_s", 60.0),
        init_sync=bool(cfg.get("init_sync")), **places)
    phases["joined"] = time.time()  # local_steps returns after the join's sync (the heal)
    if spare:  # ... and a spare's once it holds a place: that place's shard
        train, held_out, vocab = _data(gpt["block_size"], 0, outer.slot, BATCH)
    out.put(("phases", name, phases))
    seen = 0
    while True:
        for row in outer.elastic.history[seen:]:
            out.put(("row", name, {**row, "time": time.time(), "started": started}))
        seen = len(outer.elastic.history)
        if finished(index, outer.elastic.manager.current_step(), stop_at):
            break
        x, y = next(train)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    summary = _replica_summary(outer, index, held_out, vocab, gpt)
    outer.close()
    out.put(("done", name, summary))


def _meet_before_join(gate, timeout_s: float) -> None:
    """Have this process's ``Elastic`` meet the first replicas at ``gate`` (:func:`_start`)
    once torchft's manager heartbeats, just before the join."""
    from ccfx.runtime.elastic import Elastic

    keep = Elastic._keep_state_per_element

    def keep_then_meet(self):
        keep(self)
        _start(gate, timeout_s)

    Elastic._keep_state_per_element = keep_then_meet


def _replica_summary(outer, index: int, held_out, vocab: int, gpt: dict) -> dict:
    """A replica's bytes and steps; r0's also the held-out loss of the global parameters."""
    from bench.local_steps import _evaluate
    from ccfx.models import GPTConfig, TinyGPT

    summary = {"wire": outer.wire_bytes, "raw": outer.raw_bytes, "steps": outer.step}
    if index == 0:
        probe = TinyGPT(GPTConfig(vocab_size=vocab, **gpt))
        probe.load_state_dict({n: g for n, g in outer.global_parameters().items()},
                              strict=False)
        summary["held_out"] = _evaluate(probe, held_out)
    return summary


def sent_bytes(cfg: dict) -> int:
    """Bytes every replica has sent so far: over the star's links (what the hub's ports
    received), or over the shared namespace's loopback."""
    if cfg.get("star"):
        from bench.shaped import Star

        return Star(**cfg["star"]).sent_bytes()
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


class _Fleet:
    """A run's processes and what they report: the replicas, the warm standbys (one per kill,
    ``--restart standby|spare``) and the hot spare (``--restart spare``: in the quorum from the
    start on a machine of its own; the replicas hold the training places 0 .. R-1, and who
    holds which is read from their sync rows), their queues, and the sync rows, phases and
    results they send."""

    def __init__(self, cfg: dict, ctx, stop_at):
        self.cfg, self.ctx, self.stop_at = cfg, ctx, stop_at
        self.procs, self.queues = {}, {}
        self.rows: dict[str, list[dict]] = {}
        self.phases: dict[str, list[dict]] = {}
        self.done: dict[str, dict] = {}
        self.spares: list = []  # [(process, go, queue key, machine)], in kill order
        self.standby_s: list[float] = []  # each standby's start to ready
        self.hot = cfg.get("restart") == "spare"
        self.holder = {i: f"r{i}" for i in range(cfg["replicas"])}
        self.gate = ctx.Barrier(cfg["replicas"] + self.hot)  # the first replicas' start (_start)

    def start(self, name, index, restart=True):
        if restart and self.spares:  # a warm standby, waiting on this replica's machine, becomes it
            proc, go, key, on = self.spares.pop(0)  # (with --restart spare: a new spare)
            assert on == index, f"the next standby waits on r{on}'s machine, not r{index}'s"
            go.put((name, index, time.time(), self.hot))
            self.queues[name], self.procs[name] = self.queues.pop(key), proc
            return
        # one queue per replica: a SIGKILL mid-write would block a shared one
        self.queues[name] = self.ctx.Queue()
        self.procs[name] = self.ctx.Process(target=replica, args=(
            name, index, self.cfg, self.stop_at, self.queues[name],
            None if restart else self.gate), daemon=True)
        self.procs[name].start()

    def start_spare(self):
        """The hot spare, on a machine of its own (the place after the replicas')."""
        self.queues["spare0"] = self.ctx.Queue()
        self.procs["spare0"] = self.ctx.Process(target=replica, args=(
            "spare0", self.cfg["replicas"], self.cfg, self.stop_at, self.queues["spare0"],
            self.gate, True), daemon=True)
        self.procs["spare0"].start()

    def start_standbys(self):
        """One warm standby per kill the run will make, all ready before any replica starts: a
        deployment's spares run on machines of their own, and starting one later, on the cores
        the replicas share, would slow the survivors (a harness artifact)."""
        cfg = self.cfg
        every = cfg["kill_every"] // cfg["h"]
        for k in range(len(range(every, cfg["syncs"] - 1, every)) + 1 if every else 0):
            key, index = f"standby{k}", victim_of(k, cfg["replicas"])
            self.queues[key], go = self.ctx.Queue(), self.ctx.Queue()
            proc = self.ctx.Process(target=standby, args=(cfg, self.stop_at, go,
                                                          self.queues[key], index), daemon=True)
            proc.start()
            self.spares.append((proc, go, key, index))
        deadline = time.monotonic() + cfg["timeout_s"] / 2
        while len(self.standby_s) < len(self.spares):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.spares)} standbys not ready in "
                                   f"{cfg['timeout_s'] / 2} s")
            self.pump()
            time.sleep(0.1)

    def take(self, kind, name, data):
        if kind == "row":
            self.rows.setdefault(name, []).append(data)
            if data.get("slot") is not None and data["committed"]:
                self.holder[data["slot"]] = name
        elif kind == "phases":
            self.phases.setdefault(name, []).append(data)
        elif kind == "standby":
            self.standby_s.append(data["ready"] - data["started"])
        else:
            self.done[name] = data

    def pump(self):
        drain(self.queues, self.take)

    def kill(self, victim: int, step: int, kills: list[dict]) -> None:
        """SIGKILL the holder of place ``victim`` and start its replacement: with a hot spare,
        the victim machine's standby joins as a new spare (the place's first holder's machine:
        another process runs there if a spare took that place earlier, and the standby shares
        its link); else the replica comes back as ``--restart`` says."""
        name = self.holder[victim] if self.hot else f"r{victim}"
        killed_at = time.time()
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].join(10)
        self.queues.pop(name)
        kills.append({"name": name, "place": victim, "at_sync": step, "time": killed_at,
                      "rows_before": len(self.rows.get(name, [])),
                      "phases_before": len(self.phases.get(name, []))})
        if self.hot:
            kills[-1]["holder_was_first"] = name == f"r{victim}"
            self.start(f"spare{len(kills)}", victim)
        else:
            self.start(name, victim)

    def stop(self):
        for p in [*self.procs.values(), *(proc for proc, *_ in self.spares)]:
            if p.is_alive():
                p.kill()


def inside(cfg: dict) -> dict:
    """One run, in the namespace: the lighthouse, the replicas, the kills; the summary."""
    from torchft.coordination import LighthouseServer

    host = cfg["star"]["hub_address"] if cfg.get("star") else "127.0.0.1"
    lighthouse = LighthouseServer(bind=f"{host}:0", min_replicas=2,
                                  join_timeout_ms=cfg["grace_ms"],
                                  heartbeat_timeout_ms=cfg.get("heartbeat_ms", 1000),
                                  quorum_tick_ms=cfg.get("tick_ms"))
    port = lighthouse.address().rsplit(":", 1)[1]
    cfg = {**cfg, "lighthouse": f"http://{host}:{port}"}
    ctx = mp.get_context("spawn")
    stop_at = ctx.Array("i", [cfg["syncs"], 0])  # the last step; r0's step (finished())
    fleet = _Fleet(cfg, ctx, stop_at)
    tx0 = sent_bytes(cfg)
    t0 = time.time()
    if cfg.get("restart") in ("standby", "spare"):
        fleet.start_standbys()
    for i in range(cfg["replicas"]):
        fleet.start(f"r{i}", i, restart=False)
    if fleet.hot:
        fleet.start_spare()
    try:
        kills = _drive(fleet, cfg)
    finally:
        fleet.stop()
        lighthouse.shutdown()
    return _summary(cfg, fleet, kills, sent_bytes(cfg) - tx0, t0)


def _drive(fleet: _Fleet, cfg: dict) -> list[dict]:
    """Kill a replica every ``kill_every`` inner steps (at ``kill_phase`` of r0's interval)
    until every place's holder is done; the kills. r0 (never killed) ends the run; a replica
    restarted near the end may have no sync left to join: it is given a few seconds, then
    stopped."""
    names = [f"r{i}" for i in range(cfg["replicas"])]
    kills, victim = [], victim_of(0, cfg["replicas"])
    next_kill = cfg["kill_every"] // cfg["h"] if cfg["kill_every"] else None
    deadline = time.monotonic() + cfg["timeout_s"]
    r0_done_at = kill_at = None
    while not all(n in fleet.done for n in (fleet.holder.values() if fleet.hot else names)):
        if "r0" in fleet.done:
            r0_done_at = r0_done_at or time.monotonic()
            if time.monotonic() - r0_done_at > 10:
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"run did not finish in {cfg['timeout_s']} s; done {fleet.done}")
        fleet.pump()
        r0 = [r for r in fleet.rows.get("r0", []) if r["committed"]]
        step = r0[-1]["torchft_step"] if r0 else 0
        if next_kill is not None and step >= next_kill and step < cfg["syncs"] - 1:
            kill_at = kill_at or time.time() + _phase_delay(r0, cfg)
        if kill_at and time.time() >= kill_at:
            kill_at = None
            fleet.kill(victim, step, kills)
            victim = victim_of(len(kills), cfg["replicas"])
            next_kill += cfg["kill_every"] // cfg["h"]
        time.sleep(0.05)
    fleet.pump()
    return kills


def _kill_times(kills: list[dict], fleet: _Fleet) -> tuple[list, list, list]:
    """Per kill: the seconds to the first committed sync in the place, its split
    (:func:`_split`) and, with a hot spare, to the place taken (the holder's ``local_steps``
    returned: at the death, or at the sync's meet)."""
    rows, phases = fleet.rows, fleet.phases
    first_commit, splits, placed = [], [], []
    for k in kills:
        if fleet.hot:  # the first committed sync in which another replica holds the place
            taken = [(r, n) for n, rs in rows.items() if n != k["name"] for r in rs
                     if r["committed"] and r.get("slot") == k["place"] and r["time"] > k["time"]]
            if taken:
                first, holder = min(taken, key=lambda rn: rn[0]["time"])
                first_commit.append(first["time"] - k["time"])
                splits.append(_split(k, first, [], rows))
                took = [p["joined"] for p in phases.get(holder, []) if p["joined"] > k["time"]]
                placed.append(min(took) - k["time"] if took else None)
            continue
        later = [r for r in rows.get(k["name"], [])[k["rows_before"]:] if r["committed"]]
        if later:
            first_commit.append(later[0]["time"] - later[0]["started"])
            splits.append(_split(k, later[0], phases.get(k["name"], []), rows))
    return first_commit, splits, placed


def _useful_steps(cfg: dict, rows: dict, r0: list[dict]) -> int:
    """Inner steps that reached a committed sync: r0's rows hold the quorum's total; torchft's
    rows are per replica, each its own contribution, counted after r0's first commit (as the
    wall: that commit's steps were trained before it)."""
    if cfg.get("impl") != "torchft":
        return sum(r["weight"] for r in r0)
    lo, hi = r0[0]["torchft_step"], r0[-1]["torchft_step"]
    return sum(r["weight"] for rs in rows.values() for r in rs
               if r["committed"] and lo < r["torchft_step"] <= hi)


def _summary(cfg: dict, fleet: _Fleet, kills: list[dict], tx: int, t0: float) -> dict:
    """The run's row: syncs, wall, goodput, the kills' times, r0's syncs and quorums, the
    heals, the bytes, and every replica's sync rows (for reading a run afterwards)."""
    rows, done = fleet.rows, fleet.done
    r0 = [r for r in rows["r0"] if r["committed"]]
    wall = r0[-1]["time"] - r0[0]["time"]
    useful = _useful_steps(cfg, rows, r0)
    first_commit, splits, placed = _kill_times(kills, fleet)
    return {"run": cfg["run"], "codec": cfg["codec"], "replicas": cfg["replicas"],
            "restart": cfg.get("restart", "cold"), "standby_ready_s": fleet.standby_s,
            "syncs": len(r0), "torchft_steps": [r["torchft_step"] for r in r0],
            "uncommitted": sum(1 for r in rows["r0"] if not r["committed"]),
            "wall_s": wall, "useful_steps": useful, "goodput": useful / wall,
            "kills": len(kills), "first_commit_s": first_commit, "splits": splits,
            "placed_s": placed,  # --restart spare: kill -> the place taken (local_steps returned)
            "killed": [{k: v for k, v in kill.items() if k in ("name", "place", "at_sync",
                                                              "holder_was_first")}
                       for kill in kills],
            "r0_sync_s": [round(r.get("seconds", 0.0), 3) for r in rows["r0"]],
            "r0_quorum": [r["replicas"] for r in rows["r0"]],
            "r0_quorum_s": [round(r.get("quorum_s", 0.0), 3) for r in rows["r0"]],
            "heals": {n: sum(1 for r in rs if r.get("healed")) for n, rs in sorted(rows.items())},
            # r0's sync time at the torchft steps where another replica healed (with torchft's
            # transport the survivors waited there for the heal's transfer), and the heals'
            # fetch after the exchange (ccfx's lazy heal)
            "r0_sync_s_with_heal": [round(r.get("seconds", 0.0), 3) for r in rows["r0"]
                                    if r["torchft_step"] in _heal_steps(rows, "r0")],
            "heal_fetch_s": [round(r["heal_s"], 3) for rs in rows.values() for r in rs
                             if r.get("heal_s") is not None],
            "sent_bytes": tx,
            "sent_bytes_per_sync": tx / max(len(r0), 1), "wire": done["r0"]["wire"],
            "raw": done["r0"]["raw"], "held_out": done["r0"].get("held_out"),
            "total_s": time.time() - t0,
            "rows": {n: [{k: r.get(k) for k in ("torchft_step", "step", "replicas", "committed",
                                                 "healed", "own", "slot", "seconds", "quorum_s",
                                                 "heal_s", "compile_s", "error", "time")}
                         for r in rs] for n, rs in sorted(rows.items())}}


def _heal_steps(rows: dict, but: str) -> set[int]:
    """The torchft steps at which a replica other than ``but`` healed and committed."""
    return {r["torchft_step"] for n, rs in rows.items() if n != but for r in rs
            if r.get("healed") and r["committed"]}


def victim_of(k: int, replicas: int) -> int:
    """The replica the ``k``-th kill takes: r1, r2, ... in turn, never r0 (which evaluates)."""
    return k % (replicas - 1) + 1


def _phase_delay(r0_rows: list[dict], cfg: dict) -> float:
    """Seconds from r0's commit to the kill: ``kill_phase`` of the median time between r0's
    committed syncs (0.5: mid-interval, where a failure lands on average; 0: right after a
    commit, which loses no inner steps and flatters the elastic runs)."""
    times = [r["time"] for r in r0_rows[-9:]]
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return cfg.get("kill_phase", 0.5) * (gaps[len(gaps) // 2] if gaps else 0.5)


def _split(kill: dict, first: dict, phases: list[dict], rows: dict) -> dict:
    """Where one kill's time goes (seconds): the victim's restart phases, from the SIGKILL to
    its first committed sync, and the steps it lost since its last commit (its last committed
    row's inner step against its step count when killed, from the time since that row)."""
    mine = phases[kill["phases_before"]] if len(phases) > kill["phases_before"] else {}
    before = [r for r in rows.get(kill["name"], [])[:kill["rows_before"]] if r["committed"]]
    out = {"since_commit_s": kill["time"] - before[-1]["time"] if before else None}
    if mine:
        marks = [("spawn", kill["time"]), ("imports", mine["started"]),
                 ("data", mine["imported"]), ("model", mine["data"])]
        end = mine.get("joined", mine.get("manager"))
        marks += [("join", mine["model"]), ("to_commit", end)]
        stamps = [t for _, t in marks] + [first["time"]]
        out.update({name: round(b - a, 3) for (name, a), b in zip(marks, stamps[1:])})
        join_row = rows[kill["name"]][kill["rows_before"]]
        if "joined" in mine:  # ccfx: the join is a sync; before it, torchft's manager starts
            out["join_sync"] = round(join_row["seconds"], 3)
            out["join_quorum"] = round(join_row.get("quorum_s", 0.0), 3)
    out["total"] = round(first["time"] - kill["time"], 3)
    return out


def run_one(cfg: dict, rate: float | None, link: str = "star", log: str | None = None) -> dict:
    """``inside(cfg)`` on fresh links shaped to ``rate`` Mbit/s: the hub of a star whose every
    replica has a machine of its own (``link="star"``), or one shared namespace. ``log``: a
    file for the run's stderr (the replicas' warnings: failed syncs, failed heals)."""
    import dataclasses

    from bench.shaped import shaped_namespace, star

    with contextlib.ExitStack() as stack:
        if link == "star":
            machines = cfg["replicas"] + (cfg.get("restart") == "spare")  # the spare's own
            net = stack.enter_context(star(machines, rate))
            cfg = {**cfg, "star": dataclasses.asdict(net),
                   "machines": [net.machine(i) for i in range(machines)]}
            ns = net.hub
        else:
            ns = stack.enter_context(shaped_namespace(rate))
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.elastic", "--inside",
               json.dumps(cfg)]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True,
                              timeout=cfg["timeout_s"] + 60, env={**os.environ, "RUST_LOG": "error"})
    if log:
        with open(log, "w") as f:
            f.write(done.stderr)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"run {cfg['run']} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    """Goodput against the failure-free run of the same implementation (torchft's DiLoCo
    against ``tf_free``; ccfx's runs and the checkpoint restart against ``free``); bytes per
    sync against ``raw`` and against torchft's DiLoCo without failures."""
    by = {r["run"]: r for r in rows if "failed" not in r}
    out = [("| run | codec | kills | committed syncs (failed) | wall s | useful steps | goodput "
            "(steps/s) | vs free | kill → first commit s | sent MB / sync | vs raw | vs torchft "
            "| ccfx wire / raw | held-out loss |"), "|" + " --- |" * 14]
    for r in rows:
        if "failed" in r:
            out.append(f"| {r['run']} | failed: {r['failed']} |")
            continue
        first = (f"{min(r['first_commit_s']):.1f}–{max(r['first_commit_s']):.1f}"
                 if r["first_commit_s"] else "–")
        free = by.get("tf_free" if r["run"].startswith("tf_") else "free")
        vs_free = f"{r['goodput'] / free['goodput']:.0%}" if free else "–"
        ratios = []
        for ref in ("raw", "tf_free"):
            ratios.append(f"{by[ref]['sent_bytes_per_sync'] / r['sent_bytes_per_sync']:.2f}x"
                          if ref in by else "–")
        wire = f"{r['wire'] / max(r['raw'], 1):.3f}" if r.get("wire") is not None else "–"
        out.append(f"| {r['run']} | {r['codec']} | {r['kills']} | {r['syncs']} "
                   f"({r['uncommitted']}) | {r['wall_s']:.1f} | {r['useful_steps']} | "
                   f"{r['goodput']:.2f} | {vs_free} | {first} | "
                   f"{r['sent_bytes_per_sync'] / 1e6:.2f} | {ratios[0]} | {ratios[1]} | "
                   f"{wire} | {r['held_out']:.3f} |")
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    """The command line: the runs, the harness (link, lighthouse, kills) and the run's limits."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rate", type=float, default=10.0, help="Mbit/s (0: unshaped)")
    p.add_argument("--link", choices=["star", "shared"], default="star",
                   help="star: each replica its own link of --rate each way to a hub (as over "
                        "the internet); shared: one loopback of --rate for every replica")
    p.add_argument("--h", type=int, default=10, help="sync_every")
    p.add_argument("--syncs", type=int, default=40,
                   help="torchft steps per run (the join included)")
    p.add_argument("--kill-every", type=int, default=100, help="inner steps between kills")
    p.add_argument("--codec", default="int8")
    p.add_argument("--grace-ms", type=int, default=1000, help="lighthouse join_timeout_ms")
    p.add_argument("--runs", nargs="+", default=["free", "failures", "raw"],
                   help=f"any of {', '.join(RUNS)}")
    p.add_argument("--tf-outer", choices=["fedavg", "nesterov"], default="fedavg",
                   help="torchft DiLoCo's outer SGD: ccfx's (lr 1, no momentum) or DiLoCo's")
    p.add_argument("--model", choices=["tiny", "demo", "10m"], default="tiny",
                   help="bench/local_steps' GPT shapes (tiny 0.11 M, demo 3.2 M, 10m 10.7 M)")
    p.add_argument("--heartbeat-ms", type=int, default=300,
                   help="lighthouse heartbeat_timeout_ms: how soon a dead replica is dropped "
                        "(torchft's managers beat every 100 ms from a Rust thread: 300 is 3 "
                        "missed beats; torchft's default, 5000, stalls every quorum after a "
                        "death that long)")
    p.add_argument("--tick-ms", type=int, default=None,
                   help="lighthouse quorum_tick_ms (default: torchft's)")
    p.add_argument("--kill-phase", type=float, default=0.5,
                   help="where in the sync interval a kill lands (0: right after a commit)")
    p.add_argument("--ckpt-every", type=int, default=1, help="syncs between checkpoints (ckpt)")
    p.add_argument("--collective-timeout-s", type=float, default=60.0,
                   help="ccfx's collective_timeout_s: the survivors' exchange waits for a "
                        "joiner's heal, so it must cover the state's transfer (the 10 M "
                        "model: 42.8 MB, 34 s at 10 Mbit/s per healer on one source's uplink)")
    p.add_argument("--tf-timeout-s", type=float, default=60,
                   help="torchft DiLoCo's manager timeout (collectives, the checkpoint lock)")
    p.add_argument("--restart", nargs="+", choices=["cold", "standby", "spare"],
                   default=["cold"],
                   help="how a killed replica comes back in ccfx's failures run (one run per "
                        "choice): cold, a new process (imports, model); standby, a warm "
                        "process started ahead that takes its place; spare, a hot spare in "
                        "every quorum (trainers=R) takes the place at the next sync, and the "
                        "machine's warm standby joins as the next spare")
    p.add_argument("--init-sync", action="store_true",
                   help="replicas built from different seeds, torchft's heal at step 0 (each "
                        "replica gets the first one's state, from that one's link); default: "
                        "built alike, init_sync=False")
    p.add_argument("--keep-failed-group", action="store_true",
                   help="a replica whose exchange failed does not abort the quorum's group "
                        "(ccfx without the abort: measures what the abort buys)")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--json", help="write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.inside:
        cfg = json.loads(a.inside)
        if cfg["run"] == "ckpt":
            from bench.elastic_baselines import inside_ckpt

            print(json.dumps(inside_ckpt(cfg)), flush=True)
        else:
            print(json.dumps(inside(cfg)), flush=True)
        return 0
    from bench.local_steps import MODELS

    rows = []
    plan = [(run, restart) for run in a.runs
            for restart in (a.restart if run == "failures" else ["cold"])]
    for run, restart in plan:
        if run not in RUNS:
            p.error(f"unknown run {run!r}: choose from {', '.join(RUNS)}")
        tf = run.startswith("tf_")
        cfg = {"run": run if restart == "cold" else f"{run}_{restart}", "restart": restart,
               "replicas": a.replicas, "h": a.h, "syncs": a.syncs,
               "codec": "none" if run == "raw" or tf else a.codec, "grace_ms": a.grace_ms,
               "kill_every": a.kill_every if run in ("failures", "tf_failures", "ckpt") else 0,
               "timeout_s": a.timeout_s, "impl": "torchft" if tf else "ccfx",
               "tf_outer": a.tf_outer, "ckpt_every": a.ckpt_every, "kill_phase": a.kill_phase,
               "heartbeat_ms": a.heartbeat_ms, "tick_ms": a.tick_ms,
               "tf_timeout_s": a.tf_timeout_s,
               "collective_timeout_s": a.collective_timeout_s, "keep_failed_group": a.keep_failed_group,
               "init_sync": a.init_sync,
               "gpt": MODELS[a.model]["gpt"]}
        print(f"[elastic] {cfg['run']} ...", flush=True)
        log = f"{a.json}.{cfg['run']}.log" if a.json else None
        try:
            rows.append(run_one(cfg, a.rate or None, a.link, log))
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other runs still run
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            rows.append({"run": cfg["run"], "failed": lines[-1][:300] if lines else repr(e)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{a.replicas} replicas, {a.model} GPT, H={a.h}, {a.rate:g} Mbit/s "
          f"({'a link per replica' if a.link == 'star' else 'one shared loopback'}), kill every "
          f"{a.kill_every} at phase {a.kill_phase:g}, lighthouse heartbeat {a.heartbeat_ms} ms "
          f"tick {a.tick_ms or 'default'}, grace {a.grace_ms} ms, "
          f"{'init sync (a heal at step 0)' if a.init_sync else 'built alike (no heal at step 0)'}"
          f"{', failed groups kept (no abort)' if a.keep_failed_group else ''}, "
          f"load {os.getloadavg()[0]:.1f}\n")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
