"""The layers point one way, and no module imports itself back.

Every module of ccfx (``ccfx/``, and ``passes/``, ``backends/``, ``viz/``, which install as
``ccfx.passes``, ``ccfx.backends``, ``ccfx.viz``) is read with ``ast``: module-level imports,
imports inside functions, relative imports (resolved against the module's package) and
``importlib.import_module("...")`` with a literal name (an f-string counts by its fixed
prefix). ``from pkg import name`` is an import of ``pkg.name`` when that is a module, else of
``pkg``.

The layers, bottom up (:data:`LAYERS`). A module imports its own part and the layers below
it, never a layer above it nor another part of its own layer:

0. ``errors``, ``version``, ``_torch_compat``: nothing of ccfx.
1. facts with no policy, side by side: ``cost`` (what an FX node costs), ``factory`` (a user's
   ``module:callable``), ``cluster_spec`` (devices and links), ``observability`` (TORCH_LOGS,
   TORCH_TRACE), ``models`` (the tiny GPT).
2. ``codecs``: the codecs, references and custom ops.
3. records over the codecs, side by side: ``plan`` (the contract between ranks),
   ``cluster_files`` (a cluster as dicts and files), ``steps_table`` (steps multipliers).
4. ``config``: every option, checked (it reads a cluster and a steps table).
5. ``wire``: what crosses the wire and how ranks agree.
6. ``passes``: the FX passes, one per file.
7. ``planner`` | ``runtime``: they never import each other; the compile layer hands the
   runtime resolved values.
8. ``backends``: the torch.compile backend, the only caller of the planner.
9. ``viz``: drawings and the report of what the backend compiled.
10. the application: the package face (``ccfx/__init__``), the commands (``cli``, ``demo*``,
    ``run_pipeline``), ``testing`` and its pytest plugin.
11. ``integrations``: ccfx inside Hugging Face, Accelerate and Lightning; nothing imports it.

Three arrows go up, each named with its reason in :data:`UPWARD`: a codec launches its Triton
kernel (``backends/triton``, lazily, on CUDA tensors); a pass that cuts edges needs the cut
op registered (``runtime.cut_op``, which imports only the ledger and the plan); the backend
may draw, but only from inside a function that draws: compiling never imports viz.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: source folder -> the package it installs as
FOLDERS = {"ccfx": "ccfx", "passes": "ccfx.passes", "backends": "ccfx.backends",
           "viz": "ccfx.viz"}

#: The layers, bottom up: each a dict part -> its modules (a module covers its submodules;
#: the package face ``ccfx`` stands for ``ccfx/__init__.py`` alone).
LAYERS: list[dict[str, tuple[str, ...]]] = [
    {"floor": ("ccfx.errors", "ccfx.version", "ccfx._torch_compat")},
    {"cost": ("ccfx.cost",), "factory": ("ccfx.factory",),
     "cluster_spec": ("ccfx.cluster_spec",), "observability": ("ccfx.observability",),
     "models": ("ccfx.models",)},
    {"codecs": ("ccfx.codecs",)},
    {"plan": ("ccfx.plan",), "cluster_files": ("ccfx.cluster_files",),
     "steps_table": ("ccfx.steps_table",)},
    {"config": ("ccfx.config",)},
    {"wire": ("ccfx.wire",)},
    {"passes": ("ccfx.passes",)},
    {"planner": ("ccfx.planner",), "runtime": ("ccfx.runtime",)},
    {"backends": ("ccfx.backends",)},
    {"viz": ("ccfx.viz",)},
    {"application": ("ccfx", "ccfx.cli", "ccfx.demo", "ccfx.demo_common", "ccfx.demo_dp",
                     "ccfx.run_pipeline", "ccfx.testing", "ccfx.pytest_plugin")},
    {"integrations": ("ccfx.integrations",)},
]

#: The arrows allowed upward: (importer, imported, function-local only, why).
UPWARD = [
    ("ccfx.codecs", "ccfx.backends.triton", False,
     "a codec's custom op launches its Triton kernel on CUDA tensors (kept under backends/)"),
    ("ccfx.passes", "ccfx.runtime.cut_op", False,
     "the cut-edges pass inserts torch.ops.ccfx.cut, which must be registered"),
    ("ccfx.backends", "ccfx.viz", True,
     "the backend may draw, from inside the function that draws: compiling never draws"),
]


@dataclass(frozen=True)
class Import:
    line: int
    target: str  #: the ccfx module imported
    written: str  #: the import as written
    local: bool  #: inside a function


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module's dotted name -> its file."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if folder == "ccfx" and parts[0] in FOLDERS:
                continue  # the installed copies of the other folders, if any
            name = ".".join((package, *parts)).removesuffix(".__init__")
            out[name] = path
    return out


def _resolve(name: str, modules) -> str | None:
    """The module ``name`` is, or lies in (``pkg.Class`` -> ``pkg``); None outside ccfx."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _dynamic(node: ast.Call) -> str | None:
    """The module a call ``importlib.import_module("literal")`` names: the literal, or an
    f-string's fixed prefix up to its last dot."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if called != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rpartition(".")[0] or None
    return None


class _Reader(ast.NodeVisitor):
    """Collects (line, imported name, as written, inside a function) for one module."""

    def __init__(self, here: str):
        self.here, self.depth, self.found = here, 0, []

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, node, names, written):
        self.found += [(node.lineno, n, written, self.depth > 0) for n in names]

    def visit_Import(self, node):
        for alias in node.names:
            self._add(node, [alias.name], f"import {alias.name}")

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.here.split(".")
            prefix = ".".join(base[:len(base) - (node.level - 1)])
            name = f"{prefix}.{node.module}" if node.module else prefix
        else:
            name = node.module or ""
        written = f"from {'.' * node.level}{node.module or ''} import " + ", ".join(
            a.name for a in node.names)
        # `from pkg import name`: pkg.name where that is a module, else pkg (see _imports)
        self._add(node, [f"{name}.{a.name}" for a in node.names], written)

    def visit_Call(self, node):
        name = _dynamic(node)
        if name is not None:
            self._add(node, [name], f"importlib.import_module({name!r}...)")
        self.generic_visit(node)


def _imports(module: str, path: Path, modules) -> list[Import]:
    """Every import of a ccfx module in ``path`` (the module ``module``), deduplicated."""
    here = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    reader = _Reader(here)
    reader.visit(ast.parse(path.read_text(), filename=str(path)))
    out = {}
    for line, name, written, local in reader.found:
        target = _resolve(name, modules)
        if target is not None and target != module:
            out.setdefault((line, target), Import(line, target, written, local))
    return list(out.values())


def _place(module: str) -> tuple[int, str] | None:
    """(layer, part) of a module: the part naming it most closely; None when unplaced."""
    best = None
    for rank, layer in enumerate(LAYERS):
        for part, names in layer.items():
            for name in names:
                hit = module == name if name == "ccfx" else _under(module, name)
                if hit and (best is None or len(name) > best[2]):
                    best = (rank, part, len(name))
    return best and best[:2]


def _upward_ok(module: str, imp: Import) -> bool:
    return any(_under(module, a) and _under(imp.target, b) and (imp.local or not local_only)
               for a, b, local_only, _why in UPWARD)


def _violations(part: str, modules) -> list[str]:
    out = []
    for module, path in sorted(modules.items()):
        rank, own = _place(module) or (None, None)
        if own != part:
            continue
        for imp in _imports(module, path, modules):
            t_rank, t_part = _place(imp.target)
            if t_part == part or t_rank < rank or _upward_ok(module, imp):
                continue
            where = "beside it" if t_rank == rank else "above it"
            local = " (inside a function)" if imp.local else ""
            out.append(f"{path.relative_to(ROOT)}:{imp.line}: `{imp.written}`{local} imports "
                       f"{imp.target}, {t_part}: {where}")
    return out


def _graph(modules) -> dict[str, set[str]]:
    return {m: {i.target for i in _imports(m, p, modules)} for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while not scc or scc[-1] != v:
                scc.append(stack.pop())
                on_stack.discard(scc[-1])
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


MODULES = _modules()
PARTS = sorted({part for layer in LAYERS for part in layer})


def test_every_module_has_a_place():
    unplaced = sorted(m for m in MODULES if _place(m) is None)
    assert not unplaced, ("put these modules in a layer of tests/test_layers.py's LAYERS:\n  "
                          + "\n  ".join(unplaced))


@pytest.mark.parametrize("part", PARTS)
def test_layers_point_one_way(part):
    bad = _violations(part, MODULES)
    assert not bad, (f"{part} imports a layer above it or a part beside it (the layers: "
                     "tests/test_layers.py's docstring):\n  " + "\n  ".join(bad))


def test_no_module_imports_itself_back():
    graph = _graph(MODULES)
    cycles = _cycles(graph)
    text = []
    for scc in cycles:
        members = set(scc)
        text.append(" <-> ".join(scc) + "\n" + "\n".join(
            f"    {m} -> {', '.join(sorted(graph[m] & members))}" for m in scc))
    assert not cycles, "import cycles (module-level and function-local imports):\n  " + \
        "\n  ".join(text)


def test_the_reader_sees_local_relative_and_dynamic_imports(tmp_path):
    """The reader itself: a relative import inside a function, `from pkg import module`, and
    import_module with a literal and with an f-string."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    pkg = tmp_path / "ccfx" / "runtime"
    (tmp_path / "ccfx" / "planner").mkdir()
    pkg.mkdir()
    for path in (tmp_path / "ccfx" / "__init__.py", pkg / "__init__.py",
                 tmp_path / "ccfx" / "planner" / "__init__.py",
                 tmp_path / "ccfx" / "planner" / "dp_model.py", tmp_path / "viz" / "report.py",
                 tmp_path / "backends" / "__init__.py"):
        path.write_text("")
    (pkg / "thing.py").write_text(
        "import importlib\nfrom ccfx import planner\n\n\ndef f():\n"
        "    from ..planner.dp_model import x\n    importlib.import_module('ccfx.viz.report')\n"
        "    importlib.import_module(f'ccfx.backends.{x}')\n")
    modules = _modules(tmp_path)
    got = {(i.line, i.target, i.local) for i in _imports("ccfx.runtime.thing", pkg / "thing.py",
                                                         modules)}
    assert got == {(2, "ccfx.planner", False), (6, "ccfx.planner.dp_model", True),
                   (7, "ccfx.viz.report", True), (8, "ccfx.backends", True)}


def test_the_cycle_finder_names_each_cycle():
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"e"}, "e": {"f"}, "f": {"d"}}
    assert _cycles(graph) == [["a", "b"], ["d", "e", "f"]]
