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


@dataclass(frozen=True)
class MechanismSpan:
    """A mechanism named in a run (``{"event": "mechanism"}`` rows, closed by ``mechanism_end`` rows): from
    ``start_step`` (when it began) to ``end_step`` (the last logged step its rule held; None while open)."""

    name: str
    start_step: int
    detected_step: int
    end_step: Optional[int]
    #: The resume step whose timeline replaced the one that named it: it began before that step, in the
    #: timeline kept (so it ends there for the checkpoints), and was named after it, in the one abandoned.
    replaced_at: Optional[int] = None

    def covers(self, checkpoint_step: int) -> bool:
        """Whether a checkpoint holding ``checkpoint_step`` completed steps was written after the mechanism
        began and before it ended."""
        return self.start_step < checkpoint_step and (self.end_step is None or checkpoint_step - 1 <= self.end_step)

    def why(self) -> str:
        if self.replaced_at is not None:
            return (f"written after {self.name} began at step {self.start_step} (named at step "
                    f"{self.detected_step}, in the timeline that the resume from step {self.replaced_at} replaced; "
                    "metrics.jsonl)")
        until = "" if self.end_step is None else f", until step {self.end_step}"
        return (f"written after {self.name} began at step {self.start_step} (named at step {self.detected_step}"
                f"{until}; metrics.jsonl)")


_SPANS: dict[str, tuple[int, int, list[MechanismSpan]]] = {}


def logged_rows_before(path: str | Path, before_step: int) -> list[tuple[int, dict[str, Any]]]:
    """``(step, row)`` of each logged step below ``before_step`` in ``metrics.jsonl`` (none when the file
    is absent): what a callback replays on a resume to continue from the rows already logged."""
    if not Path(path).exists():
        return []
    return [(row["step"], row) for row in read_run(path).rows
            if isinstance(row.get("step"), int) and row["step"] < before_step]


def mechanism_spans(out: str | Path) -> list[MechanismSpan]:
    """The mechanisms of the run's current timeline, from ``out/metrics.jsonl`` (empty when it has none).

    Only event lines are parsed (found by text first), and the result is cached by the file's size and
    modification time: rotation asks at every checkpoint. A resume to step N drops what was named at step N
    or later before it (that timeline was abandoned), except what began before step N: the steps from its
    start to N are in the timeline kept, and so are the checkpoints written there (its span then ends at N)."""
    path = Path(out) / "metrics.jsonl"
    try:
        st = path.stat()
    except OSError:
        return []
    key = str(path.resolve())
    cached = _SPANS.get(key)
    if cached is not None and cached[:2] == (st.st_size, st.st_mtime_ns):
        return cached[2]
    spans: dict[tuple[str, int], dict[str, Any]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"event"' not in line or ('"mechanism' not in line and '"resume"' not in line):
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(ev, dict) or not isinstance(ev.get("step"), int):
                continue
            kind = ev.get("event")
            if kind == "resume":
                at = ev["step"]
                kept = {k: v for k, v in spans.items() if v["detected"] < at}
                for v in kept.values():  # the resumed timeline re-decides whether it ended
                    if v["end"] is not None and v["end"] >= at:
                        v["end"] = None
                for k, v in spans.items():  # began in the timeline kept, named in the one abandoned
                    if k not in kept and v["start"] < at:
                        kept[k] = {**v, "end": min(at - 1, v["end"] if v["end"] is not None else at - 1),
                                   "replaced": at}
                spans = kept
            elif kind == "mechanism" and isinstance(ev.get("start_step"), int):
                spans[(str(ev.get("id")), ev["start_step"])] = {
                    "name": str(ev.get("name") or ev.get("id")), "start": ev["start_step"], "detected": ev["step"],
                    "end": None, "replaced": None}
            elif kind == "mechanism_end" and isinstance(ev.get("start_step"), int):
                found = spans.get((str(ev.get("id")), ev["start_step"]))
                if found is not None and isinstance(ev.get("end_step"), int):
                    found["end"] = ev["end_step"]
    result = [MechanismSpan(v["name"], v["start"], v["detected"], v["end"], v["replaced"]) for v in spans.values()]
    _SPANS[key] = (st.st_size, st.st_mtime_ns, result)
    return result
