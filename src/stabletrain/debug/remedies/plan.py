"""Where a verification starts and ends, read from the run's own files (see docs/remedies.md).

A run folder written by ``stabletrain.train`` holds ``settings.json``, ``metrics.jsonl`` and
``checkpoints/``. :func:`make_plan` finds where the trouble began (the first non-finite step, the
first alert or recovery, or the step given), the newest healthy checkpoint before it, and the
stretch every candidate runs through: to the failing step and a margin past it, or to the run's end.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from stabletrain.errors import StabletrainError
from stabletrain.runfiles.checkpoint import checkpoint_dir, list_checkpoints, newest_healthy
from stabletrain.runfiles.history import RunHistory, read_run

__all__ = ["Plan", "RemedyError", "Trouble", "make_plan", "read_settings", "find_trouble", "described_object",
           "FINAL_WINDOW", "SCRATCH"]

#: Logged losses averaged into a candidate's final loss.
FINAL_WINDOW = 5
#: Where the re-runs go, below the run folder.
SCRATCH = Path("debug") / "remedies"
#: Events that mean the run was in trouble at their step (besides any ``*_alert`` event).
TROUBLE_EVENTS = ("nonfinite_step", "nan_detected", "recovery")
#: Events that mean the run stopped non-finite at their step.
NONFINITE_EVENTS = ("nonfinite_step", "nan_detected")


class RemedyError(StabletrainError):
    """The run cannot be verified as asked: its files, the start, or the model it needs."""


def read_settings(run: Path) -> dict[str, Any]:
    """``run/settings.json``; :class:`RemedyError` naming what to pass when there is none."""
    path = Path(run) / "settings.json"
    if not path.is_file():
        raise RemedyError(f"no settings.json in {run}: pass the out folder of a run trained by stabletrain.train "
                          "(stabletrain train out=...), which holds settings.json, metrics.jsonl and checkpoints/")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise RemedyError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise RemedyError(f"{path} does not hold the run's settings (a JSON object)")
    return data


def described_object(value: Any) -> bool:
    """Whether a settings.json value stands for a Python object (``"<module.Class>"``), which the
    file cannot rebuild."""
    return isinstance(value, str) and value.startswith("<") and value.endswith(">")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _start_step(event: dict[str, Any], step: int) -> int:
    """An alert's episode start (``start_step``) when it has one, else its step."""
    start = event.get("start_step")
    return start if isinstance(start, int) and not isinstance(start, bool) else step


@dataclass
class Trouble:
    """What a run's files show went wrong (:func:`find_trouble`).

    Attributes:
        since: The first step that shows it (None: nothing found).
        why: What shows it there, in words.
        failed: The step the run went non-finite at (None when it did not).
        mechanisms: The mechanism ids its ``{"event": "mechanism", ...}`` rows name, earliest first.
    """

    since: Optional[int] = None
    why: str = ""
    failed: Optional[int] = None
    mechanisms: list[str] = field(default_factory=list)


def find_trouble(history: RunHistory) -> Trouble:
    """Where the run's files show trouble first, and what.

    Trouble is the earliest of: a logged loss that is not finite; a ``nonfinite_step``,
    ``nan_detected`` or ``recovery`` event; a ``mechanism`` event (a mechanism named by its rule: its
    ``start_step``); a trend alert that was not tolerated (its episode's start); any other
    ``*_alert`` event (its ``start_step`` when it has one, else its step).
    """
    found: list[tuple[int, str]] = []
    failed: list[int] = []
    mechanisms: list[tuple[int, str]] = []
    for row in history.rows:  # the loss: an Inf gradient norm alone is a step fp16 loss scaling skips
        if "loss" in row and not _finite(row["loss"]):
            found.append((row["step"], f"the loss was {row['loss']} at step {row['step']}"))
            failed.append(row["step"])
    for event in history.events:
        name = str(event.get("event", ""))
        step = event.get("step")
        if not isinstance(step, int) or step < 0:
            continue
        if name in NONFINITE_EVENTS:
            found.append((step, f"the run went non-finite at step {step} ({name})"))
            failed.append(step)
        elif name == "recovery":
            found.append((step, f"the self-healing recovered from step {step} ({event.get('trigger', 'a bad step')})"))
        elif name == "mechanism":
            start = _start_step(event, step)
            what = event.get("message") or event.get("name") or event.get("id")
            found.append((start, f"{what}"))
            if isinstance(event.get("id"), str):
                mechanisms.append((start, event["id"]))
        elif name == "trend_alert":
            if event.get("tolerated"):
                continue
            start = _start_step(event, step)
            what = event.get("message") or f"{event.get('signal')} {event.get('kind')}"
            found.append((start, f"a trend alert from step {start}: {what}"))
        elif name.endswith("_alert"):
            start = _start_step(event, step)
            what = event.get("message") or event.get("mechanism") or name
            found.append((start, f"{name} from step {start}: {what}"))
    if not found:
        return Trouble()
    since, why = min(found, key=lambda f: f[0])
    ids = list(dict.fromkeys(m for _, m in sorted(mechanisms, key=lambda m: m[0])))
    return Trouble(since, why, min(failed) if failed else None, ids)


@dataclass
class Plan:
    """The stretch every candidate runs through, and what the run's own files say about it.

    Attributes:
        run: The run folder.
        settings: ``settings.json``.
        steps: The run's ``steps`` (kept in every re-run: the lr schedule depends on it).
        log_every: The run's ``log_every_num_steps``.
        start_step: The step the verification starts from (the checkpoint's step, or 0).
        start_checkpoint: The checkpoint resumed from; None for a fresh start from step 0.
        start_why: Why that start, in words.
        since_step: The first step that showed the trouble (None when none was found or given).
        since_why: What showed it.
        until_step: The end of the failing stretch: the step the run went non-finite at, else its end.
        failed_step: The step the run went non-finite at (None when it did not).
        mechanisms: The mechanism ids the run's ``mechanism`` rows name, earliest first.
        end_step: The step every candidate runs to (exclusive): ``until_step`` and a margin, at most ``steps``.
        eval_steps: The logged steps whose mean loss is each candidate's final loss: the last ``final_window``
            logged steps of the stretch's second half.
        rows: The original run's metric rows (one timeline, see :mod:`stabletrain.runfiles.history`).
        events: The original run's event rows.
        baseline_covered: The original rows cover the stretch: every step of ``eval_steps`` logged and
            finite, no resume inside it; the baseline is read from them instead of re-run.
        seconds_per_step: The original run's time per step (its logged ``steps_per_s``), or None.
        notes: What the user should know about the plan (callbacks not rebuilt, a resume in the stretch).
    """

    run: Path
    settings: dict[str, Any]
    steps: int
    log_every: int
    start_step: int
    start_checkpoint: Optional[Path]
    start_why: str
    since_step: Optional[int]
    since_why: str
    until_step: int
    end_step: int
    eval_steps: list[int]
    failed_step: Optional[int] = None
    mechanisms: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    baseline_covered: bool = False
    seconds_per_step: Optional[float] = None
    notes: list[str] = field(default_factory=list)

    @property
    def scratch(self) -> Path:
        """``run/debug/remedies``: the re-runs' folders and the report."""
        return self.run / SCRATCH

    @property
    def start_text(self) -> str:
        """``step_000020.ckpt (step 20)`` or ``step 0 (a fresh start)``."""
        if self.start_checkpoint is None:
            return "step 0 (a fresh start)"
        return f"{self.start_checkpoint.name} (step {self.start_step})"

    def original_steps(self, from_step: Optional[int] = None) -> int:
        """Steps the original run ran from ``from_step`` (default: the start) through the stretch:
        to the step it went non-finite at (that step included), else to the stretch's end or its last
        logged step, whichever comes first."""
        first = self.start_step if from_step is None else from_step
        last = self.end_step
        if self.failed_step is not None and first <= self.failed_step < last:
            last = self.failed_step + 1
        elif self.rows:
            last = min(last, max(r["step"] for r in self.rows) + 1)
        return max(0, last - first)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": str(self.run),
            "steps": self.steps,
            "log_every_num_steps": self.log_every,
            "start_step": self.start_step,
            "start_checkpoint": None if self.start_checkpoint is None else str(self.start_checkpoint),
            "start_why": self.start_why,
            "since_step": self.since_step,
            "since_why": self.since_why,
            "until_step": self.until_step,
            "failed_step": self.failed_step,
            "mechanisms": self.mechanisms,
            "end_step": self.end_step,
            "eval_steps": self.eval_steps,
            "baseline_from_original_rows": self.baseline_covered,
            "original_seconds_per_step": self.seconds_per_step,
            "notes": self.notes,
        }


def _logged_steps(first: int, end: int, log_every: int, steps: int) -> list[int]:
    """The steps in ``[first, end)`` that the trainer logs at its cadence."""
    return [s for s in range(first, end) if s % log_every == 0 or s + 1 == steps]


def _start(run: Path, start: Union[None, int, str, Path], since: Optional[int],
           since_why: str) -> tuple[int, Optional[Path], str]:
    """The start: a checkpoint given, step 0, or the newest healthy checkpoint before ``since``."""
    folder = checkpoint_dir(run)
    if isinstance(start, bool):
        raise RemedyError(f"start: a checkpoint file, a checkpoint's step or 0, got {start}")
    if isinstance(start, int):
        if start == 0:
            return 0, None, "step 0, as asked"
        found = next((c for c in list_checkpoints(folder) if c.step == start), None)
        if found is None:
            steps = ", ".join(str(c.step) for c in list_checkpoints(folder)) or "none"
            raise RemedyError(f"start: no checkpoint of step {start} in {folder} (checkpoints at steps: {steps}); "
                              "pass a checkpoint file, or 0 for a fresh start")
        return found.step, found.path, f"{found.reason()}, as asked"
    if start is not None:
        path = Path(start)
        if not path.is_file():
            raise RemedyError(f"start: no checkpoint file at {path}")
        match = next((c for c in list_checkpoints(path.parent) if c.path.resolve() == path.resolve()), None)
        if match is None:
            raise RemedyError(f"start: {path} cannot be read as a stabletrain checkpoint")
        return match.step, path, f"{match.reason()}, as asked"
    if since is None:
        return 0, None, ("the run's files show no trouble (no non-finite step, no alert, no recovery): the whole "
                         "run is re-run from step 0; give a checkpoint to start from (start=, --start) for a shorter "
                         "stretch")
    best = newest_healthy(folder, before_step=since - 1) if since > 0 else None
    if best is None:
        written = any(c.step < since for c in list_checkpoints(folder))
        none = (f"no checkpoint recorded healthy holds fewer steps than {since}" if written
                else f"no checkpoint was written before step {since}")
        return 0, None, f"{none}, where {since_why}: a fresh start from step 0"
    return best.step, best.path, f"the newest healthy checkpoint before step {since}, where {since_why}"


def _seconds_per_step(rows: list[dict[str, Any]], first: int, end: int) -> Optional[float]:
    """1 / the median logged ``steps_per_s`` over the stretch (over the whole run with fewer than 3
    rows there); the first logged row of a run (its rate holds the setup) left out."""
    def rates(selected: list[dict[str, Any]]) -> list[float]:
        return [float(r["steps_per_s"]) for r in selected
                if _finite(r.get("steps_per_s")) and r["steps_per_s"] > 0 and r["step"] > 0]

    inside = rates([r for r in rows if first < r["step"] < end])
    chosen = inside if len(inside) >= 3 else rates(rows)
    return 1 / statistics.median(chosen) if chosen else None


def make_plan(run: Union[str, Path], *, start: Union[None, int, str, Path] = None, since_step: Optional[int] = None,
              until_step: Optional[int] = None, margin: Optional[int] = None,
              final_window: int = FINAL_WINDOW) -> Plan:
    """The verification's stretch for the run folder ``run``.

    Args:
        run: A run folder written by ``stabletrain.train``.
        start: A checkpoint file (or the step of one of the run's checkpoints), or 0 for a fresh start;
            default: the newest checkpoint recorded healthy that holds fewer steps than ``since_step``,
            else step 0.
        since_step: The first logged step that shows the trouble (a mechanism's onset); default: found
            in the run's files (:func:`find_trouble`).
        until_step: The end of the failing stretch; default: the step the run went non-finite at,
            else the run's ``steps``.
        margin: Steps run past ``until_step``; default max(10, half the stretch), when steps remain.
        final_window: Logged losses averaged into the final loss.
    """
    run = Path(run)
    settings = read_settings(run)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise RemedyError(f"no metrics.jsonl in {run}: the verification compares with the run's logged losses; "
                          "train with loggers.jsonl.enabled=true")
    history = read_run(metrics)
    if int(settings.get("world_size") or 1) > 1:
        raise RemedyError(f"{run} was trained by {settings['world_size']} processes; verifying remedies re-runs it "
                          "in this process, which does not launch several (not supported yet)")
    steps = int(settings.get("steps") or 0)
    log_every = max(1, int(settings.get("log_every_num_steps") or 1))
    trouble = find_trouble(history)
    failed = trouble.failed
    since, since_why = ((since_step, f"the trouble shows (since_step={since_step}, given)") if since_step is not None
                        else (trouble.since, trouble.why))
    start_step, checkpoint, start_why = _start(run, start, since, since_why)
    until = until_step if until_step is not None else (failed if failed is not None else steps)
    until = min(max(until, start_step + 1), steps)
    if margin is None:
        margin = max(10, (until - start_step) // 2) if until < steps else 0
    end = min(steps, until + max(0, int(margin)))
    if end < steps:  # stop right after a logged step (the next one): the margin's last steps are compared too
        end = next(s for s in range(end - 1, steps) if s % log_every == 0 or s + 1 == steps) + 1
    # The final loss: the last logged losses of the stretch's second half (not its start, where every
    # candidate still has about the loss of the checkpoint).
    logged = _logged_steps(start_step, end, log_every, steps)
    late = [s for s in logged if s >= start_step + (end - start_step) // 2] or logged[-1:]
    eval_steps = late[-max(1, final_window):] or [end - 1]
    plan = Plan(run=run, settings=settings, steps=steps, log_every=log_every, start_step=start_step,
                start_checkpoint=checkpoint, start_why=start_why, since_step=since, since_why=since_why,
                until_step=until, end_step=end, eval_steps=eval_steps, failed_step=failed,
                mechanisms=trouble.mechanisms, rows=history.rows, events=history.events,
                seconds_per_step=_seconds_per_step(history.rows, start_step, end))
    by_step = {r["step"]: r for r in history.rows}
    resumed_inside = [s for s in history.resumes if start_step < s < end]
    stretch_bad = any(not _finite(r.get("loss", 0.0)) for r in history.rows if start_step <= r["step"] < end)
    plan.baseline_covered = (all(s in by_step and _finite(by_step[s].get("loss")) for s in eval_steps)
                             and not resumed_inside and not stretch_bad
                             and not any(e.get("event") in NONFINITE_EVENTS and isinstance(e.get("step"), int)
                                         and start_step <= e["step"] < end for e in history.events))
    if resumed_inside:
        plan.notes.append(f"the run was resumed at step {resumed_inside[0]}, inside the stretch: its rows from there "
                          "on may come from other settings than settings.json's, so the baseline is re-run")
    callbacks = [c for c in settings.get("callbacks") or [] if c]
    if callbacks:
        plan.notes.append(f"the run had callbacks ({', '.join(map(str, callbacks))}) that settings.json cannot "
                          "rebuild: the re-runs train without them")
    return plan
