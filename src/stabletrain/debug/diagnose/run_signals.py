"""What a run's logged signals say before, or instead of, a NaN capture: the mechanisms named by
:mod:`stabletrain.debug.mechanisms.rules`. :func:`mechanisms_before` feeds a capture's diagnosis ("why the values
got there"); :func:`diagnose_run` diagnoses a run that never went non-finite (a silent instability). See
``docs/diagnose.md`` and ``docs/mechanisms.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from stabletrain.debug.mechanisms.rules import (
    Mechanism,
    RuleContext,
    causes,
    mechanisms_of_run,
    published_fixes,
    starts_over,
)
from stabletrain.debug.remedies.record import UNVERIFIED, current_record
from stabletrain.utils.io import atomic_write_text
from stabletrain.utils.text import fmt_number

FILE_MD = "diagnosis.md"
FILE_JSON = "diagnosis.json"


def _read(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The run's current timeline of logged rows and its settings (empty when missing)."""
    rows, settings, _ = _read_history(out)
    return rows, settings


def _read_history(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any], Any]:
    """:func:`_read`, and the run's history (resumes, the events of the timelines they replaced), or None."""
    from stabletrain.runfiles.history import read_run

    rows: list[dict[str, Any]] = []
    history = None
    if (out / "metrics.jsonl").is_file():
        history = read_run(out / "metrics.jsonl")
        rows = history.rows
    try:
        settings = json.loads((out / "settings.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        settings = {}
    return rows, settings if isinstance(settings, dict) else {}, history


def is_run_without_capture(path: Path) -> bool:
    """A run folder (it has metrics.jsonl) in which no NaN capture was written (debug/nan_capture/,
    debug/recoveries/)."""
    if not path.is_dir() or not (path / "metrics.jsonl").is_file():
        return False
    debug = path / "debug"
    return not (debug.is_dir() and any(debug.rglob("nan_capture.pt")))


def mechanisms_before(out: Optional[Path], step: int) -> list[Mechanism]:
    """The mechanisms named in the run's signals that began at or before ``step`` (none without a run folder)."""
    if out is None:
        return []
    rows, settings = _read(out)
    return [m for m in mechanisms_of_run([r for r in rows if r["step"] <= step], settings) if m.start_step <= step]


def mechanism_lines(mechanisms: list[Mechanism]) -> list[str]:
    """The diagnosis' section on the mechanisms that came before the failure."""
    if not mechanisms:
        return []
    lines = ["## Before it failed: mechanisms in the logged signals", ""]
    lines += [f"- {m.describe()}." for m in mechanisms]
    first = causes(mechanisms)
    if first:
        lines += ["", f"The first, {first[0].name}, is why the values grew; the op above is where they ended "
                  "(docs/mechanisms.md)."]
    return lines


def mechanism_cause(mechanisms: list[Mechanism], ending: str) -> Optional[str]:
    """The probable cause when a mechanism came first: the mechanism, then where it ended."""
    first = causes(mechanisms)
    if not first:
        return None
    m = first[0]
    where = f" in {m.where}" if m.where else ""
    return (f"{m.name}{where} from step {m.start_step} (named in the logged signals at step {m.detected_step}); "
            f"the failure is where it ended: {ending}")


@dataclass
class RunDiagnosis:
    """The diagnosis of a run folder without a NaN capture: the mechanisms its signals show.

    Attributes:
        out: The run folder.
        steps: The first and last logged steps.
        mechanisms: Every mechanism named (:class:`~stabletrain.debug.mechanisms.rules.Mechanism`).
        loss: ``{"first", "at_start", "last", "lowest"}`` of the logged loss (``at_start``: at the first
            mechanism's start step).
        checkpoint: The newest healthy checkpoint (a path), None when none is.
        checkpoint_why: Why it is healthy, or why none is.
        next_actions: What to change, each marked verified or not.
        files: The diagnosis.md and diagnosis.json written.
    """

    out: str
    steps: tuple[int, int]
    mechanisms: list[Mechanism]
    loss: dict[str, float]
    checkpoint: Optional[str]
    checkpoint_why: str
    next_actions: list[str]
    files: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        first = causes(self.mechanisms)
        if not first:
            before = next((m for m in self.mechanisms if m.settled and not m.follows), None)
            if before is not None:  # the report's verdict names it too
                return (f"{before.name}{' in ' + before.where if before.where else ''}, named {before.settled}; "
                        "none named in the logged signals since")
            return "no mechanism named in the logged signals"
        m = first[0]
        return f"{m.name}{' in ' + m.where if m.where else ''} (a silent instability: the run never went non-finite)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.out, "verdict": self.verdict, "steps": list(self.steps),
            "mechanisms": [m.to_event() for m in self.mechanisms],
            "loss": {k: (v if math.isfinite(v) else str(v)) for k, v in self.loss.items()},
            "checkpoint": self.checkpoint, "checkpoint_why": self.checkpoint_why,
            "next_actions": self.next_actions, "files": self.files,
        }

    def to_markdown(self) -> str:
        lines = [f"# Diagnosis of the run {self.out}", "", f"**Verdict: {self.verdict}**.", "",
                 "## What happened", "", self._what_happened()]
        if self.mechanisms:
            lines += ["", "## Mechanisms in the logged signals", ""]
            lines += [f"- {m.describe()}." for m in self.mechanisms]
        lines += ["", "## Where to go back to", "", self.checkpoint_why]
        if self.next_actions:
            lines += ["", "## Next actions", ""]
            lines += [f"{i}. {a}" for i, a in enumerate(self.next_actions, start=1)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()

    def _what_happened(self) -> str:
        lo, hi = self.steps
        loss = self.loss
        text = (f"No NaN capture: the run logged steps {lo}-{hi} and its loss stayed finite "
                f"({_f(loss['first'])} at step {lo}, {_f(loss['last'])} at step {hi}, lowest {_f(loss['lowest'])}).")
        first = causes(self.mechanisms)
        if not first and self.mechanisms:
            return text + (" No rule of docs/mechanisms.md holds on the signals of its current timeline; what a "
                           "timeline that a resume replaced named is below.")
        if not first:
            return text + " No rule of docs/mechanisms.md held on its signals: nothing silent to name."
        m = first[0]
        at = loss.get("at_start", math.nan)
        return (text + f" Its signals show {m.name} from step {m.start_step}"
                + (f", when the loss was {_f(at)}" if math.isfinite(at) else "")
                + f"; the loss ended at {_f(loss['last'])}.")


def _f(x: float) -> str:
    return fmt_number(x) if math.isfinite(x) else str(x)


def diagnose_run(out: str | Path, *, write: bool = True, verified: bool = True) -> RunDiagnosis:
    """Name the mechanisms in a run's logged signals, the checkpoint to go back to, and the published fixes
    (not verified: said so).

    Args:
        out: A run folder (``metrics.jsonl``, ``settings.json``, ``checkpoints/``).
        write: Write ``diagnosis.md`` and ``diagnosis.json`` into ``out/debug/``.
        verified: Quote the run's last verification of remedies while its metrics.jsonl is unchanged since
            (``diagnose`` or ``report --verify``): the verified remedy first, the fixes marked tried or not.

    Example::

        d = stabletrain.diagnose("out/quiet_run")      # a run folder without a NaN capture
        print(d.verdict, [m.name for m in d.mechanisms])
    """
    from stabletrain.runfiles.checkpoint import list_checkpoints, newest_healthy

    out = Path(out)
    rows, settings, history = _read_history(out)
    # As the report: what a timeline that a resume replaced named is told too, settled.
    mechanisms = (mechanisms_of_run(rows, settings, history.abandoned_events, history.resumes) if history is not None
                  else mechanisms_of_run(rows, settings))
    losses = [(r["step"], float(r["loss"])) for r in rows if isinstance(r.get("loss"), (int, float))]
    finite = [v for _, v in losses if math.isfinite(v)]
    loss = {"first": losses[0][1] if losses else math.nan, "last": losses[-1][1] if losses else math.nan,
            "lowest": min(finite) if finite else math.nan}
    first = causes(mechanisms)
    if first:
        at = [v for s, v in losses if s <= first[0].start_step]
        loss["at_start"] = at[-1] if at else math.nan
    best = newest_healthy(out / "checkpoints")
    if best is not None:
        checkpoint: Optional[str] = str(best.path)
        why = f"The newest healthy checkpoint is {best.path} (step {best.step}: {best.why})."
    else:
        checkpoint = None
        n = len(list_checkpoints(out / "checkpoints"))
        why = (f"None of the run's {n} checkpoints is healthy: a fix starts over from step 0." if n
               else "The run wrote no checkpoint: a fix starts over from step 0.")
    actions = _actions(first, RuleContext.from_settings(settings), checkpoint)
    record = current_record(out) if verified else None
    if record is not None:
        actions = record.next_actions(actions)
    steps = (rows[0]["step"], rows[-1]["step"]) if rows else (0, 0)
    diag = RunDiagnosis(str(out), steps, mechanisms, loss, checkpoint, why, actions)
    if write and rows:
        folder = out / "debug"
        diag.files = [str(folder / FILE_MD), str(folder / FILE_JSON)]
        atomic_write_text(diag.to_markdown() + "\n", folder / FILE_MD)
        atomic_write_text(json.dumps(diag.to_dict(), indent=2) + "\n", folder / FILE_JSON)
    return diag


def _actions(first: list[Mechanism], context: RuleContext, checkpoint: Optional[str]) -> list[str]:
    actions = []
    start = f"resume_from={checkpoint}" if checkpoint else "a new run (overwrite=true): no healthy checkpoint"
    for m in first:
        fixes = [f if starts_over(f) else f"{f}, from {start}" for f in published_fixes(m.id, context)]
        if fixes:
            actions.append(f"{m.name}: " + "; or ".join(fixes) + f" (the published fix, {m.info.reference}; "
                           f"{UNVERIFIED})")
    return actions
