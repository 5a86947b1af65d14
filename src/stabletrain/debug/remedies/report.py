"""The :class:`RemedyReport`: the candidates ranked by measured outcome, the best verified one and
its command, what was not tried, and what the verification cost (see docs/remedies.md)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from stabletrain.debug.remedies.candidates import Candidate
from stabletrain.debug.remedies.outcome import FINITE, Outcome, beats
from stabletrain.debug.remedies.plan import Plan
from stabletrain.debug.remedies.record import METRICS_DIGEST, UNVERIFIED, label_suggestion, metrics_digest
from stabletrain.utils.io import atomic_write_text
from stabletrain.utils.text import fmt_number, json_float

__all__ = ["RemedyReport", "FILE_JSON", "FILE_MD", "SIGNAL_COLUMNS", "UNVERIFIED", "label_suggestion"]

FILE_JSON = "remedies.json"
FILE_MD = "remedies.md"

#: The signals shown in the report's table of signals at the end (the lead's rules read them all, in the JSON).
SIGNAL_COLUMNS = {
    "signals/attn_logit_max": "max attn logit",
    "signals/attn_entropy_min": "min attn entropy",
    "signals/output_logsumexp": "output logsumexp",
    "signals/update_rms_max": "max update rms",
    "signals/adam_eps_fraction": "adam eps fraction",
}


@dataclass
class RemedyReport:
    """What :func:`stabletrain.verify_remedies` measured. ``str(report)`` is one line; ``to_markdown()``
    the ranked table (also in ``remedies.md``), ``to_dict()`` the same for machines (``remedies.json``).

    Attributes:
        plan: The stretch verified and where it starts (:class:`~stabletrain.debug.remedies.plan.Plan`).
        baseline: The run as it was ("as run"): its original rows when they cover the stretch, else a re-run.
        ranked: Every candidate tried, best first (finite before non-finite, then by final loss).
        best: The best candidate that beats the baseline beyond the noise; None when none does.
        not_tried: ``(candidate, why)`` for the candidates the budget left out.
        notes: What is not a candidate and why, and what the user should know about the re-runs.
        commands: Candidate name -> the command that applies it to the run (resume from the start checkpoint,
            or a new run from step 0).
        steps: Optimizer steps run in all (baseline re-run included).
        seconds: Wall time of all re-runs.
        files: remedies.md and remedies.json, once written.
    """

    plan: Plan
    baseline: Outcome
    ranked: list[Outcome]
    best: Optional[Outcome]
    not_tried: list[tuple[Candidate, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    seconds: float = 0.0
    files: list[Path] = field(default_factory=list)

    # ------------------------------------------------------------------------ the numbers

    @property
    def run(self) -> Path:
        return self.plan.run

    @property
    def verified(self) -> bool:
        return self.best is not None

    def compared(self, outcome: Outcome) -> tuple[bool, float, float]:
        """``(beats, gain, threshold)`` of ``outcome`` against the baseline (:func:`~.outcome.beats`)."""
        return beats(outcome, self.baseline)

    def stretch_text(self) -> str:
        return f"steps {self.plan.start_step}-{self.plan.end_step - 1}"

    def eval_text(self) -> str:
        s = self.plan.eval_steps
        which = f"step {s[0]}" if len(s) == 1 else f"steps {', '.join(map(str, s))}"
        return f"the mean of the logged losses at {which}"

    def baseline_text(self) -> str:
        """``2.93 as run`` / ``as run: non-finite at step 48``."""
        b = self.baseline
        if b.status == FINITE:
            return f"{fmt_number(b.final_loss)} as run"
        if b.status == "non-finite":
            return f"non-finite at step {b.nonfinite_step} as run"
        return f"as run: {b.error}"

    def cost_text(self) -> str:
        """``verification cost: 252 steps = 8.7x the original run's 29 steps from step 20, 31 s (...)``."""
        original = self.plan.original_steps()
        ratio = (f" = {self.steps / original:.3g}x the original run's {original} steps from step "
                 f"{self.plan.start_step}") if original else ""
        text = f"verification cost: {self.steps} steps{ratio}, {self.seconds:.3g} s"
        sps = self.plan.seconds_per_step
        if sps and original:
            took = original * sps
            text += (f" ({self.seconds / took:.3g}x the {took:.3g} s the run took for them at its logged step rate; "
                     "setup and checkpoint loading of each re-run included)")
        return text

    def verdict_text(self, outcome: Outcome) -> str:
        """``verified: final loss 2.31 vs 2.93 as run, steps 20-61 from step_000020.ckpt``."""
        where = f"{self.stretch_text()} from " + (self.plan.start_checkpoint.name if self.plan.start_checkpoint
                                                   else "step 0")
        if outcome.from_step != self.plan.start_step:
            where = f"from step 0 (a new run) through step {outcome.end_step - 1}; compared at {self.eval_text()}"
        b = self.baseline
        if b.status == FINITE:
            vs = f"vs {fmt_number(b.final_loss)} as run"
        else:
            vs = f"where the run as it was went non-finite at step {b.nonfinite_step}" if b.status == "non-finite" \
                else "(the run as it was could not be re-run)"
        return f"final loss {fmt_number(outcome.final_loss)} {vs}, {where}"

    def next_action(self, command: bool = True) -> str:
        """The first next action: the best verified remedy with its numbers (and, with ``command``, the
        command that applies it), or why there is none."""
        if self.best is None:
            return self.no_remedy_text()
        best = self.best
        verb = "Resume with" if best.from_step > 0 else "Start again with"
        text = f"{verb} {best.name} (verified: {self.verdict_text(best)})"
        line = self.commands.get(best.name)
        return f"{text}: {line}" if command and line else text

    def next_actions(self, others: Sequence[str] = ()) -> list[str]:
        """The next actions to print: the verified remedy (or why there is none) first, then ``others``
        (suggestions of diagnose or the report, which were not verified), each labelled so; a command that
        replays a capture is not a suggestion and keeps its words."""
        return [self.next_action(), *(self._labelled(a) for a in others)]

    def _labelled(self, action: str) -> str:
        return label_suggestion(action, self.measured())

    def measured(self) -> list[tuple[str, str, bool]]:
        """``(candidate, result, is the verified remedy)`` of every candidate tried."""
        return [(o.name, o.result_text(), o is self.best) for o in self.ranked]

    def no_remedy_text(self) -> str:
        tried = len(self.ranked)
        if not tried:
            why = "no candidate was tried" + (" (the budget left none)" if self.not_tried else "")
            return f"No verified remedy: {why}."
        b = self.baseline
        top = self.ranked[0]
        if all(o.status == "error" for o in self.ranked):
            where = f"; its console: {top.folder / 'console.txt'}" if top.folder else ""
            return (f"No verified remedy: none of the {tried} candidates tried could be re-run (the first: "
                    f"{top.error}{where}).")
        if b.status != FINITE:
            return (f"No verified remedy: none of the {tried} candidates tried stayed finite and trained through "
                    f"{self.stretch_text()} (the best, {top.name}: {top.result_text()}).")
        _, gain, threshold = self.compared(top)
        margin = f"by more than the noise (±{fmt_number(threshold)})"
        best_text = f"the best, {top.name}, reached {top.result_text().replace('final loss ', '')}"
        return (f"No verified remedy: none of the {tried} candidates tried beat the run as it was (final loss "
                f"{fmt_number(b.final_loss)}) {margin}; {best_text}.")

    # ------------------------------------------------------------------------ rendering

    def __str__(self) -> str:
        return self.next_action(command=False)

    def to_dict(self) -> dict[str, Any]:
        def compared(o: Outcome) -> dict[str, Any]:
            ok, gain, threshold = self.compared(o)
            return {**o.to_dict(), "beats_as_run": ok,
                    "gain": None if math.isnan(gain) else json_float(gain),
                    "threshold": None if math.isnan(threshold) else json_float(threshold),
                    "command": self.commands.get(o.name), "result": o.result_text()}

        return {
            "run": str(self.run),
            "plan": self.plan.to_dict(),
            "baseline": self.baseline.to_dict(),
            "ranked": [compared(o) for o in self.ranked],
            "best": None if self.best is None else self.best.name,
            "next_action": self.next_action(),
            "not_tried": [{"candidate": c.to_dict(), "why": why} for c, why in self.not_tried],
            "notes": self.notes,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "original_steps": self.plan.original_steps(),
            "cost": self.cost_text(),
            "files": [str(f) for f in self.files],
            # What the run's later messages check before they quote this verification (record.py).
            METRICS_DIGEST: metrics_digest(self.run),
        }

    def to_markdown(self) -> str:
        p = self.plan
        lines = [f"# Verified remedies: {p.run}", ""]
        lines.append(f"From {p.start_text}: {p.start_why}. Every candidate re-ran the run's own settings with one "
                     f"change, in the run's data order, through {self.stretch_text()}"
                     + (f" (the failing stretch to step {p.until_step} and {p.end_step - p.until_step} steps past it)"
                        if p.end_step > p.until_step else "")
                     + f"; final loss: {self.eval_text()}.")
        lines += [""]
        lines += self._headline()
        lines.append("| rank | candidate | from step | result | vs as run | steps | seconds |")
        lines.append("|---|---|---|---|---|---|---|")
        for i, o in enumerate(self.ranked, 1):
            lines.append(f"| {i} | {o.name} | {o.from_step} | {o.result_text()} | {self._versus(o)} | {o.steps_run} | "
                         f"{o.seconds:.3g} |")
        b = self.baseline
        where = "original rows" if b.source != "re-run" else "re-run"
        lines.append(f"| - | as run ({where}) | {b.from_step} | {b.result_text()} | - | {b.steps_run} | "
                     f"{b.seconds:.3g} |")
        signals = self._signal_table()
        if signals:
            lines += ["", "Signals at the last logged step of each:", "", *signals]
        if self.not_tried:
            lines += ["", "Not tried (budget): " + "; ".join(f"{c.name} ({why})" for c, why in self.not_tried) + "."]
        if self.notes:
            lines += ["", *(f"- {n}" for n in self.notes)]
        lines += ["", self.cost_text() + "."]
        return "\n".join(lines)

    def _headline(self) -> list[str]:
        """The verified remedy in bold with its command below (or why there is none)."""
        if self.best is None:
            return [f"**{self.no_remedy_text()}**", ""]
        lines = [f"**{self.next_action(command=False)}**", ""]
        command = self.commands.get(self.best.name)
        if command:
            lines += ["    " + command, ""]
        return lines

    def _versus(self, o: Outcome) -> str:
        """The table's comparison with the baseline: the difference and whether it is beyond the noise."""
        if not o.trains:
            return "-"
        ok, gain, threshold = self.compared(o)
        if math.isinf(gain):
            return "finite where as run is not"
        diff = f"{'-' if gain > 0 else '+'}{fmt_number(abs(gain))}"
        if ok:
            return f"{diff}: better beyond the noise (±{fmt_number(threshold)})"
        if -gain > threshold:
            return f"{diff}: worse beyond the noise (±{fmt_number(threshold)})"
        return f"{diff}: within the noise (±{fmt_number(threshold)})"

    def _signal_table(self) -> list[str]:
        outcomes = [*self.ranked, self.baseline]
        keys = [k for k in SIGNAL_COLUMNS if any(k in o.signals for o in outcomes)]
        if not keys:
            return []
        rows = ["| candidate | " + " | ".join(SIGNAL_COLUMNS[k] for k in keys) + " |",
                "|---|" + "---|" * len(keys)]
        for o in outcomes:
            rows.append(f"| {o.name} | " + " | ".join(fmt_number(o.signals.get(k)) for k in keys) + " |")
        return rows

    def write(self, folder: Optional[Path] = None) -> list[Path]:
        """Write ``remedies.md`` and ``remedies.json`` (default: ``run/debug/remedies/``)."""
        folder = Path(folder) if folder is not None else self.plan.scratch
        md, js = folder / FILE_MD, folder / FILE_JSON
        self.files = [md, js]
        atomic_write_text(self.to_markdown() + "\n", md)
        atomic_write_text(json.dumps(self.to_dict(), indent=2) + "\n", js)
        return self.files
