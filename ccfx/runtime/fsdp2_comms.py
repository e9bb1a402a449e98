"""ccfx's codecs on torch's own FSDP2 (``fully_shard``), through its public custom comms.

FSDP2 calls one all-gather per FSDP module per unshard (the module's parameter shards copied
into one flat buffer: forward, and backward again after ``reshard_after_forward``) and one
reduce-scatter per module per backward (the module's flat unsharded gradients, ``W`` chunks
of the output's size), each through the comm object ``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter`` installed. :func:`attach` installs :class:`CodecAllGather` and
:class:`CodecReduceScatter` on every FSDP module of a model; they run the wire layer's
compressed collectives (:mod:`ccfx.wire.collectives`):

* all-gather: this rank's shard encoded once, the payloads all-gathered, every rank's payload
  decoded into FSDP's output buffer, this rank's own too, so every rank's gathered parameters
  are the same bits (the sharded parameters the optimizer steps stay exact);
* reduce-scatter: the ``W`` chunks encoded, one all-to-all, this rank's chunk's ``W`` payloads
  decoded and summed in fp32 in rank order; the op FSDP passes is honoured as
  ``reduce_scatter_tensor`` would: ``SUM``, ``AVG`` (the sum divided by ``W``),
  ``PREMUL_SUM(f)`` (each rank's input multiplied by ``f`` first); any other op runs raw.

A buffer a codec cannot serve runs torch's own collective, unchanged, and the plan says why:
FSDP gathers a ``uint8`` view when a module mixes parameter dtypes, integer data, a codec
that does not apply to the dtype (:func:`ccfx.wire.collectives.refuse`). ``"none"`` runs
torch's own collectives (``all_gather_single`` / ``reduce_scatter_single`` with FSDP's
``async_op`` and op): the same bits as plain FSDP2.

``async_op``: a compressed collective runs to its end inside the call and returns None, which
FSDP2 (torch 2.13) takes as a finished synchronous collective (it waits only on a returned
``Work``); the raw ones pass ``async_op`` through and return torch's ``Work``.

State and counts (:class:`FSDP2Codecs`): error feedback's residual per rank per FSDP module
per kind, explicit tensors named ``fsdp2.<module>.<kind>.<state-name>`` (``<module>`` the FSDP
module's name in the model, ``root`` for the model itself); a ledger counting raw and wire
bytes per module per kind (``ccfx.ledger_of(model)``; a step is one backward: the most
reduce-scatters of any module), and a plan (``ccfx.plan_of(model)``). Checkpointing the codec
state is not supported yet: a resumed run starts error feedback from zero.

Failures: a collective that fails (a peer died, hung past the process group's timeout, ran
another model) is a :class:`~ccfx.CollectiveError` naming this rank, the module, the kind, the
codec and the step. The time bound is FSDP's process group's timeout.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import _torch_compat as tc
from .. import codecs
from ..codecs.ef import ErrorFeedback
from ..errors import CollectiveError, ConfigError
from ..wire.collectives import CollectiveCall, CompressedCollective, refuse
from ..wire.comm import ProcessGroupComm
from .ledger import Ledger

#: The collectives FSDP2 lets a custom comm run (HSDP's all-reduce is not served yet).
KINDS = ("all_gather", "reduce_scatter")

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = (getattr(dist, "reduce_scatter_single", None)
                        or dist.reduce_scatter_tensor)

#: model or FSDP module -> the FSDP2Codecs attached to it (ccfx.plan_of / ledger_of find it)
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    probe = CollectiveCall(kind, (256,), torch.float32, 2,
                           "sum" if kind == "reduce_scatter" else None)
    why = refuse(probe, canon)
    if why is not None:
        raise ConfigError(f"codec {canon!r} cannot serve FSDP2's {kind}: {why}")
    return canon


def _reduce_op(op) -> tuple[str, float | None]:
    """``(sum | avg | the op's name, premultiply factor)`` of the op FSDP passes: a
    ``ReduceOp.RedOpType`` or a ``ReduceOp`` (``PREMUL_SUM(f)`` keeps ``f`` in ``factor``)."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.SUM:
        return "sum", None
    if kind == dist.ReduceOp.AVG:
        return "avg", None
    if kind == dist.ReduceOp.PREMUL_SUM:
        return "sum", float(op.factor)
    return str(kind).rsplit(".", 1)[-1].lower(), None


@dataclass
class Channel:
    """One FSDP module's collective of one kind: what runs (``algorithm``, or None when
    torch's own collective runs, ``reason`` saying why), and its codec state."""

    module: str  # the FSDP module's name in the model ("root": the model itself)
    kind: str
    index: int  # its row in the plan and the ledger
    spec: str  # the codec asked for
    call: CollectiveCall | None = None  # as it last ran (None: not yet)
    algorithm: CompressedCollective | None = None
    reason: str = ""
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    group: str = ""

    @property
    def name(self) -> str:
        """The channel's checkpoint name: ``fsdp2.<module>.<kind>``."""
        return f"fsdp2.{self.module}.{self.kind}"

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
        self.algorithm = CompressedCollective(call, self.spec)
        self.state = self.algorithm.init_state(x.device)
        return self


def _comm(group) -> ProcessGroupComm:
    """The wire layer's Comm over FSDP's group (a test replaces it to make a peer fail)."""
    return ProcessGroupComm(group)


class FSDP2Codecs:
    """What :func:`attach` returns: the codec of each kind (``specs``), every FSDP module's
    channels (``channels``, by ``(module, kind)``), the ``ledger`` (raw and wire bytes per
    module per kind; ``steps``: backwards) and :meth:`plan`; :meth:`state_tensors` holds the
    codec state (error-feedback residuals) by checkpoint name."""

    def __init__(self, specs: dict[str, str]):
        unknown = sorted(set(specs) - set(KINDS))
        if unknown:
            raise ConfigError(f"FSDP2 codecs for {unknown}: ccfx serves {', '.join(KINDS)}")
        self.specs = {kind: check_spec(kind, specs.get(kind, "none")) for kind in KINDS}
        self.ledger = Ledger()
        self.channels: dict[tuple[str, str], Channel] = {}
        self.modules: list[str] = []

    @property
    def steps(self) -> int:
        """Backwards seen: the most reduce-scatters of any FSDP module."""
        return self.ledger.steps

    def add_module(self, name: str) -> tuple[Channel, Channel]:
        """The all-gather and reduce-scatter channels of FSDP module ``name``."""
        self.modules.append(name)
        made = []
        for kind in KINDS:
            ch = Channel(name, kind, len(self.channels), self.specs[kind])
            self.channels[(name, kind)] = ch
            made.append(ch)
        return made[0], made[1]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every channel's live codec state, ``fsdp2.<module>.<kind>.<state-name>``."""
        return {f"{ch.name}.{k}": t for ch in self.channels.values()
                for k, t in ch.state.items()}

    def run(self, ch: Channel, x: torch.Tensor, group) -> torch.Tensor:
        """``ch``'s compressed collective of ``x`` on ``group``; a failure as a
        :class:`~ccfx.CollectiveError`."""
        try:
            return ch.algorithm.run(x, ch.state, _comm(group))
        except RuntimeError as e:
            raise self.failed(ch, group, e) from e

    def count(self, ch: Channel) -> None:
        """One call of ``ch`` in the ledger (a reduce-scatter also counts its module's step)."""
        self.ledger.record_collective(0, ch.index, ch.raw_bytes, ch.wire_bytes)
        if ch.kind == "reduce_scatter":
            self.ledger.count_call(("fsdp2", ch.module))

    def failed(self, ch: Channel, group, e: RuntimeError) -> CollectiveError:
        """A failed collective as a :class:`~ccfx.CollectiveError` naming this rank, the
        module, kind, codec and step, and the peer gloo's address points at."""
        from ..wire import agree

        what = (f"FSDP2's {ch.kind} of module {ch.module!r} ({ch.codec}, step {self.steps})")
        ranks = agree.world_ranks(group) if dist.is_initialized() else (0,)
        first, who = agree.failed(what, e, ranks)
        rank = dist.get_rank() if dist.is_initialized() else group.rank()
        return CollectiveError(
            f"rank {rank} of {group.size()}: {what} failed: {first}.{who} A peer rank died, "
            "hung past the process group's timeout (init_process_group(timeout=...)), or ran "
            "a different model; see that rank's own error.")

    def plan(self):
        """A :class:`~ccfx.Plan` (``ccfx.plan_of(model)``)."""
        return plan_of_fsdp2(self)

    def __repr__(self) -> str:
        return (f"FSDP2Codecs({self.specs}, {len(self.modules)} FSDP module(s), "
                f"{self.steps} step(s))")


class CodecAllGather(tc.FsdpAllGather):
    """FSDP2's all-gather of one module through ccfx's codec (see the module docstring)."""

    def __init__(self, owner: FSDP2Codecs, channel: Channel):
        self.owner, self.channel = owner, channel

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        ch = self.channel.bind(input_tensor, group)
        if ch.algorithm is None:
            try:
                work = _all_gather_flat(output_tensor, input_tensor, group, async_op)
            except RuntimeError as e:
                raise self.owner.failed(ch, group, e) from e
        else:  # the input is a view of the output: encoded before anything is written
            output_tensor.copy_(self.owner.run(ch, input_tensor, group))
            work = None
        self.owner.count(ch)
        return work


class CodecReduceScatter(tc.FsdpReduceScatter):
    """FSDP2's reduce-scatter of one module through ccfx's codec (see the module
    docstring)."""

    def __init__(self, owner: FSDP2Codecs, channel: Channel):
        self.owner, self.channel = owner, channel

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        reduce_op, factor = _reduce_op(op)
        ch = self.channel.bind(input_tensor, group, reduce_op)
        if ch.algorithm is None:
            try:
                work = _reduce_scatter_flat(output_tensor, input_tensor, op, group, async_op)
            except RuntimeError as e:
                raise self.owner.failed(ch, group, e) from e
        else:
            x = input_tensor if factor is None else input_tensor * factor
            output_tensor.copy_(self.owner.run(ch, x, group).view_as(output_tensor))
            work = None
        self.owner.count(ch)
        return work


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every ``FSDPModule`` in ``model`` (itself included), ``(name, module)`` in
    ``named_modules`` order; the model itself is named ``root``."""
    from torch.distributed.fsdp import FSDPModule

    return [(name or "root", m) for name, m in model.named_modules()
            if isinstance(m, FSDPModule)]


def attach(model: torch.nn.Module, specs: dict[str, str]) -> FSDP2Codecs:
    """Install ccfx's comms on every FSDP module of ``model`` (``specs``: a codec per kind,
    missing kinds ``"none"``); the :class:`FSDP2Codecs` that runs them. A model already
    served is a :class:`~ccfx.ConfigError`."""
    modules = fsdp_modules(model)
    if not modules:
        raise ConfigError(f"{type(model).__name__} holds no FSDP module: apply torch's "
                          "fully_shard to it (and its blocks) first")
    again = [name for name, m in modules if m in _ATTACHED]
    if model in _ATTACHED or again:
        raise ConfigError(
            f"ccfx's FSDP2 comms are already registered on {type(model).__name__} (modules "
            f"{again or ['root']}): register_codec once per model; to change the codec, "
            "build and shard the model again")
    state = FSDP2Codecs(specs)
    for name, module in modules:
        gather, scatter = state.add_module(name)
        try:
            module.set_custom_all_gather(CodecAllGather(state, gather))
            module.set_custom_reduce_scatter(CodecReduceScatter(state, scatter))
        except ValueError as e:  # several parameter groups (a per-parameter mesh)
            raise ConfigError(f"FSDP module {name!r} cannot take ccfx's comms: {e}") from e
    for _, module in modules:
        _ATTACHED[module] = state
    _ATTACHED[model] = state
    return state


def fsdp2_state_of(model) -> FSDP2Codecs | None:
    """The :class:`FSDP2Codecs` attached to ``model`` (or to the model inside
    ``torch.compile(model)``), or None; a state itself is returned as it is."""
    if isinstance(model, FSDP2Codecs):
        return model
    if not isinstance(model, torch.nn.Module):
        return None
    inner = tc.orig_module(model)
    for candidate in (model, inner):
        if candidate is not None and candidate in _ATTACHED:
            return _ATTACHED[candidate]
    return None


def plan_of_fsdp2(state: FSDP2Codecs):
    """A :class:`~ccfx.Plan` of the FSDP modules' collectives as they last ran: one row per
    module per kind (the module's name in the ``graph`` column), its buffer, the codec that
    runs (``none``: torch's own collective, and why), raw / wire bytes per call."""
    from ..config import Config
    from ..plan import Collective, DataParallelInfo, GraphPlan, Plan, Stage

    rows = [Collective(graph=0, index=ch.index, part=ch.module, kind=ch.kind, group=ch.group,
                       group_size=ch.call.world, shape=list(ch.call.shape),
                       dtype=str(ch.call.dtype), codec=ch.codec, raw_bytes=ch.raw_bytes,
                       wire_bytes=ch.wire_bytes, reduce_op=ch.call.reduce_op,
                       reason=ch.reason)
            for ch in state.channels.values() if ch.call is not None]
    note = ("torch's FSDP2 (fully_shard): each FSDP module's all-gather and reduce-scatter "
            "through ccfx's custom comms (ccfx.integrations.register_codec); below, the "
            "'graph' column names the FSDP module")
    if not rows:
        note += "; no collective ran yet (run one forward and backward)"
    gathers = [ch.call for ch in state.channels.values()
               if ch.kind == "all_gather" and ch.call is not None]
    whole = Stage(graph=0, index=0, nodes=[], cost=0.0, cost_expr="0", flops=0,
                  param_bytes=sum(c.numel * c.world * c.dtype.itemsize for c in gathers),
                  params=list(state.modules))
    graph = GraphPlan(index=0, requested_stages=1, num_stages=1, balance="fsdp2",
                      stages=[whole], edges=[], shared=[], notes=[note], collectives=rows)
    initialized = dist.is_available() and dist.is_initialized()
    world = rows[0].group_size if rows else (dist.get_world_size() if initialized else 1)
    backend = str(dist.get_backend()) if initialized else "none"
    config = Config(collective_overrides=dict(state.specs))
    return Plan(config.to_dict(), [graph],
                option_sources={"collective_overrides": "register_codec (FSDP2)"},
                data_parallel=DataParallelInfo(world, backend, state.specs["reduce_scatter"],
                                               note="torch's FSDP2 with ccfx's comms; the "
                                               "gradient codec is its reduce-scatters'"))
