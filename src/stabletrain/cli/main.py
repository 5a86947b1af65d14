"""``stabletrain COMMAND ...``: picks the command; stabletrain's errors become messages and exit codes.

Exit codes: 0 done, 1 a stabletrain error (its message says what to do), 2 invalid settings
or arguments, 130 interrupted (SIGINT), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from stabletrain import __version__
from stabletrain.cli import diagnose, replay, report, train
from stabletrain.errors import ConfigError, StabletrainError
from stabletrain.safety.interrupts import TrainingInterrupted
from stabletrain.safety.write_failures import is_write_failure, write_failure_text

#: name -> (one-line help, function taking the remaining arguments and returning an exit code)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "train": (train.HELP, train.run),
    "replay": (replay.HELP, replay.run),
    "diagnose": (diagnose.HELP, diagnose.run),
    "report": (report.HELP, report.run),
}


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``stabletrain`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="stabletrain",
        description="Training that finds and fixes instabilities.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<10} {h}" for n, (h, _) in COMMANDS.items()),
    )
    parser.add_argument("--version", action="version", version=f"stabletrain {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="command")
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv)
        return 0
    ns, _ = parser.parse_known_args(argv[:1])
    _, run = COMMANDS[ns.command]
    try:
        return run(argv[1:])
    except ConfigError as exc:
        print(f"stabletrain {ns.command}: {exc}", file=sys.stderr)
        return 2
    except TrainingInterrupted as exc:
        # The checkpoint and the command to continue were printed; exit as the signal asks.
        return exc.exit_code
    except StabletrainError as exc:
        if getattr(exc, "other_rank", False):  # stopped with the rank that failed, which says why
            return 1
        print(f"stabletrain {ns.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except OSError as exc:  # a write outside the training loop (report, settings.json) on a full disk
        if not is_write_failure(exc):
            raise
        print(f"stabletrain {ns.command}: {write_failure_text(exc)}", file=sys.stderr)
        return 1
