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

from stabletrain.debug.guard import GuardFailure
from stabletrain.debug.optimizer_damage import explain_optimizer_damage, optimizer_name, smallest_positive
from stabletrain.utils.io import atomic_write_text
from stabletrain.utils.text import shell_path

REASON_OPTIMIZER_STEP = "optimizer_step"

__all__ = ["capture_optimizer_step", "diagnose_optimizer_step", "OptimizerStepDiagnosis", "REASON_OPTIMIZER_STEP"]


class _Reached(Exception):
    """The re-run reached the failing step's optimizer step (control flow only)."""


def _cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_cpu(v) for v in obj]
    return obj


class _Collector:
    """Trainer callbacks for the re-run: collect step ``k`` and snapshot around its optimizer step."""

    def __init__(self, trainer: Any, k: int, monitor: Any):
        self.trainer, self.k, self.monitor = trainer, k, monitor
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}

    def on_step_start(self, trainer: Any, *, step: int) -> None:
        if step == self.k:
            self.monitor.begin_step(step)

    def on_microbatch(self, trainer: Any, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        if step == self.k:
            self.monitor.collect_batch(batch, indices)

    def on_after_microbatch(self, trainer: Any, *, step: int, micro_step: int, loss: Tensor) -> None:
        if step == self.k:
            self.monitor.collect_loss(loss)

    def on_after_backward(self, trainer: Any, *, step: int, grad_norm: Any) -> None:
        if step == self.k:
            self.before["grad_norm"] = float(grad_norm.total)

    def on_before_optimizer_step(self, trainer: Any, *, step: int) -> None:
        if step != self.k:
            return
        model, optimizer = trainer.model, trainer.optimizer
        self.before["params"] = {n: _cpu(p) for n, p in model.named_parameters()}
        self.before["grads"] = {n: _cpu(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        self.before["state_dict"] = _cpu(optimizer.state_dict())

    def on_after_optimizer_step(self, trainer: Any, *, step: int) -> None:
        if step != self.k:
            return
        model, optimizer = trainer.model, trainer.optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        self.after["params"] = {n: int((~torch.isfinite(p.detach())).sum()) for n, p in model.named_parameters()
                                if not bool(torch.isfinite(p.detach()).all())}
        self.after["state"] = [f"{names.get(id(p), '?')}: {key}" for p, st in optimizer.state.items()
                               for key, v in st.items() if isinstance(v, Tensor) and v.is_floating_point()
                               and not bool(torch.isfinite(v).all())]
        raise _Reached


def _source(trainer: Any, k: int) -> tuple[Optional[dict[str, Any]], str]:
    """The newest state at or before step ``k`` to re-run from, and where it came from."""
    from stabletrain.checkpoint import checkpoint_dir, list_checkpoints, load_checkpoint

    usable = [c for c in list_checkpoints(checkpoint_dir(trainer.out)) if c.step <= k]
    if usable:
        return load_checkpoint(usable[-1].path), str(usable[-1].path)
    start = trainer.safety.start_state
    if start is not None:
        return start, "the start of the run"
    return None, ""


def capture_optimizer_step(trainer: Any, failure: GuardFailure) -> Optional[Path]:
    """Re-run to ``failure.step`` and capture its optimizer step (see the module docstring).

    Returns the capture file, or None when no state from before that step is available (a
    resumed run whose checkpoints from before the step were rotated away).
    """
    from stabletrain.debug.nan_capture import NaNCaptureMonitor
    from stabletrain.events import CallbackList
    from stabletrain.utils.rng import set_rng_state

    k = failure.step
    state, source = _source(trainer, k)
    if state is None:
        return None
    model, optimizer = trainer.model, trainer.optimizer
    model.load_state_dict(state["model"])
    trainer._load_optimizer_state(state["optimizer"])
    if trainer.scaler is not None and state.get("scaler"):
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.step = int(state["step"])
    trainer.microbatches_consumed = int(state["data"]["microbatches_consumed"])
    trainer.build_loader()
    set_rng_state(state["rng"][trainer.rank])

    folder = trainer.out / "debug" / "nan_capture"
    settings = trainer.resolved_settings()
    monitor = NaNCaptureMonitor(
        model, folder, rank=trainer.rank, world_size=trainer.world_size, scaler=trainer.scaler,
        precision=trainer.precision, gradient_accumulation_steps=trainer.settings.gradient_accumulation_steps,
        settings=settings, model_meta=dict(trainer.task.model_meta), any_rank=lambda flag: False,
        replay_command=f"stabletrain diagnose {shell_path(folder / f'rank{trainer.rank}')}",
    )
    collector = _Collector(trainer, k, monitor)
    callbacks, trainer.callbacks = trainer.callbacks, CallbackList([collector])
    trainer.safety.replaying = True
    try:
        while trainer.step <= k:
            trainer.train_step()
            trainer.step += 1
    except _Reached:
        pass
    finally:
        trainer.callbacks = callbacks
        trainer.safety.replaying = False
    param_names = [n for n, _ in model.named_parameters()]
    by_id = {id(p): n for n, p in model.named_parameters()}
    order = [by_id.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]]
    extra = {"optimizer_step": {
        "optimizer": optimizer_name(optimizer),
        "param_names": order,
        "state_dict": collector.before.get("state_dict", {}),
        "grads": collector.before.get("grads", {}),
        "gradient_norm": collector.before.get("grad_norm", math.nan),
        "gradient_clip_val": float(trainer.settings.gradient_clip_val),
        "after": {"nonfinite_params": collector.after.get("params", {}),
                  "nonfinite_state": collector.after.get("state", [])},
        "reproduced_in_rerun": bool(collector.after.get("params") or collector.after.get("state")),
        "source": {"path": source, "step": int(state["step"])},
        "failure": {"param_names": failure.param_names, "state_entries": failure.state_entries,
                    "explanation": failure.explanation},
    }}
    path = monitor.write_capture(REASON_OPTIMIZER_STEP, nan_param_names=list(collector.after.get("params", {})),
                                 params=collector.before.get("params"), extra=extra)
    monitor.close()
    del param_names
    return path


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
        from stabletrain.checkpoint import newest_healthy

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
