"""The settings to change when training is unstable: learning rate, clipping, precision.

Trend alerts (:mod:`stabletrain.debug.trends`), ``stabletrain report`` and ``stabletrain
diagnose`` all advise from here, so that they propose the same values written the same way
(:func:`setting_value`: 3 significant digits, written as one would type them).

Example::

    lower_lr(3e-3)                 # 'model_args.lr=0.0003'
    clip(0.0)                      # 'gradient_clip_val=1.0 (clipping is off)'
    stabler_precisions("16-mixed") # ['bf16-mixed', '32-true']
"""

from __future__ import annotations

from typing import Any, Optional

from stabletrain.utils.text import fmt_number

__all__ = [
    "LR_DECREASE",
    "LR_INCREASE",
    "CLIP_VALUE",
    "REDUCED_PRECISIONS",
    "setting_value",
    "positive",
    "lower_lr",
    "raise_lr",
    "clip",
    "dtype_name",
    "stabler_precisions",
    "switch_precision",
]

#: A diverging run: lower the learning rate this many times.
LR_DECREASE = 10
#: Vanishing gradients or a plateau: raise the learning rate this many times.
LR_INCREASE = 3
#: The gradient norm to clip at when clipping is off.
CLIP_VALUE = 1.0

#: Precisions that compute in float16 or bfloat16 (a failure that float32 avoids is theirs).
REDUCED_PRECISIONS = ("16-mixed", "bf16-mixed", "16-true", "bf16-true")
_DTYPE_NAMES = {
    "16-mixed": "float16", "16-true": "float16", "bf16-mixed": "bfloat16", "bf16-true": "bfloat16",
    "32-true": "float32", "64-true": "float64",
}


def setting_value(x: float) -> str:
    """A number proposed for, or read from, a setting, as one would type it: rounded to 3
    significant digits, without an exponent below a million (``0.0003``, ``1000``, ``1e+20``)."""
    return f"{float(fmt_number(x)):g}"


def positive(value: Any) -> Optional[float]:
    """``value`` as a float when it is a positive number (a usable lr or clip value), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def lower_lr(lr: float) -> str:
    """``model_args.lr=...``, :data:`LR_DECREASE` times lower than ``lr``."""
    return f"model_args.lr={setting_value(lr / LR_DECREASE)}"


def raise_lr(lr: float) -> str:
    """``model_args.lr=...``, :data:`LR_INCREASE` times higher than ``lr``."""
    return f"model_args.lr={setting_value(lr * LR_INCREASE)}"


def clip(current: Any, known: bool = True) -> str:
    """``gradient_clip_val=...``: half of ``current`` when clipping is on, else :data:`CLIP_VALUE`.

    Args:
        current: The run's ``gradient_clip_val`` (0 or None: clipping is off).
        known: Whether the run's settings are known; if not, ``current`` says nothing.
    """
    value = positive(current)
    if value is not None:
        return f"gradient_clip_val={setting_value(value / 2)} (was {setting_value(value)})"
    if not known:
        return f"gradient_clip_val={CLIP_VALUE} (clip the gradient norm)"
    return f"gradient_clip_val={CLIP_VALUE} (clipping is off)"


def dtype_name(precision: str) -> str:
    """The floating-point type ``precision`` computes in: ``"16-mixed"`` -> ``"float16"``."""
    return _DTYPE_NAMES.get(precision, precision)


def stabler_precisions(precision: Optional[str]) -> list[str]:
    """Precisions with a wider range or more digits than ``precision``, best first.

    float16 (6e-8 to 65504) -> bfloat16 (float32's range) or float32; bfloat16 (3 digits) ->
    float32; float32 and float64 -> none; unknown (None) -> bf16-mixed or 32-true.
    """
    if precision in ("16-mixed", "16-true") or precision is None:
        return ["bf16-mixed", "32-true"]
    if precision in ("bf16-mixed", "bf16-true"):
        return ["32-true"]
    return []


def switch_precision(precision: Optional[str]) -> Optional[str]:
    """``precision=bf16-mixed or precision=32-true``: the :func:`stabler_precisions` as settings;
    None when there is none."""
    choices = stabler_precisions(precision)
    return " or ".join(f"precision={p}" for p in choices) or None
