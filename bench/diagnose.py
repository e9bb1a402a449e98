"""Name a slowed rank and a slowed link: ``ccfx.diagnose`` on gloo ranks that each run on a
"machine" of their own (:func:`bench.shaped.star`: a network namespace with its own veth link
to a hub's bridge).

    python -m bench.diagnose --slow-link 0 2 --slow-mbit 20 --late-rank 1 --late-ms 100

Three cases, each a fresh star of ``--world`` machines and ranks training a small MLP under
DDP with ccfx's comm hook (int8) for ``--steps`` steps, then one ``ccfx.diagnose(model,
links=True)``:

* ``link``: the link from machine ``src`` to machine ``dst`` is slow for real: an htb class of
  ``--slow-mbit`` on ``src``'s veth, which a u32 filter gives only the packets addressed to
  ``dst`` (every other link, and ``dst`` -> ``src``, stay unshaped);
* ``rank``: rank ``--late-rank`` sleeps ``--late-ms`` before each backward (a slower compute);
* ``both``: the two at once.

It prints, per case, what was slowed and what the diagnosis said, and each rank-0 report.
Codecs run eagerly (``CCFX_CODEC_COMPILE=0``): the diagnosis does not depend on their speed.
Needs root (namespaces, tc), as every shaped benchmark here.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from bench.shaped import _run_all, exit_cleanly_on_sigterm, run_ranks, star


def _model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 16))


def run_rank(rank: int, world_size: int, steps: int, late_rank: int, late_s: float,
             probe_bytes: int) -> dict:
    """In each rank: ``steps`` DDP steps (rank ``late_rank`` sleeps ``late_s`` before each
    backward), then ``ccfx.diagnose`` with the link probe; what it said."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ccfx

    model = DDP(_model(rank), bucket_cap_mb=0.5)
    model.register_comm_hook(*ccfx.ddp_comm_hook("int8"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        start = time.monotonic()
        loss = model(torch.randn(32, 256, generator=gen)).square().mean()
        if rank == late_rank:
            time.sleep(late_s)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.monotonic() - start)
    d = ccfx.diagnose(model, links=True, probe_bytes=probe_bytes)
    return {"slow_ranks": d.slow_ranks, "slow_links": [list(li) for li in d.slow_links],
            "late_s": {str(r.rank): r.late_s for r in d.ranks},
            "mbit_s": {f"{li.src}->{li.dst}": li.mbit_s for li in d.links},
            "transfer_s": {f"{li.src}->{li.dst}": li.transfer_s for li in d.links},
            "step_s": statistics.median(times), "text": str(d)}


def slow_one_link(net, src: int, dst: int, mbit: float) -> None:
    """Limit only machine ``src``'s packets to machine ``dst`` to ``mbit`` (htb + u32)."""
    ns, dev = net.namespaces[src], net.interfaces[src]
    tc = ["tc", "-n", ns]
    _run_all([[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
              [*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
               "rate", "10gbit"],
              [*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb",
               "rate", f"{mbit:g}mbit", "burst", "32kb"],
              [*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "u32",
               "match", "ip", "dst", f"{net.addresses[dst]}/32", "flowid", "1:20"]],
             "htb and u32 need CAP_NET_ADMIN and the sch_htb / cls_u32 kernel modules")


def run_case(case: str, args) -> dict:
    """One case on a fresh star; rank 0's answer, with what was slowed."""
    link = tuple(args.slow_link) if case in ("link", "both") else None
    late = args.late_rank if case in ("rank", "both") else -1
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(star(args.world, None))
        if link is not None:
            slow_one_link(net, *link, args.slow_mbit)
        env = [{"GLOO_SOCKET_IFNAME": net.interfaces[r], "TP_SOCKET_IFNAME": net.interfaces[r],
                "MASTER_ADDR": net.addresses[0]} for r in range(args.world)]
        got = run_ranks("bench.diagnose", "run_rank", args.world,
                        {"steps": args.steps, "late_rank": late, "late_s": args.late_ms / 1e3,
                         "probe_bytes": args.probe_kb << 10},
                        netns=list(net.namespaces), rank_env=env, timeout_s=args.timeout_s,
                        env={"CCFX_CODEC_COMPILE": "0"})  # eager codecs: no compile to wait for
    return {"case": case, "link": link, "late_rank": late if late >= 0 else None, **got[0]}


def _row(r: dict, args) -> str:
    slowed = []
    if r["link"] is not None:
        slowed.append(f"link {r['link'][0]}->{r['link'][1]} at {args.slow_mbit:g} Mbit/s")
    if r["late_rank"] is not None:
        slowed.append(f"rank {r['late_rank']} +{args.late_ms:g} ms/step")
    links = ", ".join(f"{a}->{b} ({r['mbit_s'][f'{a}->{b}']:.0f} Mbit/s)"
                      for a, b in r["slow_links"]) or "none"
    ranks = ", ".join(f"{k} ({r['late_s'][str(k)] * 1e3:.0f} ms late)"
                      for k in r["slow_ranks"]) or "none"
    rest = [v for k, v in r["transfer_s"].items()
            if [int(x) for x in k.split("->")] not in r["slow_links"]]
    return (f"| {r['case']} | {' + '.join(slowed)} | {ranks} | {links} | "
            f"{max(rest) * 1e3:.1f} | {r['step_s'] * 1e3:.0f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--slow-link", type=int, nargs=2, default=[0, 2], metavar=("SRC", "DST"))
    p.add_argument("--slow-mbit", type=float, default=20.0)
    p.add_argument("--late-rank", type=int, default=1)
    p.add_argument("--late-ms", type=float, default=100.0)
    p.add_argument("--probe-kb", type=int, default=1024)
    p.add_argument("--cases", default="link,rank,both")
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    exit_cleanly_on_sigterm()
    rows = [run_case(c, args) for c in args.cases.split(",")]
    for r in rows:
        print(f"--- {r['case']} (rank 0's report)\n{r['text']}\n")
    print("| case | slowed | slow ranks named | slow links named | other links' slowest "
          "transfer, ms | median step, ms |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(_row(r, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
