"""The verification loop: each candidate re-run from the plan's start through its stretch, measured,
ranked, within a budget (see docs/remedies.md).

The re-runs themselves are made by a *runner* the caller passes in: the explaining layer does not
import the trainer (:func:`stabletrain.verify_remedies` passes one that calls ``stabletrain.train``).
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from stabletrain.debug.remedies.candidates import AS_RUN, Candidate
from stabletrain.debug.remedies.outcome import ERROR, Outcome, beats, outcome_from_rows, rank
from stabletrain.debug.remedies.plan import Plan
from stabletrain.debug.remedies.report import RemedyReport
from stabletrain.errors import Interrupted

__all__ = ["RunRequest", "RunOutput", "Runner", "StopAfter", "verify", "CONSOLE_FILE"]

#: Each re-run's console, captured, in its folder.
CONSOLE_FILE = "console.txt"


@dataclass
class RunRequest:
    """One re-run for the runner to make.

    Attributes:
        candidate: The candidate (``AS_RUN`` for the baseline).
        out: Its scratch folder (empty; the runner trains into it).
        resume_from: The checkpoint to resume from; None for a fresh start from step 0.
        end_step: Stop after step ``end_step - 1``; the run's ``steps`` stay as they were (the lr
            schedule depends on them), so the runner stops it with :class:`StopAfter` when
            ``end_step`` is below them.
    """

    candidate: Candidate
    out: Path
    resume_from: Optional[Path]
    end_step: int


@dataclass
class RunOutput:
    """What a re-run left: its metric and event rows (read back from its metrics.jsonl), the time it
    took, its console, and the error that ended it when that was not a non-finite stop."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    console: str = ""
    error: Optional[str] = None


Runner = Callable[[RunRequest], RunOutput]


class StopAfter:
    """Trainer callback: stop after step ``end_step - 1`` (the step is logged and checkpointed),
    so that a re-run covers a stretch while the run's ``steps``, and so its lr schedule, stay the same."""

    def __init__(self, end_step: int):
        self.end_step = end_step

    def on_step_start(self, trainer: Any, *, step: int) -> None:
        if step + 1 >= self.end_step:
            trainer.request_stop(f"the verified stretch ends at step {self.end_step - 1}")


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def _scratch_folder(plan: Plan, candidate: Candidate) -> Path:
    """``run/debug/remedies/<slug>``, emptied (only ever below ``run/debug/remedies``)."""
    folder = plan.scratch / candidate.slug
    if plan.scratch.resolve() not in folder.resolve().parents:
        raise ValueError(f"candidate {candidate.name!r}: its folder {folder} is not below {plan.scratch}")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)  # an empty folder takes a new run; console.txt lands here even if it cannot start
    return folder


def _run_one(plan: Plan, candidate: Candidate, runner: Runner) -> Outcome:
    first = candidate.starts_at(plan.start_step)
    folder = _scratch_folder(plan, candidate)
    resume = plan.start_checkpoint if first == plan.start_step else None
    start = time.perf_counter()
    try:
        output = runner(RunRequest(candidate, folder, resume, plan.end_step))
    except Interrupted:  # Ctrl-C or SIGTERM: the verification stops, not only this re-run
        raise
    except Exception as exc:  # the runner's own failure: said in the outcome, the others still run
        output = RunOutput(error=f"{type(exc).__name__}: {exc}")
    seconds = output.seconds or (time.perf_counter() - start)
    if folder.is_dir():
        (folder / CONSOLE_FILE).write_text(output.console, encoding="utf-8")
    ran = [r["step"] for r in output.rows if isinstance(r.get("step"), int) and r["step"] >= first]
    failed = [e["step"] for e in output.events if e.get("event") in ("nonfinite_step", "nan_detected")
              and isinstance(e.get("step"), int)]
    last = max(ran + failed, default=first - 1)
    return outcome_from_rows(candidate, output.rows, plan.eval_steps, from_step=first, end_step=plan.end_step,
                             events=output.events, steps_run=max(0, last + 1 - first), seconds=seconds,
                             error=output.error, folder=folder if folder.is_dir() else None)


def _reproduction_note(plan: Plan, rerun: Outcome) -> Optional[str]:
    """A sentence when the re-run of the run as it was does not repeat the original rows (another
    device, torch version or a setting outside settings.json); None when every common logged loss is equal."""
    original = {r["step"]: r.get("loss") for r in plan.rows if plan.start_step <= r["step"] < plan.end_step}
    folder = rerun.folder
    if folder is None or not (folder / "metrics.jsonl").is_file():
        return None
    from stabletrain.runfiles.history import read_run

    again = {r["step"]: r.get("loss") for r in read_run(folder / "metrics.jsonl").rows}
    differ = [s for s in sorted(set(original) & set(again))
              if not (original[s] == again[s] or (_nan(original[s]) and _nan(again[s])))]
    if not differ:
        return None
    s = differ[0]
    return (f"the re-run of the run as it was does not repeat its logged losses (step {s}: {original[s]} in the run, "
            f"{again[s]} re-run; {len(differ)} of {len(set(original) & set(again))} common steps differ): another "
            "device or torch version, or something settings.json does not hold; every candidate is compared with "
            "the re-run")


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _budget_refusal(planned: int, steps: int, seconds: float, budget_steps: Optional[int],
                    budget_seconds: Optional[float], rate: Optional[float]) -> Optional[str]:
    """Why a candidate of ``planned`` steps does not fit the budget; None when it does."""
    if budget_steps is not None and steps + planned > budget_steps:
        return f"needs {planned} steps, {max(0, budget_steps - steps)} of budget_steps={budget_steps} left"
    if budget_seconds is not None:
        if seconds >= budget_seconds:
            return f"budget_seconds={budget_seconds:g} spent"
        if rate is not None and seconds + planned * rate > budget_seconds:
            return (f"needs about {_seconds(planned * rate)} ({planned} steps at {rate:.3g} s/step), "
                    f"{_seconds(budget_seconds - seconds)} of budget_seconds={budget_seconds:g} left")
    return None


def _stop(plan: Plan, baseline: Outcome, tried: list[Outcome], not_tried: list[tuple[Candidate, str]], label: str,
          exc: BaseException, say: Callable[[str], Any], write: bool) -> None:
    """A signal during a re-run: say so, and keep what the finished re-runs measured (remedies.md/json)."""
    what = getattr(exc, "signal_name", "") or "KeyboardInterrupt"
    say(f"{what} during the re-run of {label}: the verification stops here. The run's own files are untouched"
        + (f"; the {len(tried)} candidate(s) finished so far are in {plan.scratch}" if tried and write else "."))
    if not (tried and write):
        return
    ranked = rank(tried)
    best = next((o for o in ranked if beats(o, baseline)[0]), None)
    RemedyReport(plan=plan, baseline=baseline, ranked=ranked, best=best, not_tried=not_tried,
                 notes=[*plan.notes, f"Stopped by {what} during the re-run of {label}: not every candidate was "
                        "tried."]).write()


def _against(outcome: Outcome, baseline: Outcome) -> str:
    """``, beats as run (-0.41)`` for a candidate that trains; "" otherwise."""
    if not outcome.trains:
        return ""
    ok, gain, _ = beats(outcome, baseline)
    if not math.isfinite(gain):
        return ""
    return f", {'beats' if ok else 'does not beat'} as run ({'-' if gain > 0 else '+'}{abs(gain):.3g})"


#: How many lrs below the candidates' lowest the verification tries at most (x0.3 each).
MAX_LOWER_LRS = 2
LR = "model_args.lr"
_LOWER_WHY = "the lowest lr tried ({:g}) trained best of the lrs: the next one down (x0.3) may train better still"


def lower_lr(tried: Sequence[Outcome], names: set[str]) -> Optional[Candidate]:
    """When the best of the lr candidates that trained is the lowest lr tried (a lower one may be
    better still), the next one down: its lr x0.3 (:func:`verify` adds at most ``MAX_LOWER_LRS``).
    None otherwise: the lr candidates bracket the best."""
    lrs = [o for o in tried if set(o.candidate.overrides) == {LR} and o.trains]
    if not lrs:
        return None
    best = min(lrs, key=lambda o: math.inf if o.final_loss is None else o.final_loss)
    lr = float(best.candidate.overrides[LR])
    if lr != min(float(o.candidate.overrides[LR]) for o in lrs):
        return None
    nxt = float(f"{lr * 0.3:.3g}")
    name = f"{LR}={nxt:g}"
    if name in names:
        return None
    return replace(best.candidate, name=name, overrides={LR: nxt}, why=_LOWER_WHY.format(lr))


def verify(plan: Plan, candidates: Sequence[Candidate], runner: Runner, *, budget_steps: Optional[int] = None,
           budget_seconds: Optional[float] = None, progress: Optional[Callable[[str], Any]] = print,
           notes: Sequence[str] = (), command_for: Optional[Callable[[Outcome], Optional[str]]] = None,
           write: bool = True) -> RemedyReport:
    """Re-run the baseline (when the original rows do not cover the stretch) and each candidate, in
    order, within the budget; rank them and pick the best that beats the baseline beyond the noise.

    Args:
        plan: Where to start and end (:func:`~stabletrain.debug.remedies.plan.make_plan`).
        candidates: In the order to try them.
        runner: Makes one re-run (:class:`RunRequest` -> :class:`RunOutput`).
        budget_steps: Most optimizer steps in all; a candidate that does not fit is not tried.
        budget_seconds: Most wall time in all; a candidate is not tried when the time left is spent,
            or when its steps at the step time measured so far (at first: the run's own) would not fit.
        progress: Called with one line per candidate (default ``print``); None for silence.
        notes: Added to the report's notes.
        command_for: The command that applies a candidate's outcome to the run, for the report.
        write: Write ``remedies.md`` and ``remedies.json`` into ``run/debug/remedies/``.
    """
    say = progress or (lambda line: None)
    names = [c.name for c in candidates]
    duplicate = next((n for n in names if names.count(n) > 1 or n == AS_RUN.name), None)
    if duplicate is not None:
        raise ValueError(f"candidates: {duplicate!r} is given twice or is the baseline's name; give each a "
                         "distinct name")
    baseline = outcome_from_rows(AS_RUN, plan.rows, plan.eval_steps, from_step=plan.start_step,
                                 end_step=plan.end_step, events=plan.events, source="original rows")
    queue: list[Candidate] = ([] if plan.baseline_covered else [AS_RUN]) + list(candidates)
    budget = [f"budget_steps={budget_steps}" if budget_steps is not None else "",
              f"budget_seconds={budget_seconds:g}" if budget_seconds is not None else ""]
    budget_text = ", ".join(b for b in budget if b)
    say(f"Verifying {len(candidates)} candidate{'s' if len(candidates) != 1 else ''} from {plan.start_text} through "
        f"step {plan.end_step - 1}" + ("" if plan.baseline_covered else ", after re-running the run as it was")
        + (f" ({budget_text})" if budget_text else "") + f"; scratch runs in {plan.scratch}")
    tried: list[Outcome] = []
    not_tried: list[tuple[Candidate, str]] = []
    extra_notes: list[str] = []
    steps, seconds = 0, 0.0
    i, lowered = 0, 0
    while i < len(queue):
        candidate = queue[i]
        i += 1
        first = candidate.starts_at(plan.start_step)
        planned = plan.end_step - first
        rate = seconds / steps if steps else plan.seconds_per_step
        refusal = _budget_refusal(planned, steps, seconds, budget_steps, budget_seconds, rate)
        label = candidate.name + (" (from step 0)" if first != plan.start_step else "")
        if refusal is not None:
            not_tried.append((candidate, refusal))
            say(f"[{i}/{len(queue)}] {label}: not tried ({refusal})")
            continue
        try:
            outcome = _run_one(plan, candidate, runner)
        except (Interrupted, KeyboardInterrupt) as exc:
            _stop(plan, baseline, tried, not_tried, label, exc, say, write)
            raise
        steps += outcome.steps_run
        seconds += outcome.seconds
        if candidate is AS_RUN:
            if outcome.status == ERROR and outcome.error and baseline.status != ERROR:
                outcome.error += f"; the original rows are used instead ({baseline.result_text()})"
            else:
                reproduced = _reproduction_note(plan, outcome)
                if reproduced:
                    extra_notes.append(reproduced)
                baseline = outcome
        else:
            tried.append(outcome)
        what = outcome.result_text() + ("" if candidate is AS_RUN else _against(outcome, baseline))
        say(f"[{i}/{len(queue)}] {label}: {outcome.steps_run} steps, {what} ({_seconds(outcome.seconds)})")
        if i == len(queue) and lowered < MAX_LOWER_LRS:
            lower = lower_lr(tried, {c.name for c in queue})
            if lower is not None:
                queue.append(lower)
                lowered += 1
                say(f"Added {lower.name}: {lower.why}")
    ranked = rank(tried)
    best = next((o for o in ranked if beats(o, baseline)[0]), None)
    report = RemedyReport(plan=plan, baseline=baseline, ranked=ranked, best=best, not_tried=not_tried,
                          notes=[*plan.notes, *extra_notes, *notes], steps=steps, seconds=seconds)
    if command_for is not None:
        for o in ranked:
            if o.trains:
                line = command_for(o)
                if line:
                    report.commands[o.name] = line
    say(report.cost_text())
    if write:
        report.write()
    return report
