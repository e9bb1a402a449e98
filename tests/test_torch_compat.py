"""Every private torch / torchft name ccfx relies on still resolves (``ccfx._torch_compat``).

A failure names the symbol, the torch version that moved it and what ccfx needs it for: the
one place to fix is ``ccfx/_torch_compat.py`` (and ``docs/torch-internals.md``)."""

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

from ccfx import _torch_compat as tc

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH = ".".join(torch.__version__.split(".")[:2])


def _version(package: str) -> str:
    if package == "torch":
        return f"torch {TORCH}"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{package} {version(package)}"
    except PackageNotFoundError:
        return package


@pytest.mark.parametrize("entry", tc.INTERNALS, ids=lambda e: e.name)
def test_every_private_name_resolves(entry):
    if entry.package not in ("torch", "sys"):
        pytest.importorskip(entry.package)
    try:
        tc.resolve(entry)
    except (AttributeError, ImportError) as e:
        pytest.fail(f"{_version(entry.package)} moved `{entry.name}`: used for "
                    f"{entry.used_for} ({', '.join(entry.users)}); fix ccfx/_torch_compat.py "
                    f"({type(e).__name__}: {e})")


def test_a_moved_name_fails_naming_it():
    gone = tc.Internal("torch._dynamo.no_such_thing", "nothing", "", ())
    with pytest.raises(AttributeError):
        tc.resolve(gone)
    unset = tc.Internal("torch.nn.Module._no_such_attr", "nothing", "", (), how="instance")
    with pytest.raises(AttributeError, match="_no_such_attr"):
        tc.resolve(unset)


def test_aliases_are_the_table_entries():
    for entry in tc.INTERNALS:
        if entry.alias:
            assert getattr(tc, entry.alias) == tc.resolve(entry), entry.name  # == : a bound method
    with pytest.raises(AttributeError):
        tc.no_such_alias  # noqa: B018


def test_the_table_is_documented():
    page = (ROOT / "docs" / "torch-internals.md").read_text()
    missing = [e.name for e in tc.INTERNALS if f"`{e.name}`" not in page]
    assert not missing, f"docs/torch-internals.md does not list {missing}"


def test_importing_it_imports_neither_dynamo_nor_inductor():
    code = ("import sys, ccfx, ccfx._torch_compat; "
            "print([m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_the_accessors_read_what_they_name():
    class Manager:
        _replica_id, _pg = "r0", object()

    assert tc.torchft_replica_id(Manager) == "r0"
    assert tc.torchft_process_group(Manager) is Manager._pg
    assert tc.torchft_wrapped_group(Manager) is Manager._pg
    base = torch.zeros(4)
    assert tc.view_base(base[1:]) is base and tc.view_base(base) is base
    model = torch.nn.Linear(2, 2)
    assert tc.orig_module(torch.compile(model)) is model
    assert tc.orig_module(model) is None
    wait, post = tc.pipeline_p2p()
    assert callable(wait) and callable(post)


#: Every module of these folders reaches torch's and torchft's private names through
#: ``ccfx._torch_compat`` only (the module itself excepted).
SOURCES = ("ccfx", "passes", "backends", "viz")
COMPAT = "ccfx/_torch_compat.py"
#: The packages whose private names are routed; ``sys`` too, for ``sys._getframe``.
PACKAGES = ("torch", "torchft")


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


#: What may stay direct, as the table says: its ``op`` entries (``torch.ops._c10d_functional``,
#: the functional collectives' op namespace), each in the files the table names.
ALLOWED = {(user, e.name) for e in tc.INTERNALS if e.how == "op" for user in e.users}
#: The private names of the table, caught as attributes of any object too (an instance's
#: ``manager._replica_id``, ``t._base``) and as ``getattr(x, "_pg")``'s literal name.
PRIVATE_ATTRS = {p for e in tc.INTERNALS for p in e.name.split(".")[1:] if _is_private(p)}


def _source_files() -> list[str]:
    files = (p.relative_to(ROOT).as_posix() for top in SOURCES for p in (ROOT / top).rglob("*.py"))
    return sorted(f for f in files if f != COMPAT)


def _roots(tree: ast.AST) -> set[str]:
    """The names a file binds to torch or torchft (modules, classes, functions), and sys."""
    roots = {"sys", *PACKAGES}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.asname or a.name.split(".")[0] for a in node.names
                         if a.name.split(".")[0] in PACKAGES)
        elif (isinstance(node, ast.ImportFrom) and not node.level
              and node.module.split(".")[0] in PACKAGES):
            roots.update(a.asname or a.name for a in node.names)
    return roots


def _import_use(node: ast.AST) -> str | None:
    """``import torch._x`` or ``from torch._x import y`` / ``from torch import _y``."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.split(".")[0] in PACKAGES
                 and any(_is_private(p) for p in a.name.split("."))]
        return f"import {', '.join(names)}" if names else None
    if (isinstance(node, ast.ImportFrom) and not node.level
            and node.module.split(".")[0] in PACKAGES
            and (any(_is_private(p) for p in node.module.split("."))
                 or any(_is_private(a.name) for a in node.names))):
        return f"from {node.module} import {', '.join(a.name for a in node.names)}"
    return None


def _attribute_use(node: ast.Attribute, roots: set[str]) -> bool:
    """A private part in a dotted chain from a torch name, or a table name on any object."""
    parts, base = [], node
    while isinstance(base, ast.Attribute):
        parts.append(base.attr)
        base = base.value
    from_torch = isinstance(base, ast.Name) and base.id in roots
    selfish = isinstance(base, ast.Name) and base.id in ("self", "cls")  # ccfx's own
    return ((from_torch and any(_is_private(p) for p in parts))
            or (not selfish and any(p in PRIVATE_ATTRS for p in parts)))


def _getattr_use(node: ast.Call) -> bool:
    """``getattr(x, "_pg")`` (and hasattr, setattr) with a name the table lists."""
    return (isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in PRIVATE_ATTRS)


def _private_uses(source: str, where: str) -> list[str]:
    """``where:line: code`` for each private torch / torchft name (or ``sys._getframe``) that
    ``source`` reaches directly, less what :data:`ALLOWED` lets stay."""
    tree = ast.parse(source)
    roots = _roots(tree)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        text = _import_use(node)
        if text is None and ((isinstance(node, ast.Attribute) and id(node) not in inner
                              and _attribute_use(node, roots))
                             or (isinstance(node, ast.Call) and _getattr_use(node))):
            text = ast.unparse(node)
        if text is not None and not any(text == name or text.startswith(f"{name}.")
                                        for user, name in ALLOWED if user == where):
            found.append((node.lineno, f"{where}:{node.lineno}: {text}"))
    return [text for _, text in sorted(found)]


def test_the_scan_finds_each_kind_of_direct_use():
    source = """\
import torch._dynamo
import torch.distributed as dist
from torch._guards import detect_fake_mode
from torch.distributed import _functional_collectives
from torch.distributed.tensor import DTensor
dist.distributed_c10d._get_default_store()
DTensor._local_tensor
sys._getframe(1)
manager._replica_id
getattr(manager, '_pg', None)
torch.ops._c10d_functional.all_reduce(t, 'sum', name)
self._pg, torch.__version__, torch.ops.aten.add, other._private
"""
    found = _private_uses(source, "somewhere.py")
    assert [int(f.split(":")[1]) for f in found] == [1, 3, 4, 6, 7, 8, 9, 10, 11], found
    allowed = _private_uses("torch.ops._c10d_functional.wait_tensor(t)", "ccfx/wire/comm.py")
    assert allowed == []


@pytest.mark.parametrize("path", _source_files())
def test_every_module_reaches_private_names_only_through_the_compat_module(path):
    uses = _private_uses((ROOT / path).read_text(), path)
    assert not uses, (f"{path} reaches private torch / torchft names directly: {uses}; add them "
                      f"to {COMPAT} (INTERNALS, an alias or an accessor) and use tc.<name>")
