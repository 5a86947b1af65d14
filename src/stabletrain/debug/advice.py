"""The settings to change when training is unstable: learning rate, clipping, precision.

Trend alerts, ``stabletrain report`` and ``stabletrain diagnose`` all advise from here, so they
propose the same values written the same way: :func:`lower_lr`, :func:`clip`,
:func:`stabler_precisions`, :func:`anchored_lr` (the lr to try after an instability, anchored on
the highest lr that trained stably, never a tenth of an absurd value) and :func:`setting_value`.
See docs/blowups.md.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

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
    "anchored_lr",
    "anchored_lower_lr",
    "DEFAULT_LR",
    "FRAMEWORK_TERMS",
    "optimizer_family",
    "optimizer_label",
    "clipping_helps",
    "update_size",
    "resume_after_stop",
]

#: A diverging run: lower the learning rate this many times.
LR_DECREASE = 10
#: Vanishing gradients or a plateau: raise the learning rate this many times.
LR_INCREASE = 3
#: The gradient norm to clip at when clipping is off.
CLIP_VALUE = 1.0
#: ``model_args.lr``'s default (:class:`stabletrain.config.ModelArgs`).
DEFAULT_LR = 1e-3
#: Optimizers whose update is about lr in size whatever the gradient (Adam's m / sqrt(v)).
ADAM_FAMILY = ("adam", "adamw", "nadam", "radam", "adamax")
#: Optimizers whose update is lr x the gradient (with momentum: a running sum of gradients).
SGD_FAMILY = ("sgd",)

#: Logged steps that must follow an lr, all before the instability, for it to count as stable.
STABLE_AFTER = 3
#: A rise over the lowest value before it that ends the stable stretch (trend_alerts' defaults).
LOSS_RISE, NORM_RISE = 4.0, 10.0

#: How each framework of ``stabletrain.integrations`` spells the settings that advice names (trend
#: alerts in its loop; ``stabletrain diagnose`` of its captures, which record the framework).
FRAMEWORK_TERMS: dict[str, dict[str, str]] = {
    "lightning": {
        "lr": "the learning rate in configure_optimizers",
        "clip": "Trainer(gradient_clip_val=1.0)",
        "clip_lower": "a lower Trainer(gradient_clip_val=...)",
        "precision": "Trainer(precision='bf16-mixed') or '32-true'",
        "fp32": "Trainer(precision='32-true')",
        "debug": "StabletrainCallback(debug_args={'underflow_overflow': {'enabled': True}}), then nancapture",
        "resume": "Trainer.fit(..., ckpt_path=<last healthy checkpoint>)",
    },
    "transformers": {
        "lr": "TrainingArguments(learning_rate=...)",
        "clip": "TrainingArguments(max_grad_norm=1.0)",
        "clip_lower": "a lower TrainingArguments(max_grad_norm=...)",
        "precision": "TrainingArguments(bf16=True) instead of fp16, or neither",
        "fp32": "TrainingArguments(fp16=False, bf16=False)",
        "debug": "StabletrainCallback(debug_args={'underflow_overflow': {'enabled': True}}), then nancapture",
        "resume": "trainer.train(resume_from_checkpoint=<last healthy checkpoint>)",
    },
    "accelerate": {
        "lr": "the optimizer's learning rate",
        "clip": "accelerator.clip_grad_norm_(model.parameters(), 1.0) before optimizer.step()",
        "clip_lower": "a lower max_norm in accelerator.clip_grad_norm_",
        "precision": "Accelerator(mixed_precision='bf16') instead of 'fp16', or 'no'",
        "fp32": "Accelerator(mixed_precision='no')",
        "debug": "StepMonitor(..., debug_args={'underflow_overflow': {'enabled': True}}), then nancapture",
        "resume": "accelerator.load_state(<last healthy checkpoint>)",
    },
}

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


def optimizer_family(optimizer: Optional[str]) -> str:
    """``"adam"``, ``"sgd"`` or ``"other"`` (unknown or a user's own optimizer) for a name as
    ``model_args.optimizer`` (``"adamw"``) or a capture (``"torch.optim.AdamW"``) spells it."""
    if not optimizer:
        return "other"
    name = str(optimizer).rsplit(".", 1)[-1].lower()
    if not str(optimizer).startswith("torch.optim.") and "." in str(optimizer):
        return "other"  # a user's class that happens to be called Adam: its update is unknown
    if name in ADAM_FAMILY:
        return "adam"
    if name in SGD_FAMILY:
        return "sgd"
    return "other"


def optimizer_label(optimizer: Optional[str]) -> str:
    """How a message names the optimizer: ``AdamW``, ``SGD``, or the user's class name."""
    if not optimizer:
        return "the optimizer"
    name = str(optimizer).rsplit(".", 1)[-1]
    return {"adamw": "AdamW", "sgd": "SGD"}.get(name, name)


def clipping_helps(optimizer: Optional[str]) -> bool:
    """Whether clipping the gradient norm bounds the update: true for SGD (lr x gradient), false
    for Adam-type optimizers (their update is about lr in size whatever the gradient's scale) and
    for optimizers whose rule is unknown."""
    return optimizer_family(optimizer) == "sgd"


def update_size(optimizer: Optional[str]) -> str:
    """One clause on what bounds one update of ``optimizer``, for messages."""
    family = optimizer_family(optimizer)
    label = optimizer_label(optimizer)
    if family == "adam":
        return (f"{label}'s update is about lr in size whatever the gradient (m / sqrt(v)), so clipping gradients "
                "does not bound it; only the learning rate does")
    if family == "sgd":
        return f"{label}'s update is lr x the gradient (with momentum, a running sum of them)"
    return f"{label} is not an optimizer stabletrain knows: how its update depends on lr and the gradient is unknown"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _stable_prefix(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows before the first non-finite value or the first rise of LOSS_RISE / NORM_RISE."""
    low = {"loss": math.inf, "gradient_norm": math.inf}
    limits = {"loss": LOSS_RISE, "gradient_norm": NORM_RISE}
    out: list[Mapping[str, Any]] = []
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


def anchored_lr(lr: float, rows: Sequence[Mapping[str, Any]] = (), unstable_from: Optional[int] = None,
                default: float = DEFAULT_LR, optimizer: Optional[str] = "adamw") -> tuple[float, str]:
    """The peak lr to suggest after an instability, and why (see the module docstring).

    Args:
        lr: ``model_args.lr`` of the run.
        rows: Logged rows (``step``, ``lr``, ``loss``, ``gradient_norm``).
        unstable_from: The first step of the instability (an episode's start, the first
            non-finite step); rows from there on do not count as stable.
        default: The default ``model_args.lr`` (AdamW's): proposed only to an Adam-type
            optimizer, never to SGD or a user's optimizer, whose lr lives on another scale.
        optimizer: ``model_args.optimizer`` or the optimizer's class name (see
            :func:`optimizer_family`).

    Returns:
        ``(value, why)``; ``why`` is empty for a plain :data:`LR_DECREASE` times lower.

    Example::

        anchored_lr(1000.0, rows=[{"step": 0, "lr": 20.0, "loss": 5.5}], unstable_from=10)
        # (0.001, "AdamW's default: no logged stretch trained stably at a lower lr")
        anchored_lr(1.0, optimizer="sgd")
        # (0.1, "the run's lr x0.1, not verified: no logged stretch trained stably at a lower lr")
    """
    ordered = sorted((r for r in rows if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    limit = unstable_from if unstable_from is not None else math.inf
    before = _stable_prefix([r for r in ordered if r["step"] < limit and _finite(r.get("lr"))])
    stable = [(float(r["lr"]), r["step"]) for r in before[: max(0, len(before) - STABLE_AFTER)]]
    if stable and max(stable)[0] < lr:
        value, step = max(stable)
        return float(setting_value(value)), f"the highest lr that trained stably, from step {step}"
    if optimizer_family(optimizer) != "adam" and lr / LR_DECREASE > default:
        return float(setting_value(lr / LR_DECREASE)), (
            f"the run's lr x{1 / LR_DECREASE:g}, not verified: no logged stretch trained stably at a lower lr")
    if lr / LR_DECREASE > default:
        return default, f"{optimizer_label(optimizer)}'s default: no logged stretch trained stably at a lower lr"
    return float(setting_value(lr / LR_DECREASE)), ""


def anchored_lower_lr(lr: float, rows: Sequence[Mapping[str, Any]] = (), unstable_from: Optional[int] = None,
                      optimizer: Optional[str] = "adamw") -> str:
    """``model_args.lr=0.001 (now 1000; AdamW's default: ...)``; ``model_args.lr=0.0003 (now 0.003)``."""
    value, why = anchored_lr(lr, rows, unstable_from, optimizer=optimizer)
    return f"model_args.lr={setting_value(value)} (now {setting_value(lr)}{'; ' + why if why else ''})"


def resume_after_stop(trainer: Any, step: int, loss_nonfinite: Optional[bool] = None, reason: str = "") -> str:
    """Where to continue after a debug tool stopped the trainer at ``step`` before its optimizer
    step: the trainer's :meth:`resume_advice` (the newest checkpoint recorded healthy, why, and the
    command to paste, with what to change), or a plain sentence when the trainer has none.

    An asynchronous checkpoint still being written is committed first, as the guard's stop does:
    advice written before the commit would name an older checkpoint and say last.ckpt holds it,
    false once the commit lands. Every rank stops at the same point and writes the message (then
    one is chosen), so every rank is here; each sees the commit once rank 0 has made it.
    """
    settle = getattr(trainer, "settle_checkpoints", None)
    if callable(settle):
        settle()
        fabric = getattr(trainer, "fabric", None)
        if getattr(trainer, "world_size", 1) > 1 and fabric is not None:
            fabric.barrier()
    advise = getattr(trainer, "resume_advice", None)
    if not callable(advise):
        return f"Continue from a checkpoint written before step {step}."
    return str(advise(step, loss_nonfinite=loss_nonfinite, reason=reason))
