"""Seeing the plan: graphviz drawings, an HTML report, progress bars, PyTorch logging.

    ccfx.draw(compiled, "plan.svg")                  # modules in one cluster per stage
    ccfx.draw(compiled, "fw.png", which="forward", depth=None)   # every aten node
    ccfx.draw(ccfx.plan_of(compiled), "stages.pdf")  # the stage-level picture, from a Plan
    ccfx.viz.write_report("report.html", compiled, losses={"int8": [...], "none": [...]})

``compiled`` is anything ccfx compiled (the module ``torch.compile`` returned, a
``CcfxBackend``), run at least once. A :class:`~ccfx.plan.Plan` alone has no graph, so it draws
stages and the edges between them.

Functional collectives (tensor / sequence parallel, ``ccfx.shard``, the model's funcol code;
``collective_codec``) appear beside the stages as one table per part (forward, backward) in the
plan and partitioned drawings, and as one node each where they run in the forward and backward
drawings: the codec's orange when compressed (kind, codec, raw -> wire bytes per call), grey
with the reason when left alone. The report has a "Collectives" section and cards.
"""

from __future__ import annotations

from ccfx.observability import emit_plan_artifact, install

from .front import DEFAULT_DEPTH, WHICH, _resolve, draw, normalize_depth, to_dot  # noqa: F401
from .progress import progress
from .render import FORMATS, GraphvizNotFoundError, render, svg_text
from .report import write_report

__all__ = [
    "FORMATS", "GraphvizNotFoundError", "draw", "emit_plan_artifact", "install",
    "normalize_depth", "progress", "render", "svg_text", "to_dot", "write_report",
]
