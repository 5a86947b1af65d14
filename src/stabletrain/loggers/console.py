"""What the user sees: a live progress line, plus messages; all of it mirrored to train.log."""

from __future__ import annotations

import datetime
import shutil
import sys
from pathlib import Path
from typing import IO, Optional


class Console:
    """Prints to stdout (only on rank 0) and appends every line to ``train.log``.

    On a terminal the progress line is redrawn in place; elsewhere (CI logs, pipes) each
    progress update is its own line.
    """

    def __init__(self, log_path: Optional[Path], enabled: bool = True, stream: Optional[IO[str]] = None):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.live = enabled and getattr(self.stream, "isatty", lambda: False)()
        self._log = open(log_path, "a", encoding="utf-8") if (enabled and log_path is not None) else None
        self._line_open = False

    def info(self, message: str) -> None:
        """A message on its own line(s)."""
        if not self.enabled:
            return
        self._end_line()
        print(message, file=self.stream, flush=True)
        self.log_only(message)

    def progress(self, line: str) -> None:
        """The progress line: redrawn in place on a terminal."""
        if not self.enabled:
            return
        if self.live:
            width = shutil.get_terminal_size((120, 20)).columns
            self.stream.write("\r" + line[: width - 1].ljust(min(len(line), width - 1)) + "\x1b[K")
            self.stream.flush()
            self._line_open = True
        else:
            print(line, file=self.stream, flush=True)
        self.log_only(line)

    def _end_line(self) -> None:
        if self._line_open:
            self.stream.write("\n")
            self._line_open = False

    def log_only(self, text: str) -> None:
        """Append ``text`` to ``train.log`` without printing it (e.g. the resolved settings)."""
        if self._log is not None and not self._log.closed:
            stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
            try:
                for line in text.splitlines() or [""]:
                    self._log.write(f"{stamp} {line}\n")
                self._log.flush()
            except OSError:
                # A full disk: train.log stops here (raised once, so the run stops); printing goes on.
                log, self._log = self._log, None
                try:
                    log.close()
                except OSError:
                    pass
                raise

    def close(self) -> None:
        self._end_line()
        if self._log is not None and not self._log.closed:
            self._log.close()


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def progress_line(step: int, steps: int, metrics: dict[str, float]) -> str:
    """``step 120/500 | loss 2.3141 | grad_norm 0.8123 | lr 1.00e-03 | 12.3 steps/s | ETA 0:00:31``."""
    width = len(str(steps))
    parts = [f"step {step:>{width}}/{steps}"]
    for key, label, fmt in (
        ("loss", "loss", "{:.4f}"),
        ("gradient_norm", "grad_norm", "{:.4g}"),
        ("lr", "lr", "{:.2e}"),
        ("accuracy", "acc", "{:.3f}"),
    ):
        if key in metrics:
            parts.append(f"{label} " + fmt.format(metrics[key]))
    if "steps_per_s" in metrics:
        parts.append(f"{metrics['steps_per_s']:.1f} steps/s")
    if "eta_s" in metrics:
        parts.append(f"ETA {format_duration(metrics['eta_s'])}")
    return " | ".join(parts)
