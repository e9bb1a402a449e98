"""Load ccfx's Triton kernel modules under the Triton interpreter, on CPU tensors.

Triton decides at decoration time (``@triton.jit``) whether a kernel is compiled or interpreted,
from ``TRITON_INTERPRET``. So the variable is set before a kernel module is imported, and a
module that an earlier test imported without it is reloaded. This keeps the kernel tests
independent of test order, with no conftest.py involvement.
"""

from __future__ import annotations

import importlib
import os
import sys


def kernels(module: str):
    """Import ``ccfx.backends.triton.<module>`` with its kernels interpreted."""
    os.environ["TRITON_INTERPRET"] = "1"
    name = f"ccfx.backends.triton.{module}"
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module(name)
    jitted = [v for k, v in vars(mod).items() if k.startswith("_") and k.endswith("_kernel")]
    if any(not isinstance(v, InterpretedFunction) for v in jitted):
        importlib.reload(sys.modules["ccfx.backends.triton._common"])
        mod = importlib.reload(mod)
    return mod
