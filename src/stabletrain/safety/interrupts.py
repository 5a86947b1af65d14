"""SIGINT and SIGTERM: finish the current step, write a checkpoint, print the resume command,
exit 130 / 143.

The handler only records the signal; the trainer looks at it at the end of every step, and under
DDP the ranks agree there with one small gloo all-reduce, so every rank stops after the same step.
A second signal stops at once. :func:`wait_for_launcher` keeps the exit codes right under Fabric's
own launcher. See docs/blowups.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional

from stabletrain.errors import Interrupted

__all__ = ["StopSignals", "TrainingInterrupted", "EXIT_CODES"]

#: The conventional exit codes: 128 + the signal number.
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class TrainingInterrupted(Interrupted):
    """Training stopped on SIGINT or SIGTERM after finishing a step and writing a checkpoint.

    Attributes:
        signal_name: ``"SIGINT"`` or ``"SIGTERM"``.
        exit_code: 130 or 143 (what ``stabletrain train`` exits with).
        step: Steps completed (the checkpoint's ``step``).
        checkpoint: The checkpoint written, or None when none could be written.
        command: The command that continues the run (pasteable).
    """

    def __init__(self, message: str, *, signal_name: str, step: int, checkpoint: Optional[Path], command: str):
        super().__init__(message)
        self.signal_name = signal_name
        self.exit_code = EXIT_CODES.get(signal_name, 1)
        self.step = step
        self.checkpoint = checkpoint
        self.command = command

    def __reduce__(self) -> Any:
        return (_rebuild, (str(self), self.signal_name, self.step, self.checkpoint, self.command))


def _rebuild(message: str, name: str, step: int, checkpoint: Optional[Path], command: str) -> TrainingInterrupted:
    return TrainingInterrupted(message, signal_name=name, step=step, checkpoint=checkpoint, command=command)


def wait_for_launcher(timeout: float = 60.0) -> None:
    """In a process started by Lightning Fabric's launcher (the parent runs the same command
    line), wait until the parent has exited; elsewhere (torchrun, one process) return at once."""
    parent = os.getppid()
    try:
        same = Path(f"/proc/{parent}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes()
    except OSError:  # no /proc (not Linux): Fabric's observer may report the exit code instead
        return
    if not same:
        return
    deadline = time.monotonic() + timeout
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)


class StopSignals:
    """Records SIGINT/SIGTERM while installed (a context manager; a no-op outside the main thread).

    Args:
        on_first: Called with the signal's name when the first one arrives (e.g. to print
            that the step is being finished).

    Example::

        with StopSignals() as signals:
            for step in range(steps):
                train_step()
                if signals.received:
                    save_checkpoint(); raise SystemExit(signals.exit_code)
    """

    def __init__(self, on_first: Optional[Callable[[str], None]] = None):
        self.on_first = on_first
        self.received: Optional[str] = None
        self._previous: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.received or "", 1)

    def install(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            # Asked twice: stop now, without finishing the step or writing a checkpoint.
            self.restore()
            raise KeyboardInterrupt(f"{name} received twice: stopped at once, without a checkpoint")
        self.received = name
        if self.on_first is not None:
            self.on_first(name)

    def __enter__(self) -> "StopSignals":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()
