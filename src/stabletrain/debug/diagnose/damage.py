"""Which earlier event made the weights non-finite, when they already were at the start of the captured step.

Read from the run's own record (``metrics.jsonl``, as one timeline across resumes): the guard's
``nonfinite_step`` event when it has one (it says whether the gradients or the optimizer step went
non-finite), else the logged rows, which bound the step. See ``docs/diagnose.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from stabletrain.utils.text import fmt_list, fmt_number


@dataclass
class Damage:
    """The earlier event, as far as the record shows it.

    Attributes:
        step: The step whose update made the weights non-finite, when the record names it.
        last_finite: The last logged step before it whose loss and gradient norm were finite.
        first_nonfinite: The first logged step whose loss or gradient norm was not.
        text: One sentence, with the evidence.
    """

    step: Optional[int]
    last_finite: Optional[int]
    first_nonfinite: Optional[int]
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "last_finite": self.last_finite, "first_nonfinite": self.first_nonfinite,
                "text": self.text}


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _guard_event(events: list[dict[str, Any]], step: int) -> Optional[Damage]:
    """The guard's record of a non-finite step before ``step`` (a run with ``guard.enabled=false`` has none)."""
    for ev in events:
        k = ev.get("step")
        if ev.get("event") != "nonfinite_step" or not isinstance(k, int) or k >= step:
            continue
        params = fmt_list(list(ev.get("param_names") or []), 3)
        if ev.get("origin") == "optimizer":
            text = (f"the optimizer step of step {k} wrote NaN/Inf into {params} from finite gradients "
                    "(the guard's record in metrics.jsonl)")
        else:
            what = " and ".join(ev.get("nonfinite") or []) or "values"
            text = f"step {k} had a non-finite {what} (the guard's record in metrics.jsonl)"
        return Damage(step=k, last_finite=None, first_nonfinite=k, text=text)
    return None


def _from_rows(rows: list[dict[str, Any]], step: int) -> Optional[Damage]:
    """Bound the step with the logged rows before ``step``."""
    before = [r for r in rows if isinstance(r.get("step"), int) and r["step"] < step and "loss" in r]
    if not before:
        return None
    first_bad = next((r for r in before if not (_finite(r.get("loss")) and _finite(r.get("gradient_norm", 0.0)))),
                     None)
    limit = first_bad["step"] if first_bad is not None else step
    good = [r for r in before if r["step"] < limit and _finite(r.get("loss")) and _finite(r.get("gradient_norm", 0.0))]
    last = good[-1] if good else None
    seen = (f"loss {fmt_number(last['loss'])} and gradient norm {fmt_number(last.get('gradient_norm'))} "
            f"were finite at step {last['step']}") if last else "no logged step had a finite loss and gradient norm"
    if first_bad is not None:
        bad = [k for k in ("loss", "gradient_norm") if not _finite(first_bad.get(k, 0.0))]
        text = (f"the logged history: {seen}, the {' and '.join(bad).replace('_', ' ')} non-finite at step "
                f"{first_bad['step']}")
        if bad == ["gradient_norm"]:
            # Non-finite gradients with a finite loss: that step's update carried them into the weights.
            return Damage(step=first_bad["step"], last_finite=last["step"] if last else None,
                          first_nonfinite=first_bad["step"],
                          text=text + f": the update of step {first_bad['step']} applied non-finite gradients")
        return Damage(step=None, last_finite=last["step"] if last else None, first_nonfinite=first_bad["step"],
                      text=text)
    if last is None:
        return None
    if last["step"] == step - 1:
        return Damage(step=last["step"], last_finite=last["step"], first_nonfinite=None,
                      text=(f"the logged history: {seen}, the step just before this one, so step {last['step']}'s "
                            "optimizer step, or code run after it, made them non-finite"))
    return Damage(step=None, last_finite=last["step"], first_nonfinite=None,
                  text=(f"the logged history: {seen}, the last step logged before this one; the damage happened "
                        f"in steps {last['step']} to {step - 1} (log_every_num_steps=1 narrows it to one step)"))


def earlier_damage(out: Optional[Path], step: int) -> Optional[Damage]:
    """Which earlier event made the weights non-finite before ``step``, from ``out/metrics.jsonl``
    (None when the run folder or its record is missing, or shows nothing before ``step``)."""
    path = out / "metrics.jsonl" if out is not None else None
    if path is None or not path.is_file():
        return None
    from stabletrain.runfiles.history import read_run

    try:
        history = read_run(path)
    except OSError:
        return None
    return _guard_event(history.events, step) or _from_rows(history.rows, step)
