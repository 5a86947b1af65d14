"""Exceptions raised by stabletrain.

Every exception a user can act on derives from :class:`StabletrainError`. The command-line
interface prints these without a traceback: their message already says what was wrong and
what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


class StabletrainError(Exception):
    """Base class for errors whose message is meant for the user, not for a debugger."""


class Interrupted(StabletrainError):
    """A run stopped by the user's signal (SIGINT, SIGTERM): whatever runs it stops too, instead of
    going on with the next piece of work. :class:`stabletrain.safety.interrupts.TrainingInterrupted`
    is the trainer's; defined here so that the tools below the trainer can tell it apart."""


class ConfigError(StabletrainError, ValueError):
    """One or more settings are invalid.

    Attributes:
        problems: One line per problem, each naming the setting, the value given and what is
            valid instead. All problems found are listed at once.
    """

    def __init__(self, problems: list[str] | str):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        n = len(self.problems)
        head = "Invalid setting:" if n == 1 else f"Invalid settings ({n} problems):"
        super().__init__(head + "".join(f"\n  - {p}" for p in self.problems))


class NaNCaptureError(StabletrainError):
    """A capture cannot be written, found, read or replayed; the message says why.

    Defined here, without torch, so that ``stabletrain replay`` and ``diagnose`` can refuse a
    wrong path before loading torch; :mod:`stabletrain.debug.nan_capture` exports it.

    Attributes:
        path: The file or folder concerned, when there is one.
    """

    def __init__(self, message: str, path: Optional[str | Path] = None):
        super().__init__(message)
        self.path = None if path is None else Path(path)

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.path))
