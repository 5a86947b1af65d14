"""``out/metrics.jsonl``: one JSON object per logged step, and one per event.

Metric lines look like ``{"step": 10, "loss": 2.31, "gradient_norm": 0.81, "lr": 0.001, ...}``;
event lines carry an ``"event"`` key (e.g. ``{"event": "resume", "step": 100}``), so readers
tell them apart. Non-finite values are written as ``NaN``/``Infinity``, as Python's json
module reads them. Lines are flushed as they are written, so a crash loses nothing logged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

from stabletrain.loggers.base import Logger


class JsonlLogger(Logger):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = _ends_torn(self.path)
        self._f = open(self.path, "a", encoding="utf-8")
        if torn:  # a line cut short by a crash: end it, so that the next row is a line of its own
            self._f.write("\n")
            self._f.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, **metrics})

    def log_event(self, event: dict[str, Any]) -> None:
        self._write(event)

    def _write(self, obj: dict[str, Any]) -> None:
        if self._f.closed:
            return
        self._f.write(json.dumps(obj) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _ends_torn(path: Path) -> bool:
    """Whether ``path`` ends without a newline (its last write was cut short)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except OSError:
        return False


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read a metrics.jsonl file: (metric rows, event rows). A truncated last line is skipped."""
    rows: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for obj in _iter_lines(Path(path)):
        (events if "event" in obj else rows).append(obj)
    return rows, events


def _iter_lines(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(obj, dict):
                yield obj


def is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
