"""What a drawing is of, and its DOT text: a compiled model (the module ``torch.compile``
returned, or its ``CcfxBackend``) or a :class:`~ccfx.plan.Plan`, drawn as stages, partitioned
graph, forward or backward. :func:`ccfx.viz.draw` renders it; the HTML report embeds it.

Apart from the package's face so that the report, which the face re-exports, can draw without
importing the package that imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ccfx.errors import ConfigError
from ccfx.plan import GraphPlan, Plan

from .drawing import graph_dot, plan_dot
from .render import render

WHICH = ("partitioned", "forward", "backward", "plan")
DEFAULT_DEPTH = 2


def _resolve(obj):
    """(backend or None, plan)."""
    if isinstance(obj, Plan):
        return None, obj
    if isinstance(obj, GraphPlan):
        return None, Plan(config={}, graphs=[obj])
    from ccfx.backends.compiler import backend_of

    backend = backend_of(obj)
    return backend, backend.plan


def normalize_depth(depth) -> int | None:
    """``None``/"full"/"all" → every node; otherwise a module depth of at least 1."""
    if depth is None or (isinstance(depth, str) and depth.lower() in ("full", "all", "none")):
        return None
    try:
        d = int(depth)
    except (TypeError, ValueError):
        d = 0
    if d < 1:
        raise ConfigError(f"depth={depth!r}: give a module depth >= 1, or None/'full' to draw "
                          "every node")
    return d


def to_dot(compiled_or_plan, *, which: str | None = None, depth=DEFAULT_DEPTH,
           graph: int | None = None, title: str | None = None) -> str:
    """The DOT text of a drawing (deterministic: same model, same text).

    which: "partitioned" (default for a compiled model: the graph ccfx cut, with its codec
           ops), "forward" / "backward" (aot_autograd's graphs; backward after one
           ``.backward()``), or "plan" (stages only; the default and only choice for a Plan).
    depth: module levels to show (a ModuleList index counts with its container, so
           ``transformer.h.3`` is depth 2); None or "full" draws every node.
    graph: draw only this graph (graph breaks make several); default all.
    """
    backend, plan = _resolve(compiled_or_plan)
    which = which or ("plan" if backend is None else "partitioned")
    if which not in WHICH:
        raise ConfigError(f"which={which!r}: choose one of {', '.join(WHICH)}")
    if which == "plan":
        if graph is not None:
            plan = Plan(config=plan.config, graphs=[g for g in plan.graphs if g.index == graph])
        return plan_dot(plan, title)
    if backend is None:
        raise ConfigError(
            f"which={which!r} needs the graphs, and a Plan only has stages and edges: pass the "
            "compiled model (or its backend), or use which='plan'"
        )
    from .view import graph_views

    views = graph_views(backend, which, graph)
    from .collectives import codec_text

    return graph_dot(views, normalize_depth(depth), title,
                     codec=plan.config.get("activation_codec"),
                     collectives=codec_text(plan.config))


def draw(compiled_or_plan, path: str | os.PathLike, *, format: str | None = None,
         which: str | None = None, depth=DEFAULT_DEPTH, graph: int | None = None,
         title: str | None = None) -> Path:
    """Draw to ``path``: svg, png or pdf (rendered by graphviz's ``dot``) or the .dot text,
    chosen by ``format`` or the suffix. Returns the path written. Without ``dot`` on PATH the
    .dot file is written beside ``path`` and :class:`GraphvizNotFoundError` says how to install
    graphviz. Other keywords as in :func:`to_dot`."""
    text = to_dot(compiled_or_plan, which=which, depth=depth, graph=graph, title=title)
    return render(text, path, format)
