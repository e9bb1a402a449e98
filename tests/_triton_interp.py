"""Load ccfx's Triton kernel modules under the Triton interpreter, on CPU tensors.

Triton decides at decoration time (``@triton.jit``) whether a kernel is compiled or interpreted,
from ``TRITON_INTERPRET``. So the variable is set before a kernel module is imported, and a
module that an earlier test imported without it is reloaded. triton.language itself cannot be
reloaded that way: when something imports it first (transformers does), only a session-wide
TRITON_INTERPRET works, which tests/conftest.py sets on machines without a GPU.

``CCFX_TEST_DEVICE=cuda`` (scripts/gpu_check.sh) turns all of this off: the same tests run the
compiled kernels on CUDA tensors (tests/conftest.py makes CUDA torch's default device there).
"""

from __future__ import annotations

import importlib
import os
import sys


def _stale(mod) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return any(
        isinstance(v, JITFunction) and not isinstance(v, InterpretedFunction)
        for v in vars(mod).values()
    )


def kernels(module: str):
    """Import ``ccfx.backends.triton.<module>`` with its kernels (and its helpers') interpreted;
    with ``CCFX_TEST_DEVICE=cuda`` (tests/conftest.py), compiled as they are: the tests then run
    on CUDA tensors."""
    prefix = "ccfx.backends.triton."
    if os.environ.get("CCFX_TEST_DEVICE", "cpu") != "cpu":
        return importlib.import_module(prefix + module)
    os.environ["TRITON_INTERPRET"] = "1"
    mod = importlib.import_module(prefix + module)
    if any(_stale(m) for k, m in list(sys.modules.items()) if k.startswith(prefix)):
        # Helpers first, so the kernel modules re-import interpreted versions of them.
        for name in (prefix + "_common", prefix + "blocks", prefix + module):
            if name in sys.modules:
                importlib.reload(sys.modules[name])
        mod = sys.modules[prefix + module]
    return mod
