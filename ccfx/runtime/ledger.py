"""The byte ledger: what crossed the wire, raw and encoded, counted from what actually ran.

One table, keyed by *channel*: a hop of a cut edge in one direction (``"fwd"``/``"bwd"``,
reported by each ``ccfx::cut`` op that executes) or a data-parallel gradient bucket
(direction ``"bucket"``, reported by the compiled backward each time it runs its collectives;
wire bytes are the payload this rank contributes) or a local-steps sync of a parameter fragment
(direction ``"outer"``, reported by :mod:`.local_steps` at each merge) or a functional
collective of a compiled graph (direction ``"collective"``, the plan's collective index,
reported by the compiled graph each time it runs; raw bytes are what the uncompressed
collective would send, wire bytes what this rank sent). A *step* is one call of a compiled graph
(with graph breaks, each graph runs once per step, so ``steps`` is the largest call count among
the graphs), or on a pipeline's ranks one schedule step (each stage's first microbatch).
``per_step()`` divides by it.

Beside the bytes, ``switches``: each time a mode that picks a bucket's codec over training
(:mod:`ccfx.runtime.adaptive`) changed it, the bucket, the first step of the new codec and why.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class EdgeCount:
    graph: int
    edge: int  # the cut edge; the bucket index for "bucket"; the collective's for "collective"
    hop: tuple[int, int]  # (source stage, destination stage); (0, 0) for a bucket
    direction: str  # "fwd", "bwd" or "bucket"
    calls: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0


@dataclass(frozen=True)
class Switch:
    """A bucket's codec changed: ``new`` from ``step`` on (``old`` until the step before)."""

    graph: int
    bucket: int
    step: int
    old: str
    new: str
    why: str


class Ledger:
    def __init__(self):
        self._counts: dict[tuple[int, int, tuple[int, int], str], EdgeCount] = {}
        self._graph_calls: dict = defaultdict(int)  # a graph, or (graph, "stage", index)
        #: each codec switch of a bucket, in the order they happened
        self.switches: list[Switch] = []

    def record_switch(self, graph: int, bucket: int, step: int, old: str, new: str,
                      why: str) -> None:
        self.switches.append(Switch(graph, bucket, step, old, new, why))

    def record(self, graph: int, edge: int, hop: tuple[int, int], direction: str, raw: int,
               wire: int) -> None:
        key = (graph, edge, hop, direction)
        c = self._counts.get(key)
        if c is None:
            c = self._counts[key] = EdgeCount(graph, edge, hop, direction)
        c.calls += 1
        c.raw_bytes += raw
        c.wire_bytes += wire

    def record_bucket(self, graph: int, bucket: int, raw: int, wire: int) -> None:
        self.record(graph, bucket, (0, 0), "bucket", raw, wire)

    def record_outer(self, fragment: int, raw: int, wire: int) -> None:
        """A local-steps sync of one fragment's pseudo-gradient (direction ``"outer"``)."""
        self.record(0, fragment, (0, 0), "outer", raw, wire)

    def record_collective(self, graph: int, index: int, raw: int, wire: int) -> None:
        """One call of a compiled graph's collective ``index`` (direction ``"collective"``)."""
        self.record(graph, index, (0, 0), "collective", raw, wire)

    def count_call(self, graph) -> None:
        self._graph_calls[graph] += 1

    def reset(self) -> None:
        self._counts.clear()
        self._graph_calls.clear()
        self.switches.clear()

    @property
    def steps(self) -> int:
        return max(self._graph_calls.values(), default=0)

    def entries(self, direction: str | None = None) -> list[EdgeCount]:
        """Rows of one direction, or all of them (cut hops first, then gradient buckets)."""
        order = {"fwd": 0, "bwd": 1, "bucket": 2, "outer": 3, "collective": 4}
        rows = [c for c in self._counts.values() if direction in (None, c.direction)]
        return sorted(rows, key=lambda c: (order.get(c.direction, 5) // 2,
                                           c.direction == "collective", c.direction == "outer",
                                           c.graph, c.edge, c.hop, order.get(c.direction, 5)))

    def totals(self, direction: str | None = None) -> tuple[int, int]:
        """(raw, wire) bytes summed over every edge, hop and step (one direction, or both)."""
        rows = [c for c in self._counts.values() if direction in (None, c.direction)]
        return sum(c.raw_bytes for c in rows), sum(c.wire_bytes for c in rows)

    def per_step(self, direction: str | None = None) -> tuple[float, float]:
        raw, wire = self.totals(direction)
        steps = max(self.steps, 1)
        return raw / steps, wire / steps

    @property
    def ratio(self) -> float:
        raw, wire = self.totals()
        return wire / raw if raw else 1.0

    def to_dict(self) -> dict:
        out = {
            "steps": self.steps,
            "entries": [
                {"graph": c.graph, "edge": c.edge, "hop": list(c.hop), "direction": c.direction,
                 "calls": c.calls, "raw_bytes": c.raw_bytes, "wire_bytes": c.wire_bytes}
                for c in self.entries()
            ],
        }
        if self.switches:
            out["switches"] = [dict(vars(s)) for s in self.switches]
        return out

    def __str__(self) -> str:
        from ..plan import human_bytes

        lines = [f"ccfx ledger: {self.steps} step(s)"]
        lines.append(f"  {'graph':>5} {'edge':>4} {'hop':>5} {'dir':>3} {'raw/step':>12} {'wire/step':>12} ratio")
        steps = max(self.steps, 1)
        for c in self.entries():
            ratio = c.wire_bytes / c.raw_bytes if c.raw_bytes else 1.0
            where = f"{c.hop[0]}->{c.hop[1]:<2}" if c.direction in ("fwd", "bwd") else "  -  "
            direction = {"bucket": "grad", "outer": "sync", "collective": "col"}.get(
                c.direction, c.direction)
            lines.append(
                f"  {c.graph:>5} {c.edge:>4} {where} {direction:>3} "
                f"{human_bytes(c.raw_bytes / steps):>12} {human_bytes(c.wire_bytes / steps):>12} "
                f"{ratio:.3f}"
            )
        for d in ("fwd", "bwd", "bucket", "outer", "collective"):
            raw, wire = self.per_step(d)
            if raw:
                name = {"bucket": "gradient buckets", "outer": "local-steps sync",
                        "collective": "collectives"}.get(d, d)
                lines.append(f"  {name} per step: {human_bytes(raw)} raw -> {human_bytes(wire)} "
                             f"wire ({wire / raw:.3f})")
        if self.switches:
            lines.append("  codec switches (graph, bucket: from step, old -> new, why):")
        lines += [f"    {s.graph}, bucket {s.bucket}: step {s.step}, {s.old} -> {s.new}, {s.why}"
                  for s in self.switches]
        return "\n".join(lines)
