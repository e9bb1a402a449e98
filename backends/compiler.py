"""The torch.compile backend.

``torch.compile(model, backend="ccfx", options={...})`` reaches :func:`ccfx_backend` through the
``torch_dynamo_backends`` entry point (no ``import ccfx`` needed). ``ccfx.backend(Config(...))``
returns a :class:`CcfxBackend` to pass as ``backend=`` directly.

A :class:`CcfxBackend` is called once per graph Dynamo captures. For each it runs the passes
(annotate → partition → cut_edges), records the graph's plan, registers every hop with its
ledger, and lowers the result. It keeps everything it decided — the plan, the partitioned
graphs, the forward/backward graphs — for ``ccfx.plan_of``, tests and drawings.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx

from ccfx import codecs
from ccfx.config import Config
from ccfx.errors import CcfxError, ConfigError
from ccfx.passes import annotate, cut_edges, partition, run_passes
from ccfx.passes.graph_utils import facts, val
from ccfx.plan import GraphPlan, Plan
from ccfx.runtime.cut_op import Hop, hop_of, register_hop
from ccfx.runtime.ledger import Ledger
from ccfx.viz.observability import emit_plan_artifact
from ccfx.viz.observability import install as _install_torch_logs

from .lowering import LoweredGraphs, lower
from .plan_builder import build_graph_plan

log = logging.getLogger("ccfx")
_install_torch_logs()  # TORCH_LOGS=ccfx, TORCH_TRACE artifacts


@dataclass
class CompiledGraph:
    index: int
    captured: str  # the graph as Dynamo handed it, before any pass (readable code)
    partitioned: torch.fx.GraphModule  # after partition and cut_edges
    plan: GraphPlan
    lowered: LoweredGraphs


class CcfxBackend:
    """A configured ccfx backend; pass it as ``torch.compile(model, backend=...)``."""

    def __init__(self, config: Config | None = None, mode: str | None = None, **options):
        if config is not None and options:
            raise ConfigError("give either a Config or option keywords, not both")
        self.config = config if config is not None else Config.from_options(options or None)
        self.mode = mode
        self.ledger = Ledger()
        self.graphs: list[CompiledGraph] = []
        #: Buffers of stateful codecs on cut edges (live tensors: save and load them here).
        self.codec_state = torch.nn.Module()

    @property
    def plan(self) -> Plan:
        return Plan(config=self.config.to_dict(), graphs=[g.plan for g in self.graphs])

    def _uid_for(self, index: int, edge: int, hop: tuple[int, int], spec: str, gspec: str) -> int:
        return register_hop(Hop(self.ledger, index, edge, hop, codecs.get(spec), codecs.get(gspec)))

    def _allocate_codec_state(self, gm: torch.fx.GraphModule) -> None:
        """Allocate stateful codecs' tensors now (static shapes) and expose them as buffers of
        ``self.codec_state``, so a checkpoint finds them before the first step."""
        for node in gm.graph.nodes:
            if node.target is not torch.ops.ccfx.cut.default:
                continue
            uid, value, f = node.args[3], val(node), facts(node)
            hop = hop_of(uid)
            for direction, codec in (("fwd", hop.codec), ("bwd", hop.grad_codec)):
                if not codec.stateful or not codec.applies_to(value.dtype):
                    continue
                if not all(isinstance(d, int) for d in value.shape):
                    continue  # dynamic shapes: allocated at the first step
                state = codec.reset_state(tuple(value.shape), value.dtype, value.device)
                prefix = f"graph{hop.graph}_edge{f['edge']}_hop{hop.hop[0]}to{hop.hop[1]}_{direction}"
                for name, tensor in state.items():
                    self.codec_state.register_buffer(f"{prefix}_{name}", tensor)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence, **kwargs):
        try:
            return self._compile(gm, example_inputs, **kwargs)
        except CcfxError as e:
            raise _through_dynamo(e) from e

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence, **kwargs):
        if kwargs.get("options"):
            raise ConfigError("this backend is already configured; pass options to ccfx.backend()")
        index = len(self.graphs)
        cfg = self.config
        captured = gm.code
        gm = run_passes(gm, [
            functools.partial(annotate, example_inputs=example_inputs),
            functools.partial(partition, stages=cfg.stages, balance=cfg.balance,
                              split_points=cfg.split_points),
            functools.partial(cut_edges, codec=cfg.activation_codec,
                              uid_for=functools.partial(self._uid_for, index)),
        ])
        self._allocate_codec_state(gm)
        graph_plan = build_graph_plan(gm, index)
        log.info("ccfx: graph %d partitioned\n%s", index, Plan(cfg.to_dict(), [graph_plan]))
        emit_plan_artifact(Plan(cfg.to_dict(), [graph_plan]).to_json(), index)
        compiled, lowered = lower(gm, example_inputs, cfg.lowering, kwargs.get("mode", self.mode))
        self.graphs.append(CompiledGraph(index, captured, gm, graph_plan, lowered))
        ledger = self.ledger

        def run(*args):
            ledger.count_call(index)
            return compiled(*args)

        run._ccfx_backend = self  # type: ignore[attr-defined]
        return run


@functools.cache
def _passthrough_type(cls: type) -> type:
    from torch._dynamo.exc import ShortenTraceback

    def __init__(self, message):
        ShortenTraceback.__init__(self, message, first_useful_frame=None)

    return type(cls.__name__, (cls, ShortenTraceback), {"__init__": __init__,
                                                       "__module__": cls.__module__})


def _through_dynamo(e: CcfxError) -> CcfxError:
    """Dynamo wraps a backend's exceptions in BackendCompilerFailed, except ShortenTraceback:
    re-raise ours as a subclass of both, so users catch the ccfx type they were promised."""
    return _passthrough_type(type(e))(str(e))


# backend="ccfx": one CcfxBackend per torch.compile call, found again from its options dict.
_SESSIONS: dict[int, tuple[object, CcfxBackend]] = {}
_DEFAULT_KEY = 0


def _session(options, mode) -> CcfxBackend:
    key = id(options) if options is not None else _DEFAULT_KEY
    entry = _SESSIONS.get(key)
    if entry is None or entry[0] is not options:
        backend = CcfxBackend(Config.from_options(options), mode=mode)
        _SESSIONS[key] = (options, backend)  # holding `options` keeps its id unique
        return backend
    return entry[1]


def ccfx_backend(gm: torch.fx.GraphModule, example_inputs: Sequence, *, options=None, mode=None):
    """Entry point of ``backend="ccfx"``; ``options`` is the dict given to torch.compile."""
    try:
        backend = _session(options, mode)
    except CcfxError as e:
        raise _through_dynamo(e) from e
    return backend(gm, example_inputs, mode=mode)


def backend_of(obj) -> CcfxBackend:
    """The CcfxBackend behind a compiled module or function, a backend, or its session."""
    if isinstance(obj, CcfxBackend):
        return obj
    seen = set()
    todo = [obj]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, CcfxBackend):
            return x
        if getattr(x, "compiler_fn", None) is not None and getattr(x, "kwargs", None) is not None:
            fn = x.compiler_fn
            if isinstance(fn, CcfxBackend):
                return fn
            if getattr(fn, "__name__", "") == "ccfx_backend":
                options = x.kwargs.get("options")
                key = id(options) if options is not None else _DEFAULT_KEY
                if key in _SESSIONS and _SESSIONS[key][0] is options:
                    return _SESSIONS[key][1]
        for attr in ("dynamo_ctx", "callback", "_torchdynamo_orig_backend", "compiler_fn",
                     "__wrapped__", "_torchdynamo_inline"):
            todo.append(getattr(x, attr, None))
    raise ConfigError(
        f"{type(obj).__name__} was not compiled by ccfx, or has not run yet: call "
        "torch.compile(model, backend='ccfx', options={...}) and run it once before plan_of()"
    )
