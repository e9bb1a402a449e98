"""``register_codec`` on a model sharded with torch's FSDP2 (``fully_shard``).

What a user writes, after sharding as usual::

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    codecs = ccfx.integrations.register_codec(
        model, {"all_gather": "int8", "reduce_scatter": "int4:ef"})   # or one spec for both

Every FSDP module gets ccfx's all-gather and reduce-scatter
(:mod:`ccfx.runtime.fsdp2_comms`); ``ccfx.plan_of(model)`` / ``ccfx.ledger_of(model)`` show
them. Here the spec is read and checked (kinds, codecs) and the model is found behind what
the user passed (``torch.compile(model)`` too).
"""

from __future__ import annotations

import difflib
from collections import Counter
from typing import Any

import torch

from .. import _torch_compat as tc
from ..errors import ConfigError
from ..runtime.fsdp2_comms import KINDS, FSDP2Codecs, attach, fsdp_modules

#: The kinds a dict spec may name: FSDP2's two collectives, and HSDP's replica all-reduce
#: (reserved: not served yet).
SPEC_KINDS = (*KINDS, "all_reduce")


def _module_of(target: Any) -> torch.nn.Module | None:
    """The ``nn.Module`` behind ``target`` (the model inside ``torch.compile(model)``)."""
    inner = tc.orig_module(target)
    if inner is not None:
        return inner
    return target if isinstance(target, torch.nn.Module) else None


def holds_fsdp(target: Any) -> bool:
    """Whether ``target`` is, or holds, a module sharded with torch's ``fully_shard``."""
    module = _module_of(target)
    return module is not None and bool(fsdp_modules(module))


def describe(target: Any) -> str:
    """What ``target`` is, for an error: its type and the kinds of module it holds."""
    module = _module_of(target)
    if module is None:
        return f"a {type(target).__name__} (not an nn.Module)"
    kinds = Counter(type(m).__name__ for m in module.modules() if m is not module)
    held = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in kinds.most_common(6))
    return (f"a {type(module).__name__}" + (f" holding {held}" if held else "")
            + " (no FSDPModule from fully_shard, no DistributedDataParallel)")


def specs_by_kind(spec: Any) -> dict[str, str]:
    """``{kind: spec}`` from one spec for both kinds or a dict by kind; a
    :class:`~ccfx.ConfigError` for an unknown kind (the nearest named), the reserved
    ``all_reduce``, ``"auto"`` and what is not a spec."""
    given = dict(spec) if isinstance(spec, dict) else dict.fromkeys(KINDS, spec)
    for kind, value in given.items():
        if kind not in SPEC_KINDS:
            near = difflib.get_close_matches(str(kind), SPEC_KINDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"register_codec: unknown collective kind {kind!r}{hint}: an "
                              f"FSDP2 model takes a codec for {', '.join(KINDS)}")
        if kind == "all_reduce":
            raise ConfigError(
                "register_codec: 'all_reduce' (HSDP's all-reduce across replicas) is not "
                "supported yet on FSDP2 models: shard on a 1-D mesh and give codecs for "
                f"{' and '.join(KINDS)} only")
        if not isinstance(value, str):
            raise ConfigError(f"register_codec: the codec for {kind} is a "
                              f"{type(value).__name__}, not a spec such as 'int8'")
        if value.strip().lower() == "auto":
            raise ConfigError(f"register_codec: 'auto' for FSDP2's {kind} is not supported "
                              "yet: name a codec ('int8' for all_gather, 'int4:ef' for "
                              "reduce_scatter, 'none')")
    return given


def register(target: Any, spec: Any, process_group=None, *, accelerator=None,
             resume_from: str | None = None) -> FSDP2Codecs:
    """ccfx's comms on every FSDP module of ``target`` (see
    :func:`ccfx.integrations.register_codec`)."""
    module = _module_of(target)
    if module is None or not fsdp_modules(module):
        raise ConfigError(f"register_codec with a codec per collective kind needs a model "
                          f"sharded with torch's fully_shard; got {describe(target)}")
    if process_group is not None:
        raise ConfigError("register_codec: process_group is for DDP; FSDP2 hands its comms "
                          "the group of the mesh given to fully_shard: leave it out")
    if accelerator is not None or resume_from is not None:
        raise ConfigError("register_codec: checkpoints of ccfx's FSDP2 codec state "
                          "(accelerator=, resume_from=) are not supported yet: leave them "
                          "out (a resumed run starts error feedback from zero)")
    return attach(module, specs_by_kind(spec))
