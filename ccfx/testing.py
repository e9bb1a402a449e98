"""Golden-graph tests: record what ccfx made of a model, compare it with a file, show a diff.

    from ccfx.testing import assert_golden, golden_text
    compiled = torch.compile(model, backend="ccfx", options={...}); loss.backward()
    assert_golden("tests/golden/my_model.txt", golden_text(compiled))

``golden_text`` holds the plan (stages, cut edges, codecs, wire bytes) and the normalized
graphs: partitioned, forward and backward. Normalization removes what changes from run to run or
machine to machine (file paths, hop ids, symbol numbers). ``pytest --ccfx-update-golden`` (the
pytest plugin) or ``CCFX_UPDATE_GOLDEN=1`` rewrites the files instead of comparing.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import torch.fx

from ccfx.errors import CcfxError

UPDATE_ENV = "CCFX_UPDATE_GOLDEN"
_update_from_pytest = False


class GoldenMismatch(CcfxError, AssertionError):
    """The recorded graph or plan differs from the golden file."""


def _hop_name(match: re.Match) -> str:
    from ccfx.runtime.cut_op import describe_uid

    return f"{match.group(1)}'{describe_uid(int(match.group(2)))}'{match.group(3)}"


def normalize_graph(graph) -> str:
    """Readable graph text with paths, hop ids, group fingerprints and symbol numbers made
    stable."""
    if isinstance(graph, torch.fx.GraphModule):
        text = graph.print_readable(print_output=False, include_stride=False, include_device=False)
    else:
        text = str(graph)
    lines = []
    for line in text.splitlines():
        if re.match(r"\s*# File: ", line) or line.strip().startswith("# No stacktrace"):
            continue
        lines.append(line.rstrip())
    text = "\n".join(lines)
    text = re.sub(r"(ccfx\.cut\.default\([^)]*?'[^']*', '[^']*', )(\d+)(, (?:True|False)\))",
                  _hop_name, text)
    # ccfx's process groups are named by a fingerprint of the graph and every option: the
    # golden shows that a graph names its group, not a hash that any new option changes
    text = re.sub(r"'ccfx-[0-9a-f]{16}'", "'ccfx-<fingerprint>'", text)
    text = re.sub(r"class GraphModule\(torch\.nn\.Module\)", "class Graph", text)
    text = re.sub(r"<lambda>|GraphModule\w*", "Graph", text)
    symbols: dict[str, str] = {}
    text = re.sub(r"\b[su]\d+\b", lambda m: symbols.setdefault(m.group(0), f"s{len(symbols)}"), text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def plan_text(plan) -> str:
    """The plan's decisions, one fact per line (no timings, no floats that drift)."""
    out = []
    for g in plan.graphs:
        out.append(f"graph {g.index}: stages {g.num_stages} (asked {g.requested_stages}), "
                   f"balance {g.balance}")
        for s in g.stages:
            out.append(f"  stage {s.index}: cost {s.cost_expr}, params {s.param_bytes} B, "
                       f"nodes {' '.join(s.nodes)}")
        for e in g.edges:
            out.append(
                f"  edge {e.index}: {e.source} {e.source_stage}->{','.join(map(str, e.dest_stages))} "
                f"hops {len(e.hops)} shape {list(e.shape)} {e.dtype} codec {e.codec} "
                f"raw {e.raw_bytes_expr} wire fwd {e.wire_bytes_fwd_expr} bwd {e.wire_bytes_bwd}"
            )
        for p in g.shared:
            out.append(f"  shared {p.name}: stages {p.stages}, {p.nbytes} B")
        for note in g.notes:
            out.append(f"  note: {note}")
    return "\n".join(out) + "\n"


def golden_text(compiled, graphs: tuple[str, ...] = ("partitioned", "forward", "backward")) -> str:
    """Plan and normalized graphs of a model compiled with ccfx (run it, and backward, first)."""
    from ccfx.backends.compiler import backend_of

    backend = backend_of(compiled)
    parts = ["# plan", plan_text(backend.plan)]
    for g in backend.graphs:
        if "partitioned" in graphs:
            parts += [f"# graph {g.index}: partitioned", normalize_graph(g.partitioned)]
        for kind in ("forward", "backward", "inference"):
            if kind in graphs:
                for i, gm in enumerate(getattr(g.lowered, kind)):
                    parts += [f"# graph {g.index}: {kind} {i}", normalize_graph(gm)]
    return "\n".join(parts)


def update_requested() -> bool:
    return _update_from_pytest or os.environ.get(UPDATE_ENV, "") not in ("", "0")


def assert_golden(path: str | os.PathLike, text: str) -> None:
    """Compare ``text`` with the file at ``path``; rewrite it instead when updating."""
    path = Path(path)
    if update_requested():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        raise GoldenMismatch(
            f"golden file {path} does not exist: run pytest with --ccfx-update-golden "
            f"(or {UPDATE_ENV}=1) to create it, then review and commit it"
        )
    expected = path.read_text()
    if expected != text:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), text.splitlines(keepends=True),
            fromfile=f"{path} (golden)", tofile="now", n=2))
        raise GoldenMismatch(
            f"ccfx graph or plan changed from {path}:\n{diff}\n"
            f"If the change is intended, rerun with --ccfx-update-golden and commit the file "
            f"with a message that says why."
        )
