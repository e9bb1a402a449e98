"""Spec strings → codec objects. Codecs register themselves; there is no central if/elif."""

from __future__ import annotations

import dataclasses
import functools
import typing

from ..errors import ConfigError
from .base import Codec

_CODECS: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} must set a `name`")
    if cls.name in _CODECS and _CODECS[cls.name] is not cls:
        raise TypeError(f"codec name {cls.name!r} is taken by {_CODECS[cls.name].__name__}")
    _CODECS[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(_CODECS)


def _param_types(cls: type[Codec]) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def parse_spec(spec: str) -> tuple[str, dict[str, str | bool]]:
    """``"topk:ratio=0.01,ef"`` → ``("topk", {"ratio": "0.01", "ef": True})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"a codec spec is a non-empty string such as 'int8:block=128', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    params: dict[str, str | bool] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        params[key.strip()] = value.strip() if eq else True
    return name.strip().lower(), params


def _near(word: str, valid) -> str:
    """" (did you mean 'x'?)" for the valid word nearest ``word`` (difflib), else ""."""
    import difflib

    near = difflib.get_close_matches(word.lower(), list(valid), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _suggest(spec: str, name: str) -> str:
    """For an unknown codec name: the spec the user probably meant. ``int8,ef`` is ``int8:ef``
    (a name's parameters follow a colon); else the nearest codec name."""
    head, comma, _ = name.partition(",")
    if comma and head.strip() in _CODECS:
        tail = spec.strip().partition(",")[2]
        return f" (did you mean {head.strip() + ':' + tail.strip()!r}? parameters follow a colon)"
    return _near(name, names())


def _convert(name: str, key: str, value, typ):
    if typ is bool:
        if isinstance(value, bool):
            return value
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
    elif value is not True:
        try:
            return typ(value)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"codec {name!r}: parameter {key}={value!r} is not a valid {typ.__name__}")


@functools.cache
def _build(name: str, frozen_params: tuple) -> Codec:
    cls = _CODECS[name]
    types = _param_types(cls)
    kwargs = {}
    for key, value in frozen_params:
        if key not in types:
            valid = ", ".join([*types, "ef"])
            raise ConfigError(
                f"codec {name!r} has no parameter {key!r}{_near(key, [*types, 'ef'])}; "
                f"its parameters: {valid}"
            )
        kwargs[key] = _convert(name, key, value, types[key])
    try:
        return cls(**kwargs)
    except ValueError as e:  # validation in __post_init__
        raise ConfigError(f"codec {name!r}: {e}") from None


def prototype(spec: str | Codec) -> Codec:
    """The cached, shared codec for ``spec``. Stateful codecs come without state here: use its
    functional face (``encode_with(x, state)``), as the custom ops do, or call :func:`get`."""
    if isinstance(spec, Codec):
        return spec
    name, params = parse_spec(spec)
    if name not in _CODECS:
        raise ConfigError(f"unknown codec {name!r}{_suggest(spec, name)}; "
                          f"available: {', '.join(names())}")
    ef = params.pop("ef", False)
    ef = _convert(name, "ef", ef, bool)
    codec = _build(name, tuple(sorted(params.items())))
    if ef:
        from .ef import ErrorFeedback  # the wrapper for any codec

        codec = _wrap_ef(ErrorFeedback, codec)
    return codec


@functools.cache
def _wrap_ef(wrapper, codec: Codec) -> Codec:
    return wrapper(codec)


def get(spec: str | Codec) -> Codec:
    """The codec for ``spec``. Stateless codecs are cached and shared; a stateful spec (error
    feedback ``ef``, ``powersgd``, the stochastic codecs' step counter) gets a fresh object on
    every call, which then carries its own state."""
    if isinstance(spec, Codec):
        return spec
    return prototype(spec).fresh()


def available() -> dict[str, dict[str, object]]:
    """Every codec name with its parameters and their defaults (``ef``: any codec takes it)."""
    return {
        n: {**{f.name: f.default for f in dataclasses.fields(_CODECS[n])}, "ef": False}
        for n in names()
    }


def canonical(spec: str) -> str:
    return prototype(spec).spec


#: canonical spec → how the user wrote it, where the two differ by more than case and spaces
#: (``powersgd:ef`` → ``powersgd:rank=4,ef``): for display only; plans compare and store the
#: canonical form.
_SPELLED: dict[str, str] = {}


def canonical_as_written(spec: str) -> str:
    """:func:`canonical`, remembering the user's spelling for :func:`spelled` (call it on
    specs a user wrote, not on ones ccfx derives)."""
    canon = canonical(spec)
    written = spec.strip() if isinstance(spec, str) else canon
    if written.lower().replace(" ", "") != canon:
        _SPELLED[canon] = written
    else:
        _SPELLED.pop(canon, None)
    return canon


def spelled(spec: str | None) -> str | None:
    """How the user wrote the canonical ``spec`` (``powersgd:rank=4,ef`` for ``powersgd:ef``)
    where this process saw them write it, else ``spec``; ``"a/b"`` pairs part by part."""
    if not isinstance(spec, str):
        return spec
    return "/".join(_SPELLED.get(part, part) for part in spec.split("/"))


def spellings(specs) -> dict[str, str]:
    """canonical → as the user wrote it, for each part of ``specs`` (codec specs, ``"a/b"``
    pairs) whose spelling this process saw differ: what a plan stores, so that a plan read in
    another process is shown as written (:func:`remember_spellings`)."""
    out = {}
    for spec in specs:
        if isinstance(spec, str):
            for part in spec.split("/"):
                if part in _SPELLED:
                    out[part] = _SPELLED[part]
    return out


def remember_spellings(table: dict[str, str]) -> None:
    """Take a stored plan's spellings (:func:`spellings`) as this process's, for display."""
    for canon, written in (table or {}).items():
        if isinstance(canon, str) and isinstance(written, str):
            _SPELLED[canon] = written
