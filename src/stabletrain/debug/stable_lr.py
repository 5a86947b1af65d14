"""Which learning rate to suggest after an instability: anchored, never a tenth of an absurd value.

After ``model_args.lr=1000`` blew up, "model_args.lr=100" is no advice. The suggestion is:

1. the highest lr that trained stably in this run: an lr logged at a step followed by
   :data:`STABLE_AFTER` more logged steps before the instability began (during warmup the lr
   grows, so this is the last such lr), when it is below ``model_args.lr``. The instability
   begins at ``unstable_from`` or at the first logged step whose loss is more than
   ``LOSS_RISE`` (4x) or whose gradient norm is more than ``NORM_RISE`` (10x) the lowest
   before it, whichever comes first;
2. else the default ``model_args.lr`` (1e-3), when a tenth of ``model_args.lr`` would still be
   above it (an absurd lr: a tenth of it is no advice);
3. else a tenth of ``model_args.lr``.

Trend alerts, ``stabletrain report``, ``stabletrain diagnose`` and the guard's error all use
:func:`suggest_lr`, so they suggest the same value.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

#: ``model_args.lr``'s default (:class:`stabletrain.config.ModelArgs`).
DEFAULT_LR = 1e-3
#: Logged steps that must follow an lr, all before the instability, for it to count as stable.
STABLE_AFTER = 3
#: A rise over the lowest value before it that ends the stable stretch (trend_alerts' defaults).
LOSS_RISE, NORM_RISE = 4.0, 10.0

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
        ``(value, why)``, e.g. ``(0.00042, "the last lr that trained stably, from step 20")``;
        ``why`` is empty for a plain tenth.

    Example::

        suggest_lr(1000.0, rows=[{"step": 0, "lr": 20.0, "loss": 5.5}], unstable_from=10)
        # (0.001, 'the default: no logged stretch trained stably at a lower lr')
    """
    ordered = [r for r in rows if isinstance(r.get("step"), int)]
    ordered.sort(key=lambda r: r["step"])
    limit = unstable_from if unstable_from is not None else math.inf
    before = _stable_prefix([r for r in ordered if r["step"] < limit and _finite(r.get("lr"))])
    stable = [(float(r["lr"]), r["step"]) for r in before[: max(0, len(before) - STABLE_AFTER)]]
    if stable and max(stable)[0] < lr:
        value, step = max(stable)
        return _round_down(value), f"the highest lr that trained stably, from step {step}"
    if lr / 10 > default:
        return default, "the default: no logged stretch trained stably at a lower lr"
    return _round_down(lr / 10), ""


def lr_advice(lr: Optional[float], rows: Sequence[Mapping[str, Any]] = (), unstable_from: Optional[int] = None) -> str:
    """``model_args.lr=0.001 (now 1000; the default: ...)``, ``model_args.lr=0.0003 (now 0.003)``."""
    if not lr or not _finite(lr):
        return "a lower learning rate (model_args.lr), e.g. the default 0.001"
    value, why = suggest_lr(float(lr), rows, unstable_from)
    return f"model_args.lr={value:g} (now {lr:g}{'; ' + why if why else ''})"


def _stable_prefix(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows before the first non-finite value or the first rise of LOSS_RISE / NORM_RISE."""
    low = {"loss": math.inf, "gradient_norm": math.inf}
    limits = {"loss": LOSS_RISE, "gradient_norm": NORM_RISE}
    out = []
    for r in rows:
        for key, limit in limits.items():
            v = r.get(key)
            if v is None:
                continue
            if not _finite(v) or (math.isfinite(low[key]) and low[key] > 0 and v > limit * low[key]):
                return out
        for key in limits:
            if _finite(r.get(key)):
                low[key] = min(low[key], float(r[key]))
        out.append(r)
    return out


def _round_down(x: float) -> float:
    """Two significant digits, never above ``x``."""
    if x <= 0:
        return x
    exp = math.floor(math.log10(x)) - 1
    digits = math.floor(x / 10**exp * (1 + 1e-9))  # 1e-9: 0.0042 / 1e-4 is 41.99999... in binary
    return float(f"{digits}e{exp}")
