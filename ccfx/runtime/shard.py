"""Sharded data parallel as graph nodes: ``ccfx.shard(model, mesh=None)`` (FSDP / ZeRO-3, the
SimpleFSDP way, PyTorch-native).

Every parameter becomes an ``nn.Parameter`` holding a DTensor on the data-parallel mesh:
``Shard(0)`` (each rank keeps 1/W of its rows, uneven sizes as ``torch.chunk`` splits them), a
0-d parameter ``Replicate()`` (it has no dimension to split). Reading ``module.weight`` in a
forward gathers it: ``p.redistribute(placements=[Replicate()]).to_local(grad_placements=
[Partial("avg")])`` (outside any forward it is the parameter itself, this rank's shard, as in
FSDP2: one rank may read it alone, where a gather would leave its peers waiting), so

* the forward all-gathers each weight where it is used and the backward reduce-scatters its
  gradient, averaged over the ranks (DTensor's ``Partial("avg")``: no division to add), into a
  ``Shard(0)`` gradient beside the shard: the optimizer (any torch optimizer) then steps on
  shards only, and its state is sharded with them;
* compiled, those are ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` nodes of the
  forward and backward graphs, where ccfx's collective pass can compress them;
* a gathered weight is not kept for backward. Compiled, the gather runs inside
  ``torch.utils.checkpoint`` with a policy that recomputes every op of it, so the AOT
  partitioner saves the shard and gathers again in the backward graph (SimpleFSDP's selective
  recomputation). Eagerly, a saved-tensor hook on the root module's forward replaces each saved
  gathered weight (or a view of it, ``weight.t()``) by a note of which shard it came from, and
  the backward gathers it again when the note is unpacked. Either way only shards (plus one
  layer's gathered weight at a time) stay alive between forward and backward, TP weights
  included.

Why a property and not ``torch.nn.utils.parametrize``: a parametrization renames the parameter
(``fc.parametrizations.weight.original``), so the state dict, the optimizer's parameter names
and torch.distributed.checkpoint's keys would no longer be the model's. Each module that owns
parameters gets a subclass of its own class (made once per class) whose parameter names are
properties that gather; the parameters stay in ``module._parameters`` under their own names.
Dynamo traces the property like any attribute.

Tensor parallel first, then this: a parameter that is already a DTensor on another mesh (torch's
``parallelize_module`` on the "tp" dimension of a 2-D mesh) is sharded over ``mesh`` (the "dp"
dimension) as its *local* tensor; the gather gives back the local tensor and rewraps it as the
TP DTensor (``DTensor.from_local`` with its placements), so the TP code runs unchanged.

Values start equal: every parameter's shards are scattered from the mesh's rank 0
(``distribute_tensor``'s ``src_data_rank=0``), and buffers (replicated, not sharded) are
broadcast from it. Checkpoints: ``torch.distributed.checkpoint`` with the model's and the
optimizer's state dicts (``get_state_dict`` / ``set_state_dict``): the keys are the model's own.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from .. import _torch_compat as tc
from ..errors import ConfigError

__all__ = ["ShardInfo", "is_sharded", "shard", "sharded_info"]

#: The attribute that marks a model ``shard`` has sharded (and holds what it did).
_MARK = "_ccfx_shard"


@dataclasses.dataclass(frozen=True)
class _Outer:
    """How to rewrap a gathered local tensor as the DTensor it was before sharding (TP)."""

    mesh: object
    placements: tuple
    shape: torch.Size
    stride: tuple


@dataclasses.dataclass
class ShardInfo:
    """What :func:`shard` did to a model: the mesh and, per parameter name, its placement."""

    mesh: object
    placements: dict[str, str]
    #: parameter name → how its gather is rewrapped (TP parameters only)
    outer: dict[str, _Outer] = dataclasses.field(default_factory=dict)


def is_sharded(model: nn.Module) -> bool:
    return sharded_info(model) is not None


def sharded_info(model: nn.Module) -> ShardInfo | None:
    return getattr(model, _MARK, None)


# -- the gather ----------------------------------------------------------------------------------


def _replicate(param: torch.Tensor, outer: _Outer | None) -> torch.Tensor:
    """The full (data-parallel) value of a sharded parameter, as the module reads it."""
    from torch.distributed.tensor import Partial, Replicate

    full = param.redistribute(placements=[Replicate()]).to_local(
        grad_placements=[Partial("avg")])
    return _replicate_wrap(full, outer)


def _replicate_wrap(full: torch.Tensor, outer: _Outer | None) -> torch.Tensor:
    """A TP parameter's gathered local tensor as the TP DTensor it was (else unchanged)."""
    from torch.distributed.tensor import DTensor

    if outer is None:
        return full
    return DTensor.from_local(full, outer.mesh, outer.placements, run_check=False,
                              shape=outer.shape, stride=outer.stride)


def _recompute_everything(ctx, func, *args, **kwargs):
    """Selective-checkpoint policy of the gather: recompute all of it in backward (it is a
    collective and reshapes), so the partitioner saves the shard, never the gathered weight."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE


def _recompute_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_recompute_everything)


def _gathered(module: nn.Module, name: str) -> torch.Tensor:
    param = module._parameters[name]
    # per module and name, never per id(param): Dynamo writes what it reads into the graph's
    # code, which must be the same on every rank (ccfx's ranks agree on it)
    info_outer = module.__dict__.get(_OUTER_ATTR, {}).get(name)
    if torch.compiler.is_compiling():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(_replicate, param, info_outer, use_reentrant=False,
                          context_fn=_recompute_context)
    if not _in_a_forward():
        # outside a forward (``print(model.fc.weight)``, torch.distributed.checkpoint walking
        # the model) one rank may read alone: the parameter itself, this rank's shard, with
        # no communication (FSDP2's convention); a gather would leave its peers waiting
        return param
    full = _replicate(param, info_outer)
    _EagerRecompute.note(full, param)
    return full


#: The attribute of a module holding, per parameter name, how to rewrap its gather (TP).
_OUTER_ATTR = "_ccfx_outer"
#: Code names of the frames that make a read of a sharded parameter a forward's: a module's
#: call (also an eager activation checkpoint's recomputation in backward) or a ``forward``.
_FORWARD_FRAMES = frozenset({"_call_impl", "_wrapped_call_impl", "forward"})


def _in_a_forward() -> bool:
    """Whether a module's forward (or call) is on the Python stack, so that every rank of the
    group reads its parameters too: the training step, an eager activation checkpoint's
    recomputation in backward. Without frame support (not CPython): always."""
    frame = inspect.currentframe()
    if frame is None:
        return True
    while frame is not None:
        if frame.f_code.co_name in _FORWARD_FRAMES:
            return True
        frame = frame.f_back
    return False


def _sharded_class(cls: type, names: Sequence[str]) -> type:
    """``cls`` with each parameter name a property that gathers (one subclass per class and set
    of names, so isinstance checks and ``type(m).__name__`` still read as the user's)."""
    key = (cls, tuple(sorted(names)))
    made = _CLASSES.get(key)
    if made is None:
        def prop(name):
            return property(lambda self: _gathered(self, name),
                            doc=f"{name}, gathered from its shards (ccfx.shard)")

        made = type(cls.__name__, (cls,), {n: prop(n) for n in names}
                    | {"_ccfx_sharded_class": True, "__module__": cls.__module__})
        _CLASSES[key] = made
    return made


_CLASSES: dict[tuple, type] = {}


# -- eager: gathered weights saved for backward become notes -------------------------------------


def _storage(t: torch.Tensor) -> int:
    """The address of the storage under ``t`` (a DTensor's: its local tensor's)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = tc.dtensor_local(t)
    return t.untyped_storage().data_ptr()


@dataclasses.dataclass(frozen=True)
class _Note:
    """A saved gathered weight (or a view of it), by where to gather it from again: the view's
    size, stride and offset in the gathered tensor and, for a TP weight, the DTensor it was."""

    param: torch.Tensor
    size: torch.Size
    stride: tuple
    offset: int
    dtensor: _Outer | None = None


class _EagerRecompute:
    """Saved-tensor hooks active during the root module's eager forward: a tensor autograd saves
    whose storage is a weight gathered in this forward (for a TP weight, a DTensor whose local
    tensor is) is packed as a :class:`_Note` and gathered again when the backward unpacks it
    (every rank's backward runs the same nodes in the same order, so the gathers pair up)."""

    #: storage address → (weak reference to the gathered tensor, parameter); filled by the
    #: property during an eager forward, emptied when it ends
    live: ClassVar[dict[int, tuple]] = {}
    depth: ClassVar[int] = 0

    @classmethod
    def note(cls, gathered: torch.Tensor, param: torch.Tensor) -> None:
        """``gathered``: what the module reads (the weak reference is to it, the object whose
        views keep it alive; a TP DTensor's local tensor can be a short-lived wrapper)."""
        if cls.depth == 0:
            return
        ptr = _storage(gathered)
        if ptr:
            cls.live[ptr] = (weakref.ref(gathered), param)

    @classmethod
    def pack(cls, t: torch.Tensor):
        from torch.distributed.tensor import DTensor

        if not cls.live:
            return t
        wrapped = None
        local = t
        if isinstance(t, DTensor):
            local = tc.dtensor_local(t)
            wrapped = _Outer(t.device_mesh, tuple(t.placements), t.shape, t.stride())
        if type(local) is not torch.Tensor:
            return t
        ptr = local.untyped_storage().data_ptr()
        entry = cls.live.get(ptr)
        if entry is None:
            return t
        ref, param = entry
        gathered = ref()
        # the gathered tensor itself must still be alive, or the address was reused
        if gathered is None or _storage(gathered) != ptr:
            return t
        return _Note(param, local.size(), local.stride(), local.storage_offset(), wrapped)

    @staticmethod
    def unpack(saved):
        if not isinstance(saved, _Note):
            return saved
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            local = _replicate(saved.param, None)
            view = local.as_strided(saved.size, saved.stride, saved.offset)
            d = saved.dtensor
            if d is None:
                return view
            return DTensor.from_local(view, d.mesh, d.placements, run_check=False,
                                      shape=d.shape, stride=d.stride)


def _enter(module, args, kwargs=None):
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return
    hooks = torch.autograd.graph.saved_tensors_hooks(_EagerRecompute.pack, _EagerRecompute.unpack)
    hooks.__enter__()
    module.__dict__.setdefault("_ccfx_shard_hooks", []).append(hooks)
    _EagerRecompute.depth += 1


def _exit(module, args, output):
    stack = module.__dict__.get("_ccfx_shard_hooks")
    if torch.compiler.is_compiling() or not stack:
        return
    stack.pop().__exit__(None, None, None)
    _EagerRecompute.depth -= 1
    if _EagerRecompute.depth == 0:
        _EagerRecompute.live.clear()


# -- an optimizer made before shard --------------------------------------------------------------

#: id of each parameter ``shard`` replaced → (weak reference to it, "Model.path.name"); an entry
#: goes when its parameter is freed, so only one something still holds (an optimizer) stays
_REPLACED: dict[int, tuple[weakref.ref, str]] = {}
#: the handle of :func:`_refuse_replaced`, registered once per process
_STEP_HOOK: list = []


def _remember_replaced(old: torch.Tensor, name: str) -> None:
    key = id(old)
    _REPLACED[key] = (weakref.ref(old, lambda _ref, key=key: _REPLACED.pop(key, None)), name)
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_replaced))


def _refuse_replaced(optimizer, args, kwargs) -> None:
    """Every optimizer's step pre-hook: refuse a step over parameters ``shard`` replaced. An
    optimizer made before ``shard`` holds the model's old parameters, which nothing computes
    with any more: its steps would change nothing, silently. Nothing to do (one dict lookup per
    parameter) once the replaced parameters are freed, which is the usual case. Not checked
    while Dynamo traces a compiled ``step`` (there the hook would only break its graph)."""
    if not _REPLACED or torch.compiler.is_compiling():
        return
    held = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _REPLACED.get(id(p))
            if entry is not None and entry[0]() is p:
                held.append(entry[1])
    if held:
        more = f" and {len(held) - 1} more" if len(held) > 1 else ""
        raise ConfigError(
            f"{type(optimizer).__name__} steps the parameters of the model as it was before "
            f"ccfx.shard replaced them with shards ({held[0]}{more}): the model trains the "
            "new ones, so this step would change nothing. Build the optimizer after "
            "ccfx.shard: model = ccfx.shard(model); opt = torch.optim.AdamW(model.parameters())")


# -- shard ---------------------------------------------------------------------------------------


def _mesh(model: nn.Module, mesh):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "ccfx.shard needs a process group: call torch.distributed.init_process_group() "
                "first (torchrun sets one up), or pass a DeviceMesh")
        device = next((p.device.type for p in model.parameters()), "cpu")
        return init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("dp",))
    if not isinstance(mesh, DeviceMesh):
        raise ConfigError(f"ccfx.shard's mesh is a {type(mesh).__name__}, not a "
                          "torch.distributed.device_mesh.DeviceMesh: pass init_device_mesh(...) "
                          "or leave it out (the whole world)")
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names
        hint = (f"mesh[{names[0]!r}] for its data-parallel dimension" if names
                else "a 1-D mesh of the data-parallel ranks (name the dimensions and index it)")
        raise ConfigError(f"ccfx.shard shards over one mesh dimension, and this mesh has "
                          f"{mesh.ndim} (shape {tuple(mesh.shape)}): pass {hint}; tensor "
                          "parallel goes on the other dimension first (parallelize_module)")
    return mesh


def _check_not_sharded(model: nn.Module, mesh) -> None:
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        if getattr(type(module), "_ccfx_sharded_class", False) or is_sharded(module):
            raise ConfigError(f"{type(model).__name__}{'.' + name if name else ''} is already "
                              "sharded by ccfx.shard: call it once per model (on the model "
                              "before sharding, or keep the sharded one)")
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and p.device_mesh == mesh:
            raise ConfigError(f"parameter {name} is already a DTensor on this mesh "
                              f"({p.placements}): ccfx.shard shards plain parameters and those "
                              "of tensor parallelism on another mesh dimension; do not shard "
                              "a model twice over the same ranks (FSDP's fully_shard included)")


def shard(model: nn.Module, mesh=None) -> nn.Module:
    """Shard ``model``'s parameters over ``mesh`` (default: a 1-D mesh over the whole world) in
    place and return it. See the module's docstring for what changes; the training loop does
    not: ``opt = torch.optim.AdamW(model.parameters())``, forward, ``loss.backward()`` (the
    gradients are averaged over the mesh), ``opt.step()``; eager or compiled
    (``backend="ccfx"`` or ``"inductor"``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    if not isinstance(model, nn.Module):
        raise ConfigError(f"ccfx.shard takes an nn.Module, not a {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "ccfx.shard needs a process group: call torch.distributed.init_process_group() "
            "first (torchrun sets one up)")
    mesh = _mesh(model, mesh)
    _check_not_sharded(model, mesh)

    done: dict[int, nn.Parameter] = {}  # a parameter tied in several modules is sharded once
    outers: dict[int, _Outer | None] = {}
    info = ShardInfo(mesh, {})
    for mod_name, module in model.named_modules(remove_duplicate=False):
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        for name in names:
            old = module._parameters[name]
            new = done.get(id(old))
            if new is None:
                outer = None
                local = old.detach()
                if isinstance(old, DTensor):
                    outer = _Outer(old.device_mesh, tuple(old.placements), old.shape,
                                   old.stride())
                    local = old.to_local().detach()
                placement = Shard(0) if local.dim() >= 1 else Replicate()
                value = distribute_tensor(local.contiguous(), mesh, [placement],
                                          src_data_rank=0)
                new = nn.Parameter(value, requires_grad=old.requires_grad)
                done[id(old)] = new
                full = f"{mod_name}.{name}" if mod_name else name
                _remember_replaced(old, f"{type(model).__name__}.{full}")
                info.placements[full] = str(placement)
                if outer is not None:
                    info.outer[full] = outer
                outers[id(new)] = outer
            module._parameters[name] = new
            if outers[id(new)] is not None:
                module.__dict__.setdefault(_OUTER_ATTR, {})[name] = outers[id(new)]
        module.__class__ = _sharded_class(type(module), names)

    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for buf in model.buffers():
            dist.broadcast(buf, src=src, group=group)
    setattr(model, _MARK, info)
    model.register_forward_pre_hook(_enter)
    model.register_forward_hook(_exit, always_call=True)
    return model
