"""ccfx in PyTorch's observability tools (TORCH_LOGS, TORCH_TRACE): :mod:`ccfx.observability`,
named here too. It lives below the backend, which registers the log as it compiles, since
compiling never imports the drawing package."""

from ccfx.observability import ARTIFACT_PREFIX, LOG_NAME, emit_plan_artifact, install, log

__all__ = ["ARTIFACT_PREFIX", "LOG_NAME", "emit_plan_artifact", "install", "log"]
