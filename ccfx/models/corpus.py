"""The embedded training corpus, a character tokenizer and a deterministic batch sampler.

``corpus.txt`` (next to this file) is the documentation text of part of the Python standard
library: the docstrings (``inspect.getdoc``) of a fixed list of stdlib modules and of their public
classes, functions and methods, as shipped with CPython 3.11. That text is part of CPython,
distributed under the Python Software Foundation License, which permits redistribution. It is
kept to printable ASCII so the character vocabulary stays under a hundred symbols. It needs no
download; ``python -m ccfx.models.corpus`` regenerates it (the result depends on the Python
version, so the committed file is the reference).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import string
from collections.abc import Iterator
from pathlib import Path

import torch

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
HEADER_END = "=" * 72 + "\n"  # the header of corpus.txt ends with this line

# Modules whose documentation makes up the corpus, in order. Only pure-library modules that import
# on every platform without side effects (no GUI, no network access at import).
MODULES = (
    "collections", "itertools", "functools", "operator", "string", "textwrap", "re", "difflib",
    "json", "csv", "configparser", "argparse", "logging", "datetime", "calendar", "time",
    "math", "cmath", "decimal", "fractions", "random", "statistics", "heapq", "bisect", "array",
    "copy", "pprint", "enum", "dataclasses", "typing", "abc", "contextlib", "io", "os",
    "pathlib", "shutil", "glob", "fnmatch", "tempfile", "zipfile", "tarfile", "gzip", "struct",
    "codecs", "base64", "hashlib", "hmac", "secrets", "uuid", "pickle", "shelve", "sqlite3",
    "threading", "queue", "sched", "subprocess", "selectors", "socket", "email.message",
    "urllib.parse", "http.client", "html", "ast", "dis", "tokenize", "inspect", "types",
    "weakref", "unittest", "doctest", "timeit", "traceback", "warnings", "locale", "gettext",
)
MAX_CHARS = 200_000
PER_MODULE_CHARS = 6_000  # so that every module contributes, not only the first few
_ALLOWED = set(string.printable) - set("\t\r\x0b\x0c")


def _clean(text: str) -> str:
    text = text.replace("\t", "    ")
    return "".join(c for c in text if c in _ALLOWED).strip()


def _documented(module) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) for a module, its public classes and functions, and methods."""
    yield module.__name__, inspect.getdoc(module) or ""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            yield f"{module.__name__}.{name}", inspect.getdoc(obj) or ""
            for mname, member in sorted(vars(obj).items()):
                if not mname.startswith("_") and callable(member):
                    doc = member.__doc__
                    if doc:
                        yield f"{module.__name__}.{name}.{mname}", inspect.cleandoc(doc)
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            yield f"{module.__name__}.{name}", inspect.getdoc(obj) or ""


def build_corpus(max_chars: int = MAX_CHARS) -> str:
    """The corpus body, from the docstrings of ``MODULES`` (deterministic for one Python)."""
    parts: list[str] = []
    size = 0
    seen: set[str] = set()
    for modname in MODULES:
        module = importlib.import_module(modname)
        module_size = 0
        for qualname, doc in _documented(module):
            doc = _clean(doc)
            if len(doc) < 40 or doc in seen:  # skip stubs and inherited duplicates
                continue
            seen.add(doc)
            part = f"{qualname}\n{doc}\n\n"
            if size + len(part) > max_chars:
                return "".join(parts)
            if module_size + len(part) > PER_MODULE_CHARS:
                break
            parts.append(part)
            size += len(part)
            module_size += len(part)
    return "".join(parts)


def write_corpus(path: Path = CORPUS_PATH) -> None:
    import sys

    header = (
        "Docstrings of part of the Python standard library (CPython "
        f"{sys.version_info.major}.{sys.version_info.minor}), gathered with inspect.getdoc by\n"
        "ccfx/models/corpus.py (python -m ccfx.models.corpus). Copyright Python Software\n"
        "Foundation; distributed under the PSF License Agreement, which permits redistribution.\n"
        "Only the text after the line of '=' below is used for training.\n"
    )
    path.write_text(header + HEADER_END + build_corpus(), encoding="ascii")


@functools.cache
def load_corpus() -> str:
    """The training text: corpus.txt without its header."""
    text = CORPUS_PATH.read_text(encoding="ascii")
    return text.split(HEADER_END, 1)[1]


class CharTokenizer:
    """Character-level tokenizer; the vocabulary is the sorted set of characters of ``text``."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """A 1-D int64 tensor of token ids (KeyError on a character outside the vocabulary)."""
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


def batches(
    data: torch.Tensor,
    batch_size: int,
    block_size: int,
    generator: torch.Generator | int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random (x, y) windows of ``data``, y shifted by one: ``(batch_size, block_size)``.

    ``generator`` is a torch.Generator or an int seed; the same seed yields the same batches.
    """
    if isinstance(generator, int):
        generator = torch.Generator().manual_seed(generator)
    n = data.numel() - block_size - 1
    if n <= 0:
        raise ValueError(f"data has {data.numel()} tokens, need more than block_size + 1")
    offsets = torch.arange(block_size + 1)
    while True:
        starts = torch.randint(0, n + 1, (batch_size,), generator=generator)
        window = data[starts[:, None] + offsets]
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()


if __name__ == "__main__":
    write_corpus()
    print(f"wrote {CORPUS_PATH} ({CORPUS_PATH.stat().st_size} bytes)")
