"""A user's model factory named on the command line: ``module:callable`` or
``path/to/file.py:callable``.

``ccfx viz``, ``ccfx report``, ``ccfx plan`` and the pipeline runner all take one; it sits
here, below the commands, so that none of them imports another command's module to read it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from .errors import ConfigError


def load_factory(spec: str):
    """The callable named by ``module:attr`` or ``path/to/file.py:attr``."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{spec!r}: give module:factory (e.g. mypkg.models:make_model) or "
                          "path/to/file.py:factory")
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name)
        if not path.exists():
            raise ConfigError(f"{spec!r}: no file {path}")
        name = f"_ccfx_target_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"{spec!r}: cannot import {module_name}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{spec!r}: {module_name} has no attribute {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{spec!r}: {attr} is not callable")
    return obj
