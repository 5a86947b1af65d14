"""The words a self-healing run ends with at ``on_instability.max_recoveries``.

Like every other stop it names the cause found, the newest healthy checkpoint and a command that
does not repeat the failure unchanged. The cause comes from the recoveries' evidence:

* **data**: the last recovery's samples were isolated (their inputs hold NaN/Inf, or they alone
  make the loss non-finite) and quarantined; a resume skips them (``quarantine.json``);
* **the update size**: recoveries that no sample explains. Non-finite steps and spikes that the
  data does not explain come from the state the updates made: the lr is too high for this
  optimizer. The advice follows the optimizer: SGD's update is ``lr * gradient``, so clipping
  bounds it too; Adam's is about ``lr`` in size whatever the gradient, so clipping does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from stabletrain.debug import advice
from stabletrain.safety.quarantine import QUARANTINE_FILE
from stabletrain.safety.stop_messages import logged_rows, resume_advice, run_optimizer
from stabletrain.utils.text import shell_path

__all__ = ["recovery_limit_message", "update_size_advice"]

#: Recoveries in a row (each at most 2 steps after the one before; after a rollback, at or below it)
#: that show the state, not a batch, is bad: a bad batch makes one bad step, not a run of them.
_STREAK = 3


def _streak(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trailing recoveries that no sample explains and that came one after another."""
    out: list[dict[str, Any]] = []
    for r in reversed(rows):
        if r.get("culprits") or (out and out[0]["step"] > r["step"] + 2):  # a rollback goes back: lower is near
            break
        out.insert(0, r)
    return out


def update_size_advice(optimizer: Any, lr_text: str, clip_val: float) -> str:
    """How to make the updates smaller with this optimizer (``lr_text``: the lower-lr advice)."""
    name = type(optimizer).__name__
    if "adam" in name.lower():
        return (f"lower the learning rate: {lr_text}. {name}'s update is about lr in size whatever the gradient, "
                "so clipping gradients does not bound it")
    if name == "SGD":
        clip = "" if clip_val else ("; clipping (gradient_clip_val=1.0) also bounds it, since SGD's update is "
                                    "lr x gradient")
        return f"lower the learning rate: {lr_text}{clip}"
    return f"lower the learning rate of {name}: {lr_text}"


def recovery_limit_message(healer: Any, rec: Any, row: dict[str, Any], capture: Optional[Path],
                           verdicts: dict[int, str]) -> str:
    """The RecoveryLimitError's message: what stopped, the cause found, where to continue, next steps."""
    t = healer.trainer
    s = t.settings
    limit = healer.args.max_recoveries
    rows = healer.recoveries
    lines = [f"Step {rec.step}: {rec.description}, after {limit} recoveries (on_instability.max_recoveries): "
             f"stopping" + (f"; capture: {capture}" if capture is not None else "") + "."]
    unexplained = [r for r in rows if not r.get("culprits")]
    quarantined = sorted(healer.quarantine.entries)
    if row.get("culprits"):
        ev = "; ".join(f"{e['index']}: {e['evidence']}" for e in healer.quarantine.state_dict()
                       if e["index"] in row["culprits"])
        lines.append(f"Cause: bad data. The samples of step {rec.step} were isolated ({ev}) and are quarantined "
                     f"in {t.out / QUARANTINE_FILE} with the {len(quarantined)} found before: a resume skips them.")
        text, _, _ = resume_advice(t, rec.step)
        lines.append(text)
    else:
        streak = _streak(rows)
        first = streak[0]["step"] if streak else min(r["step"] for r in unexplained)
        triggers = ", ".join(sorted({r["trigger"] for r in streak or unexplained}))
        logged = logged_rows(t)
        optimizer = run_optimizer(t)
        lr, why = advice.anchored_lr(s.model_args.lr, logged, first, optimizer=optimizer)
        lower = {"model_args.lr": lr} if lr < s.model_args.lr else None
        note = (f"It carries model_args.lr={advice.setting_value(lr)} instead of "
                f"{advice.setting_value(s.model_args.lr)} ({why}): unchanged, the same settings from the same state "
                "fail the same way." if lower else "")
        if len(streak) >= _STREAK:
            act = "rolling back" if healer.policy == "rollback" else "skipping"
            lines.append(f"Cause: the updates, not the data: the last {len(streak)} recoveries ({triggers}) came one "
                         f"after another from step {first} on, on different batches, and no sample explains them: "
                         f"{act} did not get past them, so the state the updates made is bad at this learning rate.")
        else:
            lines.append(f"Cause not found: {len(unexplained)} of the {len(rows)} recoveries ({triggers}) are steps "
                         "apart and no sample was isolated for them (non-finite steps are searched sample by sample; "
                         "spikes with finite values are not). Look at the newest capture: stabletrain diagnose "
                         f"{shell_path(capture.parent) if capture is not None else t.out}")
        text, _, _ = resume_advice(t, first, extra=lower, note=note)
        lines.append(text)
        lines.append("Next:")
        lower_text = advice.anchored_lower_lr(s.model_args.lr, logged, first, optimizer=optimizer)
        lines.append("  - " + update_size_advice(t.optimizer, lower_text, s.gradient_clip_val))
        if quarantined:
            lines.append(f"  - {len(quarantined)} sample(s) are quarantined in {t.out / QUARANTINE_FILE}; "
                         "the resume skips them")
    # The diagnosis is built for non-finite steps: of a spike with finite values it can only say it replays finite.
    nonfinite = {int(r["recovery"]) for r in rows if r["trigger"] in ("nonfinite_loss", "nonfinite_grad")}
    shown = [f"  recovery {n}: {v}" for n, v in sorted(verdicts.items()) if n in nonfinite]
    if shown:
        lines.append("Diagnosis of the captures (diagnosis.json next to each):")
        lines += shown[-3:]
    return "\n".join(lines)
