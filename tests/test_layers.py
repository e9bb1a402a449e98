"""The layers point one way: codecs <- wire <- planner, runtime <- backends.

Every module's imports are read with ``ast`` (module-level ones and those inside functions),
relative imports resolved against the module's own package. The planner and the runtime
never import each other (the compile layer, backends/, is the only caller of the planner and
hands the runtime resolved values), neither imports the backend, and the wire layer imports
none of the three.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: folder -> (its package name, packages it must never import)
RULES = {
    "ccfx/planner": ("ccfx.planner", ("ccfx.runtime", "ccfx.backends")),
    "ccfx/runtime": ("ccfx.runtime", ("ccfx.planner", "ccfx.backends")),
    "ccfx/wire": ("ccfx.wire", ("ccfx.planner", "ccfx.runtime", "ccfx.backends")),
    "ccfx/codecs": ("ccfx.codecs", ("ccfx.planner", "ccfx.runtime", "ccfx.wire",
                                    "ccfx.backends")),
}

#: The codecs' Triton kernels live in backends/triton/ (the design card's layout): a codec
#: calls its kernel on CUDA tensors. That is the one import of the backend below it.
ALLOWED = {"ccfx/codecs": ("ccfx.backends.triton",)}


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _imports(path: Path, package: str, root: Path = ROOT) -> list[tuple[int, str, str]]:
    """(line, absolute module name, the import as written) for every import in ``path``."""
    module = package + "." + ".".join(path.relative_to(root / package.replace(".", "/"))
                                       .with_suffix("").parts)
    module = module.removesuffix(".__init__")
    # the package a relative import starts from
    here = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")
            if node.level:
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base)
                name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                name = node.module or ""
            written = f"from {'.' * node.level}{node.module or ''} import " + ", ".join(
                a.name for a in node.names)
            found.append((node.lineno, name, written))
            # `from ccfx import runtime`: the names may be modules themselves
            for alias in node.names:
                found.append((node.lineno, f"{name}.{alias.name}", written))
    return found


def _violations(folder: str) -> list[str]:
    package, forbidden = RULES[folder]
    allowed = ALLOWED.get(folder, ())
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        seen = set()
        for line, name, written in _imports(path, package):
            bad = next((f for f in forbidden if _under(name, f)), None)
            if bad is None or any(_under(name, a) for a in allowed):
                continue
            if (line, written) in seen:
                continue
            seen.add((line, written))
            out.append(f"{path.relative_to(ROOT)}:{line}: `{written}` imports {bad}")
    return out


@pytest.mark.parametrize("folder", sorted(RULES))
def test_layers_point_one_way(folder):
    bad = _violations(folder)
    assert not bad, (f"{folder} must not import {', '.join(RULES[folder][1])}:\n  "
                     + "\n  ".join(bad))


def test_the_check_sees_function_local_and_relative_imports(tmp_path):
    """The reader itself: a relative import inside a function is found and resolved."""
    pkg = tmp_path / "ccfx" / "runtime"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "thing.py").write_text("def f():\n    from ..planner.dp_model import x\n")
    got = _imports(pkg / "thing.py", "ccfx.runtime", tmp_path)
    assert (2, "ccfx.planner.dp_model", "from ..planner.dp_model import x") in got
