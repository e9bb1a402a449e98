"""Say so when a model compiled with ccfx runs without ccfx (issue 17, part 7).

Dynamo runs code it cannot capture eagerly, and the backend is never told: a GCN whose
adjacency is a sparse CSR tensor (``adj @ x``) makes Dynamo give up on the model's whole
``forward`` ("Attempted to wrap sparse Tensor"), so ccfx never compiles, cuts, compresses or
synchronizes anything, and the model still runs, correctly and silently. A graph break can
leave a large part of a model (a ``torch.compiler.disable``-d block, the rest of ``forward``
after a frame Dynamo gives up on) outside every graph ccfx sees, just as silently. This module
watches each ccfx-compiled model and says so once: a :class:`~ccfx.errors.CcfxWarning` quoting
the reason Dynamo recorded, or a :class:`~ccfx.errors.ConfigError` where the options ask for
what cannot happen outside ccfx's graphs (``stages`` > 1: nothing to cut;
``data_parallel=True``: gradients never averaged).

**Where ccfx can notice.** When Dynamo skips the only frame, the backend is never called.
What Dynamo does call for every frame it tries is its compile callbacks
(``torch._dynamo.callback_handler``, the registry behind ``torch._dynamo.on_compile_start`` /
``on_compile_end``), and it counts every graph break and every frame it gave up on, with the
reason, in ``torch._dynamo.utils.counters`` (``"graph_break"``, ``"unimplemented"``). ccfx
registers one start and one end callback (:func:`arm`); a callback finds the compile's Dynamo
context on the stack (as the backend's first compile does: Dynamo's callbacks get a compile id,
not the compiled object) and ignores compiles that are not ccfx's.
Per context a :class:`Watch` records the reasons counted during its compiles and whether ccfx
compiled a graph in each. ``torch._dynamo.reset()`` clears every registered callback: ccfx
registers again when it is imported (the first ``torch.compile(..., backend="ccfx")`` of a
process) and whenever a ccfx backend is made or called, so a model whose every frame Dynamo
skips right after a reset, before any ccfx compile, goes unnoticed.

**A whole frame.** The first frame Dynamo tries for a compiled model is its ``forward``. If
that compile ends with no ccfx graph and Dynamo counted a frame it gave up on, the model runs
eagerly: the warning comes at once, before the eager run. An error cannot: Dynamo's
end-of-compile callback must not raise (its count of compiles in progress would stay up, and
no callback would run again in the process), so it waits for the first gradient of one of
the model's parameters (a hook on each: raised there, before any gradient is accumulated) or
the model's next call, whichever comes first.

**A large share outside.** The measure is the model's parameters that no ccfx graph takes as
an input after its first call. Why parameters and not FLOPs: what runs outside never reaches a
graph ccfx sees, so its FLOPs are unknown to ccfx, while every parameter is either an input of
a ccfx graph or not; in the layers that dominate a model's work (linear layers, convolutions,
attention projections) the FLOPs are the parameters' size times the tokens, so the share of
parameters outside is the share of that work outside. It costs a set of tensor ids, once. It
is blind to parameter-free work between graphs (a sparse product in the middle of captured
code): the graph-break reasons, which the warning quotes, are what shows those. Checked once,
when the first call is over: at the first gradient of one of the model's trainable
parameters (the same hooks, put on at the end of the model's first compile; Dynamo ignores
hooks on parameters: no recompile, no graph break) or at the start of its second call,
whichever comes first (a model that only ever runs once without grad is never checked). A
share of :data:`WARN_SHARE` or more warns (an error with ``stages`` > 1); under
``data_parallel`` any trainable parameter outside is an error (its gradient would differ
between ranks). With ``sync_every`` alone it stays a warning: ``ccfx.local_steps`` averages
the parameters whether or not ccfx compiled the model.

The second call is seen through the Dynamo context's ``enter_exit_hooks`` (run at the entry
of every call of the compiled model): ccfx puts its check first there, so an error raised
in it leaves nothing half entered, and raises it again at every later call (an eager run
never synchronizes).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field

import torch

from ccfx import _torch_compat as tc
from ccfx.errors import CcfxError, CcfxWarning, ConfigError

from .dynamo_context import config_of_context as _config_of
from .dynamo_context import through_dynamo

#: The share of the model's parameters outside ccfx's graphs from which ccfx warns (with
#: ``stages`` > 1: raises). A quarter: below it, ccfx's graphs still carry most of the
#: parameterised work and most of what crosses the wire.
WARN_SHARE = 0.25

#: The Dynamo counters that hold reasons: a graph break (the rest of the frame resumes in a
#: new one) and a frame Dynamo gave up on (it runs eagerly, whole).
_BREAK, _GAVE_UP = "graph_break", "unimplemented"

#: Every reason quoted at most this many times in one message.
_MAX_REASONS = 3

#: How to make code capturable, said in every message.
_FIXES = ("keep the model fullgraph-able (torch.compile(..., fullgraph=True) names each "
          "break), use a dense tensor where Dynamo rejects a sparse one (adj.to_dense()), or "
          "make the op one graph node (torch.library.custom_op, torch._dynamo.allow_in_graph)")


@dataclass(eq=False)
class Watch:
    """What ccfx knows about one compiled model's compiles (one Dynamo context)."""

    ctx: weakref.ref
    name: str
    module: weakref.ref | None
    compiles: int = 0
    reasons: list[str] = field(default_factory=list)
    checked: bool = False  # said (or found nothing to say) once: never again
    error: CcfxError | None = None  # raised again at every later call
    hooks: list = field(default_factory=list)  # gradient hooks waiting to raise ``error``
    # the compile in progress: counters and ccfx's graph count when it started
    before: dict = field(default_factory=dict)
    graphs_before: int = 0

    def backend(self):
        ctx = self.ctx()
        return getattr(ctx, "_ccfx_backend", None) if ctx is not None else None

    def config(self):
        ctx = self.ctx()
        return _config_of(ctx) if ctx is not None else None

    def graph_count(self) -> int:
        backend = self.backend()
        return len(backend.graphs) if backend is not None else 0


# -- the callbacks ----------------------------------------------------------------------------

_current: Watch | None = None


def arm() -> None:
    """Register ccfx's compile callbacks with Dynamo, once (again after torch._dynamo.reset())."""
    tc.arm_compile_callbacks(_on_start, _on_end)


def _on_start(args) -> None:
    global _current
    if args.callback_trigger is not tc.CallbackTrigger.DYNAMO:
        return
    _current = _watch_of_running_compile()
    if _current is None:
        return
    _current.before = _snapshot()
    _current.graphs_before = _current.graph_count()


def _on_end(args) -> None:
    global _current
    watch, _current = _current, None
    if watch is None or args.callback_trigger is not tc.CallbackTrigger.DYNAMO:
        return
    new = _new_reasons(watch.before)
    for reason in new[_BREAK] + new[_GAVE_UP]:
        if reason not in watch.reasons:
            watch.reasons.append(reason)
    first, watch.compiles = watch.compiles == 0, watch.compiles + 1
    compiled = watch.graph_count() > watch.graphs_before
    if first and not compiled and new[_GAVE_UP] and not watch.checked:
        _whole_frame(watch, new[_GAVE_UP])
    if first:
        _at_first_backward(watch)


def _snapshot() -> dict[str, dict[str, int]]:
    counters = tc.dynamo_counters
    return {key: dict(counters[key]) for key in (_BREAK, _GAVE_UP)}


def _new_reasons(before: dict) -> dict[str, list[str]]:
    """The reasons Dynamo counted since ``before``, per counter."""
    counters = tc.dynamo_counters
    return {key: [r for r, n in counters[key].items() if n > before.get(key, {}).get(r, 0)]
            for key in (_BREAK, _GAVE_UP)}


# -- finding the compiled model ---------------------------------------------------------------

def _watch_of_running_compile() -> Watch | None:
    """The Watch of the ccfx-compiled model whose frame Dynamo is compiling (made at its first
    compile), None if the compile is not ccfx's. Dynamo's callback is not told which
    compile it is: the stack says (above Dynamo's callback runner)."""
    ctx = fn = module = None
    for f_locals in tc.caller_locals(2):
        me = f_locals.get("self")
        if ctx is None and isinstance(me, tc.DynamoContext):
            ctx, fn = me, f_locals.get("fn")
        elif ctx is not None and isinstance(me, torch.nn.Module) \
                and getattr(me, "dynamo_ctx", None) is ctx:
            module = tc.orig_module(me)  # torch.compile(model)
            break
    if ctx is None or getattr(ctx, "fullgraph", False):
        return None  # fullgraph=True: Dynamo raises where it would break or give up
    watch = getattr(ctx, "_ccfx_fallbacks", None)
    if watch is not None:
        return watch
    try:
        if _config_of(ctx) is None:
            return None
    except CcfxError:
        return None  # bad options: the backend says so when it is called
    if module is None and isinstance(getattr(fn, "__self__", None), torch.nn.Module):
        module = fn.__self__  # model.compile(): fn is the model's bound _call_impl
    name = (type(module).__name__ if module is not None
            else getattr(fn, "__qualname__", None) or "the compiled function")
    watch = Watch(weakref.ref(ctx), name, weakref.ref(module) if module is not None else None)
    ctx._ccfx_fallbacks = watch
    _add_call_hook(ctx, watch)
    return watch


def _add_call_hook(ctx, watch: Watch) -> None:
    """Run :func:`_on_call` at the entry of every call of the compiled model, first among the
    context's hooks (an error leaves no other hook entered)."""
    ref = weakref.ref(watch)

    def enter():
        w = ref()
        if w is not None:
            _on_call(w)
        return _nothing

    tc.enter_exit_hooks(ctx).insert(0, enter)


def _nothing() -> None:
    pass


def _on_call(watch: Watch) -> None:
    if watch.error is not None:
        _raise(watch)
    if not watch.checked and watch.compiles:
        _drop_hooks(watch)
        _check_share(watch)  # a later call: the first is over


# -- what ccfx says ---------------------------------------------------------------------------

def _whole_frame(watch: Watch, gave_up: list[str]) -> None:
    """Dynamo gave up on the model's own frame: it runs eagerly, without ccfx. Called from
    Dynamo's end-of-compile callback, which must not raise (Dynamo's count of pending compiles
    would stay up): an error waits for the model's first backward or its next call."""
    what = (f"Dynamo could not capture {watch.name}'s forward, so the model runs eagerly, "
            "without ccfx: nothing is cut, compressed or synchronized")
    _say(watch, what, gave_up, outside_trainable=True, share=1.0)


def _check_share(watch: Watch) -> None:
    """After the first call: the share of the model's parameters no ccfx graph took (raises
    the ConfigError the options call for)."""
    watch.checked = True
    module = watch.module() if watch.module is not None else None
    if module is None:
        return  # a compiled function: its parameters are not known
    params = dict(module.named_parameters())
    total = sum(p.numel() for p in params.values())
    if not total:
        return
    inside = _graph_tensor_ids(watch.backend())
    outside = {n: p for n, p in params.items() if id(p) not in inside}
    out = sum(p.numel() for p in outside.values())
    share = out / total
    trainable = any(p.requires_grad for p in outside.values())
    cfg = watch.config()
    if share < WARN_SHARE and not (cfg is not None and cfg.data_parallel and trainable):
        return
    names = sorted(outside, key=lambda n: -outside[n].numel())
    listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    what = (f"{share:.0%} of {watch.name}'s parameters ({out:,} of {total:,}: {listed}) ran "
            "outside ccfx's graphs in its first call (unused, or run eagerly around them), "
            "so ccfx neither cuts, compresses nor synchronizes their work")
    if _say(watch, what, watch.reasons, outside_trainable=trainable, share=share):
        _raise(watch)


def _say(watch: Watch, what: str, reasons: list[str], *, outside_trainable: bool,
         share: float) -> bool:
    """Warn once; or, where the options ask for what cannot happen outside ccfx's graphs, keep
    the ConfigError on ``watch`` and return True (the caller raises it when it may)."""
    watch.checked = True
    told = "; ".join(_short(r) for r in reasons[:_MAX_REASONS]) or \
        "none recorded (a torch.compiler.disable-d or skipped function runs eagerly)"
    if len(reasons) > _MAX_REASONS:
        told += f"; and {len(reasons) - _MAX_REASONS} more"
    message = f"ccfx: {what}. Dynamo's reason: {told}. To fix: {_FIXES}."
    try:
        cfg = watch.config()
    except CcfxError as e:  # options no backend call checked: wrong whatever Dynamo did
        watch.error = e
        return True
    asked = []
    if cfg is not None and cfg.stages > 1 and share >= WARN_SHARE:
        asked.append(f"stages={cfg.stages} cannot cut code ccfx never sees")
    if cfg is not None and cfg.data_parallel and outside_trainable:
        asked.append("data_parallel=True would leave those gradients different on every rank")
    if asked:
        watch.error = ConfigError(f"ccfx: {'; '.join(asked)}: {message[len('ccfx: '):]}")
        return True
    if cfg is not None and cfg.sync_every is not None:
        message += (f" (sync_every={cfg.sync_every}: ccfx.local_steps still averages the "
                    "parameters; that outer sync is all ccfx does for this model)")
    warnings.warn(message, CcfxWarning, stacklevel=2)
    return False


def _raise(watch: Watch):
    """Raise ``watch.error`` (as a type Dynamo lets through), dropping the gradient hooks that
    waited for it."""
    _drop_hooks(watch)
    raise through_dynamo(watch.error)


def _at_first_backward(watch: Watch) -> None:
    """Hook every trainable parameter of the model: the first gradient computed (the first
    call is over, no gradient of it used yet) drops the hooks, checks the share
    (:func:`_check_share`) and raises what is due. Dynamo ignores hooks on parameters (no
    recompile, no graph break): they run where the gradient is accumulated."""
    module = watch.module() if watch.module is not None else None
    if module is None:
        return
    ref = weakref.ref(watch)

    def on_grad(_grad):
        w = ref()
        if w is None:
            return
        _drop_hooks(w)
        if w.error is not None:
            _raise(w)
        if not w.checked:
            _check_share(w)

    watch.hooks = [p.register_hook(on_grad) for p in module.parameters() if p.requires_grad]


def _drop_hooks(watch: Watch) -> None:
    for handle in watch.hooks:
        handle.remove()
    watch.hooks.clear()


def _short(reason: str) -> str:
    """Dynamo's reason as one line: its title, its explanation and its page, if it has them."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    if not lines:
        return reason
    text = lines[0]
    explained = next((line.split(":", 1)[1].strip() for line in lines
                      if line.startswith("Explanation:")), "")
    if explained:
        text += f" ({explained.rstrip('.')})"
    page = next((word for line in lines for word in line.split()
                 if word.startswith("https://")), "")
    if page:
        text += f", see {page}"
    return text


def _graph_tensor_ids(backend) -> set[int]:
    """The ids of the parameters and buffers ccfx's graphs take: their inputs (Dynamo lifts
    them by default) and their ``get_attr`` attributes (without inlined nn modules)."""
    ids: set[int] = set()
    for graph in getattr(backend, "graphs", ()):
        for ref in graph.state_inputs.values():
            tensor = ref()
            if tensor is not None:
                ids.add(id(tensor))
        gm = graph.partitioned
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                try:
                    ids.add(id(_attr(gm, node.target)))
                except AttributeError:
                    pass
    return ids


def _attr(gm: torch.fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def why_not_compiled(candidates) -> str:
    """For the error of ``ccfx.plan_of`` (and friends) on a model ccfx never compiled: what
    Dynamo recorded when it ran the model without ccfx, if it did ("" otherwise)."""
    for ctx in candidates:
        watch = getattr(ctx, "_ccfx_fallbacks", None)
        if watch is not None and watch.compiles:
            told = "; ".join(_short(r) for r in watch.reasons[:_MAX_REASONS]) or "none recorded"
            return (f". It has run, but Dynamo ran it without ccfx (Dynamo's reason: {told}). "
                    f"To fix: {_FIXES}")
    return ""
