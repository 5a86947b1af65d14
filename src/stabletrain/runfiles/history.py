"""A run's metrics.jsonl as one timeline, across resumes.

A resumed run appends to ``metrics.jsonl``: the steps it redoes are logged again, after a
``{"event": "resume", "step": N}`` row. Read in order, that event means the rows already
written for steps N and later belong to an abandoned timeline: the later rows win, and rows of
the abandoned timeline that the resumed run did not log again are dropped too (a run resumed
from an older checkpoint with ``resume_from`` may log at other steps), and so are the events
of those steps (alerts, the guard's stop), kept apart as ``abandoned_events``. Recovery events
(``on_instability``) always stay: a rollback logs a resume to the step it restored, and the
recovery that caused it is part of the run's story.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class RunHistory:
    """``rows``: one metric row per step, in step order; ``events``: the event rows of the same
    timeline, in file order (those of abandoned steps are in ``abandoned_events``); ``resumes``:
    the steps runs resumed at, in file order (``rollbacks``: those an ``on_instability`` rollback
    made); ``abandoned_rows``: the metric rows of abandoned timelines, in file order; ``skipped``:
    the numbers (from 1) of the lines that are not a JSON object, e.g. a last line cut short by a
    crash or a full disk."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)
    abandoned_events: list[dict[str, Any]] = field(default_factory=list)
    abandoned_rows: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def skipped_note(self, path: str | Path) -> Optional[str]:
        """A sentence saying which lines of ``path`` were skipped; None when none was."""
        if not self.skipped:
            return None
        n = len(self.skipped)
        shown = ", ".join(str(i) for i in self.skipped[:5]) + (", ..." if n > 5 else "")
        return (f"{path}: skipped {n} line{'s' if n > 1 else ''} that {'do' if n > 1 else 'does'} not parse "
                f"(line{'s' if n > 1 else ''} {shown}: cut short by a crash or a full disk); every other line "
                f"was read ({len(self.rows)} logged steps, {len(self.events)} events).")


def run_folder_problem(out: str | Path) -> str | None:
    """Why ``out`` is not a training run's folder with a ``metrics.jsonl`` to read, or None.
    Needs no torch: ``stabletrain report`` asks it before loading anything."""
    folder = Path(out)
    if not folder.is_dir():
        kind = "a file, not a folder" if folder.exists() else "no such folder"
        return (f"{folder}: {kind}; pass the out folder of a training run (stabletrain report out/my_run), "
                "trained with loggers.jsonl.enabled=true")
    if not (folder / "metrics.jsonl").is_file():
        return (f"no metrics.jsonl in {folder}: pass the out folder of a training run "
                "(stabletrain report out/my_run), trained with loggers.jsonl.enabled=true")
    return None


def read_run(path: str | Path) -> RunHistory:
    """Read ``metrics.jsonl`` with resume semantics (see the module docstring). A line cut
    short by a crash is skipped, and its number recorded in ``skipped``."""
    by_step: dict[int, dict[str, Any]] = {}
    history = RunHistory()
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                history.skipped.append(number)
                continue
            if not isinstance(obj, dict):
                history.skipped.append(number)
                continue
            if "event" in obj:
                history.events.append(obj)
                if obj.get("event") == "resume" and isinstance(obj.get("step"), int):
                    start = obj["step"]
                    history.resumes.append(start)
                    if str(obj.get("reason", "")).startswith("rollback"):
                        history.rollbacks.append(start)
                    for step in sorted(s for s in by_step if s >= start):
                        history.abandoned_rows.append(by_step.pop(step))
                    kept: list[dict] = []
                    for ev in history.events[:-1]:
                        later = (isinstance(ev.get("step"), int) and ev["step"] >= start
                                 and ev.get("event") not in ("resume", "recovery"))
                        (history.abandoned_events if later else kept).append(ev)
                    history.events = kept + [obj]
                continue
            if isinstance(obj.get("step"), int):
                by_step[obj["step"]] = obj
    history.rows = [by_step[s] for s in sorted(by_step)]
    return history
