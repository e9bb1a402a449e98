"""bench/elastic.py's accounting, without processes: where a kill lands in the sync interval,
the split of one kill's time, the table's ratios (goodput against the same
implementation's failure-free run, bytes against raw and torchft's DiLoCo), and the star of
links it runs on (one process per machine; needs root for network namespaces)."""

import multiprocessing as mp
import socket

import pytest

from bench import elastic, shaped


def test_kill_lands_at_the_phase_of_the_median_sync_interval():
    rows = [{"time": t} for t in (0.0, 1.0, 2.0, 3.5, 4.5)]  # gaps 1, 1, 1.5, 1
    assert elastic._phase_delay(rows, {"kill_phase": 0.5}) == pytest.approx(0.5)
    assert elastic._phase_delay(rows, {"kill_phase": 0.0}) == 0.0
    assert elastic._phase_delay([], {}) == pytest.approx(0.25)  # no interval yet: 0.5 s


def test_split_of_one_kill_adds_up_to_kill_to_first_commit():
    kill = {"name": "r1", "time": 100.0, "rows_before": 2, "phases_before": 1}
    rows = {"r1": [{"committed": True, "time": 98.0}, {"committed": True, "time": 99.6},
                   {"committed": True, "time": 104.0, "seconds": 1.25, "quorum_s": 1.0}]}
    phases = [{}, {"started": 100.2, "imported": 102.0, "data": 102.1, "model": 102.2,
                   "joined": 104.0}]
    split = elastic._split(kill, rows["r1"][2], phases, rows)
    assert split["since_commit_s"] == pytest.approx(0.4)
    assert split["spawn"] == pytest.approx(0.2) and split["imports"] == pytest.approx(1.8)
    assert split["join"] == pytest.approx(1.8) and split["join_sync"] == 1.25
    assert split["join_quorum"] == 1.0
    parts = ("spawn", "imports", "data", "model", "join", "to_commit")
    assert sum(split[p] for p in parts) == pytest.approx(split["total"]) == pytest.approx(4.0)


def _row(run, goodput, per_sync, wire=1, raw=4):
    return {"run": run, "codec": "x", "kills": 0, "syncs": 10, "uncommitted": 0,
            "wall_s": 10.0, "useful_steps": 100, "goodput": goodput, "first_commit_s": [],
            "sent_bytes_per_sync": per_sync, "wire": wire, "raw": raw, "held_out": 2.5}


def test_table_compares_each_run_with_its_own_free_run_and_bytes_with_torchft():
    rows = [_row("free", 10.0, 1e6), _row("failures", 8.0, 1e6), _row("raw", 3.0, 4e6),
            _row("tf_free", 4.0, 5e6, wire=None), _row("tf_failures", 2.0, 5e6, wire=None),
            _row("ckpt", 5.0, 1e6)]
    lines = {line.split(" | ")[0][2:]: line for line in elastic.table(rows).splitlines()[2:]}
    assert "| 80% |" in lines["failures"] and "| 50% |" in lines["ckpt"]
    assert "| 50% |" in lines["tf_failures"]  # against tf_free, not ccfx's free
    assert "| 4.00x | 5.00x |" in lines["free"]  # fewer bytes than raw, than torchft
    assert "| 0.250 |" in lines["free"] and "| – |" in lines["tf_free"]


def test_a_failed_run_is_a_row_that_says_why_and_the_others_are_still_compared():
    rows = [{"run": "free", "failed": "CollectiveError: no quorum formed within 300 s"},
            _row("failures", 8.0, 1e6), _row("raw", 3.0, 4e6)]
    lines = {line.split(" | ")[0][2:]: line for line in elastic.table(rows).splitlines()[2:]}
    assert "failed: CollectiveError: no quorum" in lines["free"]
    assert "| – |" in lines["failures"]  # no free run to compare with: no ratio, no crash
    assert "| 4.00x |" in lines["failures"]


def test_kills_take_every_replica_but_r0_in_turn():
    assert [elastic.victim_of(k, 4) for k in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert [elastic.victim_of(k, 2) for k in range(3)] == [1, 1, 1]


def _machine_server(machine, out):
    shaped.become_machine(**machine)
    srv = socket.create_server((socket.gethostname(), 0))  # the machine's own address
    out.put(srv.getsockname())
    conn, _ = srv.accept()
    got = 0
    while chunk := conn.recv(1 << 16):
        got += len(chunk)
    out.put(got)


def _machine_client(machine, server, out):
    shaped.become_machine(**machine)
    try:  # 127.0.0.1 is this machine's own loopback, where nothing listens
        socket.create_connection(("127.0.0.1", server[1]), timeout=5).close()
        out.put("reached the server on 127.0.0.1")
    except ConnectionRefusedError:
        pass
    with socket.create_connection(tuple(server), timeout=10) as s:
        s.sendall(b"x" * 300_000)
    out.put("sent")


def test_a_star_gives_each_replica_a_machine_of_its_own_reached_through_the_hub():
    """bench/elastic's harness (``--link star``): a process that becomes machine i sits in its
    own namespace, advertises its link's address and reaches the others only through the hub,
    whose counters see every byte a machine sends."""
    ctx = mp.get_context("spawn")
    try:
        net_cm = shaped.star(2, None)
        net = net_cm.__enter__()
    except shaped.ShapingUnavailable as e:
        pytest.skip(f"no network namespaces here: {e}")
    try:
        before = net.sent_bytes()
        out_s, out_c = ctx.Queue(), ctx.Queue()
        server = ctx.Process(target=_machine_server, args=(net.machine(0), out_s))
        server.start()
        host, port = out_s.get(timeout=30)
        assert host == net.addresses[0]
        client = ctx.Process(target=_machine_client, args=(net.machine(1), (host, port), out_c))
        client.start()
        assert out_c.get(timeout=30) == "sent"
        assert out_s.get(timeout=30) == 300_000
        server.join(10), client.join(10)
        assert net.sent_bytes() - before >= 300_000
    finally:
        for p in mp.active_children():
            p.kill()
        net_cm.__exit__(None, None, None)
