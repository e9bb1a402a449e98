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
