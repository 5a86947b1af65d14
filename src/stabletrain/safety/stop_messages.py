"""The words a run ends with: where to continue from, and the command that does it.

Every message that recommends a checkpoint names the newest one recorded healthy
(:func:`stabletrain.safety.checkpoint_health.newest_healthy`) and says why, with a command to paste:
``resume_interrupted=true`` when that checkpoint is ``last.ckpt``'s state, ``resume_from=<file>``
when it is older, ``overwrite=true`` when the run has none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from stabletrain.debug import advice
from stabletrain.runfiles.checkpoint import CheckpointInfo, checkpoint_dir, list_checkpoints, newest_healthy
from stabletrain.runfiles.commands import train_command
from stabletrain.safety.guard import ORIGIN_OPTIMIZER, GuardFailure
from stabletrain.utils.text import shell_path


def _last_step(folder: Path) -> Optional[int]:
    infos = [c for c in list_checkpoints(folder)]
    last = folder / "last.ckpt"
    for c in reversed(infos):
        if c.path == last:
            return c.step
    from stabletrain.runfiles.checkpoint import read_checkpoint_health

    try:
        return read_checkpoint_health(last)[0] if last.is_file() else None
    except Exception:
        return None


def resume_advice(trainer: Any, failing_step: Optional[int], extra: Optional[dict[str, Any]] = None
                  ) -> tuple[str, Optional[CheckpointInfo], str]:
    """``(sentence, checkpoint, command)``: where to continue after a failure at
    ``failing_step`` (None: not a failure), and the command that does it with ``extra``
    settings (e.g. a lower lr)."""
    folder = checkpoint_dir(trainer.out)
    settings = trainer.settings
    best = newest_healthy(folder, before_step=failing_step)
    infos = list_checkpoints(folder)
    if best is None:
        command = train_command(settings, overwrite=True, extra=extra)
        if not infos:
            every = settings.checkpoint_every_num_steps
            when = f" before step {failing_step}" if failing_step is not None else ""
            return (f"No checkpoint was written{when} (checkpoint_every_num_steps={every}): start again with "
                    f"overwrite=true: {command}", None, command)
        listed = "; ".join(f"step {c.step}: {(c.health or {}).get('problems', [c.why])[0] if c.health else c.why}"
                           for c in infos[-3:])
        return (f"No checkpoint of this run is healthy ({listed}): start again with overwrite=true: {command}",
                None, command)
    last = folder / "last.ckpt"
    if _last_step(folder) == best.step:
        command = train_command(settings, resume_interrupted=True, extra=extra)
        where = f"{last} holds the healthy state from before step {best.step}"
        if best.path != last:
            where += f" (as does {best.path.name})"
        text = f"{where}: {best.why}. Continue from it: {command}"
    else:
        command = train_command(settings, resume_from=best.path, extra=extra)
        text = (f"The newest healthy checkpoint is {best.path}, from before step {best.step}: {best.why}. "
                f"Continue from it: {command}")
    if failing_step is not None and best.step == failing_step:
        text += (" It holds the state right before the failing step, whose gradient a lower lr cannot change; "
                 "an older checkpoint (resume_from=) changes the steps leading here.")
    return text, best, command


def logged_rows(trainer: Any) -> list[dict[str, Any]]:
    """The run's logged rows so far (from metrics.jsonl, later rows of a step winning)."""
    from stabletrain.runfiles.history import read_run

    path = Path(trainer.out) / "metrics.jsonl"
    if not path.is_file():
        return []
    return read_run(path).rows


def guard_message(
    trainer: Any, failure: GuardFailure, capture: Optional[Path]
) -> tuple[str, Optional[CheckpointInfo], str]:
    """The guard's error message (description, what stopped where, where to continue, next steps)."""
    s = trainer.settings
    lines = [failure.describe()]
    step = failure.step if failure.step >= 0 else (failure.other_rank_step or 0)
    if failure.origin != ORIGIN_OPTIMIZER and failure.stopped_at == step:
        lines.append(f"Training stopped before the optimizer step of step {step}: the weights in memory are intact.")
    elif failure.stopped_at == step:
        lines.append(f"Training stopped right after the optimizer step of step {step}.")
    else:
        lines.append(f"Training stopped at step {failure.stopped_at}, the first point where the verdict could be read "
                     "without slowing the steps in between; the weights in memory are damaged from step "
                     f"{step} on.")
    lines.append("Nothing damaged was saved: every checkpoint is verified finite before it is written.")
    rows = logged_rows(trainer)
    unstable = _instability_start(trainer, step)
    lr_value, _ = advice.anchored_lr(s.model_args.lr, rows, unstable)
    # An optimizer step that overflowed from finite gradients is not the lr's doing when its
    # explanation names another cause (eps below the dtype's resolution).
    lr_matters = failure.origin != ORIGIN_OPTIMIZER or not failure.explanation
    lower = {"model_args.lr": lr_value} if lr_value < s.model_args.lr and lr_matters else {}
    text, best, command = resume_advice(trainer, step, extra=lower or None)
    lines.append(text)
    nexts = []
    if capture is not None:
        nexts.append(f"the optimizer step was captured: {capture}; explain and replay it offline: "
                     f"stabletrain diagnose {shell_path(capture.parent)}")
    elif failure.origin == ORIGIN_OPTIMIZER:
        cap = _capture_command(trainer, best, step)
        nexts.append(f"capture the optimizer step for stabletrain diagnose (debug_args.nancapture.enabled=true): {cap}")
    else:
        cap = _capture_command(trainer, best, step)
        nexts.append(f"turn on debug_args.nancapture.enabled=true for a capture of that step: {cap}")
    if lr_matters:
        nexts.append(f"lower the learning rate: {advice.anchored_lower_lr(s.model_args.lr, rows, unstable)}")
        if not s.gradient_clip_val:
            nexts.append("clip gradients: gradient_clip_val=1.0")
    lines.append("Next:")
    lines += [f"  - {n}" for n in nexts]
    return "\n".join(lines), best, command


def _capture_command(trainer: Any, best: Optional[CheckpointInfo], step: int) -> str:
    extra = {"debug_args.nancapture.enabled": True}
    s = trainer.settings
    if best is None:
        return train_command(s, overwrite=True, extra=extra)
    folder = checkpoint_dir(trainer.out)
    if _last_step(folder) == best.step:
        return train_command(s, resume_interrupted=True, extra=extra)
    return train_command(s, resume_from=best.path, extra=extra)


def _instability_start(trainer: Any, step: int) -> int:
    """The first step of the instability that ended at ``step``: the start of an exploding or
    non-finite episode still open in the run's history, else ``step``."""
    safety = getattr(trainer, "safety", None)  # absent in the plain-loop and integration callers
    health = getattr(safety, "health", None)
    if health is None:
        return step
    starts = [e.start_step for e in health.detector.open_episodes() if e.kind in ("exploding", "nonfinite")]
    return min([step, *starts])


def interrupt_message(trainer: Any, signal_name: str, path: Optional[Path]) -> tuple[str, str]:
    """What an interrupted run prints: the checkpoint written and the exact command to continue."""
    s = trainer.settings
    if path is None:
        command = train_command(s, overwrite=True)
        return (f"{signal_name}: stopped after step {trainer.step - 1}, but no checkpoint could be written: "
                f"start again with overwrite=true: {command}", command)
    command = train_command(s, resume_interrupted=True)
    text = f"{signal_name}: stopped after step {trainer.step - 1}; checkpoint {path} holds {trainer.step} steps."
    from stabletrain.runfiles.checkpoint import read_checkpoint_health

    try:
        _, health = read_checkpoint_health(path)
    except Exception:
        health = None
    if health is not None and not health.get("healthy"):
        advice, _, _ = resume_advice(trainer, None)
        text += f" It is not healthy ({health.get('why')}). {advice}"
    return text + f"\nContinue with: {command}", command


def keyboard_interrupt_message(trainer: Any) -> str:
    """A KeyboardInterrupt that was not our signal (raised in the middle of a step)."""
    folder = checkpoint_dir(trainer.out)
    last = _last_step(folder)
    if last is None:
        command = train_command(trainer.settings, overwrite=True)
        return (f"Interrupted during step {trainer.step}, before any checkpoint was written: start again with "
                f"overwrite=true: {command}")
    command = train_command(trainer.settings, resume_interrupted=True)
    return (f"Interrupted during step {trainer.step}; no checkpoint was written for it. Continue from the last "
            f"checkpoint ({folder / 'last.ckpt'}, {last} steps): {command}")
