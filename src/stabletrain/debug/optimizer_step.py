"""When the optimizer step is the origin: capture it, then explain and reproduce it offline.

When an update makes finite parameters non-finite (and ``debug_args.nancapture.enabled=true``), the
trainer re-runs to the failing step from the newest checkpoint and captures the optimizer's state
and gradients right before the step (``reason = "optimizer_step"``);
:func:`diagnose_optimizer_step` replays it, also in float32, and says why. See docs/blowups.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from stabletrain.debug import advice
from stabletrain.debug.optimizer_damage import (
    NORM_OVERFLOW_AT,
    explain_optimizer_damage,
    explain_trips,
    smallest_positive,
)
from stabletrain.debug.replay.optimizer import replay_optimizer_step
from stabletrain.utils.io import atomic_write_text

REASON_OPTIMIZER_STEP = "optimizer_step"

__all__ = ["diagnose_optimizer_step", "OptimizerStepDiagnosis", "REASON_OPTIMIZER_STEP"]


# --------------------------------------------------------------------------------------
# Offline: explain and reproduce
# --------------------------------------------------------------------------------------


@dataclass
class OptimizerStepDiagnosis:
    """What :func:`diagnose_optimizer_step` found.

    Attributes:
        path: The capture.
        step: The failing step.
        optimizer: The optimizer's class.
        precision: The run's precision.
        reproduced: The optimizer step replayed from the captured state made the same
            parameters non-finite.
        nonfinite_params: Parameter -> number of NaN/Inf values after the replayed step.
        nonfinite_state: ``"<param>: <entry>"`` of the state entries NaN/Inf after it.
        gradients_finite: Forward and backward replayed from the capture give finite gradients.
        gradient_norm: Their norm (replayed); ``captured_gradient_norm``: the one training saw.
        float32_finite: The same optimizer step in float32 keeps everything finite (None: the
            run was already float32 or wider).
        explanation: Why (eps and float16 resolution, an overflowing update, ...).
        next_actions: What to change.
    """

    path: str
    step: int
    optimizer: str
    precision: str
    reproduced: bool
    nonfinite_params: dict[str, int]
    nonfinite_state: list[str]
    gradients_finite: Optional[bool]
    gradient_norm: float
    captured_gradient_norm: float
    float32_finite: Optional[bool]
    explanation: str
    next_actions: list[str]
    source: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    cause: str = "optimizer_step"
    #: Every value finite after the replayed step, but these tensors' float32 norm overflows, so the
    #: guard's check fails: (name, "parameter" or "optimizer state", max |value|), largest first.
    trips: list[tuple[str, str, float]] = field(default_factory=list)
    #: (name, max |w|) of the largest parameter after the replayed step.
    largest_param: tuple[str, float] = ("", math.nan)

    @property
    def finite_overflow(self) -> bool:
        """The step left every value finite, but beyond the range the guard's checks accept."""
        return not self.nonfinite_params and not self.nonfinite_state and bool(self.trips)

    def to_dict(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in (
            "path", "step", "cause", "optimizer", "precision", "reproduced", "nonfinite_params", "nonfinite_state",
            "gradients_finite", "float32_finite", "explanation", "next_actions", "source", "files")}
        data["finite_overflow"] = self.finite_overflow
        data["trips"] = [{"name": n, "kind": k, "abs_max": _jf(v)} for n, k, v in self.trips]
        data["gradient_norm"] = _jf(self.gradient_norm)
        data["captured_gradient_norm"] = _jf(self.captured_gradient_norm)
        return data

    @property
    def verdict(self) -> str:
        """One line, as :attr:`stabletrain.Diagnosis.verdict`."""
        return f"the optimizer step: {self._what()}"

    def _what(self) -> str:
        if self.finite_overflow:
            name, kind, value = self.trips[0]
            what = "|w|" if kind == "parameter" else "|v|"
            return (f"{self.optimizer}'s update left the range the checks accept, with finite values "
                    f"({what} reaches {_fmt(value)} in {name}{'' if kind == 'parameter' else ', ' + kind}) "
                    "from finite gradients")
        if self.nonfinite_params or self.nonfinite_state or self.reproduced:
            return f"{self.optimizer} wrote NaN/Inf into the weights from finite gradients"
        return (f"{self.optimizer}'s step failed the guard's check in training, from finite gradients; "
                "replayed here it does not")

    def __str__(self) -> str:
        return self.to_markdown()

    def _outcome(self) -> str:
        if self.finite_overflow:
            name, kind, value = self.trips[0]
            return (f"every value stays finite, but {name} ({kind}) reaches {_fmt(value)}: its float32 L2 norm, "
                    f"which the guard checks, overflows beyond about {NORM_OVERFLOW_AT:.2g}.")
        if self.nonfinite_params or self.nonfinite_state:
            return ((f"NaN/Inf in {_few([f'{n} ({c:,})' for n, c in self.nonfinite_params.items()])}"
                     if self.nonfinite_params else "every parameter stays finite")
                    + (f"; state entries {_few(self.nonfinite_state)}." if self.nonfinite_state else "."))
        name, value = self.largest_param
        return (f"every value stays finite and within the checks' range (|w| up to {_fmt(value)} in {name})."
                if name else "every value stays finite.")

    def to_markdown(self) -> str:
        lines = [
            f"# Diagnosis of step {self.step}: {self.path}",
            "",
            f"**Verdict: the optimizer step** — {self._what()}.",
            "",
            "## What happened",
            "",
            (f"Forward and backward of step {self.step} replayed from the capture give finite gradients "
             f"(gradient norm {_fmt(self.gradient_norm)}; training saw {_fmt(self.captured_gradient_norm)})."
             if self.gradients_finite else
             f"The gradients of step {self.step} were finite in training (gradient norm "
             f"{_fmt(self.captured_gradient_norm)})."),
            (f"The optimizer step replayed from the captured state ({self.precision}) reproduces the failure: "
             if self.reproduced else "The optimizer step replayed from the captured state does not reproduce it: ")
            + self._outcome(),
        ]
        if self.float32_finite is not None:
            lines.append("The same step in float32 keeps every value finite: the failure comes from the reduced "
                         "precision of the weights and the optimizer state." if self.float32_finite else
                         "The same step in float32 fails too: not a matter of precision alone.")
        lines += ["", "## Why", "", self.explanation or "-", "", "## Next actions", ""]
        lines += [f"{i}. {a}" for i, a in enumerate(self.next_actions, 1)]
        if self.source:
            lines += ["", f"Captured by re-running from {self.source.get('path')} (step {self.source.get('step')})."]
        return "\n".join(lines)


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def _jf(x: float) -> Any:
    return x if math.isfinite(x) else str(x)


def _few(items: list[str], limit: int = 5) -> str:
    return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def diagnose_optimizer_step(
    cap: Any, *, device: Optional[torch.device] = None, write: bool = True
) -> OptimizerStepDiagnosis:
    """Explain and reproduce a captured optimizer-step failure (``reason == "optimizer_step"``).

    Args:
        cap: A loaded :class:`~stabletrain.debug.replay.NaNCapture` of one rank.
        device: Where to replay; default: the capture's default device.
        write: Write ``diagnosis.md`` and ``diagnosis.json`` next to the capture.

    Example::

        d = stabletrain.diagnose("out/fp16/debug/nan_capture/rank0")
        print(d.optimizer, d.reproduced, d.explanation)
    """
    from stabletrain.debug.replay import forward_backward

    part = cap.ranks[0]
    entry = part.raw["optimizer_step"]
    dev = device if device is not None else cap.default_device()
    model = cap.get_model()
    gradients_finite: Optional[bool] = None
    replayed_norm = math.nan
    try:
        fb = forward_backward(cap, device=dev)
        gradients_finite, replayed_norm = fb.finite and math.isfinite(fb.gradient_norm), fb.gradient_norm
    except Exception:  # a capture whose microbatches could not be stored: the optimizer step still replays
        gradients_finite = None
    outcome = replay_optimizer_step(model, part, entry, dev, None)
    precision = cap.precision
    bad_params, bad_state = outcome.nonfinite_params, outcome.nonfinite_state
    captured_bad = set(entry["after"]["nonfinite_params"]) | set(entry["after"]["nonfinite_state"])
    if not outcome.rebuilt:
        explanation = (
            f"{entry['optimizer']} is not a torch.optim optimizer, so it cannot be rebuilt from the capture; "
            "the re-run in training found: " + (entry.get("failure", {}).get("explanation") or "no explanation"))
        reproduced = False
    elif captured_bad:
        reproduced = outcome.nonfinite and set(bad_params) == set(entry["after"]["nonfinite_params"])
        explanation = explain_optimizer_damage(model, outcome.optimizer_obj, set(bad_params)) or entry.get(
            "failure", {}).get("explanation", "")
        if not explanation and bad_params:
            explanation = f"{entry['optimizer']} wrote NaN/Inf into {_few(list(bad_params))} from finite gradients."
    else:
        # Training saw every value finite: the guard's norm check overflowed. The replay reproduces
        # it when the same check fails again with every value finite.
        reproduced = not outcome.nonfinite and bool(outcome.trips)
        explanation = entry.get("failure", {}).get("explanation", "") or explain_trips(
            outcome.trips, entry["state_dict"]["param_groups"][0].get("lr") if entry["state_dict"].get(
                "param_groups") else None, float(entry.get("gradient_norm", math.nan)), entry["optimizer"])
    float32_finite: Optional[bool] = None
    dtypes = {t.dtype for t in part.params.values() if t.is_floating_point()}
    if outcome.rebuilt and dtypes & {torch.float16, torch.bfloat16}:
        wide = replay_optimizer_step(model, part, entry, dev, torch.float32)
        float32_finite = wide.rebuilt and not wide.nonfinite
    actions = _actions(entry, dtypes, explanation, float32_finite, cap, outcome.trips)
    diag = OptimizerStepDiagnosis(
        path=str(cap.path), step=cap.step, optimizer=entry["optimizer"], precision=precision, reproduced=reproduced,
        nonfinite_params=bad_params, nonfinite_state=bad_state, gradients_finite=gradients_finite,
        gradient_norm=replayed_norm, captured_gradient_norm=float(entry.get("gradient_norm", math.nan)),
        float32_finite=float32_finite, explanation=explanation, next_actions=actions,
        source=dict(entry.get("source", {})),
        trips=[(t.name, t.kind, t.abs_max) for t in outcome.trips],
        largest_param=outcome.largest_param,
    )
    if write:
        folder = part.path.parent
        md, js = folder / "diagnosis.md", folder / "diagnosis.json"
        diag.files = [str(md), str(js)]
        atomic_write_text(diag.to_markdown() + "\n", md)
        atomic_write_text(json.dumps(diag.to_dict(), indent=2) + "\n", js)
    return diag


def _lr_actions(optimizer: str, settings: dict[str, Any], trips: list[Any]) -> list[str]:
    """What to change when the update itself was too large: depends on the optimizer's rule."""
    lr = advice.positive((settings.get("model_args") or {}).get("lr"))
    label = advice.optimizer_label(optimizer)
    if lr is not None:
        value, why = advice.anchored_lr(lr, optimizer=optimizer)
        change = (f"model_args.lr={advice.setting_value(value)} (now {advice.setting_value(lr)}"
                  f"{'; ' + why if why else ''})")
    else:
        change = f"a {advice.LR_DECREASE}x lower learning rate (model_args.lr)"
    state = [t for t in trips if t.kind != "parameter"]
    if state and state[0].name.endswith("exp_avg_sq"):
        return [f"The gradients are exploding (the second moment holds their squares): clip gradients "
                f"(gradient_clip_val={advice.CLIP_VALUE}), which bounds what enters {label}'s moments, and lower "
                f"the learning rate: {change}."]
    family = advice.optimizer_family(optimizer)
    if family == "sgd":
        return [f"Lower the learning rate, {change}, or clip gradients (gradient_clip_val={advice.CLIP_VALUE}): "
                f"{advice.update_size(optimizer)}, and the update left the range the checks accept."]
    if family == "adam":
        return [f"Lower the learning rate: {change}. {advice.update_size(optimizer)}."]
    return [f"Lower the learning rate: {change}. {advice.update_size(optimizer)}; the change is not verified."]


def _actions(entry: dict[str, Any], dtypes: set[torch.dtype], explanation: str, float32_finite: Optional[bool],
             cap: Any, trips: Optional[list[Any]] = None) -> list[str]:
    actions = []
    settings = cap.settings or {}
    half = dtypes & {torch.float16, torch.bfloat16}
    if half:
        dtype = next(iter(half))
        actions.append(
            "Train with precision=16-mixed or precision=bf16-mixed (float32 weights and optimizer state, reduced "
            "precision only inside the forward and backward passes) or precision=32-true"
            + f"; {_DTYPE.get(dtype, dtype)}'s smallest positive value is {smallest_positive(dtype):.2g}"
            + ".")
    if "eps" in explanation and half:
        # The trainer builds AdamW with model_args.eps unless the model's configure_optimizer builds it.
        try:
            own = callable(getattr(cap.get_model(), "configure_optimizer", None))
        except Exception:  # the model cannot be rebuilt here: say both
            own = None
        where = {False: "model_args.eps=1e-4",
                 True: "in configure_optimizer on your model, which builds the optimizer, e.g. eps=1e-4",
                 None: "model_args.eps=1e-4, or in configure_optimizer if your model builds its optimizer"}[own]
        actions.append(f"Or keep the reduced precision and raise AdamW's eps above that resolution: {where}.")
    if not half:
        actions += _lr_actions(entry["optimizer"], settings, trips or [])
    out = _run_folder(cap)
    if out is not None:
        from stabletrain.runfiles.checkpoint import list_checkpoints, newest_healthy

        best = newest_healthy(out / "checkpoints", before_step=cap.step)
        if best is not None:
            actions.append(f"Continue from the newest healthy checkpoint, {best.path} (step {best.step}: {best.why}), "
                           f"with resume_from={best.path} and the change above.")
        elif any(c.step <= cap.step for c in list_checkpoints(out / "checkpoints")):
            actions.append("No checkpoint from before the failing step is healthy: start again with overwrite=true "
                           "and the change above.")
        else:
            actions.append(f"No checkpoint was written before step {cap.step}: start again with overwrite=true and "
                           "the change above.")
    return actions


_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _run_folder(cap: Any) -> Optional[Path]:
    f = cap.ranks[0].path.resolve()
    if len(f.parents) > 3 and f.parents[1].name == "nan_capture" and f.parents[2].name == "debug":
        return f.parents[3]
    return None
