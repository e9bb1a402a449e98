"""Where a ccfx compile lives among Dynamo's objects, shared by the backend and its fallbacks.

Each ``torch.compile`` call has a Dynamo context (``compiled.dynamo_ctx`` for a module; a
closure cell of a compiled function or of ``model.compile()``'s call) and, for a string
backend, a ``torch.compile`` wrapper whose kwargs reach the backend at every compile. ccfx keeps
a model's backend on its context and an :class:`OwnerToken` in the wrapper's kwargs. This module
finds them (:func:`running_compile`, :func:`contexts_of`, :func:`wrapper_of`), reads a
context's ccfx config (:func:`config_of_context`) and lets ccfx's errors through Dynamo
(:func:`through_dynamo`). It imports neither :mod:`.compiler` nor :mod:`.fallbacks`: the
compiler and the backend's entry point mark themselves with :data:`MARK`.
"""

from __future__ import annotations

import functools
import weakref

from ccfx import _torch_compat as tc
from ccfx.config import Config
from ccfx.errors import CcfxError

#: The attribute that marks ccfx's compilers: ``"backend"`` on a CcfxBackend (it has a
#: ``config``), ``"entry"`` on the ``backend="ccfx"`` entry point (options in the kwargs).
MARK = "_ccfx_compiler"


class OwnerToken:
    """Put in a torch.compile wrapper's kwargs: equal only to itself, so Dynamo never serves
    this compile's cached graphs to another torch.compile call (it compares wrappers with ==).
    It refers to the compile's backend weakly: later compiles find it without a stack walk."""

    __slots__ = ("backend",)

    def __init__(self, backend=None):
        self.backend = weakref.ref(backend) if backend is not None else (lambda: None)

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


def _no_user_stack(self):
    raise AttributeError("real_stack")


#: Dynamo appends "from user code" and its "Set TORCHDYNAMO_VERBOSE=1 ... reporting a bug to
#: PyTorch" trailer to an exception that has ``real_stack`` (which its tracing contexts set on
#: whatever passes them): ccfx's errors have none, and setting one is ignored.
_NO_USER_STACK = property(_no_user_stack, lambda self, value: None)


def _remove_dynamo_frames(self):
    """Dynamo's ShortenTraceback.remove_dynamo_frames, but a traceback that does not pass the
    frame that raised (re-raised elsewhere) is kept whole rather than failing."""
    tb = self.__traceback__
    while tb is not None and tb.tb_frame is not self.first_useful_frame:
        tb = tb.tb_next
    if tb is None or tc.dynamo_config.verbose:
        return self
    return self.with_traceback(tb)


@functools.cache
def _passthrough_type(cls: type) -> type:
    def __init__(self, message, first_useful_frame=None):
        tc.ShortenTraceback.__init__(self, message, first_useful_frame=first_useful_frame)

    return type(cls.__name__, (cls, tc.ShortenTraceback),
                {"__init__": __init__, "__module__": cls.__module__,
                 "real_stack": _NO_USER_STACK, "remove_dynamo_frames": _remove_dynamo_frames})


def through_dynamo(e: CcfxError) -> CcfxError:
    """Dynamo wraps a backend's exceptions in BackendCompilerFailed, except ShortenTraceback:
    re-raise ours as a subclass of both, so users catch the ccfx type they were promised, with
    the traceback cut to the frame that raises it (the caller's) and no Dynamo trailer."""
    return _passthrough_type(type(e))(str(e), tc.caller_frame())


def running_compile():
    """The Dynamo context running this compile (its ``compile_wrapper`` frame's ``self``) and
    the ``torch.compile`` wrapper that called the backend, either of them None if not found.
    Dynamo does not tell a backend which compile it serves: the stack does."""
    ctx = wrapper = None
    for f_locals in tc.caller_locals(1):
        candidate = f_locals.get("self")
        if wrapper is None and isinstance(candidate, tc.TorchCompileWrapper):
            wrapper = candidate
        if ctx is None and isinstance(candidate, tc.DynamoContext):
            ctx = candidate
        if ctx is not None and wrapper is not None:
            break
    return ctx, wrapper


def wrapper_of(ctx):
    """Dynamo's wrapper of ccfx's backend (its ``compiler_fn`` is marked with :data:`MARK`) in
    the callback chain of ``ctx``; None if it does not compile with ccfx."""
    fn = getattr(ctx, "callback", None)
    for _ in range(8):  # CatchErrorsWrapper -> ConvertFrame -> WrapBackendDebug -> the backend
        if fn is None:
            return None
        if getattr(getattr(fn, "compiler_fn", None), MARK, None):
            return fn
        fn = tc.orig_backend(fn)
    return None


def config_of_wrapper(fn) -> Config:
    """The Config of Dynamo's wrapper ``fn`` of a ccfx compiler (:func:`wrapper_of`)."""
    inner = fn.compiler_fn
    if getattr(inner, MARK, None) == "backend":  # backend=ccfx.backend(...)
        return inner.config
    return Config.resolve((getattr(fn, "kwargs", None) or {}).get("options"))[0]


def config_of_context(ctx) -> Config | None:
    """The ccfx Config a Dynamo context compiles with, None if its backend is not ccfx's."""
    backend = getattr(ctx, "_ccfx_backend", None)
    if backend is not None:
        return backend.config
    fn = wrapper_of(ctx)
    return config_of_wrapper(fn) if fn is not None else None


def contexts_of(obj) -> list:
    """The Dynamo contexts a compiled module (``torch.compile(model)``, ``model.compile()``)
    or compiled function may run under."""
    candidates = [getattr(obj, "dynamo_ctx", None)]
    inner = tc.compiled_call_impl(obj)  # nn.Module.compile()
    for fn in (obj, inner):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                candidates.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    return [c for c in candidates if isinstance(c, tc.DynamoContext)]
