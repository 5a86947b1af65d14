"""What one candidate did, measured from its metric rows, and how outcomes are ranked and compared
(see docs/remedies.md).

The final loss is the mean of the last logged losses of the stretch (the same steps for every
candidate); its noise is the spread of those losses around their linear trend. A candidate beats
the baseline when its final loss is lower by more than twice the standard error of the two means,
and by at least :data:`MIN_GAIN` of the baseline's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from stabletrain.debug.remedies.candidates import Candidate
from stabletrain.utils.text import fmt_number, json_float

__all__ = ["Outcome", "outcome_from_rows", "noise_of_mean", "beats", "rank", "MIN_GAIN", "FINITE", "NONFINITE",
           "ERROR", "summary_signals"]

#: The smallest relative gain over the baseline that counts, whatever the measured noise.
MIN_GAIN = 0.01
FINITE, NONFINITE, ERROR = "finite", "non-finite", "error"
_ORDER = {FINITE: 0, NONFINITE: 1, ERROR: 2}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class Outcome:
    """One candidate's re-run (or, for the baseline, the original run's rows), measured.

    Attributes:
        candidate: What was tried.
        status: ``finite`` (every logged loss of the stretch finite, no non-finite stop), ``non-finite``
            or ``error`` (the re-run could not start or failed: ``error`` says why).
        from_step: The step it started from (the checkpoint's, or 0).
        end_step: The step it ran to (exclusive).
        steps_run: Optimizer steps it ran (0 for the original rows).
        seconds: Wall time of the re-run, setup included (0 for the original rows).
        final_loss: Mean of ``final_losses``; None when not finite.
        final_losses: ``(step, loss)`` of the last logged steps of the stretch that make the final loss.
        noise: Standard error of ``final_loss``: the spread of ``final_losses`` around their linear
            trend over sqrt(n) (None with fewer than 2 of them).
        start_loss: The first logged loss of the re-run (the loss it started from).
        nonfinite_step: The first step whose logged loss was not finite, or where the run stopped non-finite
            (the guard's ``nonfinite_step`` or nancapture's ``nan_detected`` event).
        error: Why the re-run failed (``status == "error"``).
        signals: The ``signals/...`` values (mechanism signals) of the last logged row.
        folder: The scratch folder of the re-run (None for the original rows).
        source: ``re-run`` or ``original rows``.
    """

    candidate: Candidate
    status: str
    from_step: int
    end_step: int
    steps_run: int = 0
    seconds: float = 0.0
    final_loss: Optional[float] = None
    final_losses: list[tuple[int, float]] = field(default_factory=list)
    noise: Optional[float] = None
    start_loss: Optional[float] = None
    nonfinite_step: Optional[int] = None
    error: Optional[str] = None
    signals: dict[str, float] = field(default_factory=dict)
    folder: Optional[Path] = None
    source: str = "re-run"

    @property
    def name(self) -> str:
        return self.candidate.name

    @property
    def trains(self) -> bool:
        """Finite, and its final loss is below the loss it started from."""
        return (self.status == FINITE and self.final_loss is not None and self.start_loss is not None
                and self.final_loss < self.start_loss)

    def result_text(self) -> str:
        """``final loss 2.41`` / ``non-finite at step 48`` / ``error: ...``."""
        if self.status == FINITE:
            text = f"final loss {fmt_number(self.final_loss)}"
            if not self.trains and self.start_loss is not None:
                text += f" (did not train: it started at {fmt_number(self.start_loss)})"
            return text
        if self.status == NONFINITE:
            return f"non-finite at step {self.nonfinite_step}"
        return f"error: {self.error}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate.to_dict(),
            "status": self.status,
            "from_step": self.from_step,
            "end_step": self.end_step,
            "steps_run": self.steps_run,
            "seconds": round(self.seconds, 3),
            "final_loss": None if self.final_loss is None else json_float(self.final_loss),
            "final_losses": [[s, json_float(v)] for s, v in self.final_losses],
            "noise": None if self.noise is None else json_float(self.noise),
            "start_loss": None if self.start_loss is None else json_float(self.start_loss),
            "trains": self.trains,
            "nonfinite_step": self.nonfinite_step,
            "error": self.error,
            "signals": {k: json_float(v) for k, v in self.signals.items()},
            "folder": None if self.folder is None else str(self.folder),
            "source": self.source,
        }


def noise_of_mean(values: Sequence[float]) -> Optional[float]:
    """Standard error of the mean of ``values``: their spread around their least-squares line
    (4 or more values; around their mean with 2 or 3) over sqrt(n). None with fewer than 2."""
    n = len(values)
    if n < 2:
        return None
    if n >= 4:
        xs = range(n)
        mx, my = (n - 1) / 2, sum(values) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sxx
        resid = [y - (my + slope * (x - mx)) for x, y in zip(xs, values)]
        var = sum(r * r for r in resid) / (n - 2)
    else:
        my = sum(values) / n
        var = sum((y - my) ** 2 for y in values) / (n - 1)
    return math.sqrt(var / n)


def summary_signals(row: dict[str, Any]) -> dict[str, float]:
    """The ``signals/...`` values of ``row`` (every key, per module and per group included)."""
    return {k: float(v) for k, v in row.items() if k.startswith("signals/") and isinstance(v, (int, float))}


def outcome_from_rows(candidate: Candidate, rows: Sequence[dict[str, Any]], eval_steps: Sequence[int], *,
                      from_step: int, end_step: int, events: Sequence[dict[str, Any]] = (),
                      steps_run: int = 0, seconds: float = 0.0, error: Optional[str] = None,
                      folder: Optional[Path] = None, source: str = "re-run") -> Outcome:
    """The :class:`Outcome` of a run's ``rows`` (metric rows of metrics.jsonl) over ``[from_step, end_step)``.

    Args:
        eval_steps: The logged steps whose mean loss is the final loss (the same for every candidate).
        events: The run's event rows: a ``nonfinite_step`` or ``nan_detected`` event in the stretch makes
            the outcome non-finite at its step even when no non-finite row was logged.
        error: The re-run failed to start or raised something other than a non-finite stop.
    """
    out = Outcome(candidate, FINITE, from_step, end_step, steps_run=steps_run, seconds=seconds, folder=folder,
                  source=source)
    stretch = [r for r in rows if isinstance(r.get("step"), int) and from_step <= r["step"] < end_step]
    # The loss, not the gradient norm: under fp16 loss scaling a step with Inf gradients is skipped, as expected;
    # a non-finite step the guard stopped at is its nonfinite_step event.
    bad = [r["step"] for r in stretch if "loss" in r and not _finite(r["loss"])]
    bad += [int(e["step"]) for e in events if e.get("event") in ("nonfinite_step", "nan_detected")
            and isinstance(e.get("step"), int) and from_step <= e["step"] < end_step]
    losses = {r["step"]: float(r["loss"]) for r in stretch if _finite(r.get("loss"))}
    if losses:
        out.start_loss = losses[min(losses)]
    measured = [r for r in stretch if _finite(r.get("loss")) and summary_signals(r)]
    if measured:  # a row logged at a stop has no signals (they are measured at the logging cadence)
        out.signals = summary_signals(measured[-1])
    if bad:
        out.status, out.nonfinite_step = NONFINITE, min(bad)
        return out
    if error is not None:
        out.status, out.error = ERROR, error
        return out
    picked = [(s, losses[s]) for s in eval_steps if s in losses]
    if not picked:
        out.status = ERROR
        out.error = (f"no logged loss at the steps compared ({', '.join(map(str, eval_steps))}); "
                     f"logged: {', '.join(str(r['step']) for r in stretch[-5:]) or 'none'}")
        return out
    out.final_losses = picked
    out.final_loss = sum(v for _, v in picked) / len(picked)
    out.noise = noise_of_mean([v for _, v in picked])
    return out


def beats(candidate: Outcome, baseline: Outcome) -> tuple[bool, float, float]:
    """Whether ``candidate`` beats ``baseline`` beyond the noise: ``(beats, gain, threshold)``.

    A non-finite (or failed) baseline is beaten by any candidate that trains (finite, final loss
    below its start); a finite one by a candidate that trains and whose final loss is lower by more
    than the threshold: twice the standard error of the difference of the two means, at least
    :data:`MIN_GAIN` of the baseline's final loss. ``gain`` is baseline minus candidate (inf for a
    non-finite baseline).
    """
    if not candidate.trains or candidate.final_loss is None:
        return False, math.nan, math.nan
    if baseline.status != FINITE or baseline.final_loss is None:
        return True, math.inf, 0.0
    gain = baseline.final_loss - candidate.final_loss
    se = math.sqrt((baseline.noise or 0.0) ** 2 + (candidate.noise or 0.0) ** 2)
    threshold = max(2 * se, MIN_GAIN * abs(baseline.final_loss))
    return gain > threshold, gain, threshold


def rank(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """Finite before non-finite before failed; finite ones by final loss (those that train first),
    non-finite ones by how long they stayed finite."""

    def key(o: Outcome) -> tuple[Any, ...]:
        if o.status == FINITE:
            return (0, not o.trains, o.final_loss if o.final_loss is not None else math.inf)
        if o.status == NONFINITE:
            return (1, False, -(o.nonfinite_step if o.nonfinite_step is not None else -1))
        return (2, False, 0.0)

    return sorted(outcomes, key=key)
