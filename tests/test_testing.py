"""The golden machinery itself: a mismatch fails with a readable diff; updating rewrites."""

import pytest
import torch

from ccfx import testing

from . import toy_models as models
from .util import compile_ccfx


def test_mismatch_shows_a_diff(tmp_path, monkeypatch):
    monkeypatch.setattr(testing, "_update_from_pytest", False)
    monkeypatch.delenv(testing.UPDATE_ENV, raising=False)
    path = tmp_path / "g.txt"
    path.write_text("stage 0: a b\nstage 1: c\n")
    testing.assert_golden(path, "stage 0: a b\nstage 1: c\n")
    with pytest.raises(testing.GoldenMismatch) as e:
        testing.assert_golden(path, "stage 0: a\nstage 1: b c\n")
    assert "-stage 0: a b" in str(e.value) and "+stage 1: b c" in str(e.value)
    assert "--ccfx-update-golden" in str(e.value)


def test_missing_file_says_how_to_create_it(tmp_path, monkeypatch):
    monkeypatch.setattr(testing, "_update_from_pytest", False)
    monkeypatch.delenv(testing.UPDATE_ENV, raising=False)
    with pytest.raises(testing.GoldenMismatch, match="does not exist"):
        testing.assert_golden(tmp_path / "none.txt", "x")


def test_update_rewrites(tmp_path, monkeypatch):
    monkeypatch.setenv(testing.UPDATE_ENV, "1")
    path = tmp_path / "sub" / "g.txt"
    testing.assert_golden(path, "new\n")
    assert path.read_text() == "new\n"


def test_normalization_is_stable_across_compiles():
    texts = []
    for _ in range(2):
        torch._dynamo.reset()
        compiled, _ = compile_ccfx(models.MLP(width=8, depth=4), stages=2, activation_codec="int8",
                                   dynamic=True)
        compiled(torch.randn(3, 8)).sum().backward()
        texts.append(testing.golden_text(compiled))
    assert texts[0] == texts[1]
    assert "'e0:0->1'" in texts[0]  # hop ids are named, not numbered
    assert "/" not in "".join(line for line in texts[0].splitlines() if "# File" in line)
