"""Imports decided at run time: optional libraries, and objects named on the command line.

* :func:`is_importable` and :func:`import_optional`: an optional dependency (a logger's
  library) is looked for without importing it, and imported only when it is used, with an
  error that says how to install it.
* :func:`load_object`: ``path/to/file.py:Name`` or ``package.module:Name``, as ``stabletrain
  replay --model`` and ``stabletrain diagnose --model`` take them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from stabletrain.errors import ConfigError

__all__ = ["is_importable", "import_optional", "load_object"]


def is_importable(module: str) -> bool:
    """True when ``module`` can be found (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a parent in sys.modules set to None
        return False


def import_optional(module: str, setting: str, fix: str) -> Any:
    """Import an optional library, or raise :class:`~stabletrain.errors.ConfigError` naming the
    ``setting`` that needs it and the ``fix`` (e.g. the pip command that installs it).

    Example::

        import_optional("wandb", "loggers.wandb", 'run pip install "stabletrain[wandb]"')
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{setting}: cannot import {module} ({exc}); {fix}") from None


def load_object(spec: str, error: type[Exception] = ImportError) -> Any:
    """``path/to/file.py:Name`` or ``package.module:Name`` -> the object (``Name`` may be dotted).

    A file is imported as a module of its own name (its ``if __name__ == "__main__":``
    block does not run), with its folder on ``sys.path`` for its own imports, once: asked
    again for the same, unchanged file, the module already imported is used.

    Args:
        spec: What to load.
        error: The exception class raised, with a message saying what is wrong, for a
            malformed ``spec``, a missing file or a missing name.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise error(f"{spec!r}: expected path/to/file.py:Name or package.module:Name")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(spec, Path(target).expanduser().resolve(), error)
    else:
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")
        module = importlib.import_module(target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{spec!r}: {target} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _import_file(spec: str, file: Path, error: type[Exception]) -> Any:
    if not file.is_file():
        raise error(f"{spec!r}: no such file {file}")
    name = f"_stabletrain_user_{file.stem}"
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    module = sys.modules.get(name)
    mtime = file.stat().st_mtime_ns
    # The same file once (e.g. --model and --step-fn from one file): one module, whose
    # classes and functions are the very objects the other names refer to. An edited
    # file is imported again.
    if (module is None or getattr(module, "__file__", None) != str(file)
            or getattr(module, "_stabletrain_mtime", None) != mtime):
        module_spec = importlib.util.spec_from_file_location(name, file)
        if module_spec is None or module_spec.loader is None:
            raise error(f"{spec!r}: cannot import {file}")
        module = importlib.util.module_from_spec(module_spec)
        module._stabletrain_mtime = mtime  # type: ignore[attr-defined]
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return module
