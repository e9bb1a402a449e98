"""Every private torch and torchft name ccfx relies on, reached from this one module.

torch moves its private names between releases without notice. ccfx reaches each of them here,
so that a move breaks one place, and :data:`INTERNALS` lists them: the dotted name, what ccfx
needs it for, and the public route where one exists (and why it is not taken).
``tests/test_torch_compat.py`` resolves every entry and fails naming the symbol and the torch
version. ``docs/torch-internals.md`` is the same table for readers.

Use: ``from ccfx import _torch_compat as tc``, then ``tc.detect_fake_mode(...)``,
``tc.dynamo_config.patch(...)``, ``tc.torchft_replica_id(manager)``. An entry with an
``alias`` is an attribute of this module, resolved at its first use (``import ccfx`` never
imports Dynamo or inductor); the accessor functions below cover what is more than a name (an
instance attribute, a patch, a stack walk).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Internal:
    """One private name: ``name`` (dotted, from the package), what ccfx ``used_for`` it,
    ``public`` (the public route and why it is not used; "" when there is none), the ccfx files
    that use it, ``alias`` (its attribute of this module, if any) and ``how`` it is reached:
    ``attr`` (imported, then read), ``instance`` (an attribute the class sets on its
    instances: found in the class's source) or ``op`` (a ``torch.ops`` operator)."""

    name: str
    used_for: str
    public: str
    users: tuple[str, ...]
    alias: str | None = None
    how: str = "attr"

    @property
    def package(self) -> str:
        return self.name.split(".", 1)[0]


def _i(name, used_for, public, users, alias=None, how="attr") -> Internal:
    return Internal(name, used_for, public, tuple(users.split()), alias, how)


_NO_TORCH_COMPILER = "torch.compiler has no equivalent"

#: The table (the docs page lists the same names).
INTERNALS: tuple[Internal, ...] = (
    # -- Dynamo: where a compile lives, its options and its records --------------------------
    _i("sys._getframe", "find the Dynamo context and torch.compile wrapper of the compile that "
       "calls the backend (Dynamo calls a backend with the graph and inputs only)",
       "none: a backend is not told which torch.compile it serves; later compiles of one "
       "torch.compile reach ccfx's backend through the owner token in the wrapper's kwargs",
       "backends/dynamo_context.py backends/fallbacks.py"),
    _i("torch._dynamo.eval_frame._TorchDynamoContext", "recognise a compiled model's Dynamo "
       "context (where ccfx keeps the model's backend)", "none: torch.compile returns an "
       "OptimizedModule or a function closing over the context",
       "backends/dynamo_context.py backends/fallbacks.py ccfx/integrations/_ddp.py",
       "DynamoContext"),
    _i("torch._dynamo.eval_frame._TorchDynamoContext.enter_exit_hooks", "run ccfx's "
       "fallback check at the entry of every call of a compiled model", "none",
       "backends/fallbacks.py", how="instance"),
    _i("torch._TorchCompileWrapper", "the torch.compile wrapper of a string backend: its "
       "kwargs carry ccfx's owner token", "none", "backends/dynamo_context.py",
       "TorchCompileWrapper"),
    _i("torch._dynamo.convert_frame.ConvertFrame._torchdynamo_orig_backend", "walk a "
       "context's callback chain down to ccfx's backend (config_of before the first call)",
       "none", "backends/dynamo_context.py", how="instance"),
    _i("torch._dynamo.eval_frame.OptimizedModule._orig_mod", "the model inside "
       "torch.compile(model); parameter names without the '_orig_mod.' prefix",
       "none (OptimizedModule has no public accessor)",
       "backends/compiler.py backends/fallbacks.py ccfx/integrations/_ddp.py "
       "ccfx/runtime/local_steps.py",
       how="instance"),
    _i("torch.nn.Module._compiled_call_impl", "the Dynamo context of model.compile() (a "
       "closure)", "none", "backends/dynamo_context.py ccfx/integrations/_ddp.py"),
    _i("torch._dynamo.exc.ShortenTraceback", "let ccfx's errors through Dynamo unwrapped "
       "(Dynamo wraps others in BackendCompilerFailed)", "none", "backends/dynamo_context.py",
       "ShortenTraceback"),
    _i("torch._dynamo.exc.augment_exc_message", "Dynamo appends its 'Set TORCHDYNAMO_VERBOSE=1 "
       "... reporting a bug to PyTorch' trailer to an exception that has a real_stack "
       "attribute: ccfx's errors let through hide theirs, and their traceback starts at "
       "ccfx's frame (ShortenTraceback's first_useful_frame)", "none",
       "backends/dynamo_context.py"),
    _i("torch._dynamo.config", "raise recompile_limit (one backend per torch.compile), read "
       "optimize_ddp", f"{_NO_TORCH_COMPILER} for recompile_limit or optimize_ddp",
       "backends/compiler.py ccfx/codecs/_fast.py", "dynamo_config"),
    _i("torch._dynamo.utils.get_optimize_ddp_mode", "whether Dynamo's DDPOptimizer splits "
       "graphs inside DDP", "none (reading optimize_ddp misses its string modes)",
       "backends/compiler.py ccfx/integrations/_ddp.py", "get_optimize_ddp_mode"),
    _i("torch._dynamo.utils.counters", "the graph-break and gave-up reasons of a compile",
       "none: TORCH_LOGS=graph_breaks prints text", "backends/fallbacks.py",
       "dynamo_counters"),
    _i("torch._dynamo.utils.guard_failures", "why a frame recompiled", "none",
       "ccfx/runtime/data_parallel.py", "guard_failures"),
    _i("torch._dynamo.callback_handler", "register the compile callbacks once (again after "
       "torch._dynamo.reset(), which clears them)", "torch._dynamo.on_compile_start / "
       "on_compile_end register (used) but cannot tell whether a callback is registered",
       "backends/fallbacks.py"),
    _i("torch._dynamo.on_compile_start", "register the compile-start callback", "it is the "
       "registration route; torch.compiler has no callback API", "backends/fallbacks.py"),
    _i("torch._dynamo.on_compile_end", "register the compile-end callback", "as "
       "on_compile_start", "backends/fallbacks.py"),
    _i("torch._dynamo.callback.CallbackTrigger", "ignore compiles other than Dynamo's own "
       "(lazy backward, autotuning)", "none", "backends/fallbacks.py", "CallbackTrigger"),
    # -- AOT autograd and inductor: lowering ------------------------------------------------
    _i("torch._dynamo.backends.common.aot_autograd", "forward and backward graphs with ccfx's "
       "compilers", "the documented route for custom backends (torch.compile's backend "
       "docs); listed because its module is private", "backends/lowering.py", "aot_autograd"),
    _i("torch._functorch.partitioners.default_partition", "AOT's default partitioner",
       "none", "backends/lowering.py", "default_partition"),
    _i("torch._functorch.partitioners.min_cut_rematerialization_partition", "the min-cut "
       "partitioner for graphs with recompute tags", "none", "backends/lowering.py",
       "min_cut_rematerialization_partition"),
    _i("torch._functorch.partitioners.has_recomputable_ops", "whether a graph has recompute "
       "tags", "none", "backends/lowering.py", "has_recomputable_ops"),
    _i("torch._functorch.config", "no AOT autograd cache and a non-lazy backward for graphs "
       "ccfx rewrites", "none", "backends/lowering.py", "functorch_config"),
    _i("torch._inductor.compile_fx.compile_fx", "lower to inductor with ccfx's inner compile",
       "torch._inductor.compile takes no inner compile", "backends/lowering.py", "compile_fx"),
    _i("torch._inductor.compile_fx.compile_fx_inner", "compile one rewritten graph", "none",
       "backends/lowering.py", "compile_fx_inner"),
    _i("torch._inductor.decomposition.select_decomp_table", "inductor's decompositions for a "
       "rewritten backward", "none", "backends/lowering.py", "select_decomp_table"),
    _i("torch._inductor.config", "keep each collective where ccfx put it "
       "(reorder_for_peak_memory=False)", "none", "backends/lowering.py", "inductor_config"),
    _i("torch._inductor.list_mode_options", "torch.compile's mode= as inductor config "
       "patches", "documented by torch.compile's docstring, in a private module",
       "backends/lowering.py", "inductor_mode_options"),
    # -- fake tensors, dispatch, ops, shapes ------------------------------------------------
    _i("torch._guards.detect_fake_mode", "the fake mode of a graph's example values", "none",
       "ccfx/cost.py passes/annotate.py passes/grad_buckets.py passes/compress_collectives.py",
       "detect_fake_mode"),
    _i("torch._subclasses.fake_tensor.FakeTensorMode", "shapes without data (annotate, the "
       "layout planner)", "none", "passes/annotate.py backends/plan_parallel.py",
       "FakeTensorMode"),
    _i("torch._subclasses.fake_tensor.unset_fake_temporarily", "real tensors (codec state, "
       "timings) while AOT compiles under a fake mode", "none", "backends/collectives.py "
       "ccfx/codecs/state.py ccfx/runtime/data_parallel.py", "unset_fake_temporarily"),
    _i("torch.utils._python_dispatch.TorchDispatchMode", "count FLOPs and bytes per op in "
       "the layout planner", "none", "backends/plan_parallel.py", "TorchDispatchMode"),
    _i("torch._C._len_torch_dispatch_stack", "take the eager fast path only outside every "
       "dispatch mode", "none", "ccfx/codecs/_fast.py ccfx/codecs/_sparse.py",
       "len_torch_dispatch_stack"),
    _i("torch._ops.OpOverload", "name a graph node's op", "none (torch.library re-exports "
       "it incidentally)", "ccfx/cost.py", "OpOverload"),
    _i("torch._ops.OpOverloadPacket", "name a graph node's op", "none", "ccfx/cost.py",
       "OpOverloadPacket"),
    _i("torch.Tensor._base", "the base of a view (count a view's storage once)", "none",
       "backends/plan_parallel.py"),
    _i("torch._functorch._aot_autograd.utils.make_boxed_func._boxed_call", "mark a compiled "
       "graph's callable as taking its inputs as one list (AOT's boxed convention)",
       "make_boxed_func wraps instead of marking (and is private too)",
       "backends/collectives.py ccfx/runtime/data_parallel.py", how="instance"),
    _i("torch.distributed.tensor.DTensor._local_tensor", "a DTensor's local shard without "
       "an autograd op", "DTensor.to_local() (public) records one",
       "ccfx/runtime/shard.py"),
    _i("torch.utils._sympy.symbol.SymT", "recognise unbacked sizes", "none", "ccfx/cost.py",
       "SymT"),
    _i("torch.utils._sympy.symbol.symbol_is_type", "recognise unbacked sizes", "none",
       "ccfx/cost.py", "symbol_is_type"),
    _i("torch._check", "tell Dynamo a sequence fits the block", "documented (torch._check in "
       "the torch.compile docs) despite its name", "ccfx/models/tiny_gpt.py", "torch_check"),
    _i("torch.utils._pytree.tree_leaves", "the tensors of any model output", "none in torch "
       "2.13 (no torch.utils.pytree)", "viz/cli.py backends/tp_derive.py", "tree_leaves"),
    # -- logging ----------------------------------------------------------------------------
    _i("torch._logging._internal.log_registry", "whether TORCH_LOGS knows 'ccfx'", "none",
       "ccfx/observability.py"),
    _i("torch._logging._internal.register_log", "TORCH_LOGS=ccfx", "torch._logging.set_logs "
       "is documented, for registered names only", "ccfx/observability.py"),
    _i("torch._logging.trace_structured", "plans as TORCH_TRACE artifacts (tlparse)", "none",
       "ccfx/observability.py", "trace_structured"),
    # -- distributed ------------------------------------------------------------------------
    _i("torch.nn.parallel.DistributedDataParallel._get_active_ddp_module", "whether a "
       "compile runs inside DDP's forward", "none", "backends/compiler.py "
       "ccfx/runtime/data_parallel.py", "get_active_ddp_module"),
    _i("torch.nn.parallel.DistributedDataParallel._comm_hooks", "refuse a second comm hook",
       "none", "ccfx/integrations/_ddp.py ccfx/runtime/comm_hook.py", how="instance"),
    _i("torch.distributed.fsdp._fully_shard._fsdp_api.AllGather", "the interface of a "
       "custom FSDP2 all-gather (FSDPModule.set_custom_all_gather, public, takes one)",
       "none: torch.distributed.fsdp exports fully_shard and FSDPModule, not the comm "
       "interfaces", "ccfx/runtime/fsdp2_comms.py", "FsdpAllGather"),
    _i("torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter", "the interface of a "
       "custom FSDP2 reduce-scatter (FSDPModule.set_custom_reduce_scatter)", "as AllGather",
       "ccfx/runtime/fsdp2_comms.py", "FsdpReduceScatter"),
    _i("torch.distributed.fsdp.FSDPModule._get_fsdp_state", "the FSDP modules sharded "
       "together (fully_shard([norm, lm_head]): one parameter group, one set of comms), so "
       "ccfx keeps one channel per group, not one idle channel per module", "none: FSDPModule "
       "does not say which modules share its parameter group", "ccfx/runtime/fsdp2_comms.py"),
    _i("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_groups",
       "how many times a step gathers an FSDP module's parameters (twice when it reshards "
       "after forward): FSDP2 'auto' prices each gather it will run", "none: fully_shard "
       "takes reshard_after_forward and FSDPModule only sets it", "ccfx/integrations/"
       "_fsdp2_auto.py", how="instance"),
    _i("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._auto_reshard_after_forward",
       "whether the root module keeps its parameters between forward and backward (FSDP2's "
       "default for the root: one gather a step)", "none, as above",
       "ccfx/integrations/_fsdp2_auto.py", how="instance"),
    _i("torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup."
       "post_forward_mesh_info", "whether a parameter group reshards after forward (None: it "
       "does not, so the backward does not gather it again)", "none, as above",
       "ccfx/integrations/_fsdp2_auto.py", how="instance"),
    _i("torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker", "per-rank peak memory "
       "of an FSDP2 training step by category (bench/fsdp2.py's memory part)", "none: "
       "torch.cuda.max_memory_allocated is CUDA-only; on CPU the max RSS is the only other "
       "figure", "bench/fsdp2.py", "FSDPMemTracker"),
    _i("torch.distributed.pipelining.schedules._batch_p2p", "name the peer of a failed "
       "pipeline transfer (patched process-wide)", "none: PipelineStage hooks make the P2P ops "
       "but the schedule posts and waits for them", "ccfx/runtime/pipeline.py"),
    _i("torch.distributed.pipelining.schedules._wait_batch_p2p", "as _batch_p2p, for the "
       "wait", "as _batch_p2p", "ccfx/runtime/pipeline.py"),
    *(_i(f"torch.ops._c10d_functional.{op}", "functional collectives that trace into graphs",
         "the functional collectives' op namespace (torch.distributed._functional_collectives "
         "is private too)", "ccfx/wire/comm.py", how="op")
      for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_to_all_single", "wait_tensor")),
    _i("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu", "count the FLOPs of "
       "the fused attention kernel a CPU trace runs (FlopCounterMode has formulas for the CUDA "
       "kernels only)", "none: FlopCounterMode's public custom_mapping is keyed by the op",
       "backends/plan_parallel.py", how="op"),
    _i("torch.distributed.distributed_c10d._get_default_store", "the default group's store",
       "none", "ccfx/wire/world.py"),
    _i("torch.distributed.distributed_c10d._get_default_group", "the default group (its "
       "backend and timeout)", "none", "ccfx/wire/groups.py ccfx/wire/ring.py"),
    _i("torch.distributed.distributed_c10d._resolve_process_group", "the group a graph's "
       "functional collective names", "none", "backends/collectives.py ccfx/wire/ring.py",
       "resolve_process_group"),
    _i("torch.distributed.distributed_c10d._world.pg_names", "whether a group is still "
       "registered", "none", "ccfx/wire/groups.py"),
    _i("torch.distributed.distributed_c10d._world.pg_map", "the default group's backend and "
       "store", "none", "ccfx/wire/groups.py"),
    _i("torch.distributed.distributed_c10d._world.pg_group_ranks", "register a group's ranks",
       "none", "ccfx/wire/groups.py"),
    _i("torch.distributed.distributed_c10d._new_process_group_helper", "a group under a name "
       "ccfx chooses", "dist.new_group names groups by a process-wide count",
       "ccfx/wire/groups.py"),
    _i("torch._C._distributed_c10d._register_process_group", "a stand-in group inductor can "
       "read while a backward compiles", "none", "ccfx/wire/groups.py"),
    _i("torch._C._distributed_c10d._unregister_process_group", "drop the stand-in", "none",
       "ccfx/wire/groups.py"),
    _i("torch.distributed.ProcessGroup._get_backend", "a group's timeout for an error "
       "message", "none", "ccfx/wire/ring.py"),
    _i("torch.distributed.ProcessGroupGloo._Options._timeout", "a group's timeout for an "
       "error message", "none", "ccfx/wire/ring.py"),
    # -- torchft ----------------------------------------------------------------------------
    _i("torchft.Manager._replica_id", "name the replica in logs and errors", "none",
       "ccfx/runtime/elastic/states.py ccfx/runtime/elastic/spares.py "
       "ccfx/runtime/elastic/replica.py", how="instance"),
    _i("torchft.Manager._pg", "the manager's reconfigurable process group for ccfx's "
       "exchanges", "none", "ccfx/runtime/elastic/replica.py ccfx/runtime/elastic/failures.py",
       how="instance"),
    _i("torchft.process_group.ProcessGroupWrapper._pg", "whether the manager's group is "
       "configured (abort only a live one after a failed exchange)", "ProcessGroupWrapper.parent "
       "asserts where there is none instead of answering", "ccfx/runtime/elastic/failures.py",
       how="instance"),
    _i("torchft.Manager._quorum_future", "forget a quorum request that failed (the lighthouse "
       "was away) so that the next sync asks again", "none: start_quorum re-raises the last "
       "request's error forever", "ccfx/runtime/elastic/failures.py", how="instance"),
    _i("torchft.Manager._quorum_id", "rebuild the group at the first quorum after the "
       "lighthouse was away (a restarted lighthouse counts its quorum ids from 1 again)",
       "none", "ccfx/runtime/elastic/failures.py", how="instance"),
)


# -- resolving an entry ------------------------------------------------------------------------

def _import_longest(parts: list[str]):
    """The deepest importable module of ``parts`` and how many parts it took."""
    for n in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:n])), n
        except ImportError:
            continue
    raise ImportError(f"no module in {'.'.join(parts)}")


def _lookup(name: str):
    parts = name.split(".")
    obj, n = _import_longest(parts)
    for part in parts[n:]:
        obj = getattr(obj, part)
    return obj


def resolve(entry: Internal):
    """The object ``entry`` names (for ``instance``: its class, after checking that its source
    sets the attribute). Raises AttributeError or ImportError where torch moved it."""
    if entry.how != "instance":
        return _lookup(entry.name)
    owner_name, attr = entry.name.rsplit(".", 1)
    owner = _lookup(owner_name)
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):  # a class inspect cannot find: its module's source
        source = inspect.getsource(sys.modules[owner.__module__])
    if not re.search(rf"\.{attr}\b\s*[:=]", source):
        raise AttributeError(f"{owner_name} no longer sets {attr}")
    return owner


_BY_ALIAS = {e.alias: e for e in INTERNALS if e.alias}


def __getattr__(alias: str):
    """An aliased entry, resolved at its first use and kept (lazy: no import of Dynamo or
    inductor with ``import ccfx``)."""
    entry = _BY_ALIAS.get(alias)
    if entry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {alias!r}")
    value = _lookup(entry.name)
    globals()[alias] = value
    return value


# Cheap names used on hot paths or inside traced code: bound now (torch has loaded them).
len_torch_dispatch_stack = torch._C._len_torch_dispatch_stack
torch_check = torch._check
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


# -- Dynamo ------------------------------------------------------------------------------------

def caller_locals(skip: int = 0) -> Iterator[dict]:
    """The locals of each frame from the function iterating this (``skip`` frames above it)
    outwards: how a backend finds the compile it serves (Dynamo does not pass it)."""
    frame = sys._getframe(1 + skip)
    while frame is not None:
        yield frame.f_locals
        frame = frame.f_back


def caller_frame(skip: int = 0):
    """The frame of the function calling this one's caller (``skip`` frames further out)."""
    return sys._getframe(2 + skip)


def arm_compile_callbacks(start: Callable, end: Callable) -> None:
    """Register ``start`` and ``end`` as Dynamo compile callbacks unless they are already."""
    import torch._dynamo

    handler = torch._dynamo.callback_handler
    if start not in handler.start_callbacks:
        torch._dynamo.on_compile_start(start)
    if end not in handler.end_callbacks:
        torch._dynamo.on_compile_end(end)


def orig_module(compiled) -> torch.nn.Module | None:
    """The model inside ``torch.compile(model)`` (an OptimizedModule), None for others."""
    inner = getattr(compiled, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def compiled_call_impl(module: torch.nn.Module):
    """What ``module.compile()`` put in place of its call (None if it was not compiled so)."""
    return getattr(module, "_compiled_call_impl", None)


def orig_backend(fn):
    """The next callable down a Dynamo callback chain (None at its end)."""
    return getattr(fn, "_torchdynamo_orig_backend", None)


def enter_exit_hooks(ctx) -> list:
    """The hooks a Dynamo context runs at the entry of every call."""
    return ctx.enter_exit_hooks


# -- distributed -------------------------------------------------------------------------------

def mark_boxed(fn: Callable) -> Callable:
    """Mark a compiled graph's callable as AOT's boxed convention (inputs as one list)."""
    fn._boxed_call = True  # type: ignore[attr-defined]
    return fn


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``t`` views (``t`` itself when it is not a view): a view's
    storage is counted once, under its base."""
    return t._base if t._base is not None else t


def dtensor_local(t) -> torch.Tensor:
    """A DTensor's local shard, as it is (no autograd op: ``to_local()`` records one)."""
    return t._local_tensor


def fsdp_state(module):
    """The FSDP state of an ``FSDPModule`` (shared by the modules one ``fully_shard`` call
    sharded together)."""
    return module._get_fsdp_state()


def fsdp_gathers_per_step(module, root: bool) -> int:
    """How many times a training step all-gathers FSDP module ``module``'s parameters: once
    for the root left at FSDP2's default (it keeps them for backward) or a module that does
    not reshard after forward, twice otherwise (forward, and again in backward)."""
    state = module._get_fsdp_state()
    if root and state._auto_reshard_after_forward:
        return 1
    groups = state._fsdp_param_groups
    return 2 if any(g.post_forward_mesh_info is not None for g in groups) else 1


def ddp_comm_hooks(ddp) -> list:
    """The comm hooks registered on a DistributedDataParallel (``[(hook, state)]``)."""
    return getattr(ddp, "_comm_hooks", None) or []


def pipeline_p2p() -> tuple[Callable | None, Callable | None]:
    """torch's pipeline schedules' (wait, post) of a batch of P2P ops; None where moved."""
    from torch.distributed.pipelining import schedules

    return (getattr(schedules, "_wait_batch_p2p", None),
            getattr(schedules, "_batch_p2p", None))


def set_pipeline_p2p(wait: Callable, post: Callable) -> None:
    """Make torch's pipeline schedules wait and post through ``wait`` and ``post``."""
    from torch.distributed.pipelining import schedules

    schedules._wait_batch_p2p, schedules._batch_p2p = wait, post


def c10d_default_store():
    """The default group's c10d store (where ranks meet and publish their records)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def c10d_default_group():
    """The default process group (its backend, store and timeout)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_group()


def c10d_registered_names():
    """The names of the process groups torch knows."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._world.pg_names.values()


def c10d_default_backend_and_store() -> tuple:
    """The (backend name, store) the default group was made with."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._world.pg_map[c10d._get_default_group()]


def c10d_set_group_ranks(pg, ranks) -> None:
    """Tell torch ``pg``'s global ranks, as ``dist.new_group`` does."""
    from torch.distributed import distributed_c10d as c10d

    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}


def c10d_new_group(ranks, rank: int, backend, store, name: str, timeout_s: float, desc: str):
    """torch's own construction of a group named ``name`` (``_new_process_group_helper``)."""
    import datetime

    from torch.distributed import distributed_c10d as c10d

    pg, _ = c10d._new_process_group_helper(
        len(ranks), list(ranks).index(rank), list(ranks), c10d.Backend(backend), store, name,
        timeout=datetime.timedelta(seconds=timeout_s), group_desc=desc)
    return pg


def c10d_register_group(name: str, pg) -> None:
    """Register ``pg`` under ``name`` for ``_c10d_functional`` (and inductor) to find."""
    from torch._C import _distributed_c10d as c

    c._register_process_group(name, pg)


def c10d_unregister_group(name: str) -> None:
    """Remove ``name`` from torch's registry of named groups (a stand-in making way)."""
    from torch._C import _distributed_c10d as c

    c._unregister_process_group(name)


def group_timeout_s(pg) -> float:
    """A group's timeout in seconds (its CPU backend's options)."""
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def torchft_replica_id(manager) -> str:
    """A torchft Manager's replica id."""
    return manager._replica_id


def torchft_process_group(manager):
    """A torchft Manager's (reconfigurable) process group, None where it has none."""
    return getattr(manager, "_pg", None)


def torchft_forget_quorum(manager, request: bool = True) -> None:
    """Make a torchft Manager rebuild its group at its next quorum whatever that quorum's id
    (a restarted lighthouse counts from 1 again: an id this replica's group already has would
    keep a group its peers no longer hold) and, with ``request``, drop its failed quorum
    request (``start_quorum`` waits for the last one first and would raise its error again)."""
    manager._quorum_id = -1
    if request:
        manager._quorum_future = None


def torchft_wrapped_group(pg):
    """The group a torchft ``ProcessGroupWrapper`` wraps now, None while it is not configured
    (or was aborted): only a configured group is worth aborting."""
    return getattr(pg, "_pg", None)


# -- logging -----------------------------------------------------------------------------------

def register_torch_log(name: str) -> None:
    """Make ``TORCH_LOGS=<name>`` and ``torch._logging.set_logs(modules={name: ...})`` know
    the logger ``name`` (idempotent)."""
    from torch._logging import _internal

    if not _internal.log_registry.is_log(name):
        _internal.register_log(name, name)
