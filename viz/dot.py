"""DOT text, written directly: quoting, HTML-like labels, and a small deterministic builder.

Nothing here depends on the order of a ``dict`` filled from sets or on object ids: the text is a
function of what was added, in the order it was added, so the same model gives the same text.

Two kinds of label are used:

* quoted strings (:func:`quote`): every character graphviz treats specially is escaped —
  backslash (else ``\\N``, ``\\G``… expand to names), double quote, newline (written ``\\n``), and
  ``| { } < >`` (field separators and ports in record shapes, harmless escaped elsewhere);
* HTML-like labels (:class:`Html`), for tables: text inside is escaped with :func:`html_text`
  (entities, and backslashes doubled: graphviz expands ``\\N`` there too).
"""

from __future__ import annotations

import html
from collections.abc import Iterator
from contextlib import contextmanager

_SPECIAL = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "", "|": "\\|", "{": "\\{",
            "}": "\\}", "<": "\\<", ">": "\\>"}


def quote(text: object) -> str:
    """``text`` as a DOT quoted string, safe in any label, record shape or id."""
    return '"' + "".join(_SPECIAL.get(c, c) for c in str(text)) + '"'


def html_text(text: object) -> str:
    """``text`` escaped for the inside of an HTML-like label: ``& < > " '`` as entities, and
    backslash doubled (graphviz expands ``\\N``, ``\\G``… in HTML labels too, after entities)."""
    return (html.escape(str(text).replace("\\", "\\\\"), quote=True)
            .replace("\n", '<BR ALIGN="LEFT"/>'))


class Html(str):
    """An HTML-like label: written between ``<`` and ``>`` instead of quoted. Build its content
    with :func:`html_text` for anything that comes from the model."""


def _value(value: object) -> str:
    if isinstance(value, Html):
        return f"<{value}>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return quote(value)


def _attrs(attrs: dict[str, object]) -> str:
    items = [f"{k}={_value(v)}" for k, v in attrs.items() if v is not None]
    return f" [{', '.join(items)}]" if items else ""


class Digraph:
    """Collects statements and prints them; ``with g.cluster(name, ...)`` nests a subgraph."""

    def __init__(self, name: str = "ccfx", **graph_attrs: object):
        self.name = name
        self._lines: list[str] = []
        self._indent = 1
        if graph_attrs:
            self.attrs("graph", **graph_attrs)

    def _emit(self, text: str) -> None:
        self._lines.append("  " * self._indent + text)

    def attrs(self, kind: str, **attrs: object) -> None:
        """Default attributes: ``kind`` is "graph", "node" or "edge"."""
        self._emit(f"{kind}{_attrs(attrs)};")

    def node(self, node_id: str, **attrs: object) -> None:
        self._emit(f"{quote(node_id)}{_attrs(attrs)};")

    def edge(self, tail: str, head: str, **attrs: object) -> None:
        self._emit(f"{quote(tail)} -> {quote(head)}{_attrs(attrs)};")

    def comment(self, text: str) -> None:
        for line in str(text).splitlines():
            self._emit(f"// {line}")

    @contextmanager
    def cluster(self, name: str, **attrs: object) -> Iterator[None]:
        """A subgraph named ``cluster_<name>`` (graphviz draws clusters as boxes)."""
        self._emit(f"subgraph {quote('cluster_' + name)} {{")
        self._indent += 1
        if attrs:
            self.attrs("graph", **attrs)
        try:
            yield
        finally:
            self._indent -= 1
            self._emit("}")

    def source(self) -> str:
        return "\n".join([f"digraph {quote(self.name)} {{", *self._lines, "}"]) + "\n"
