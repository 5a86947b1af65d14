"""Capture the optimizer step the guard stopped at: re-run to it and save its state and gradients.

When an update makes finite parameters non-finite (and ``debug_args.nancapture.enabled=true``), the
trainer re-runs to the failing step from the newest checkpoint and captures the optimizer's state
and gradients right before the step (``reason = "optimizer_step"``);
:func:`stabletrain.debug.optimizer_step.diagnose_optimizer_step` replays it offline. See docs/blowups.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from stabletrain.debug.optimizer_damage import optimizer_name
from stabletrain.debug.optimizer_step import REASON_OPTIMIZER_STEP
from stabletrain.safety.guard import GuardFailure
from stabletrain.utils.text import shell_path

__all__ = ["capture_optimizer_step"]


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
    from stabletrain.runfiles.checkpoint import checkpoint_dir, list_checkpoints, load_checkpoint

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
