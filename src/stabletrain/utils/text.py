"""How numbers, lists and paths are written in messages, reports and JSON: one format per kind.

:func:`fmt_number` (3 significant digits), :func:`fmt_column`, :func:`fmt_factor`, :func:`fmt_list`,
:func:`fmt_path`, :func:`abs_path`, :func:`shell_path` and :func:`json_float`; each function's
docstring gives its format. Internal: no docs page.
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = [
    "NUMBER_DIGITS",
    "MEASURED_DIGITS",
    "fmt_number",
    "fmt_column",
    "fmt_factor",
    "fmt_list",
    "abs_path",
    "fmt_path",
    "shell_path",
    "json_float",
]

#: Significant digits of a number in prose, reports and advice.
NUMBER_DIGITS = 3
#: Significant digits of a measured value that is compared with another (replayed vs captured loss).
MEASURED_DIGITS = 6


def fmt_number(x: Any, digits: int = NUMBER_DIGITS) -> str:
    """``x`` with ``digits`` significant digits: ``0.001``, ``1e+03``, ``nan``, ``-inf``; ``-`` for
    None; a string (e.g. a value read back from JSON) as it is.

    Example::

        fmt_number(1 / 3)                    # '0.333'
        fmt_number(2.5e19)                   # '2.5e+19'
        fmt_number(7.161492e16, MEASURED_DIGITS)   # '7.16149e+16'
    """
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{float(x):.{digits}g}"


def fmt_column(x: float, width: int = 11) -> str:
    """``x`` right-aligned in ``width`` characters, 4 significant digits in scientific notation
    (``  2.000e+18``, ``        nan``): the columns of a table stay aligned whatever the magnitude."""
    return f"{float(x):{width}.3e}"


def fmt_factor(f: float) -> str:
    """A ratio: ``22.7x``, ``211x``, ``1.2e+04x``; ``far`` when it is not finite."""
    if not math.isfinite(f):
        return "far"
    return f"{f:.3g}x" if f < 1000 else f"{f:.1e}x"


def fmt_list(items: Iterable[Any], limit: int = 4, fmt: Callable[[Any], str] = str) -> str:
    """The first ``limit`` items joined by commas, then how many are left out.

    Example::

        fmt_list(["a", "b", "c", "d", "e", "f"])     # 'a, b, c, d (+2 more)'
        fmt_list([0.5, 1 / 3], fmt=fmt_number)      # '0.5, 0.333'
    """
    items = list(items)
    shown = ", ".join(fmt(x) for x in items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def fmt_path(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute; never
    starting with ``-`` (so that a command line cannot read it as an option)."""
    p = Path(path)
    absolute = p if p.is_absolute() else Path.cwd() / p
    try:
        rel = os.path.relpath(absolute, Path.cwd())
    except ValueError:  # another drive (Windows)
        rel = str(absolute)
    text = str(absolute) if rel.startswith("..") else rel
    return "./" + text if text.startswith("-") else text


def abs_path(path: str | Path) -> str:
    """``path`` made absolute, for commands in messages, which must work when pasted in any folder,
    not only where the run started. Symlinks are kept: the path stays the one the user gave."""
    return os.path.abspath(os.path.expanduser(path))


def shell_path(path: str | Path) -> str:
    """:func:`abs_path` quoted for a POSIX shell (spaces, quotes, ``$`` and all)."""
    return shlex.quote(abs_path(path))


def json_float(x: float) -> Any:
    """``x`` for JSON, which has no NaN or Infinity: non-finite values as ``"nan"``, ``"inf"``, ``"-inf"``."""
    return x if math.isfinite(x) else str(x)
