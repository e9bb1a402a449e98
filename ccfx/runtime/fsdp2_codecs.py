"""What ccfx keeps for a model sharded with torch's FSDP2: a channel per FSDP module per
collective kind (the codec that runs, why raw, its codec state), the ledger, and the codec
state's checkpoint (:meth:`FSDP2Codecs.state_dict` / :meth:`FSDP2Codecs.load_state_dict`).

The comms that run the channels are in :mod:`ccfx.runtime.fsdp2_comms`. Kinds: FSDP2's
``all_gather`` and ``reduce_scatter``, and HSDP's ``all_reduce`` across replicas (FSDP over
each replica's shard group, the replicas' all-reduce through ``set_all_reduce_hook``).

State is named ``fsdp2.<module>.<kind>.<state-name>`` (:func:`ccfx.codecs.state.fsdp2_channel`)
and is per rank: error feedback's residual is what this rank's gradient lost. A checkpoint
records the world size and rank it was made on and the codec of each kind; loading it on
another world size, rank or codec is a :class:`~ccfx.ConfigError` saying what differs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import codecs
from ..codecs.ef import ErrorFeedback
from ..codecs.state import check, check_finite, check_place, fsdp2_channel, named
from ..config import Config
from ..errors import CollectiveError, ConfigError
from ..wire.collectives import CollectiveCall, CompressedCollective, refuse
from .ledger import Ledger

#: The collectives ccfx serves on FSDP2: its two, and HSDP's all-reduce across replicas.
KINDS = ("all_gather", "reduce_scatter", "all_reduce")

#: The reduction each kind's probe (and, for the all-reduce, each call) takes.
_PROBE_OP = {"all_gather": None, "reduce_scatter": "sum", "all_reduce": "avg"}

FORMAT = 1

_FIX = ("Resume on the same ranks with the same codecs, or leave ccfx's FSDP2 codec state out "
        "(do not load it: the codecs start afresh, error feedback from zero).")


def check_spec(kind: str, spec: str) -> str:
    """``spec`` in its canonical form, checked for FSDP2's ``kind``: a
    :class:`~ccfx.ConfigError` names a codec that cannot serve it, and why."""
    if kind not in KINDS:
        raise ConfigError(f"FSDP2 collective kind {kind!r}: ccfx serves {', '.join(KINDS)}")
    canon = codecs.canonical(spec)
    codec = codecs.prototype(canon)
    if codec.name == "none":
        return canon
    if kind == "all_gather" and isinstance(codec, ErrorFeedback):
        raise ConfigError(
            f"codec {canon!r} for FSDP2's all_gather: error feedback adds what one encode lost "
            "to the next, which suits a gradient summed over steps, not a weight gather (the "
            "same weights are gathered in forward and again in backward): use "
            f"{codecs.spelled(codec.inner.spec)!r} for all_gather and keep ':ef' for "
            "reduce_scatter")
    why = refuse(CollectiveCall(kind, (256,), torch.float32, 2, _PROBE_OP[kind]), canon)
    if why is not None:
        raise ConfigError(f"codec {canon!r} cannot serve FSDP2's {kind}: {why}")
    return canon


@dataclass
class Channel:
    """One FSDP module's collective of one kind: what runs (``algorithm``, or None when
    torch's own collective runs, ``reason`` saying why), and its codec state (``pending``: a
    checkpoint's, loaded at the first call, once the buffer's size is known)."""

    module: str  # the FSDP module's name in the model ("root": the model itself)
    kind: str
    index: int  # its row in the plan and the ledger
    spec: str  # the codec asked for
    call: CollectiveCall | None = None  # as it last ran (None: not yet)
    algorithm: CompressedCollective | None = None
    reason: str = ""
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: dict[str, torch.Tensor] | None = None
    group: str = ""

    @property
    def name(self) -> str:
        """The channel's checkpoint name: ``fsdp2.<module>.<kind>``."""
        return fsdp2_channel(self.module, self.kind)

    @property
    def codec(self) -> str:
        """The codec that runs (``"none"``: torch's own collective)."""
        return self.algorithm.spec if self.algorithm is not None else "none"

    @property
    def raw_bytes(self) -> int:
        """Bytes this rank sends per call uncompressed (ring convention, as the plan's)."""
        return self.call.raw_bytes if self.call is not None else 0

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends per call as it runs."""
        if self.algorithm is None:
            return self.raw_bytes
        return self.algorithm.wire_bytes()

    def bind(self, x: torch.Tensor, group, reduce_op: str | None = None) -> Channel:
        """Make the algorithm and state for ``x`` on ``group`` (again when its buffer changed:
        FSDP's buffers keep their size, so once in practice)."""
        call = CollectiveCall(self.kind, (x.numel(),), x.dtype, group.size(), reduce_op)
        if call == self.call:
            return self
        from ..wire import agree

        agree.publish_process()  # once per process: a peer's error can then name this rank
        self.call, self.group = call, getattr(group, "group_name", "")
        self.algorithm, self.reason, self.state = None, "", {}
        if codecs.prototype(self.spec).name == "none":
            return self
        why = refuse(call, self.spec)
        if why is not None:
            self.reason = why
            return self
        codec = codecs.prototype(self.spec)
        self.algorithm = CompressedCollective(
            call, self.spec,
            owner_feedback=self.kind == "all_reduce" and isinstance(codec, ErrorFeedback))
        self.state = self.algorithm.init_state(x.device)
        self._load_pending()
        return self

    def _load_pending(self) -> None:
        """A checkpoint's state for this channel, copied in once it has its live layout."""
        if self.pending is None:
            return
        saved, self.pending = self.pending, None
        check(named(self.name, self.state), named(self.name, saved),
              {self.name: self.spec}, "FSDP2 codec state")
        for k, t in self.state.items():
            t.copy_(saved[k])


def file_name() -> str:
    """This rank's checkpoint file: ``ccfx_fsdp2_rank<global rank>.pt``."""
    return f"ccfx_fsdp2_rank{_place()['rank']}.pt"


def _place(group=None) -> dict[str, int]:
    """The world size and this rank (global): what per-rank codec state was made for."""
    if not (dist.is_available() and dist.is_initialized()):
        return {"world_size": 1, "rank": 0}
    return {"world_size": dist.get_world_size(group), "rank": dist.get_rank(group)}


class FSDP2Codecs:
    """What ``register_codec`` returns for an FSDP2 model: the codec of each kind (``specs``),
    every FSDP module's channels (``channels``, by ``(module, kind)``), the ``ledger`` (raw and
    wire bytes per module per kind; ``steps``: backwards; the plan: ``ccfx.plan_of(model)``),
    and the codec state
    (:meth:`state_tensors`, :meth:`state_dict`, :meth:`load_state_dict`)."""

    def __init__(self, specs: dict[str, str], replicate=None,
                 chosen: dict[tuple[str, str], str] | None = None):
        unknown = sorted(set(specs) - set(KINDS))
        if unknown:
            raise ConfigError(f"FSDP2 codecs for {unknown}: ccfx serves {', '.join(KINDS)}")
        self.specs = {kind: "auto" if specs.get(kind) == "auto" and chosen is not None
                      else check_spec(kind, specs.get(kind, "none")) for kind in KINDS}
        #: HSDP: the replicas' process group whose all-reduce ccfx runs (None: FSDP only)
        self.replicate = replicate
        #: ``"auto"``'s codec per ``(module, kind)``, its decisions and predicted collectives
        self.chosen = dict(chosen or {})
        self.decisions: list = []
        self.prediction = None
        self.ledger = Ledger()
        self.channels: dict[tuple[str, str], Channel] = {}
        self.modules: list[str] = []
        #: how long a collective on CPU (gloo) waits for its peers before a CollectiveError
        #: names them (``options={"collective_timeout_s": ...}``; Config's default)
        self.timeout_s: float = Config.collective_timeout_s
        #: wall seconds spent inside ccfx's FSDP2 comm calls (encode, wire, decode; a raw
        #: collective FSDP waits on itself counts its issue only), over every step so far
        self.seconds = 0.0

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds ccfx runs: FSDP2's two, and the all-reduce across replicas under HSDP."""
        return KINDS if self.replicate is not None else KINDS[:2]

    @property
    def steps(self) -> int:
        """Backwards seen: the most gradient reductions of any FSDP module and kind."""
        return self.ledger.steps

    def add_module(self, name: str) -> dict[str, Channel]:
        """The channels of FSDP module ``name``, by kind."""
        self.modules.append(name)
        made = {}
        for kind in self.kinds:
            spec = self.chosen.get((name, kind), self.specs[kind])
            made[kind] = self.channels[(name, kind)] = Channel(
                name, kind, len(self.channels), "none" if spec == "auto" else spec)
        return made

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every channel's live codec state, ``fsdp2.<module>.<kind>.<state-name>``."""
        return {k: t for ch in self.channels.values() for k, t in named(ch.name, ch.state).items()}

    def run(self, ch: Channel, x: torch.Tensor, comm, group) -> torch.Tensor:
        """``ch``'s compressed collective of ``x`` over ``comm`` (on ``group``); a failure as a
        :class:`~ccfx.CollectiveError`."""
        try:
            return ch.algorithm.run(x, ch.state, comm)
        except RuntimeError as e:
            raise self.failed(ch, group, e) from e

    def count(self, ch: Channel, seconds: float = 0.0) -> None:
        """One call of ``ch`` that took ``seconds``, in the ledger (a gradient reduction also
        counts a step)."""
        self.seconds += seconds
        self.ledger.record_collective(0, ch.index, ch.raw_bytes, ch.wire_bytes)
        if ch.kind != "all_gather":
            self.ledger.count_call(("fsdp2", ch.module, ch.kind))

    def failed(self, ch: Channel, group, e: RuntimeError) -> CollectiveError:
        """A failed collective as a :class:`~ccfx.CollectiveError` naming this rank, the
        module, kind, codec and step, and the peer gloo's address points at."""
        from ..wire import agree

        what = f"FSDP2's {ch.kind} of module {ch.module!r} ({ch.codec}, step {self.steps})"
        ranks = agree.world_ranks(group) if dist.is_initialized() else (0,)
        first, who = agree.failed(what, e, ranks)
        rank = dist.get_rank() if dist.is_initialized() else group.rank()
        if "PREMUL_SUM" in str(e) and "loo" in str(e):  # gloo has no premultiplied sum
            return CollectiveError(
                f"rank {rank} of {group.size()}: {what} failed: {first}. FSDP passes "
                "PREMUL_SUM when a gradient divide factor is set (torchtitan sets 1), and gloo "
                "has none: call module.set_force_sum_reduction_for_comms(True) on every FSDP "
                "module (the same values: a sum), or give reduce_scatter a codec (ccfx "
                "applies the factor itself)")
        return CollectiveError(
            f"rank {rank} of {group.size()}: {what} failed: {first.rstrip('.!')}.{who} A peer "
            f"rank died, froze or fell behind past collective_timeout_s ({self.timeout_s:g} s "
            "on CPU; "
            "register_codec(..., options={'collective_timeout_s': ...})), or ran a different "
            "model; see that rank's own error.")

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's codec state (copies), the codec of each kind and where it was made
        (world size, rank); a checkpoint's state not used yet is kept in it."""
        state = {}
        for ch in self.channels.values():
            tensors = ch.pending if ch.pending is not None else ch.state
            state.update(named(ch.name, {k: t.detach().clone() for k, t in tensors.items()}))
        return {"format": FORMAT, "specs": dict(self.specs), **_place(),
                "hsdp": self.replicate is not None, "state": state}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: into channels that ran, at once; into the others
        at their first call. Another codec, world size, rank, FSDP module or a damaged entry
        (NaN, a missing field) is a :class:`~ccfx.ConfigError` saying what differs."""
        state = _readable(saved)
        differ = [f"{k}: the checkpoint's is {saved['specs'].get(k, 'none')!r}, this run's "
                  f"{self.specs[k]!r}" for k in self.kinds
                  if codecs.canonical(saved["specs"].get(k, "none")) != self.specs[k]]
        if differ:
            raise ConfigError("the checkpoint's FSDP2 codec state is for other codecs ("
                              + "; ".join(differ) + "): register_codec with the checkpoint's "
                              "codecs, or " + _FIX[0].lower() + _FIX[1:])
        check_place({k: saved[k] for k in ("world_size", "rank") if k in saved}, _place(),
                    "FSDP2 codec state")
        check_finite(state, "FSDP2 codec state", fix=_FIX)
        mine = {ch.name: ch for ch in self.channels.values()}
        by_channel: dict[str, dict[str, torch.Tensor]] = {}
        strange = []
        for k, t in state.items():  # (a state name may hold dots: chunk0000.residual)
            channel = next((c for c in mine if k.startswith(c + ".")), None)
            if channel is None:
                strange.append(k)
            else:
                by_channel.setdefault(channel, {})[k[len(channel) + 1:]] = t
        if strange:
            raise ConfigError(f"the checkpoint's FSDP2 codec state has channels this model "
                              f"lacks ({', '.join(strange[:4])}; this model's FSDP modules are "
                              f"{', '.join(self.modules)}): shard the same model the same way "
                              "(fully_shard on the same modules). " + _FIX)
        for name, ch in mine.items():  # (a channel with no saved state starts afresh)
            saved_state = by_channel.get(name)
            ch.pending = None if saved_state is None else {k: t.clone()
                                                           for k, t in saved_state.items()}
            if ch.call is not None:
                ch._load_pending()

    def save(self, folder: str) -> str:
        """Write this rank's :meth:`state_dict` into ``folder`` (:func:`file_name`); its path.
        Every rank calls it: the state is per rank."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, file_name())
        torch.save(self.state_dict(), path)
        return path

    def load(self, folder: str) -> bool:
        """Load this rank's file from ``folder`` (:meth:`save`'s); False when there is none;
        a damaged or mismatched file is a :class:`~ccfx.ConfigError` naming it."""
        path = os.path.join(folder, file_name())
        if not os.path.isfile(path):
            return False
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 (torch.load's failures have no common type)
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise ConfigError(f"{path}: ccfx's FSDP2 codec state cannot be read "
                              f"({type(e).__name__}: {first}): the file is damaged. "
                              + _FIX) from None
        try:
            self.load_state_dict(saved)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        return True

    def __repr__(self) -> str:
        return (f"FSDP2Codecs({self.specs}, {len(self.modules)} FSDP module(s), "
                f"{self.steps} step(s))")


def _readable(saved: Any) -> dict[str, torch.Tensor]:
    """The ``state`` of a checkpoint made by :meth:`FSDP2Codecs.state_dict`; a
    :class:`~ccfx.ConfigError` for anything else (a damaged or foreign entry)."""
    bad = []
    if not isinstance(saved, dict):
        bad.append(f"it is a {type(saved).__name__}, not a dict")
    else:
        for k, kind in (("specs", dict), ("state", dict)):
            if not isinstance(saved.get(k), kind):
                bad.append(f"{k!r} is {type(saved[k]).__name__ if k in saved else 'missing'}")
        if not bad and not all(isinstance(t, torch.Tensor) for t in saved["state"].values()):
            bad.append("'state' holds entries that are not tensors")
    if bad:
        raise ConfigError("the checkpoint's FSDP2 codec state cannot be read ("
                          + "; ".join(bad) + "): it is damaged, or not "
                          "FSDP2Codecs.state_dict()'s. " + _FIX)
    return saved["state"]
