"""pytest plugin (entry point ``pytest11``): golden files for ccfx graphs and plans.

    def test_my_model(ccfx_golden):
        compiled = torch.compile(model, backend="ccfx", options={"stages": 2})
        compiled(x).sum().backward()
        ccfx_golden(compiled)               # tests/golden/test_my_model.txt beside the test

``pytest --ccfx-update-golden`` rewrites the files instead of comparing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.getgroup("ccfx").addoption(
        "--ccfx-update-golden", action="store_true", default=False,
        help="rewrite ccfx golden files instead of comparing against them",
    )


def pytest_configure(config):
    from ccfx import testing

    testing._update_from_pytest = bool(config.getoption("--ccfx-update-golden", False))


@pytest.fixture
def ccfx_golden(request):
    """``ccfx_golden(compiled_or_text, name=None)``: compare with ``golden/<test name>.txt``
    in the test file's folder."""
    from ccfx import testing

    def check(compiled_or_text, name: str | None = None):
        text = compiled_or_text if isinstance(compiled_or_text, str) else \
            testing.golden_text(compiled_or_text)
        stem = name or re.sub(r"[^\w.-]+", "_", request.node.name).strip("_")
        path = Path(request.node.fspath).parent / "golden" / f"{stem}.txt"
        testing.assert_golden(path, text)

    return check
