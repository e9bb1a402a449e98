"""Progress bars for long work (training steps, benchmarks), shown once per job.

``progress(iterable, **tqdm_kwargs)`` is a ``tqdm`` bar that is disabled

* on every rank but 0 (the ``RANK`` environment variable torchrun sets), always;
* when the bar's stream (stderr by default) is not a terminal (logs, CI, pipes), unless
  ``force=True`` or ``CCFX_PROGRESS=1``;
* everywhere when ``CCFX_PROGRESS=0``.
"""

from __future__ import annotations

import os
import sys

ENV = "CCFX_PROGRESS"


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def enabled(force: bool = False, file=None) -> bool:
    """Whether a progress bar should draw here."""
    if _rank() != 0:
        return False
    setting = os.environ.get(ENV, "").strip()
    if setting == "0":
        return False
    if force or setting == "1":
        return True
    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False


def progress(iterable=None, *, force: bool = False, **kwargs):
    """A ``tqdm`` bar over ``iterable`` (or a manual one with ``total=``), on rank 0 in a
    terminal only (see the module docstring). Other keywords go to ``tqdm``."""
    from tqdm import tqdm

    if kwargs.get("disable") is None:
        kwargs["disable"] = not enabled(force, kwargs.get("file"))
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)
