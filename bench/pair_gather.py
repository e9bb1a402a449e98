"""What gloo's collectives get through the slow link of the two-"node" harness (#19): why a
2-rank all-gather costs more than its bytes (:data:`ccfx.wire.link.PAIR_GATHER_WAIT`).

Four ranks placed as ``bench.layouts``' pp2-dp2 "replicas across" (ranks 0, 1 on node 0;
2, 3 on node 1), groups {0, 2} and {1, 3} (each crosses the link). Each pattern moves
``--mbytes`` per rank, timed ``--repeats`` times after a barrier (the slowest rank's time), and
is printed as a multiple of the time its bytes take one way at the measured link rate:

  send_one_way        rank 0 -> rank 2 only: the link's rate
  gather_one_pair     all_gather_into_tensor over {0, 2}: both directions on one connection
  gather_two_pairs    both groups at once (the two stages' bucket exchanges)
  gather_8_chunks     the two pairs, each payload as 8 all-gathers issued at once
  all_reduce_two      an all-reduce of the same bytes in both groups (gloo chunks it)
  gather_4_ranks      one all-gather over the four ranks (a ring: sends and receives on
                      different pairs)

    python -m bench.pair_gather --mbit 50 --repeats 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.shaped import exit_cleanly_on_sigterm, run_ranks, two_nodes

PLACEMENT = [0, 0, 1, 1]
#: what TCP gets through the tbf-limited pair (bench.layouts: 48.1 Mbit/s at --mbit 50)
EFFICIENCY = 48.1 / 50


def rank_fn(rank: int, world: int, *, nbytes: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    out = torch.empty(2 * nbytes, dtype=torch.uint8)
    flat = torch.randn(nbytes // 4)
    n = nbytes // 8
    outs = [torch.empty(2 * n, dtype=torch.uint8) for _ in range(8)]
    everyone = torch.empty(world * nbytes, dtype=torch.uint8)

    def one_way():
        if rank == 0:
            dist.send(x, 2)
        elif rank == 2:
            dist.recv(x, 0)

    def chunks():
        works = [dist.all_gather_into_tensor(outs[i], x[i * n:(i + 1) * n], group=mine,
                                             async_op=True) for i in range(8)]
        for w in works:
            w.wait()

    patterns = {
        "send_one_way": (one_way, (0, 2), 1),
        "gather_one_pair": (lambda: dist.all_gather_into_tensor(out, x, group=mine), (0, 2), 1),
        "gather_two_pairs": (lambda: dist.all_gather_into_tensor(out, x, group=mine),
                             range(4), 2),
        "gather_8_chunks": (chunks, range(4), 2),
        "all_reduce_two": (lambda: dist.all_reduce(flat, group=mine), range(4), 2),
        "gather_4_ranks": (lambda: dist.all_gather_into_tensor(everyone, x), range(4), 3),
    }
    res = {}
    for name, (fn, who, payloads) in patterns.items():
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank in who:
                fn()
            times.append(time.perf_counter() - t0)
        res[name] = {"times": times, "payloads": payloads}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--mbit", type=float, default=50.0)
    ap.add_argument("--mbytes", type=float, default=5.4, help="payload per rank (MB)")
    ap.add_argument("--repeats", type=int, default=6)
    a = ap.parse_args(argv)
    exit_cleanly_on_sigterm()
    nbytes = int(a.mbytes * 1e6) // 64 * 64
    with two_nodes(a.mbit) as nodes:
        netns, env = nodes.launch(PLACEMENT)
        res = run_ranks("bench.pair_gather", "rank_fn", 4,
                        {"nbytes": nbytes, "repeats": a.repeats},
                        netns=netns, rank_env=env, timeout_s=900, stall_s=300)
    one = nbytes * 8 / (a.mbit * EFFICIENCY * 1e6)  # one payload, one way
    print(f"{nbytes / 1e6:.2f} MB per rank, one payload one way {one:.3f} s at "
          f"{a.mbit * EFFICIENCY:g} Mbit/s")
    for name, row in res[0].items():
        slowest = [max(r[name]["times"][i] for r in res) for i in range(a.repeats)]
        ideal = one * row["payloads"]
        print(f"{name:>17}: median {statistics.median(slowest):.3f} s = "
              f"{statistics.median(slowest) / ideal:.2f}x its bytes' time ({ideal:.3f} s); "
              f"each {', '.join(f'{t / ideal:.2f}' for t in slowest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
