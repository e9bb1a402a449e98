"""ccfx's codecs on torch's own FSDP2 (``fully_shard``), through its public custom comms.

FSDP2 calls one all-gather per FSDP module per unshard (the module's parameter shards copied
into one flat buffer: forward, and backward again after ``reshard_after_forward``) and one
reduce-scatter per module per backward (the module's flat unsharded gradients, ``W`` chunks
of the output's size), each through the comm object ``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter`` installed; ``set_all_reduce_hook`` is handed each module's
reduce-scatter output after it. :func:`attach` installs :class:`CodecAllGather` and
:class:`CodecReduceScatter` on every FSDP module of a model, and under HSDP
:class:`CodecAllReduce` as its all-reduce hook; they run the wire layer's compressed
collectives (:mod:`ccfx.wire.collectives`):

* all-gather: this rank's shard encoded once, the payloads all-gathered, every rank's payload
  decoded into FSDP's output buffer, this rank's own too, so every rank's gathered parameters
  are the same bits (the sharded parameters the optimizer steps stay exact);
* reduce-scatter: the ``W`` chunks encoded, one all-to-all, this rank's chunk's ``W`` payloads
  decoded and summed in fp32 in rank order; the op FSDP passes is honoured as
  ``reduce_scatter_tensor`` would: ``SUM``, ``AVG`` (the sum divided by ``W``),
  ``PREMUL_SUM(f)`` (each rank's input multiplied by ``f`` first); any other op runs raw;
* HSDP's all-reduce across replicas (FSDP shards over each replica's group, 1-D, and ccfx
  averages the reduce-scatter output over the ``replicate`` group): the wire layer's two-step
  all-reduce, bit-identical on every replica, so the replicas never drift apart.

A buffer a codec cannot serve runs torch's own collective, unchanged, and the plan says why:
FSDP gathers a ``uint8`` view when a module mixes parameter dtypes, integer data, a codec
that does not apply to the dtype (:func:`ccfx.wire.collectives.refuse`). ``"none"`` runs
torch's own collectives (``all_gather_single`` / ``reduce_scatter_single`` with FSDP's
``async_op`` and op): the same bits as plain FSDP2.

``async_op``: a compressed collective runs to its end inside the call and returns None, which
FSDP2 (torch 2.13) takes as a finished synchronous collective (it waits only on a returned
``Work``); the raw ones pass ``async_op`` through and return torch's ``Work``.

The channels, their state, the ledger and the checkpoint are :mod:`.fsdp2_codecs`'s.

Failures: a collective that fails (a peer died, froze, ran another model) is a
:class:`~ccfx.CollectiveError` naming this rank, the module, the kind, the codec, the step and
the peer. On CPU (gloo) a synchronous collective, raw or compressed, waits at most
``collective_timeout_s`` (``FSDP2Codecs.timeout_s``, 300 s unless ``options=`` sets it) through
``Work.wait(timeout)``, so a frozen peer is named within it; FSDP's group keeps its own timeout.
A raw collective FSDP asks for with ``async_op`` returns torch's ``Work``, which FSDP waits on.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

from .. import _torch_compat as tc
from ..errors import ConfigError
from ..wire.comm import ProcessGroupComm, wait_work
from .fsdp2_codecs import KINDS, Channel, FSDP2Codecs, check_spec
from .fsdp2_plan import plan_of_fsdp2

__all__ = ["KINDS", "Channel", "CodecAllGather", "CodecAllReduce", "CodecReduceScatter",
           "FSDP2Codecs", "attach", "check_spec", "fsdp2_state_of", "fsdp_modules",
           "plan_of_fsdp2"]

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = (getattr(dist, "reduce_scatter_single", None)
                        or dist.reduce_scatter_tensor)

#: model or FSDP module -> the FSDP2Codecs attached to it (ccfx.plan_of / ledger_of find it)
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def _timeout(owner: FSDP2Codecs, t: torch.Tensor) -> float | None:
    """How long a wait on ``t``'s collective may last: the owner's bound on CPU (gloo), the
    group's own on an accelerator (a CUDA wait orders streams; NCCL has its watchdog)."""
    return owner.timeout_s if t.device.type == "cpu" else None


def _comm(group, timeout_s: float | None = None) -> ProcessGroupComm:
    """The wire layer's Comm over FSDP's group (a test replaces it to make a peer fail)."""
    return ProcessGroupComm(group, timeout_s)


def _raw(issue, async_op: bool, timeout_s: float | None):
    """torch's own collective: ``issue(async_op)``'s ``Work`` when FSDP asks for one, else
    waited for here within ``timeout_s`` (None)."""
    work = issue(async_op or timeout_s is not None)
    if async_op or work is None:
        return work
    wait_work(work, timeout_s)
    return None


class CodecAllGather(tc.FsdpAllGather):
    """FSDP2's all-gather of one module through ccfx's codec (see the module docstring)."""

    def __init__(self, owner: FSDP2Codecs, channel: Channel):
        self.owner, self.channel = owner, channel

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        start = time.perf_counter()
        ch = self.channel.bind(input_tensor, group)
        timeout_s = _timeout(self.owner, input_tensor)
        if ch.algorithm is None:
            try:
                work = _raw(lambda a: _all_gather_flat(output_tensor, input_tensor, group, a),
                            async_op, timeout_s)
            except RuntimeError as e:
                raise self.owner.failed(ch, group, e) from e
        else:  # the input is a view of the output: encoded before anything is written
            output_tensor.copy_(self.owner.run(ch, input_tensor, _comm(group, timeout_s),
                                               group))
            work = None
        self.owner.count(ch, time.perf_counter() - start)
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
        start = time.perf_counter()
        reduce_op, factor = _reduce_op(op)
        ch = self.channel.bind(input_tensor, group, reduce_op)
        timeout_s = _timeout(self.owner, input_tensor)
        if ch.algorithm is None:
            try:
                work = _raw(lambda a: _reduce_scatter_flat(output_tensor, input_tensor, op,
                                                           group, a), async_op, timeout_s)
            except RuntimeError as e:
                raise self.owner.failed(ch, group, e) from e
        else:
            x = input_tensor if factor is None else input_tensor * factor
            output_tensor.copy_(self.owner.run(ch, x, _comm(group, timeout_s), group)
                                 .view_as(output_tensor))
            work = None
        self.owner.count(ch, time.perf_counter() - start)
        return work


class CodecAllReduce:
    """HSDP's all-reduce of one FSDP module's reduce-scatter output across the replicas
    (FSDP's all-reduce hook: called with the output, which it averages in place)."""

    def __init__(self, owner: FSDP2Codecs, channel: Channel):
        self.owner, self.channel = owner, channel

    def __call__(self, reduce_output: torch.Tensor) -> None:
        start = time.perf_counter()
        group = self.owner.replicate
        ch = self.channel.bind(reduce_output, group, "avg")
        timeout_s = _timeout(self.owner, reduce_output)
        if ch.algorithm is None:  # torch's own (sum, then / replicas: gloo has no avg)
            try:
                _raw(lambda a: dist.all_reduce(reduce_output, group=group, async_op=a), False,
                     timeout_s)
            except RuntimeError as e:
                raise self.owner.failed(ch, group, e) from e
            reduce_output.div_(group.size())
        else:
            reduce_output.copy_(self.owner.run(ch, reduce_output.view(-1),
                                               _comm(group, timeout_s), group)
                                .view_as(reduce_output))
        self.owner.count(ch, time.perf_counter() - start)


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every FSDP unit in ``model`` (itself included), ``(name, module)`` in
    ``named_modules`` order; the model itself is named ``root``. Modules one ``fully_shard``
    call sharded together (``fully_shard([norm, lm_head])``) share one parameter group and so
    one set of comms: one unit, named ``norm+lm_head``, its first module standing for it."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            units.setdefault(id(tc.fsdp_state(m)), []).append((name or "root", m))
    return [("+".join(n for n, _ in unit), unit[0][1]) for unit in units.values()]


def _native_hsdp(modules) -> list[str]:
    """The FSDP modules whose parameters live on a 2-D mesh (torch's own HSDP)."""
    from torch.distributed.tensor import DTensor

    return [name for name, m in modules
            if any(isinstance(p, DTensor) and p.device_mesh.ndim > 1
                   for p in m.parameters())]


def _check_hsdp(modules, specs: dict[str, str], replicate) -> None:
    """A :class:`~ccfx.ConfigError` where HSDP's all-reduce is asked for and ccfx cannot run
    it: no replicas' group given, or torch's own HSDP (a 2-D mesh), whose all-reduce FSDP
    runs itself with no comm hook before it."""
    native = _native_hsdp(modules)
    wants = specs.get("all_reduce", "none") != "none"
    if native and (wants or replicate is not None):
        raise ConfigError(
            f"FSDP modules {native[:3]} are sharded on a 2-D mesh (torch's own HSDP), which "
            "runs the replicas' all-reduce itself, with no hook before it that ccfx could "
            "compress: shard over the shard dimension only, fully_shard(m, mesh=mesh['shard']), "
            "and pass register_codec(..., replicate=mesh['replicate']): ccfx then averages "
            "each module's gradients across the replicas")
    if wants and replicate is None:
        raise ConfigError(
            "register_codec: an 'all_reduce' codec compresses HSDP's all-reduce across "
            "replicas, and no replicas' group was given: pass replicate=mesh['replicate'] "
            "(with fully_shard over mesh['shard'])")


def attach(model: torch.nn.Module, specs: dict[str, str], replicate=None,
           chosen: dict[tuple[str, str], str] | None = None) -> FSDP2Codecs:
    """Install ccfx's comms on every FSDP module of ``model`` (``specs``: a codec per kind,
    missing kinds ``"none"``; ``replicate``: HSDP's replicas' process group, whose all-reduce
    ccfx then runs; ``chosen``: ``"auto"``'s codec per ``(module, kind)``); the
    :class:`FSDP2Codecs` that runs them. A model already served is a
    :class:`~ccfx.ConfigError`."""
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
    _check_hsdp(modules, specs, replicate)
    state = FSDP2Codecs(specs, replicate, chosen)
    for name, module in modules:
        channels = state.add_module(name)
        try:
            module.set_custom_all_gather(CodecAllGather(state, channels["all_gather"]))
            module.set_custom_reduce_scatter(CodecReduceScatter(state,
                                                                channels["reduce_scatter"]))
            if replicate is not None:
                module.set_all_reduce_hook(CodecAllReduce(state, channels["all_reduce"]))
        except ValueError as e:  # several parameter groups (a per-parameter mesh)
            raise ConfigError(f"FSDP module {name!r} cannot take ccfx's comms: {e}") from e
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():  # (every module of a unit: ccfx.plan_of finds it)
        if isinstance(module, FSDPModule):
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
