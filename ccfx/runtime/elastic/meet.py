"""The meet: one small all-gather at the start of every sync, in which each member says where
it stands, and the checks every member makes on the same rows (fingerprints, the start)."""

from __future__ import annotations

import hashlib
import json
import socket

import torch

from ...errors import ConfigError
from ...wire.fingerprints import short_hash
from .states import State


def fingerprint(fragments, options: dict) -> str:
    """16 hex digits naming what a replica syncs: parameters (names, shapes, dtypes) and the
    outer options. Replicas with different ones must not average."""
    desc = {"params": [[n, list(p.shape), str(p.dtype)] for f in fragments
                       for n, p in zip(f.names, f.local)], "options": options}
    return short_hash(json.dumps(desc, sort_keys=True))


def _ipv4_columns(host: str, port: int) -> tuple[int, int]:
    """``host``:``port`` for the meet's rows (IPv4 as an int, port); (0, 0) when ``host`` has
    no IPv4 address (no spare watches this replica then: it takes the place at the next
    sync)."""
    try:
        return int.from_bytes(socket.inet_aton(socket.gethostbyname(host)), "big"), port
    except OSError:
        return 0, 0


def _alive_url(row) -> str:
    """A meet row's ``/alive`` address (its IPv4 and port columns) as the transport's URL."""
    return f"http://{socket.inet_ntoa(row[7].to_bytes(4, 'big'))}:{row[8]}"


class Meet:
    """The meet's side of :class:`~ccfx.runtime.elastic.Elastic` (a mixin)."""

    def _nothing_to_send(self) -> bool:
        """Healing (its state not here yet, or this sync's heal came from a replica still
        healing): its parameters are stale, it sends zeros and reports 2 in the meet."""
        return self.state is State.HEALING or self._unhealed

    def _meet(self, comm, own: int, interval: float | None) -> list[tuple]:
        """Every member's (tokens, inner step, fingerprint as an int, milliseconds from its
        previous sync's end to this one's start or -1, where it stands: 0 in step, 1 catching
        up or a spare, 2 healing (its state not here yet), the training place it claims or
        -1, with ``init_sync=False`` at inner step 0 a digest of its global parameters or 0,
        its ``/alive`` address for hot spares: IPv4 as an int and port, or 0 and 0)."""
        healing = self._nothing_to_send()
        mine = torch.tensor([own, self.outer.step, int(self.fingerprint, 16) - (1 << 63),
                             -1 if interval is None else int(interval * 1000),
                             2 if healing else int(self.state is State.CATCHING_UP),
                             -1 if self.slot is None else self.slot,
                             self._start_digest(healing), *self._address], dtype=torch.int64)
        rows = comm.wait(comm.all_gather(mine)).view(comm.world, len(mine))
        return [tuple(int(x) for x in row) for row in rows.tolist()]

    def _start_digest(self, healing: bool) -> int:
        """With ``init_sync=False``, at inner step 0: a digest of the global parameters (the
        replicas must have been built alike), else 0 (nothing to check)."""
        if self.opts.init_sync or self.outer.step != 0 or healing:
            return 0
        h = hashlib.sha256()
        for frag in self.outer.fragments:
            for g in frag.global_:
                flat = g.detach().cpu().contiguous().reshape(-1)
                h.update(flat.view(torch.uint8).numpy().tobytes())
        return int.from_bytes(h.digest()[:8], "big") - (1 << 63) or 1

    def _check_start(self, rows) -> None:
        """``init_sync=False``: the members at step 0 must start from the same parameters."""
        digests = {r[6] for r in rows if r[6] != 0}
        if len(digests) > 1:
            self.shutdown()
            raise ConfigError(
                f"init_sync=False, but the {len(rows)} replicas of the first sync start from "
                f"{len(digests)} different parameters: build the model from the same seed on "
                "every replica (torch.manual_seed before building it), or leave init_sync=True "
                "(torchft then sends every replica the first one's state at step 0)")

    def _check_fingerprints(self, rows, comm) -> None:
        """Members whose fingerprint is not the quorum's (the most held; ties: the highest
        step, then the lowest quorum rank) leave with a ConfigError; the others do not commit
        this sync."""
        prints = [f"{r[2] + (1 << 63):016x}" for r in rows]
        if len(set(prints)) == 1 and self._refused is None:
            return
        counts = {p: prints.count(p) for p in prints}
        steps = {p: max(r[1] for r, q in zip(rows, prints) if q == p) for p in prints}
        ref = min(prints, key=lambda p: (-counts[p], -steps[p], prints.index(p)))
        if self.fingerprint != ref:
            self.shutdown()
            raise ConfigError(
                f"this replica syncs other parameters or options (fingerprint "
                f"{self.fingerprint}) than the replicas it joined (fingerprint {ref}): start it "
                "with the same model and the same local-step options")
        odd = sorted({p for p in prints if p != ref} | {self._refused} - {None})
        raise RuntimeError(f"a replica with fingerprint {', '.join(odd)} (ours: {ref}) was "
                           "refused: this sync is not committed")
