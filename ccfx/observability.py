"""ccfx in PyTorch's own observability tools.

* ``TORCH_LOGS=ccfx`` shows the plan of every graph as it is compiled: ccfx logs it on the
  standard logger ``"ccfx"`` and :func:`install` registers that logger under the TORCH_LOGS
  name ``ccfx`` (``TORCH_LOGS=+ccfx`` for debug). When TORCH_LOGS names ccfx, torch already
  enables the ``ccfx`` package's loggers at import, since it is an importable module; the
  registration names the log for ``torch._logging.set_logs(modules={"ccfx": logging.INFO})``
  too, which then also prints the plan.
* ``TORCH_TRACE=<dir>`` (read by tlparse): :func:`emit_plan_artifact` writes the plan as a
  structured JSON artifact named ``ccfx_plan_graph<i>``, attached to the compile that made it
  when called from inside the backend.
"""

from __future__ import annotations

import logging

LOG_NAME = "ccfx"
ARTIFACT_PREFIX = "ccfx_plan_graph"

_installed = False


def install() -> None:
    """Register ``ccfx`` with ``torch._logging`` (idempotent; cheap)."""
    global _installed
    if _installed:
        return
    from ccfx import _torch_compat as tc

    tc.register_torch_log(LOG_NAME)
    _installed = True


def emit_plan_artifact(plan_json: str, graph_index: int) -> None:
    """Put one graph's plan (``Plan.to_json()`` text) into the TORCH_TRACE structured trace.

    A no-op (a few function calls) when TORCH_TRACE is not set. Call it from the backend while
    the graph compiles, so tlparse files it under that compile id."""
    from ccfx import _torch_compat as tc

    tc.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"{ARTIFACT_PREFIX}{graph_index}", "encoding": "json"},
        payload_fn=lambda: plan_json,
    )


def log() -> logging.Logger:
    return logging.getLogger(LOG_NAME)
