"""What to change after a trend alert, worded in the framework's own settings (see docs/trend_alerts.md)."""

from __future__ import annotations

from typing import Optional

from stabletrain.debug.advice import FRAMEWORK_TERMS


def next_actions(kind: str, framework: str, *, lr: Optional[float] = None, clipping: bool = False,
                 precision: Optional[str] = None) -> list[str]:
    """What to change after a trend alert of ``kind``, in ``framework``'s settings."""
    t = FRAMEWORK_TERMS[framework]
    lr_text = f" (now {lr:.3g})" if lr else ""
    reduced = precision not in (None, "32-true", "64-true")
    if kind == "exploding":
        actions = [f"lower {t['lr']}, e.g. by 10x{lr_text}"]
        if reduced:
            actions.append(f"rule out reduced precision ({precision}): {t['precision']}")
        if not clipping:
            actions.append(f"clip gradients: {t['clip']}")
        return actions
    if kind == "vanishing":
        return [f"raise {t['lr']}{lr_text}, especially for small models (~10M parameters or fewer)",
                "check that the input normalization matches your data"]
    if kind == "spike":
        return ["a single spike is usually harmless; if spikes recur or grow, "
                + (f"clip gradients ({t['clip']}), " if not clipping else "") + f"lower {t['lr']} or warm up longer"]
    if kind == "plateau":
        return [f"if gradient_norm is small too, raise {t['lr']}{lr_text}",
                "check that inputs and labels match (a shuffled or constant label gives a flat loss)"]
    return [f"re-run from the last healthy checkpoint with a lower learning rate: {t['resume']}",
            f"isolate reduced precision: {t['fp32']}" if reduced
            else f"precision is already {precision or '32-true'}: reduced precision is not the cause",
            f"localise it: {t['debug']}"]

