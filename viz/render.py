"""Rendering DOT text through the ``graphviz`` Python package (``graphviz.pipe``, which runs
graphviz's ``dot`` layout program; svg, png, pdf), or writing the text.

The DOT text itself is ccfx's (:mod:`ccfx.viz.dot`): the package's quoting leaves ``| { } < >``
alone, which record shapes read as fields, and our builder keeps the text byte-for-byte
deterministic (the golden files). The package does the rendering.

Without ``dot`` on PATH the ``.dot`` file is still written, and :class:`GraphvizNotFoundError`
says how to install graphviz. The package is imported when something is rendered, not when ccfx
is: a machine without it (a bare GPU image) still compiles, and is told what to install the
first time it draws.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import warnings
from pathlib import Path

from ccfx.errors import CcfxError, CcfxWarning, ConfigError

FORMATS = ("svg", "png", "pdf", "dot")
INSTALL_HINT = (
    "install graphviz, which provides `dot`: `apt-get install graphviz` (Debian/Ubuntu), "
    "`dnf install graphviz` (Fedora), `brew install graphviz` (macOS) or "
    "`conda install -c conda-forge graphviz`"
)


class GraphvizNotFoundError(CcfxError, RuntimeError):
    """graphviz's ``dot`` binary is not on PATH; the .dot file was written instead."""

    def __init__(self, message: str, dot_path: Path | None = None):
        super().__init__(message)
        self.dot_path = dot_path


def format_of(path: str | os.PathLike, format: str | None = None) -> str:
    fmt = (format or Path(path).suffix.lstrip(".") or "svg").lower()
    fmt = "dot" if fmt == "gv" else fmt
    if fmt not in FORMATS:
        raise ConfigError(f"cannot draw to {fmt!r}: choose one of {', '.join(FORMATS)} "
                          "(from the file suffix or format=)")
    return fmt


def dot_binary() -> str | None:
    return shutil.which("dot")


def _graphviz_package():
    try:
        import graphviz
    except ImportError as e:
        raise GraphvizNotFoundError(
            "the `graphviz` Python package (a ccfx dependency) is not installed: "
            "`pip install graphviz`") from e
    return graphviz


def run_dot(dot_text: str, fmt: str) -> bytes:
    """``dot_text`` laid out by ``dot`` and rendered to ``fmt`` (``graphviz.pipe``); the bytes.
    What graphviz says on stderr becomes a :class:`CcfxWarning`."""
    if dot_binary() is None:
        raise GraphvizNotFoundError(f"graphviz's `dot` is not on PATH: {INSTALL_HINT}")
    graphviz = _graphviz_package()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            out = graphviz.pipe("dot", fmt, dot_text.encode())
    except graphviz.ExecutableNotFound as e:
        raise GraphvizNotFoundError(f"graphviz's `dot` is not on PATH: {INSTALL_HINT}") from e
    except graphviz.CalledProcessError as e:
        err = (e.stderr or b"").decode(errors="replace").strip() or said.getvalue().strip()
        raise CcfxError(f"`dot -T{fmt}` failed (exit {e.returncode}): {err}") from None
    err = said.getvalue().strip()
    if err:
        warnings.warn(f"graphviz: {err}", CcfxWarning, stacklevel=3)
    return out


def render(dot_text: str, path: str | os.PathLike, format: str | None = None) -> Path:
    """Write ``dot_text`` rendered to ``path`` (format from ``format`` or the suffix). Returns
    the path written. Without ``dot``: writes ``path`` with suffix ``.dot`` and raises
    :class:`GraphvizNotFoundError`."""
    path = Path(path)
    fmt = format_of(path, format)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dot":
        path.write_text(dot_text)
        return path
    if dot_binary() is None:
        dot_path = path.with_suffix(".dot")
        dot_path.write_text(dot_text)
        raise GraphvizNotFoundError(
            f"cannot render {path}: graphviz's `dot` is not on PATH. The DOT text is in "
            f"{dot_path} (render it later with `dot -T{fmt} {dot_path} -o {path}`). To render "
            f"directly, {INSTALL_HINT}.", dot_path)
    path.write_bytes(run_dot(dot_text, fmt))
    return path


def svg_text(dot_text: str) -> str | None:
    """The drawing as SVG text (for embedding), or None without ``dot``."""
    if dot_binary() is None:
        return None
    return run_dot(dot_text, "svg").decode()
