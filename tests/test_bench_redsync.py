"""bench/redsync.py's encode timings on a small tensor: the three encodes are timed, the
table has their rows, and redsync's achieved density is within its tolerance of the target."""

import json

import pytest

from bench import redsync as bench
from ccfx.codecs.redsync import TOLERANCE

pytestmark = pytest.mark.usefixtures("one_thread")


def test_encode_rows_ratios_and_density(tmp_path, capsys):
    out = tmp_path / "redsync.json"
    assert bench.main(["--mb", "1", "--reps", "2", "--steps", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("torch.topk", "topk", "redsync", "x redsync"))
    encode = json.loads(out.read_text())["encode"]
    assert set(encode["medians"]) == {"torch.topk", "topk", "redsync"}
    assert all(len(s) == 2 for s in encode["samples"].values())
    assert len(encode["achieved"]) == 2
    assert all(abs(d - 0.01) <= TOLERANCE * 0.01 + 1 / encode["numel"]
               for d in encode["achieved"])
    assert encode["wire"]["redsync"] > encode["wire"]["topk"] == pytest.approx(0.02, rel=1e-3)
