"""Exception types users see. Every error names the problem and the fix."""


class CcfxError(Exception):
    """Base class of every error ccfx raises on purpose."""


class ConfigError(CcfxError, ValueError):
    """An option, a value or a codec spec is not valid."""


class CodecError(CcfxError):
    """A codec cannot handle this input (dtype, shape, state)."""


class PartitionError(CcfxError):
    """The graph cannot be cut as asked."""


class CollectiveError(CcfxError):
    """A collective between ranks failed or timed out (a peer rank died, hung or diverged)."""


class CcfxWarning(UserWarning):
    """Something ccfx changed on your behalf (e.g. fewer stages than asked)."""


def first_line(e: BaseException | str) -> str:
    """The first line of an error's message, for one-line reports of a longer error: an
    exception's type name when it has no message, "" for an empty text."""
    text = str(e).strip()
    if text:
        return text.splitlines()[0]
    return "" if isinstance(e, str) else type(e).__name__


def optimize_ddp_error(compiled: str) -> ConfigError:
    """The error for a ccfx-compiled ``compiled`` (a module's name) run inside
    DistributedDataParallel while Dynamo's DDP optimizer is on: one text, raised by the backend
    when Dynamo calls it from DDP's forward and by the integrations when they attach a hook."""
    return ConfigError(
        f"ccfx: {compiled!r} is compiled by ccfx and runs inside DistributedDataParallel, and "
        "Dynamo's DDP optimizer (torch._dynamo.config.optimize_ddp, on by default) would split "
        "its graph at DDP's gradient-bucket boundaries and give ccfx each piece apart: ccfx's "
        "pipeline stages need the model's whole graph. Set "
        "torch._dynamo.config.optimize_ddp = False before training: the graph stays whole, "
        "and DDP (with ccfx's codec as its comm hook) averages the gradients once the "
        "compiled backward has made them")
