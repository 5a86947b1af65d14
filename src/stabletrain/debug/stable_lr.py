"""Which learning rate to suggest after an instability: anchored, never a tenth of an absurd value.

After ``model_args.lr=1000`` blew up, "model_args.lr=100" is no advice. The suggestion is:

1. the last lr that trained stably in this run: the lr logged at a step whose next logged
   step still came before the instability began (during warmup the lr grows, so this is the
   largest lr the run survived), when it is below ``model_args.lr``;
2. else the default ``model_args.lr`` (1e-3), when ``model_args.lr`` is above it;
3. else a tenth of ``model_args.lr``.

Trend alerts, ``stabletrain report``, ``stabletrain diagnose`` and the guard's error all use
:func:`suggest_lr`, so they suggest the same value.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

#: ``model_args.lr``'s default (:class:`stabletrain.config.ModelArgs`).
DEFAULT_LR = 1e-3

__all__ = ["suggest_lr", "lr_advice", "DEFAULT_LR"]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def suggest_lr(lr: float, rows: Sequence[Mapping[str, Any]] = (), unstable_from: Optional[int] = None,
               default: float = DEFAULT_LR) -> tuple[float, str]:
    """The peak lr to suggest and why.

    Args:
        lr: ``model_args.lr`` of the run.
        rows: Logged rows (``step``, ``lr``, ``loss``, ``gradient_norm``), in step order.
        unstable_from: The first step of the instability (an episode's start, or the first
            non-finite step); rows from there on do not count as stable.
        default: The default ``model_args.lr``.

    Returns:
        ``(value, why)``, e.g. ``(0.00042, "the last lr that trained stably, at step 20")``.

    Example::

        suggest_lr(1000.0, rows=[{"step": 0, "lr": 20.0, "loss": 5.5}], unstable_from=10)
        # (0.001, 'the default; no logged step trained stably at a lower lr')
    """
    ordered = [r for r in rows if isinstance(r.get("step"), int)]
    ordered.sort(key=lambda r: r["step"])
    limit = unstable_from if unstable_from is not None else math.inf
    before = [r for r in ordered if r["step"] < limit and _finite(r.get("loss", 0.0)) and _finite(r.get("lr"))]
    stable = [(r["step"], float(r["lr"])) for r, nxt in zip(before, before[1:]) if nxt["step"] < limit]
    if stable and stable[-1][1] < lr:
        step, value = stable[-1]
        return _round_down(value), f"the last lr that trained stably, at step {step}"
    if lr > default:
        return default, "the default; no logged step trained stably at a lower lr"
    return _round_down(lr / 10), "a tenth of model_args.lr"


def lr_advice(lr: Optional[float], rows: Sequence[Mapping[str, Any]] = (), unstable_from: Optional[int] = None) -> str:
    """``model_args.lr=0.001 (the default; ...; now 1000)``, or a generic line without an lr."""
    if not lr or not _finite(lr):
        return "a lower learning rate (model_args.lr), e.g. the default 0.001"
    value, why = suggest_lr(float(lr), rows, unstable_from)
    return f"model_args.lr={value:g} ({why}; now {lr:g})"


def _round_down(x: float) -> float:
    """Two significant digits, never above ``x``."""
    if x <= 0:
        return x
    exp = math.floor(math.log10(x)) - 1
    digits = math.floor(x / 10**exp * (1 + 1e-9))  # 1e-9: 0.0042 / 1e-4 is 41.99999... in binary
    return float(f"{digits}e{exp}")
