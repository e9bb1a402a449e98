"""``register_codec`` on a model sharded with torch's FSDP2 (``fully_shard``).

What a user writes, after sharding as usual::

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    codecs = ccfx.integrations.register_codec(
        model, {"all_gather": "int8", "reduce_scatter": "int4:ef"})   # or one spec for both

Every FSDP module gets ccfx's all-gather and reduce-scatter
(:mod:`ccfx.runtime.fsdp2_comms`); under HSDP (``fully_shard`` over ``mesh["shard"]``,
``replicate=mesh["replicate"]``) ccfx also averages each module's gradients across the
replicas, through the ``all_reduce`` codec. ``ccfx.plan_of(model)`` / ``ccfx.ledger_of(model)``
show them. Here the spec is read and checked (kinds, codecs), the model is found behind what
the user passed (``torch.compile(model)`` too), and the codec state is saved and restored
with a checkpoint (a file per rank: ``ccfx_fsdp2_rank<rank>.pt``).
"""

from __future__ import annotations

import difflib
import warnings
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from .. import _torch_compat as tc
from ..config import Config
from ..errors import CcfxWarning, ConfigError
from ..plan import Decision
from ..runtime.fsdp2_codecs import file_name
from ..runtime.fsdp2_comms import KINDS, FSDP2Codecs, attach, fsdp_modules

#: The kinds a dict spec may name: FSDP2's two collectives, and HSDP's replica all-reduce.
SPEC_KINDS = KINDS


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


def specs_by_kind(spec: Any, hsdp: bool = False) -> dict[str, str]:
    """``{kind: spec}`` from one spec for every kind or a dict by kind; a
    :class:`~ccfx.ConfigError` for an unknown kind (the nearest named) and what is not a
    spec. One spec serves the all-reduce too under HSDP (``hsdp``)."""
    given = dict(spec) if isinstance(spec, dict) else dict.fromkeys(
        KINDS if hsdp else KINDS[:2], spec)
    for kind, value in given.items():
        if kind not in SPEC_KINDS:
            near = difflib.get_close_matches(str(kind), SPEC_KINDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"register_codec: unknown collective kind {kind!r}{hint}: an "
                              f"FSDP2 model takes a codec for {', '.join(KINDS)}")
        if not isinstance(value, str):
            raise ConfigError(f"register_codec: the codec for {kind} is a "
                              f"{type(value).__name__}, not a spec such as 'int8'")
        if value.strip().lower() == "auto":
            given[kind] = "auto"
    return given


def _group_of(replicate: Any):
    """The replicas' process group from ``replicate``: a 1-D DeviceMesh or a ProcessGroup."""
    from torch.distributed.device_mesh import DeviceMesh

    if replicate is None or isinstance(replicate, dist.ProcessGroup):
        return replicate
    if isinstance(replicate, DeviceMesh) and replicate.ndim == 1:
        return replicate.get_group()
    raise ConfigError(f"register_codec: replicate= is the replicas' dimension, a 1-D "
                      f"DeviceMesh (mesh['replicate']) or a ProcessGroup; got "
                      f"{type(replicate).__name__}"
                      + (f" of {replicate.ndim} dimensions" if hasattr(replicate, "ndim")
                         else ""))


def _shard_group(modules):
    """The process group FSDP shards over (the last dimension of its parameters' mesh)."""
    from torch.distributed.tensor import DTensor

    for _, m in modules:
        for p in m.parameters():
            if isinstance(p, DTensor):
                return p.device_mesh.get_group(p.device_mesh.ndim - 1)
    return None


def _timeout_of(options: dict | None) -> float:
    """``options["collective_timeout_s"]``: how long a CPU collective waits for its peers."""
    value = (options or {}).get("collective_timeout_s", Config.collective_timeout_s)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"register_codec: options['collective_timeout_s']={value!r}: give "
                          "seconds, a positive number (e.g. 300)")
    return float(value)


def _auto(module, specs: dict[str, str], options: dict | None, group):
    """``"auto"``'s choice for the kinds that ask for it: ``(chosen, decisions,
    prediction)`` (:mod:`._fsdp2_auto`), or None when no kind does."""
    from . import _fsdp2_auto

    if "auto" not in specs.values():
        if set(options or {}) - {"collective_timeout_s"}:
            raise ConfigError("register_codec: options= prices 'auto' codecs (and may set "
                              "collective_timeout_s), and no kind asks for 'auto': leave "
                              "the pricing options out, or give 'auto'")
        return None
    modules = fsdp_modules(module)
    try:
        chosen, decisions, prediction = _fsdp2_auto.decide(modules, dict(options or {}),
                                                           _shard_group(modules), group)
    except ConfigError as e:
        raise ConfigError(f"register_codec(model, 'auto'): {e} (FSDP2: give them as "
                          "options={'link_gbps': ..., 'link_latency_ms': ...})") from None
    asked = {kind for kind, spec in specs.items() if spec == "auto"}
    return ({key: spec for key, spec in chosen.items() if key[1] in asked}, decisions,
            prediction)


def register(target: Any, spec: Any, process_group=None, *, replicate=None, accelerator=None,
             resume_from: str | None = None, options: dict | None = None) -> FSDP2Codecs:
    """ccfx's comms on every FSDP module of ``target`` (see
    :func:`ccfx.integrations.register_codec`)."""
    module = _module_of(target)
    if module is None or not fsdp_modules(module):
        raise ConfigError(f"register_codec with a codec per collective kind needs a model "
                          f"sharded with torch's fully_shard; got {describe(target)}")
    if process_group is not None:
        raise ConfigError("register_codec: process_group is for DDP; FSDP2 hands its comms "
                          "the group of the mesh given to fully_shard (HSDP's replicas: "
                          "replicate=mesh['replicate']): leave it out")
    group = _group_of(replicate)
    specs = specs_by_kind(spec, hsdp=group is not None)
    auto = _auto(module, specs, options, group)
    state = attach(module, specs, group, auto[0] if auto else None)
    state.timeout_s = _timeout_of(options)
    if auto:  # (a decision names its channel's row in the plan: "collective <index>")
        state.prediction = auto[2]
        state.decisions = [Decision(f"collective {state.channels[key].index}", d.chosen,
                                    d.candidates, f"FSDP module {key[0]}: {d.reason}")
                           for key, d in auto[1] if key in state.channels]
    if resume_from is not None and not state.load(resume_from):
        raise ConfigError(f"register_codec(resume_from={resume_from!r}): no {file_name()} "
                          "there: pass the folder this rank saved its FSDP2 codec state in "
                          "(codecs.save(folder)), or leave resume_from out to start afresh")
    if accelerator is not None:
        _checkpoint_with(accelerator, state)
    return state


# -- the codec state in a checkpoint: a file per rank -------------------------------------


def _checkpoint_with(accelerator, state: FSDP2Codecs) -> None:
    """``accelerator.save_state`` / ``load_state`` save and restore ``state``, every rank its
    own file (the pre-hooks run on every process and are handed the folder)."""

    def save(_models, _weights, folder):
        state.save(folder)

    def load(_models, folder):
        if not state.load(folder):
            warnings.warn(f"ccfx: no {file_name()} in {folder}: ccfx's FSDP2 codecs start "
                          "from fresh state", CcfxWarning, stacklevel=2)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
