r"""Fault-tolerant local steps on torchft: a replica dies, the others train on, it comes back.

Start a lighthouse once; it forms each sync's quorum from the replicas alive at that moment
(`pip install 'ccfx[ft]'` installs torchft and its `torchft_lighthouse`):

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --heartbeat_timeout_ms 3000 \
        --bind 127.0.0.1:29510 &

Then each replica, in a shell of its own (on other machines: MASTER_ADDR=<an address of this
machine the others reach>, and the lighthouse's URL with its host):

    REPLICA_ID=0 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 python examples/fault_tolerance.py
    REPLICA_ID=1 TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 python examples/fault_tolerance.py

Sizing: `--min_replicas 1` (and `min_replicas=1` below) lets a quorum of one commit, so when a
replica is killed (Ctrl-C, kill -9) the survivor goes on alone; with 2 of 2 it would stall
until a second replica came back. Start the killed one again (the same command): it joins at
the survivor's next sync and heals from it; the rows of `outer.elastic.history` it prints show
it (`healed True`, then `replicas 2`).
"""

import argparse
import hashlib
import os

import torch
from torch import nn

import ccfx


def build_model() -> nn.Module:
    torch.manual_seed(0)                       # every replica builds the model alike
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 1))


def show(row: dict) -> None:
    """One sync of this replica: its inner step, the quorum's size, committed or not."""
    print(f"sync at step {row['step']}: torchft step {row['torchft_step']}, replicas "
          f"{row['replicas']}, committed {row['committed']}, healed {row['healed']}"
          + (f", error {row['error']}" if row["error"] else ""), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()

    # Any model, compiled or not (compiled: run one forward and backward before local_steps,
    # or compiling after the join makes this replica late for its first sync).
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # Joins the lighthouse's quorum (TORCHFT_LIGHTHOUSE, REPLICA_ID from the environment);
    # a replica that starts late waits here for the others' next sync and heals.
    outer = ccfx.local_steps(model, opt, fault_tolerant=True, sync_every=10,
                             outer_codec="int8", outer_lr=1.0, outer_momentum=0.0,
                             init_sync=False, min_replicas=1)

    replica = int(os.environ.get("REPLICA_ID", "0"))
    data = torch.Generator().manual_seed(1000 * replica + outer.step)   # its own batches
    shown = 0
    for _ in range(args.steps):
        x = torch.randn(16, 32, generator=data)
        loss = nn.functional.mse_loss(model(x), x[:, :4].sum(dim=1, keepdim=True))
        loss.backward()
        outer.add_tokens(x.shape[0])           # optional: weight the average by samples
        opt.step()                             # every 10th step is a sync: a torchft step
        opt.zero_grad()
        for row in outer.elastic.history[shown:]:   # watch the syncs as they happen
            show(row)
        shown = len(outer.elastic.history)
    outer.close()

    rows = outer.elastic.history
    digest = hashlib.sha256(b"".join(t.numpy().tobytes()
                                     for t in outer.global_parameters().values())).hexdigest()
    print(f"fault_tolerance: {len(rows)} syncs, {sum(r['committed'] for r in rows)} committed, "
          f"largest quorum {max(r['replicas'] for r in rows)}, loss {loss.item():.4f}, "
          f"global parameters {digest[:16]}")


if __name__ == "__main__":
    main()
