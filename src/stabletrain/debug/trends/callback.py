"""The trainer callback :class:`TrendAlerts`: a :class:`~stabletrain.debug.trends.detector.TrendDetector` on
every logged step, each new episode printed with next actions and recorded in ``metrics.jsonl``; and
:func:`checkpoint_context`, the newest healthy checkpoint for those actions. See ``docs/trend_alerts.md``.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Mapping, Optional

from stabletrain.config import TrendAlertArgs
from stabletrain.debug.trends.detector import TrendDetector
from stabletrain.debug.trends.episode import AlertContext, format_alerts
from stabletrain.events import TrainerLike

#: Logged rows a live TrendAlerts keeps for the lr advice.
HISTORY_ROWS = 500


class TrendAlerts:
    """Trainer callback: runs a :class:`TrendDetector` on every logged step (``on_log``).

    Each new episode is printed once with concrete next actions (``trainer.console``) and
    recorded in ``metrics.jsonl`` as ``{"event": "trend_alert", "kind": ..., "signal": ...,
    "start_step": ..., "end_step": ..., "actions": [...]}``. The metrics it reads are host
    floats the trainer already read back, so it adds no host synchronisation.

    Args:
        settings: Thresholds; default: the trainer's ``trend_alerts`` settings.

    Example::

        stabletrain.train(out="out/x", trend_alerts={"explode_factor": 5})   # on by default
    """

    def __init__(self, settings: Optional[TrendAlertArgs] = None):
        self._settings = settings
        self.detector: Optional[TrendDetector] = None
        self.context: Optional[AlertContext] = None
        self.alerts: list[dict[str, Any]] = []
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_ROWS)
        #: A non-finite step's alert held back until the self-healing has judged that step: (step, episodes).
        self._pending: Optional[tuple[int, list[Any]]] = None

    def on_train_start(self, trainer: TrainerLike) -> None:
        s = trainer.settings
        self.detector = TrendDetector(self._settings or s.trend_alerts, warmup_steps=s.model_args.warmup_steps)
        self.context = AlertContext(
            lr=s.model_args.lr,
            precision=getattr(trainer, "precision", None),
            gradient_clip_val=s.gradient_clip_val,
            warmup_steps=s.model_args.warmup_steps,
            n_params=sum(p.numel() for p in trainer.model.parameters()),
            task=(trainer.task.name if getattr(trainer, "task", None) is not None else None),
            optimizer=_optimizer_of(trainer),
        )
        if s.resume_interrupted or getattr(s, "resume_from", None) is not None:
            self._replay_history(Path(trainer.out) / "metrics.jsonl", before_step=trainer.step)

    def _replay_history(self, path: Path, before_step: int) -> None:
        """After a resume, continue the trend of the steps already logged (alerts already given)."""
        from stabletrain.runfiles.history import logged_rows_before

        if self.detector is None:
            return
        for step, row in logged_rows_before(path, before_step):
            self.detector.update(step, row)
            self.history.append(_history_row(step, row))

    def on_log(self, trainer: TrainerLike, *, step: int, metrics: dict[str, float]) -> None:
        if self.detector is None:
            self.on_train_start(trainer)
        assert self.detector is not None
        self.history.append(_history_row(step, metrics))
        opened = self.detector.update(step, metrics)
        if not opened:
            return
        assert self.context is not None
        self.context.history = list(self.history)
        if any(e.kind in ("nonfinite", "exploding") for e in opened) and hasattr(trainer, "healthy_checkpoint"):
            checkpoint_context(self.context, trainer)
        if any(e.kind == "nonfinite" for e in opened) and _healer(trainer) is not None:
            # on_instability recovers this step after it is logged, and finds out whether its samples
            # explain it: the alert waits for that evidence (the next step's start at the latest).
            self._flush(trainer)
            self._pending = (step, list(opened))
            return
        self._alert(trainer, opened)

    def _alert(self, trainer: TrainerLike, opened: list[Any]) -> None:
        for episode in opened:
            event = episode.to_event(self.context)
            self.alerts.append(event)
            trainer.log_event(event)
        trainer.console.info(format_alerts(opened, self.context))

    def _flush(self, trainer: TrainerLike) -> None:
        """Print the held-back alert, answered by the self-healing's recovery of its step when there is one."""
        if self._pending is None:
            return
        step, opened = self._pending
        self._pending = None
        healer = _healer(trainer)
        row = next((r for r in reversed(getattr(healer, "recoveries", [])) if r.get("step") == step), None)
        if row is not None:
            answer = recovery_answer(row, getattr(getattr(healer, "quarantine", None), "entries", {}), self.context)
            for episode in opened:
                if episode.kind == "nonfinite":
                    episode.settled = answer
        self._alert(trainer, opened)

    def on_step_start(self, trainer: TrainerLike, *, step: int) -> None:
        self._flush(trainer)

    def on_exception(self, trainer: TrainerLike, *, exception: BaseException) -> None:
        self._flush(trainer)

    def on_train_end(self, trainer: TrainerLike) -> None:
        self._flush(trainer)
        if self.detector is not None:
            self.detector.finish()


def _healer(trainer: Any) -> Any:
    """The trainer's self-healing (``on_instability`` skip_step or rollback), or None."""
    return getattr(getattr(trainer, "safety", None), "healer", None)


def recovery_answer(row: Mapping[str, Any], quarantined: Mapping[int, Mapping[str, Any]],
                    context: Optional[AlertContext] = None) -> str:
    """What the self-healing's recovery ``row`` of a non-finite step established, as the answer to its
    alert: the samples it isolated (the data is the cause: no setting to change), or none (the
    updates are the suspect: the lr advice), or the stop at the recovery limit."""
    from stabletrain.debug import advice

    step, policy = row.get("step"), row.get("action")
    if policy == "stop":
        return (f"on_instability stopped the run at step {step}: over its max_recoveries; the stop message names "
                "the cause it found and the way on")
    done = (f"on_instability skipped step {step}'s update" if policy == "skip_step"
            else f"on_instability rolled back to step {row.get('rolled_back_to')}")
    culprits = [int(i) for i in row.get("culprits") or []]
    if culprits:
        evidence = "; ".join(f"{i}: {quarantined[i]['evidence']}" if quarantined.get(i, {}).get("evidence")
                             else str(i) for i in culprits[:4])
        return (f"{done}, and its samples explain it ({evidence}): they are quarantined (quarantine.json) and "
                "skipped from now on; the cause is the data, not a setting such as the learning rate: check how "
                "those samples were made")
    c = context or AlertContext()
    lr = advice.positive(c.lr)
    lower = advice.anchored_lower_lr(lr, c.history or (), int(step or 0), optimizer=c.optimizer) if lr else ""
    return (f"{done}; no sample of the step explains it, so the updates are the suspect: if it recurs, lower "
            f"the learning rate{': ' + lower if lower else ' (model_args.lr)'}")


def _history_row(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {"step": step, **{k: metrics.get(k) for k in ("lr", "loss", "gradient_norm")}}


def checkpoint_context(context: AlertContext, trainer: Any) -> None:
    """The newest healthy checkpoint, as the setting that resumes from it."""
    best = trainer.healthy_checkpoint()
    context.checkpoint_known = True
    if best is None:
        context.resume_setting = None
        return
    last = best.path.parent / "last.ckpt"
    same = best.path == last or _step_of(last) == best.step
    context.resume_setting = "resume_interrupted=true" if same else f"resume_from={best.path}"
    context.checkpoint_why = f"step {best.step}: {best.why}"


def _step_of(path: Path) -> Optional[int]:
    from stabletrain.runfiles.checkpoint import is_checkpoint, read_checkpoint_health

    try:
        return read_checkpoint_health(path)[0] if is_checkpoint(path) else None
    except Exception:
        return None


def _optimizer_of(trainer: TrainerLike) -> Optional[str]:
    """The optimizer's class as ``torch.optim.AdamW`` (a model's own configure_optimizer may build
    another than ``model_args.optimizer``), else the setting."""
    from stabletrain.debug.optimizer_damage import optimizer_name

    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None:
        return optimizer_name(optimizer)
    return getattr(getattr(trainer.settings, "model_args", None), "optimizer", None)
