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
from torch import Tensor, nn

from stabletrain.debug.optimizer_damage import explain_optimizer_damage, smallest_positive
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

    def to_dict(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in (
            "path", "step", "cause", "optimizer", "precision", "reproduced", "nonfinite_params", "nonfinite_state",
            "gradients_finite", "float32_finite", "explanation", "next_actions", "source", "files")}
        data["gradient_norm"] = _jf(self.gradient_norm)
        data["captured_gradient_norm"] = _jf(self.captured_gradient_norm)
        return data

    @property
    def verdict(self) -> str:
        """One line, as :attr:`stabletrain.Diagnosis.verdict`."""
        return f"the optimizer step: {self.optimizer} wrote NaN/Inf into the weights from finite gradients"

    def __str__(self) -> str:
        return self.to_markdown()

    def to_markdown(self) -> str:
        lines = [
            f"# Diagnosis of step {self.step}: {self.path}",
            "",
            f"**Verdict: the optimizer step** — {self.optimizer} wrote NaN/Inf into the weights from finite gradients.",
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
            + (f"NaN/Inf in {_few([f'{n} ({c:,})' for n, c in self.nonfinite_params.items()])}"
               if self.nonfinite_params else "every parameter stays finite")
            + (f"; state entries {_few(self.nonfinite_state)}." if self.nonfinite_state else "."),
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


def _build_optimizer(name: str, model: nn.Module, names: list[str], state_dict: dict[str, Any]) -> Any:
    cls_name = name.rsplit(".", 1)[-1]
    cls = getattr(torch.optim, cls_name, None) if name.startswith("torch.optim.") else None
    if cls is None:
        return None
    params = dict(model.named_parameters())
    groups = []
    for g in state_dict["param_groups"]:
        groups.append({"params": [params[names[i]] for i in g["params"]]})
    optimizer = cls(groups, lr=float(state_dict["param_groups"][0].get("lr", 1e-3)))
    optimizer.load_state_dict(state_dict)
    return optimizer


def _step_once(model: nn.Module, part: Any, entry: dict[str, Any], device: torch.device,
               dtype: Optional[torch.dtype]) -> Optional[tuple[dict[str, int], list[str], Any]]:
    """Load the captured parameters, gradients and optimizer state (converted to ``dtype`` if
    given), run one optimizer step, and say what is non-finite afterwards."""
    names = list(entry["param_names"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            src = part.params[n]
            p.data = src.to(device=device, dtype=dtype or src.dtype, copy=True)
            g = entry["grads"].get(n)
            p.grad = None if g is None else g.to(device=device, dtype=dtype or g.dtype, copy=True)
        for n, b in model.named_buffers():
            if n in part.buffers:
                b.data = part.buffers[n].to(device=device, copy=True)
    state_dict = entry["state_dict"]
    if dtype is not None:
        state_dict = {"param_groups": state_dict["param_groups"], "state": {
            i: {k: (v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() and k != "step" else v)
                for k, v in st.items()} for i, st in state_dict["state"].items()}}
    optimizer = _build_optimizer(entry["optimizer"], model, names, state_dict)
    if optimizer is None:
        return None
    optimizer.step()
    by_id = {id(p): n for n, p in model.named_parameters()}
    bad_params = {n: int((~torch.isfinite(p.detach())).sum()) for n, p in model.named_parameters()
                  if not bool(torch.isfinite(p.detach()).all())}
    bad_state = [f"{by_id.get(id(p), '?')}: {k}" for p, st in optimizer.state.items() for k, v in st.items()
                 if isinstance(v, Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]
    return bad_params, bad_state, optimizer


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
    result = _step_once(model, part, entry, dev, None)
    precision = cap.precision
    if result is None:
        bad_params: dict[str, int] = {}
        bad_state: list[str] = []
        explanation = (
            f"{entry['optimizer']} is not a torch.optim optimizer, so it cannot be rebuilt from the capture; "
            "the re-run in training found: " + (entry.get("failure", {}).get("explanation") or "no explanation"))
        reproduced = False
    else:
        bad_params, bad_state, optimizer = result
        reproduced = bool(bad_params or bad_state) and set(bad_params) == set(entry["after"]["nonfinite_params"])
        explanation = explain_optimizer_damage(model, optimizer, set(bad_params)) or entry.get("failure", {}).get(
            "explanation", "")
        if not explanation and bad_params:
            explanation = f"{entry['optimizer']} wrote NaN/Inf into {_few(list(bad_params))} from finite gradients."
    float32_finite: Optional[bool] = None
    dtypes = {t.dtype for t in part.params.values() if t.is_floating_point()}
    if result is not None and dtypes & {torch.float16, torch.bfloat16}:
        wide = _step_once(model, part, entry, dev, torch.float32)
        float32_finite = wide is not None and not wide[0] and not wide[1]
    actions = _actions(entry, dtypes, explanation, float32_finite, cap)
    diag = OptimizerStepDiagnosis(
        path=str(cap.path), step=cap.step, optimizer=entry["optimizer"], precision=precision, reproduced=reproduced,
        nonfinite_params=bad_params, nonfinite_state=bad_state, gradients_finite=gradients_finite,
        gradient_norm=replayed_norm, captured_gradient_norm=float(entry.get("gradient_norm", math.nan)),
        float32_finite=float32_finite, explanation=explanation, next_actions=actions,
        source=dict(entry.get("source", {})),
    )
    if write:
        folder = part.path.parent
        md, js = folder / "diagnosis.md", folder / "diagnosis.json"
        diag.files = [str(md), str(js)]
        atomic_write_text(diag.to_markdown() + "\n", md)
        atomic_write_text(json.dumps(diag.to_dict(), indent=2) + "\n", js)
    return diag


def _actions(entry: dict[str, Any], dtypes: set[torch.dtype], explanation: str, float32_finite: Optional[bool],
             cap: Any) -> list[str]:
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
        actions.append("Or keep the reduced precision and raise AdamW's eps above that resolution (e.g. 1e-4): "
                       "configure_optimizer on your model builds the optimizer.")
    if not half:
        lr = ((settings.get("model_args") or {}).get("lr"))
        now = f", now {lr:g}" if isinstance(lr, (int, float)) else ""
        actions.append(f"Lower the learning rate (model_args.lr{now})"
                       " or clip gradients (gradient_clip_val=1.0): the update left the dtype's range.")
    out = _run_folder(cap)
    if out is not None:
        from stabletrain.runfiles.checkpoint import newest_healthy

        best = newest_healthy(out / "checkpoints", before_step=cap.step)
        if best is not None:
            actions.append(f"Continue from the newest healthy checkpoint, {best.path} (step {best.step}: {best.why}), "
                           f"with resume_from={best.path} and the change above.")
        else:
            actions.append("No checkpoint from before the failing step is healthy: start again with overwrite=true "
                           "and the change above.")
    return actions


_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _run_folder(cap: Any) -> Optional[Path]:
    f = cap.ranks[0].path.resolve()
    if len(f.parents) > 3 and f.parents[1].name == "nan_capture" and f.parents[2].name == "debug":
        return f.parents[3]
    return None
