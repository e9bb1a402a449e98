"""The docs' generated pages match the code, and the README keeps its promises.

docs/reference/options.md and docs/reference/codecs.md are written by scripts/gen_reference.py
from ``ccfx.Config`` and the codec registry: a field or codec changed without regenerating
them fails here, naming the page. The README stays short, runs CI's test command, and speaks of
the project rather than of its sessions.
"""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    path = ROOT / "scripts" / "gen_reference.py"
    spec = importlib.util.spec_from_file_location("gen_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["options", "codecs"])
def test_generated_reference_page_is_current(page):
    gen = _generator()
    path = ROOT / "docs" / "reference" / f"{page}.md"
    render = {"options": gen.render_options, "codecs": gen.render_codecs}[page]
    assert path.read_text() == render(), (
        f"{path.relative_to(ROOT)} differs from what scripts/gen_reference.py makes: run "
        "`.venv/bin/python scripts/gen_reference.py` and commit the page")


def test_check_mode_names_a_stale_page(tmp_path, monkeypatch, capsys):
    gen = _generator()
    stale = tmp_path / "docs" / "reference" / "options.md"
    stale.parent.mkdir(parents=True)
    stale.write_text("old\n")
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    monkeypatch.setattr(gen, "PAGES", {stale: gen.render_options})
    assert gen.main(["--check"]) == 1
    assert "docs/reference/options.md differs" in capsys.readouterr().err


def test_every_config_field_has_its_own_doc():
    import dataclasses

    from ccfx.config import Config

    fields = {f.name for f in dataclasses.fields(Config)}
    groups = _generator().parse_config_doc(Config.__doc__, fields)
    documented = [n for _, _, entries in groups for names, text in entries for n in names if text]
    assert sorted(documented) == sorted(fields)


def test_readme_is_short_and_runs_ci_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert ".venv/bin/python -m pytest -q -n 2 --durations=20" in readme
    assert ".venv/bin/python -m pytest -q -n 2 --durations=20" in (ROOT / ".ci" / "run").read_text()


def test_docs_speak_of_the_project_not_its_sessions():
    paths = [ROOT / "README.md", ROOT / "tests" / "README.md", *(ROOT / "docs").rglob("*.md")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in paths
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"[Ss]ession [0-9]", line)]
    assert not found, f"'session N' in {found}"
