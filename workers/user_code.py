"""Loading user code named on the command line (`package.module:fn` or `package.module.fn`,
slime's spelling): rewards, generate functions."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def load_function(path: str, what: str) -> Any:
    """The callable at `path`; a ValueError naming `what` and `path` when there is none."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} path {path!r} is not a dotted path like 'package.module.func' or "
                         f"'package.module:func'")
    try:
        module = _import_here_too(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} path {path!r}: cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):  # 'module:Class.method' is allowed
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ValueError(f"{what} path {path!r}: module {module_name!r} has no attribute {attr!r}") from exc
    if not callable(obj):
        raise ValueError(f"{what} path {path!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def _import_here_too(module_name: str) -> Any:
    """Import as `python -m` would: from the working directory too (a console script's
    path starts with its own directory, so `rollout worker` would not find ./my_rollout.py)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        if here in sys.path or not (exc.name and module_name.startswith(exc.name)):
            raise
        sys.path.append(here)
        return importlib.import_module(module_name)
