"""The torch.compile backend.

``torch.compile(model, backend="ccfx", options={...})`` reaches :func:`ccfx_backend` through the
``torch_dynamo_backends`` entry point (no ``import ccfx`` needed). ``ccfx.backend(Config(...))``
returns a :class:`CcfxBackend` to pass as ``backend=`` directly.

A :class:`CcfxBackend` is called once per graph Dynamo captures. For each it runs the passes
(annotate → partition → cut_edges), records the graph's plan, registers every hop with its
ledger, and lowers the result. It keeps everything it decided — the plan, the partitioned
graphs, the forward/backward graphs — for ``ccfx.plan_of``, tests and drawings.

Ownership: each ``torch.compile(..., backend="ccfx")`` call gets a backend of its own, kept on
the compiled object's Dynamo context (``compiled.dynamo_ctx`` for a module; the context a
compiled function closes over), so it lives and dies with the compiled object. Dynamo keeps
its caches (and the callables a backend returns) until ``torch._dynamo.reset()``: what ccfx
returns to it holds only a weak reference to the backend. Dynamo would also hand one
compile's cached graphs to another ``torch.compile`` of the same code with equal options;
each ccfx compile therefore marks its ``torch.compile`` wrapper with a token of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx

from ccfx import _torch_compat as tc
from ccfx import codecs
from ccfx.codecs.state import CodecState
from ccfx.config import AUTO, Config
from ccfx.errors import CcfxError, CcfxWarning, ConfigError, optimize_ddp_error
from ccfx.observability import emit_plan_artifact
from ccfx.observability import install as _install_torch_logs
from ccfx.passes import annotate, cut_edges, partition, run_passes
from ccfx.passes.facts import NodeFacts, kind_of, need, stage_of
from ccfx.passes.graph_utils import val
from ccfx.passes.partition import uses_parameters
from ccfx.plan import GraphPlan, Plan
from ccfx.runtime.cut_op import Hop, hop_of, register_hop
from ccfx.runtime.data_parallel import DataParallel, inside_ddp
from ccfx.runtime.ledger import Ledger

from . import fallbacks
from .collectives import Collectives, unmatched_overrides
from .collectives import active as collectives_active
from .dp_link import collective_decisions, group_link
from .dynamo_context import OwnerToken, config_of_wrapper, contexts_of, running_compile
from .dynamo_context import through_dynamo as _through_dynamo
from .dynamo_context import wrapper_of as _wrapper_of
from .lowering import LoweredGraphs, lower
from .plan_builder import build_graph_plan, capacity_notes, expansion_notes

log = logging.getLogger("ccfx")
_install_torch_logs()  # TORCH_LOGS=ccfx, TORCH_TRACE artifacts
fallbacks.arm()  # a model Dynamo runs without ccfx is said so (issue 17 part 7)


@dataclass
class CompiledGraph:
    index: int
    captured: str  # the graph as Dynamo handed it, before any pass (readable code)
    partitioned: torch.fx.GraphModule  # after partition and cut_edges
    plan: GraphPlan
    lowered: LoweredGraphs
    #: The parameters and buffers among the graph's inputs (placeholder index → a weak
    #: reference): what ``split`` gives each pipeline stage, without keeping the model alive.
    state_inputs: dict[int, weakref.ref] = dataclasses.field(default_factory=dict)
    #: What the graph was compiled for, the same on every rank that compiles it (its code's
    #: hash, its inputs, the options, the grad mode): what ranks agree on about it
    #: (:mod:`ccfx.wire.agree`), never its index or the backend's place among others.
    desc: dict = dataclasses.field(default_factory=dict)

    def split(self) -> torch.fx.GraphModule:
        """The stage modules of this graph (``passes.split_stages``) over the live parameters."""
        from ccfx.passes.split_stages import split_stages

        placeholders = [n for n in self.partitioned.graph.nodes if n.op == "placeholder"]
        inputs = []
        for k, node in enumerate(placeholders):
            ref = self.state_inputs.get(k)
            tensor = ref() if ref is not None else None
            if ref is not None and tensor is None:
                raise ConfigError(f"the model's {need(node, NodeFacts).name or node.name} is gone: "
                                  "build pipeline stages while the compiled model is alive")
            inputs.append(tensor)
        return split_stages(self.partitioned, inputs)


class CcfxBackend:
    """A configured ccfx backend; pass it as ``torch.compile(model, backend=...)``."""

    _ccfx_compiler = "backend"  # dynamo_context.MARK: Dynamo's wrapper of it is ccfx's

    def __init__(self, config: Config | None = None, mode: str | None = None, *,
                 option_sources: dict[str, str] | None = None,
                 codec_state: CodecState | None = None, **options):
        if config is not None and options:
            raise ConfigError("give either a Config or option keywords, not both")
        if config is None:
            config, sources = Config.resolve(options or None)
            option_sources = option_sources or sources
        self.config = config
        self.option_sources = dict(option_sources or {})
        self.mode = mode
        self.ledger = Ledger()
        self.graphs: list[CompiledGraph] = []
        #: The hops this backend registered (the cut op's table refers to them weakly).
        self.hops: list[Hop] = []
        #: The state of stateful codecs on cut edges and gradient buckets, as buffers named
        #: ``<channel>.<state-name>`` (live tensors: save and load them here; see
        #: :mod:`ccfx.codecs.state`). Deferred until the first compile: a checkpoint loaded
        #: before it is applied as each channel is made, before its first encode. ``codec_state``:
        #: the holder ``ccfx.codec_state(compiled)`` gave out before this backend existed.
        self.codec_state = codec_state if codec_state is not None else CodecState()
        self.codec_state.deferred = True
        #: Data-parallel gradient synchronization (``data_parallel=True``), made at the first
        #: compile (it creates a process group: every rank compiles together).
        self.data_parallel: DataParallel | None = None
        #: the link its ``gradient_collective="auto"`` is priced on (ccfx.backends.dp_link)
        self._dp_link = None
        #: The functional collectives of the compiled graphs, compressed as the options say
        #: (``collective_codec``; their rows are in each graph's plan).
        self.collectives = Collectives(self.config, self.ledger, self.codec_state)
        #: checked once: ``collective_overrides`` keys that match no collective
        self._overrides_checked = False
        #: (channel, codec) pairs already warned of sending more than their raw bytes
        self._expansions_warned: set[str] = set()
        _LIVE.add(self)
        fallbacks.arm()  # again: torch._dynamo.reset() drops Dynamo's compile callbacks

    def _check_local_steps(self) -> None:
        """``sync_every`` without ``ccfx.local_steps``: the replicas would silently train apart."""
        import warnings

        import torch.distributed as dist

        if self.config.sync_every is None or not (dist.is_available() and dist.is_initialized()
                                                  and dist.get_world_size() > 1):
            return
        ctx, _ = running_compile()
        outer = getattr(ctx, "_ccfx_local_steps", None)
        if outer is None or outer() is None:
            warnings.warn(
                f"sync_every={self.config.sync_every} is set but no ccfx.local_steps(compiled, "
                "optimizer) syncs this model: until it does, the replicas train apart. "
                "Call it after making the optimizer, before the first step.",
                CcfxWarning, stacklevel=3)

    def _check_gradient_codec(self, graph_plan) -> None:
        """``gradient_codec`` without ``data_parallel=True`` on a one-stage graph that is
        called again (a training loop: pipeline stages are built after one call and the
        compiled model is not called again): nothing uses the codec, which serves data
        parallel or ``ccfx.sync_grads`` of pipeline stages, and under torchrun the ranks
        would train apart. Warned once per compiled model."""
        import warnings

        cfg = self.config
        if (cfg.gradient_codec == "none" or cfg.data_parallel or cfg.sync_every is not None
                or graph_plan.requested_stages > 1 or getattr(self, "_warned_gradient", False)):
            return
        self._warned_gradient = True
        warnings.warn(
            f"gradient_codec={cfg.gradient_codec!r} is set but data_parallel is not: with one "
            "stage nothing averages the gradients, so the codec is never used (and ranks "
            "launched together train apart). Add data_parallel=True (after "
            "dist.init_process_group()); the codec also serves ccfx.sync_grads of pipeline "
            "stages (PP x DP).", CcfxWarning, stacklevel=3)

    def _after_first_call(self, graph_plan, desc: dict) -> None:
        """What the second call of a graph can check, a whole first call being over (forward
        and, when training, backward): the gradient codec's use (:meth:`_check_gradient_codec`)
        and, once per model, ``collective_overrides`` keys that match no collective of its
        graphs (an inference graph alone waits: a training graph's backward may have them)."""
        self._check_gradient_codec(graph_plan)
        if (not self.config.collective_overrides or not desc.get("grad")
                or self._overrides_checked):
            return
        self._overrides_checked = True
        error = unmatched_overrides(self.config, self.plan.collectives)
        if error is not None:
            raise error

    @property
    def plan(self) -> Plan:
        """Every graph's plan, as compiled (decisions were written in when they were made)."""
        graphs = [g.plan for g in self.graphs]
        dp = self.data_parallel
        plan = Plan(config=self.config.to_dict(), graphs=graphs,
                    option_sources=self.option_sources,
                    data_parallel=dp.info() if dp is not None else None)
        plan._owner = weakref.ref(self)  # Plan.build_stages builds from this backend
        return plan

    def _uid_for(self, index: int, edge: int, hop: tuple[int, int], spec: str, gspec: str) -> int:
        hop_ = Hop(self.ledger, index, edge, hop, codecs.prototype(spec), codecs.prototype(gspec),
                   self.codec_state)
        self.hops.append(hop_)
        return register_hop(hop_)

    def _allocate_codec_state(self, gm: torch.fx.GraphModule) -> None:
        """Allocate stateful codecs' tensors now (static shapes) and expose them as buffers of
        ``self.codec_state``, so a checkpoint finds them before the first step."""
        for node in gm.graph.nodes:
            if node.target is not torch.ops.ccfx.cut.default:
                continue
            uid, value = node.args[3], val(node)
            if not all(isinstance(d, int) for d in value.shape):
                continue  # dynamic shapes: allocated at the first step
            hop = hop_of(uid)
            for direction in ("fwd", "bwd"):  # registered in self.codec_state
                hop.state_for(direction, tuple(value.shape), value.dtype, value.device)

    def _describe(self, gm: torch.fx.GraphModule, example_inputs: Sequence) -> dict:
        """The graph as Dynamo captured it, its inputs, the options (``collective_timeout_s``
        apart: how long a rank waits is its own business) and the grad mode: equal on every
        rank that compiles the same model with the same options at the same step."""
        from ccfx.passes.compress_collectives import agreed_code
        from ccfx.wire.agree import code_hash

        code = "\n".join(line for line in agreed_code(gm.code).splitlines()
                         if line.strip() and not line.strip().startswith("#"))
        inputs = [[[str(d) for d in t.shape], str(t.dtype), bool(t.requires_grad)]
                  if isinstance(t, torch.Tensor) else type(t).__name__ for t in example_inputs]
        options = {k: v for k, v in self.config.to_dict().items() if k != "collective_timeout_s"}
        return {"code": code_hash(code), "inputs": inputs, "options": options,
                "grad": torch.is_grad_enabled()}

    def _plan_auto(self, gm: torch.fx.GraphModule, desc: dict):
        """``auto`` activation codecs: the planner's choice for every cut edge of ``gm``
        (partitioned, not yet cut), the same on every rank (rank 0's, where a process group
        exists: measured timings differ between ranks, the payloads must not)."""
        cfg = self.config
        if AUTO not in (cfg.activation_codec, cfg.activation_grad_codec):
            return None
        from ccfx.planner.plan_edges import plan_edge_codecs
        from ccfx.wire.agree import from_rank0

        num_stages = 1 + max((stage_of(n) or 0 for n in gm.graph.nodes), default=0)
        import torch.distributed as dist

        # with a cluster, where the stages sit follows from the world (plan_edges.pipeline_shape)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        # keyed by the graph and the options, never by how many models this rank compiled:
        # an extra model compiled on rank 0 asks another question, or this one (same graph,
        # same options: the same answer)
        return from_rank0(
            "activation_codec='auto' for a graph's cut edges", desc,
            lambda: plan_edge_codecs(gm, cfg, num_stages, world),
            timeout_s=cfg.collective_timeout_s,
            hint="Every rank must compile the same model with the same ccfx options.")

    def stage_gradient_codecs(self, parent: torch.fx.GraphModule, dp_group=None,
                              graph: int = 0) -> list[str]:
        """Each pipeline stage's data-parallel gradient codec under PP × DP (``parent``: graph
        ``graph`` split into its stages): ``gradient_codec`` for the stages
        ``gradient_codec_stages`` selects (all by default), ``"none"`` for the others; with
        ``"auto"`` the planner's choice per stage (rank 0's, taken by every rank of the default
        group), its decisions written into the graph's plan."""
        import torch.distributed as dist

        cfg = self.config
        count = len(parent.meta["ccfx"]["interfaces"])
        if cfg.gradient_codec != AUTO:
            selected = cfg.gradient_codec_stages
            return [cfg.gradient_codec if selected is None or s in selected else "none"
                    for s in range(count)]
        if dp_group is None or dist.get_world_size(dp_group) < 2:
            return ["none"] * count
        from ccfx.planner.plan_stages import plan_stage_codecs
        from ccfx.wire.agree import from_rank0
        from ccfx.wire.policy import compressible

        shapes = [[tuple(p.shape) for p in getattr(parent, f"stage_{s}").parameters()
                   if compressible(tuple(p.shape), cfg.compress_min_numel)]
                  for s in range(count)]
        dp_world = dist.get_world_size(dp_group)
        chosen, decisions = from_rank0(
            "gradient_codec='auto' for pipeline stages",
            {"graph": self.graphs[graph].desc, "shapes": shapes, "dp_world": dp_world},
            lambda: plan_stage_codecs(self.plan, cfg, dp_world, shapes, dist.get_world_size()),
            timeout_s=cfg.collective_timeout_s,
            hint="Every rank must build the stages of the same model with the same options.")
        g = self.graphs[graph].plan
        g.decisions = [d for d in g.decisions if not d.what.startswith("stage ")] + decisions
        return list(chosen)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence, **kwargs):
        kwargs.pop("ccfx_owner", None)
        _adopt(self)
        return self._compile_passing_errors(gm, example_inputs, **kwargs)

    def _compile_passing_errors(self, gm: torch.fx.GraphModule, example_inputs: Sequence,
                                **kwargs):
        fallbacks.arm()
        try:
            return self._compile(gm, example_inputs, **kwargs)
        except CcfxError as e:
            raise _through_dynamo(e) from e

    def _setup_data_parallel(self) -> DataParallel | None:
        if not self.config.data_parallel:
            return None
        if inside_ddp():
            raise ConfigError(
                "this model runs inside DistributedDataParallel and data_parallel=True would "
                "all-reduce its gradients a second time: drop the DDP wrapper (ccfx synchronizes "
                "the gradients itself), or keep DDP, drop data_parallel and give DDP ccfx's codec "
                "with model.register_comm_hook(*ccfx.ddp_comm_hook(spec))")
        if self.data_parallel is None:
            decide = None
            if self.config.gradient_codec == AUTO:  # priced by the planner, per bucket
                from ccfx.planner.plan_buckets import plan_bucket_codecs as decide
            import torch.distributed as dist

            # gradient_collective="auto": priced on the group's link (the cluster's slowest
            # between the ranks' devices), decided here once and named in the plan
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
                else 1
            self._dp_link = group_link(self.config, range(world))
            self.data_parallel = DataParallel(
                self.config, self.ledger, decide, state=self.codec_state,
                link=self._dp_link.link if self._dp_link is not None else None)
        return self.data_parallel

    def stage_gradient_link(self, dp_group):
        """Under PP × DP, the link ``gradient_collective="auto"`` is priced on for this rank's
        data-parallel group (:func:`ccfx.backends.dp_link.group_link`), or None."""
        import torch.distributed as dist

        if dp_group is None or not dist.is_initialized():
            return None
        return group_link(self.config, dist.get_process_group_ranks(dp_group))

    def record_stage_collectives(self, stages, group, graph: int = 0) -> None:
        """Write what ``gradient_collective="auto"`` chose for this rank's stage buckets, and
        on which link (``group``: :meth:`stage_gradient_link`'s), into graph ``graph``'s
        plan."""
        sync = getattr(stages[0], "grad_sync", None) if stages else None
        if group is None or sync is None or not sync.buckets:
            return
        import torch.distributed as dist

        first = stages[0].stage_index
        rows = [(i, ex.spec, ex.collective, ex.layout.numel, ex.layout.dtype)
                for i, _, ex, _ in sync.buckets]
        g = self.graphs[graph].plan
        where = f"stage {first} bucket"
        g.decisions = [d for d in g.decisions if not d.what.startswith(where)] + \
            collective_decisions(where, rows, dist.get_world_size(sync.dp_group), group)

    def _after_lowering(self, graph_plan: GraphPlan, dp: DataParallel | None) -> None:
        """The graph's data-parallel buckets (the backward compiled with the forward: they are
        decided) written into its plan, then the channels whose codec expands them noted."""
        if dp is not None:
            _record_buckets(graph_plan, dp, self._dp_link)
        if dp is not None and dp.buckets(graph_plan.index):
            with_buckets = Plan(self.config.to_dict(), [graph_plan], data_parallel=dp.info())
            log.info("ccfx: graph %d gradient buckets\n%s", graph_plan.index, with_buckets)
        self._note_expansions(graph_plan)

    def _note_expansions(self, graph_plan: GraphPlan) -> None:
        """Each channel of the graph whose codec sends more than the raw bytes
        (:func:`.plan_builder.expansion_notes`) or sends a variable payload at its capacity
        (:func:`.plan_builder.capacity_notes`): a note in the plan, and one CcfxWarning per
        channel and codec for the model (not again when a graph recompiles)."""
        import warnings

        for key, note in expansion_notes(graph_plan) + capacity_notes(graph_plan):
            if note not in graph_plan.notes:
                graph_plan.notes.append(note)
            if key not in self._expansions_warned:
                self._expansions_warned.add(key)
                warnings.warn(f"ccfx: {note}", CcfxWarning, stacklevel=3)

    def _flops_before(self, desc: dict) -> int:
        """The model's FLOPs in the graphs compiled before this one, each distinct graph once
        (a recompile of the same code counts as the graph it recompiles; this graph's own
        earlier compiles are not "before" it): what ``partition`` weighs a graph against to
        leave a small one whole (a loss function after a graph break)."""
        seen: dict[str, int] = {}
        for g in self.graphs:
            if g.desc.get("code") != desc.get("code"):
                flops = sum(s.flops for s in g.plan.stages)
                seen[g.desc.get("code")] = max(seen.get(g.desc.get("code"), 0), flops)
        return sum(seen.values())

    def _warn_left_whole(self, gm: torch.fx.GraphModule, index: int, desc: dict) -> None:
        """One CcfxWarning per graph ``partition`` left whole (not again when it recompiles)."""
        import warnings

        reason = gm.meta["ccfx"]["partition"].left_whole
        if not reason or any(g.desc.get("code") == desc.get("code") and g.plan.left_whole
                             for g in self.graphs):
            return
        others = "other" if not uses_parameters(gm) else "larger"
        warnings.warn(f"ccfx: graph {index}: {reason} (stages="
                      f"{self.config.stages} applies to the model's {others} graphs)",
                      CcfxWarning, stacklevel=2)

    def _check_ddp_optimizer(self) -> None:
        """Inside DDP's forward with Dynamo's DDP optimizer on, Dynamo hands this backend one
        piece of the graph per DDP bucket: pipeline stages need the whole graph. Refused here,
        at the first piece, not later with an error about the pieces."""
        cfg = self.config
        if not (cfg.stages > 1 or cfg.split_points) or not inside_ddp() \
                or tc.get_optimize_ddp_mode() != "ddp_optimizer":
            return
        ddp = tc.get_active_ddp_module()
        ctx, _ = running_compile()
        inner = tc.orig_module(ddp.module)
        name = next((n or type(ddp.module).__name__ for n, m in ddp.module.named_modules()
                     if ctx is not None and getattr(m, "dynamo_ctx", None) is ctx),
                    type(inner if inner is not None else ddp.module).__name__)
        raise optimize_ddp_error(name)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence, **kwargs):
        if kwargs.get("options"):
            raise ConfigError("this backend is already configured; pass options to ccfx.backend()")
        index = len(self.graphs)
        cfg = self.config
        self._check_ddp_optimizer()
        self.codec_state.deferred = False  # a load from now on meets the live channels
        dp = self._setup_data_parallel()
        self._check_local_steps()
        captured = gm.code
        desc = self._describe(gm, example_inputs)
        gm = run_passes(gm, [
            functools.partial(annotate, example_inputs=example_inputs),
            functools.partial(partition, stages=cfg.stages, balance=cfg.balance,
                              split_points=cfg.split_points,
                              flops_before=self._flops_before(desc)),
        ])
        self._warn_left_whole(gm, index, desc)
        decided = self._plan_auto(gm, desc)
        chosen = ((lambda edge, _stage: decided.choice[edge]) if decided is not None
                  else cfg.codecs_for)

        def codecs_for(edge: int, stage: int) -> tuple[str, str]:
            fwd, bwd = chosen(edge, stage)
            return fwd, cfg.backward_spec(bwd)

        gm = run_passes(gm, [
            functools.partial(cut_edges, codec="none", grad_codec=None,
                              uid_for=functools.partial(self._uid_for, index),
                              codecs_for=codecs_for),
        ])
        self._allocate_codec_state(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        graph_plan = build_graph_plan(gm, index)
        if decided is not None:
            graph_plan.decisions = decided.decisions
            graph_plan.prediction = decided.prediction
        log.info("ccfx: graph %d partitioned\n%s", index, Plan(cfg.to_dict(), [graph_plan]))
        emit_plan_artifact(Plan(cfg.to_dict(), [graph_plan]).to_json(), index)
        rewrite = None
        if dp is not None:
            params, synced = _parameter_inputs(gm)
            dp.add_graph(index, params, synced, desc)
            rewrite = functools.partial(_rewrite_backward, weakref.ref(dp), index)
        collect = None
        if collectives_active():  # functional collectives need a process group
            collect = functools.partial(_rewrite_collectives, weakref.ref(self), graph_plan, desc)
        compiled, lowered = lower(gm, example_inputs, cfg.lowering, kwargs.get("mode", self.mode),
                                  rewrite_backward=rewrite, rewrite_collectives=collect,
                                  fuse_codecs=cfg.fuse_codecs)
        state_inputs = {k: weakref.ref(example_inputs[k]) for k, n in enumerate(placeholders)
                        if kind_of(n) in ("param", "buffer")}
        self.graphs.append(CompiledGraph(index, captured, gm, graph_plan, lowered, state_inputs,
                                         desc=desc))
        self._after_lowering(graph_plan, dp)
        # Dynamo keeps what a backend returns until torch._dynamo.reset(): refer to this
        # backend weakly, so its ledger, hops and state die with the compiled model.
        owner = weakref.ref(self)
        runs = [0]

        def run(*args):
            backend = owner()
            if backend is not None:
                if runs[0] and backend.codec_state.claiming:
                    # a whole call (forward and backward) is over: every channel this model
                    # makes exists; a loaded one that none claimed is reported now
                    backend.codec_state.check_unclaimed()
                if runs[0] == 1:  # called again: a training loop, not a pipeline's stages
                    backend._after_first_call(graph_plan, desc)
                runs[0] += 1
                backend.ledger.count_call(index)
                if backend.data_parallel is not None:
                    backend.data_parallel.before_call(index, args)
            return compiled(*args)

        return run


def _record_buckets(graph_plan: GraphPlan, dp: DataParallel, link=None) -> None:
    """Write the data-parallel decisions of one graph into its plan, once: its buckets, what
    ``gradient_codec="auto"`` chose for them and the step it predicted, and what
    ``gradient_collective="auto"`` chose on which link (``link``: the backend's
    :class:`ccfx.backends.dp_link.GroupLink`)."""
    index = graph_plan.index
    graph_plan.buckets = dp.buckets(index)
    edge_decisions = [d for d in graph_plan.decisions if not d.what.startswith("bucket")]
    rows = [(b.index, b.codec, b.collective, b.numel, getattr(torch, b.dtype.split(".")[-1]))
            for b in graph_plan.buckets]
    graph_plan.decisions = edge_decisions + dp.decisions(index) + collective_decisions(
        "bucket", rows, dp.world, link)
    if graph_plan.prediction is None:
        graph_plan.prediction = dp.prediction(index)


def _rewrite_backward(dp_ref, index, gm, compile_fn, decompositions, record):
    dp = dp_ref()
    if dp is None:  # the compiled model is gone; nothing to synchronize for
        return compile_fn(gm)
    try:
        return dp.compile_backward(index, gm, compile_fn, decompositions, record)
    except CcfxError as e:
        raise _through_dynamo(e) from e


def _rewrite_collectives(owner, graph_plan, desc, kind, gm, compile_fn, decompositions):
    backend = owner()
    if backend is None:  # the compiled model is gone
        return compile_fn(gm)
    try:
        compiled = backend.collectives.rewrite(graph_plan, desc, kind, gm, compile_fn,
                                               decompositions)
    except CcfxError as e:
        raise _through_dynamo(e) from e
    if kind == "backward":  # the forward's are noted with the graph's other channels
        backend._note_expansions(graph_plan)
    return compiled


def _parameter_inputs(gm: torch.fx.GraphModule) -> tuple[dict[int, str], list[int]]:
    """Forward inputs that are parameters (index → name), and those to broadcast from rank 0
    at the first call (parameters and buffers)."""
    params, synced = {}, []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, node in enumerate(placeholders):
        kind = kind_of(node)
        if kind == "param":
            params[k] = need(node, NodeFacts).name or node.name
        if kind in ("param", "buffer"):
            synced.append(k)
    return params, synced


# -- one backend per torch.compile call -------------------------------------------------------

#: Every live backend, weakly (tests check that compiled models free theirs).
_LIVE: weakref.WeakSet[CcfxBackend] = weakref.WeakSet()


def live_backends() -> int:
    return len(_LIVE)


def _adopt(backend: CcfxBackend) -> None:
    """Keep ``backend`` on the Dynamo context of the compile that is running."""
    ctx, _ = running_compile()
    if ctx is not None and getattr(ctx, "_ccfx_backend", None) is None:
        ctx._ccfx_backend = backend


#: Dynamo counts every torch.compile's graphs of one code object (a model class's forward)
#: against one recompile limit, 8 by default, and then runs that code eagerly (for data
#: parallel: with no gradient synchronization). ccfx gives each torch.compile a backend of its
#: own, so a process that compiles the same model class many times reaches it; ccfx raises it.
RECOMPILE_LIMIT = 64


def _raise_recompile_limit() -> None:
    config = tc.dynamo_config
    if config.recompile_limit < RECOMPILE_LIMIT:
        log.info("ccfx: raising torch._dynamo.config.recompile_limit from %d to %d",
                 config.recompile_limit, RECOMPILE_LIMIT)
        config.recompile_limit = RECOMPILE_LIMIT


def ccfx_backend(gm: torch.fx.GraphModule, example_inputs: Sequence, *, options=None, mode=None,
                 ccfx_owner=None):
    """Entry point of ``backend="ccfx"``; ``options`` is the dict given to torch.compile. The
    first compile of a torch.compile call finds its Dynamo context and wrapper on the stack
    and leaves an :class:`OwnerToken` in the wrapper's kwargs: later compiles get the backend
    from the token (Dynamo passes the kwargs), without walking the stack."""
    backend = ccfx_owner.backend() if ccfx_owner is not None else None
    if backend is None:
        ctx, wrapper = running_compile()
        backend = getattr(ctx, "_ccfx_backend", None)
        if backend is None:
            backend = _new_backend(ctx, options, mode)
        if wrapper is not None and "ccfx_owner" not in wrapper.kwargs:
            wrapper.kwargs["ccfx_owner"] = OwnerToken(backend)
    return backend._compile_passing_errors(gm, example_inputs, mode=mode)


ccfx_backend._ccfx_compiler = "entry"  # type: ignore[attr-defined]  (dynamo_context.MARK)


def _new_backend(ctx, options, mode) -> CcfxBackend:
    """The backend of a ``backend="ccfx"`` compile, kept on its Dynamo context ``ctx``."""
    _raise_recompile_limit()
    try:
        config, sources = Config.resolve(options)
        pending = ctx.__dict__.pop(_PENDING, None) if ctx is not None else None
        backend = CcfxBackend(config, mode=mode, option_sources=sources, codec_state=pending)
    except CcfxError as e:
        raise _through_dynamo(e) from e
    if ctx is not None:
        ctx._ccfx_backend = backend
    else:
        import warnings

        warnings.warn("ccfx could not find torch.compile's context: this graph gets a "
                      "backend of its own, and ccfx.plan_of() will not find it",
                      CcfxWarning, stacklevel=3)
    return backend


def config_of(obj) -> Config | None:
    """The Config of a model compiled with ``backend="ccfx"``, before or after its first call
    (before it, the backend does not exist yet: the options are read off Dynamo's wrapper of
    the backend); None if ccfx did not compile it."""
    try:
        return backend_of(obj).config
    except ConfigError:
        pass
    fn = _wrapper_of(getattr(obj, "dynamo_ctx", None))
    return config_of_wrapper(fn) if fn is not None else None


#: The Dynamo context's attribute for the CodecState handed out before the backend existed.
_PENDING = "_ccfx_pending_state"


def codec_state_before_first_call(obj) -> CodecState | None:
    """The codec state holder of a ccfx-compiled model that has not run yet (None if ccfx did
    not compile it): the backend's own for ``backend=ccfx.backend(...)``; for
    ``backend="ccfx"``, whose backend is made at the first compile, a holder kept on the
    Dynamo context, which that backend adopts. Loaded now, it applies the checkpoint as the
    compile makes each channel, before the first encode."""
    for ctx in contexts_of(obj):
        fn = _wrapper_of(ctx)
        if fn is None:
            continue
        if isinstance(fn.compiler_fn, CcfxBackend):
            return fn.compiler_fn.codec_state
        holder = ctx.__dict__.get(_PENDING)
        if holder is None:
            holder = CodecState()
            holder.deferred = True
            setattr(ctx, _PENDING, holder)
        return holder
    return None


def backend_of(obj) -> CcfxBackend:
    """The CcfxBackend behind a compiled module (``torch.compile(model)``, or a model after
    ``model.compile()``), a compiled function, or a backend itself."""
    if isinstance(obj, CcfxBackend):
        return obj
    contexts = contexts_of(obj)
    for c in contexts:
        if getattr(c, "_ccfx_backend", None) is not None:
            return c._ccfx_backend
    why = fallbacks.why_not_compiled(contexts)
    if not why and any(_wrapper_of(c) is not None for c in contexts):
        # compiled with ccfx, never called: Dynamo compiles (and ccfx plans) at the first call
        raise ConfigError(
            f"this {type(obj).__name__} was compiled with backend='ccfx' but has not run yet: "
            "Dynamo hands ccfx the graph at the first call, so call it once (e.g. "
            "compiled(x)) before asking for its plan, ledger, explanation or drawing")
    raise ConfigError(
        f"{type(obj).__name__} was not compiled by ccfx, or has not run yet: call "
        "torch.compile(model, backend='ccfx', options={...}) and run it once before plan_of()"
        + why)
