"""Fingerprints: the one short hash behind every key ranks compare.

A description (a small JSON-able dict) is named by 16 hex digits of a SHA-256 of its
canonical JSON; the same digits name an agreement in the c10d store and the process group
made for it. Other fingerprints (a pipeline's stage interfaces, a replica's parameters) hash
their own text with :func:`short_hash`, so every fingerprint has the same form.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence


def short_hash(text: str) -> str:
    """16 hex digits of the SHA-256 of ``text`` (the same on every rank and run)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def code_hash(text: str) -> str:
    """A short hash of a graph's code (what a description carries instead of the code)."""
    return short_hash(text)


def fingerprint(desc) -> str:
    """16 hex digits of the canonical JSON of ``desc`` (the same on every rank and run)."""
    return short_hash(json.dumps(desc, sort_keys=True, default=str, separators=(",", ":")))


def described(what: str, desc: dict, ranks: Sequence[int]) -> dict:
    """What an agreement's fingerprint covers: its kind, its ranks and the description."""
    return {"what": what, "ranks": list(ranks), "desc": desc}
