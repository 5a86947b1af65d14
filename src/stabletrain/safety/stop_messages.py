"""The words a run ends with: where to continue from, and the command that does it.

Every message that recommends a checkpoint names the newest one recorded healthy
(:func:`stabletrain.safety.checkpoint_health.newest_healthy`) and says why, with a command to paste:
``resume_interrupted=true`` when that checkpoint is ``last.ckpt``'s state, ``resume_from=<file>``
when it is older, ``overwrite=true`` when the run has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from stabletrain.debug import advice
from stabletrain.debug.mechanisms import keys
from stabletrain.runfiles.checkpoint import CheckpointInfo, checkpoint_dir, list_checkpoints, newest_healthy
from stabletrain.runfiles.commands import train_command
from stabletrain.safety.guard import ORIGIN_GRADIENTS, ORIGIN_OPTIMIZER, ORIGIN_SKIPPED, GuardFailure
from stabletrain.utils.text import shell_path


def _last_step(folder: Path) -> Optional[int]:
    infos = [c for c in list_checkpoints(folder)]
    last = folder / "last.ckpt"
    for c in reversed(infos):
        if c.path == last:
            return c.step
    from stabletrain.runfiles.checkpoint import is_checkpoint, read_checkpoint_health

    try:
        return read_checkpoint_health(last)[0] if is_checkpoint(last) else None
    except Exception:
        return None


@dataclass
class Remedy:
    """The change a stop's commands carry, and why: the same settings would fail again.

    Attributes:
        cause: ``"lr"`` (the update's size), ``"precision"`` (eps below the dtype's resolution),
            ``"data"`` (a sample: the loss went non-finite from a normal value with finite
            weights), ``"start"`` (the weights or optimizer state were out of range before the
            first optimizer step checked: no setting of the steps is to blame) or ``""`` (nothing
            to change is known).
        change: The settings the continue command carries (empty: none known).
        why: One sentence for the message: what changes, from what evidence, not verified.
        samples: With ``"data"``: the dataset indices of the microbatch whose loss went
            non-finite, the ones measured non-finite alone first.
        culprits: The samples whose loss alone is non-finite (measured; empty when not).
    """

    cause: str = ""
    change: dict[str, Any] = field(default_factory=dict)
    why: str = ""
    samples: list[int] = field(default_factory=list)
    culprits: list[int] = field(default_factory=list)


def run_optimizer(trainer: Any) -> Optional[str]:
    """The optimizer that ran, as ``torch.optim.AdamW`` (a model's configure_optimizer may build
    another than ``model_args.optimizer``), else the setting."""
    from stabletrain.debug.optimizer_damage import optimizer_name

    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None:
        return optimizer_name(optimizer)
    return getattr(trainer.settings.model_args, "optimizer", None)


def _sudden(rows: list[dict[str, Any]], step: int, update_limit: float = math.inf) -> Optional[tuple[int, float]]:
    """``(step, loss)`` of the last logged finite loss before ``step`` when it was normal: within
    LOSS_RISE x the median of the logged losses before it (no growth to explain a blow-up), with
    no update of ``update_limit`` or more of the weights' size logged there (``signals/update_rms``;
    ``runaway_update``), nor a weight RMS that overflowed: such a step moved the weights far while
    the loss it logged was still normal."""
    before = [r for r in rows if isinstance(r.get("step"), int) and r["step"] < step
              and isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    if not before:
        return None
    last = before[-1]
    earlier = sorted(float(r["loss"]) for r in before[-21:-1]) or [float(last["loss"])]
    median = earlier[len(earlier) // 2]
    norms = [float(r["gradient_norm"]) for r in before[-21:] if isinstance(r.get("gradient_norm"), (int, float))]
    grew = any(not math.isfinite(n) for n in norms) or (
        len(norms) > 1 and norms[-1] > advice.NORM_RISE * sorted(norms[:-1])[len(norms[:-1]) // 2])
    if grew or abs(float(last["loss"])) > advice.LOSS_RISE * abs(median):
        return None

    def logged(prefix: str) -> list[float]:
        return [float(v) for k, v in last.items() if k.startswith(prefix) and isinstance(v, (int, float))]

    if any(not u < update_limit for u in logged(keys.UPDATE_RMS + "/")) or any(
            not math.isfinite(w) for w in logged(keys.WEIGHT_RMS + "/")):
        return None
    return int(last["step"]), float(last["loss"])


def failure_remedy(trainer: Any, step: int, failure: Optional[GuardFailure] = None,
                   loss_nonfinite: Optional[bool] = None, skipped_steps: bool = False) -> Remedy:
    """What to change after a failure at ``step``, from the evidence at hand (see :class:`Remedy`).

    Args:
        failure: The guard's finding, when the guard stopped the run.
        loss_nonfinite: Whether the loss itself went non-finite (None: read from ``failure``).
        skipped_steps: fp16 loss scaling skipped too many steps in a row (nancapture's stop).
    """
    s = trainer.settings
    rows = logged_rows(trainer)
    if failure is not None and failure.previous_step >= 0 and all(r.get("step") != failure.previous_step
                                                                    for r in rows):
        # The guard knows the last finite step even when it was not logged.
        rows = sorted([*rows, {"step": failure.previous_step, "loss": failure.previous_loss,
                               "gradient_norm": failure.previous_gradient_norm}], key=lambda r: r.get("step", -1))
    unstable = _instability_start(trainer, step)
    optimizer = run_optimizer(trainer)
    if loss_nonfinite is None:
        loss_nonfinite = failure is not None and "loss" in failure.nonfinite
    origin = failure.origin if failure is not None else (ORIGIN_SKIPPED if skipped_steps else ORIGIN_GRADIENTS)
    if failure is not None and origin == ORIGIN_OPTIMIZER and failure.before == "already":
        return Remedy("start")
    if origin == ORIGIN_GRADIENTS and loss_nonfinite and unstable == step:
        normal = _sudden(rows, step, update_limit=float(s.debug_args.mechanisms.runaway_update))
        samples, culprits, measured = _step_samples(trainer, failure, step) if normal is not None else ([], [], False)
        # Measured: some samples alone fail and the others do not. Not measurable: the sudden
        # jump from a normal loss is the evidence. Every sample failing alone is the weights'.
        singled_out = bool(culprits) and len(culprits) < len(samples)
        if normal is not None and s.on_instability.policy == "stop" and (singled_out or not measured):
            return Remedy("data", {"on_instability.policy": "skip_step"}, (
                f"It carries on_instability.policy=skip_step: the loss went non-finite in one step from a normal "
                f"value ({normal[1]:.4g} at step {normal[0]}) with finite weights, so a sample is likelier to blame "
                "than the learning rate; skip_step skips such a step's update (not verified to reach the end)."),
                samples, culprits)
    if origin == ORIGIN_SKIPPED:
        # fp16's range: the scaled gradients overflowed step after step. bfloat16 has float32's range.
        return Remedy("precision", {"precision": "bf16-mixed"}, (
            "It carries precision=bf16-mixed: float32's range in the forward and backward passes, where float16's "
            "scaled gradients overflowed step after step (not verified to train stably; precision=32-true is the "
            "other way)."))
    if failure is not None and origin == ORIGIN_OPTIMIZER and "+ eps" in failure.explanation:
        mixed = {"16-true": "16-mixed", "bf16-true": "bf16-mixed"}.get(str(getattr(trainer, "precision", "")))
        if mixed is None:
            return Remedy("precision")
        return Remedy("precision", {"precision": mixed}, (
            f"It carries precision={mixed}: float32 weights and optimizer state, where eps is not 0 "
            "(not verified to train stably)."))
    lr = float(s.model_args.lr)
    value, why = advice.anchored_lr(lr, rows, unstable, optimizer=optimizer)
    if value >= lr:
        return Remedy("lr")
    text = (f"It carries model_args.lr={advice.setting_value(value)} instead of {advice.setting_value(lr)} "
            f"({why or f'{advice.LR_DECREASE}x lower'}): unchanged, the same settings from the same state fail the "
            "same way."
            + ("" if "not verified" in why else " The new lr is not verified to train stably."))
    return Remedy("lr", {"model_args.lr": value}, text)


def _step_samples(trainer: Any, failure: Optional[GuardFailure], step: int) -> tuple[list[int], list[int], bool]:
    """The dataset indices of the step's microbatches whose loss is non-finite (the ones measured
    non-finite alone first), those whose loss alone is non-finite (each sample forwarded alone
    in eval mode, no gradient), and whether that was measured. Empty when the step's batches are
    no longer at hand."""
    safety = getattr(trainer, "safety", None)
    seen = getattr(safety, "step_batches", None)
    if not seen or seen[0] != step or (failure is not None and failure.stopped_at != step):
        return [], [], False
    _, batches, losses = seen
    samples: list[int] = []
    culprits: list[int] = []
    measured = True
    for (indices, batch), loss in zip(batches, losses):
        if math.isfinite(float(loss)):  # the failure path: host reads are fine
            continue
        ix = [int(i) for i in indices]
        samples += ix
        alone = _alone_nonfinite(trainer, batch, ix)
        measured = measured and alone is not None
        culprits += alone or []
    return [*culprits, *[i for i in samples if i not in culprits]], culprits, measured and bool(samples)


def _alone_nonfinite(trainer: Any, batch: Any, indices: list[int]) -> Optional[list[int]]:
    """The samples of ``batch`` whose loss alone is non-finite; None when it cannot be measured."""
    import torch

    model: Any = getattr(trainer, "model", None)
    step_fn = getattr(model, "training_step", None)
    # Several processes: a forward may hold collectives (FSDP2 gathers) that the other ranks would
    # not join; the microbatch is named instead.
    if not callable(step_fn) or len(indices) > 256 or getattr(trainer, "world_size", 1) > 1:
        return None

    def one(x: Any, i: int) -> Any:
        if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == len(indices):
            return x[i:i + 1]
        if isinstance(x, dict):
            return {k: one(v, i) for k, v in x.items()}
        if isinstance(x, (list, tuple)) and not isinstance(x, str):
            return type(x)(one(v, i) for v in x)
        return x

    bad = []
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for k, ix in enumerate(indices):
                loss = step_fn(one(batch, k))
                if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()):
                    bad.append(ix)
    except Exception:  # a batch that cannot be cut into samples: the microbatch is named instead
        return None
    finally:
        model.train(was)
    return bad


def resume_advice(trainer: Any, failing_step: Optional[int], extra: Optional[dict[str, Any]] = None,
                  note: str = "") -> tuple[str, Optional[CheckpointInfo], str]:
    """``(sentence, checkpoint, command)``: where to continue after a failure at
    ``failing_step`` (None: not a failure), and the command that does it with ``extra``
    settings (e.g. a lower lr); ``note`` says what the change is and that it is not verified.
    A failure with no change says plainly that the command repeats the settings that failed."""
    text, best, command = _resume_advice(trainer, failing_step, extra)
    if note:
        cut = text.find(" It holds the state right before")
        text = text + "\n" + note if cut < 0 else text[:cut] + "\n" + note + text[cut:]
    elif failing_step is not None and not extra:
        text += ("\nAs printed, it repeats the settings that failed (a resumed run is bitwise exact): change a "
                 "setting first.")
    return text, best, command


def _resume_advice(trainer: Any, failing_step: Optional[int], extra: Optional[dict[str, Any]] = None
                   ) -> tuple[str, Optional[CheckpointInfo], str]:
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
        listed = "; ".join(f"step {c.step}: {((c.health or {}).get('problems') or [c.why])[0]}" for c in infos[-3:])
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
    if failing_step is not None and best.step == failing_step and "model_args.lr" in (extra or {}):
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
    if mechanisms_note(trainer, step):
        lines.append(mechanisms_note(trainer, step))
    rows = logged_rows(trainer)
    unstable = _instability_start(trainer, step)
    optimizer = run_optimizer(trainer)
    remedy = failure_remedy(trainer, step, failure)
    text, best, command = resume_advice(trainer, step, extra=remedy.change or None, note=remedy.why)
    lines.append(text)
    nexts = []
    if remedy.cause == "start":
        nexts.append("check the weights and optimizer state the run started from (its initialisation, or the "
                     "checkpoint it resumed from): they were out of range before its first optimizer step")
    if remedy.cause == "data":
        shown = ", ".join(map(str, remedy.samples[:8])) + (f" (+{len(remedy.samples) - 8} more)"
                                                             if len(remedy.samples) > 8 else "")
        if remedy.culprits:
            nexts.append(f"check the data: sample(s) {', '.join(map(str, remedy.culprits[:8]))} give a non-finite "
                         f"loss alone (measured with the weights of step {step}); the microbatch held {shown}")
        elif remedy.samples:
            nexts.append(f"check the data: the microbatch whose loss went non-finite held samples {shown}")
        else:
            nexts.append("check the data of this step: a sample is the likely cause")
    if capture is not None:
        nexts.append(f"the optimizer step was captured: {capture}; explain and replay it offline: "
                     f"stabletrain diagnose {shell_path(capture.parent)}")
    elif remedy.cause == "start":
        pass  # no step did it: nothing to capture
    elif failure.origin == ORIGIN_OPTIMIZER:
        cap = _capture_command(trainer, best, step)
        nexts.append(f"capture the optimizer step for stabletrain diagnose (debug_args.nancapture.enabled=true): {cap}")
    else:
        cap = _capture_command(trainer, best, step)
        what = "to isolate the culprit sample" if remedy.cause == "data" else "for a capture of that step"
        nexts.append(f"turn on debug_args.nancapture.enabled=true {what}: {cap}")
    if remedy.cause == "data":
        nexts.append("or skip such steps: on_instability.policy=skip_step (see docs/self_healing.md); the learning "
                     "rate is not what the evidence points at")
    elif remedy.cause == "lr":
        lower = advice.anchored_lower_lr(s.model_args.lr, rows, unstable, optimizer=optimizer)
        if remedy.change:
            nexts.append(f"lower the learning rate: {lower}; {advice.update_size(optimizer)}")
        state_trip = any(t.kind != "parameter" and t.name.endswith("exp_avg_sq") for t in failure.trips)
        if not s.gradient_clip_val and (advice.clipping_helps(optimizer) or state_trip):
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


def mechanisms_note(trainer: Any, step: int) -> str:
    """"Before it, the logged signals named ..." for a stop at ``step``; "" when they named nothing."""
    before = _mechanisms_before(trainer, step)
    if not before:
        return ""
    return ("Before it, the logged signals named " + "; then ".join(m.describe() for m in before)
            + " (docs/mechanisms.md).")


def _mechanisms_before(trainer: Any, step: int) -> list[Any]:
    """The mechanisms the run's signals named that began at or before ``step`` (open or closed since)."""
    health = getattr(getattr(trainer, "safety", None), "health", None)
    detector = getattr(health, "mechanisms", None)
    if detector is None:
        return []
    return [m for m in detector.found if m.start_step <= step]


def _instability_start(trainer: Any, step: int) -> int:
    """The first step of the instability that ended at ``step``: the start of an exploding or
    non-finite episode still open in the run's history, or of a mechanism the signals named, else ``step``."""
    safety = getattr(trainer, "safety", None)  # absent in the plain-loop and integration callers
    health = getattr(safety, "health", None)
    if health is None:
        return step
    starts = [e.start_step for e in health.detector.open_episodes() if e.kind in ("exploding", "nonfinite")]
    starts += [m.start_step for m in _mechanisms_before(trainer, step)]
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
        # Not a failure, but the run was going bad: the way on is the newest healthy checkpoint with
        # the change the evidence points at (unchanged, the same state would go bad the same way);
        # continuing the interrupted state as it is stays possible, said as such.
        remedy = failure_remedy(trainer, trainer.step)
        advice, _, healthy = resume_advice(trainer, trainer.step, extra=remedy.change or None, note=remedy.why)
        text += (f" It is not healthy ({health.get('why')}). {advice}\nTo continue the interrupted run as it is "
                 f"anyway (the same settings from a state that is not healthy): {command}")
        return text + f"\nContinue with: {healthy}", healthy
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
    text = f"Interrupted during step {trainer.step}; no checkpoint was written for it."
    from stabletrain.runfiles.checkpoint import read_checkpoint_health

    try:
        _, health = read_checkpoint_health(folder / "last.ckpt")
    except Exception:
        health = None
    if health is not None and not health.get("healthy"):  # as interrupt_message: the healthy one, with the change
        remedy = failure_remedy(trainer, trainer.step)
        advice, _, _ = resume_advice(trainer, trainer.step, extra=remedy.change or None, note=remedy.why)
        return (f"{text} The last checkpoint ({folder / 'last.ckpt'}, {last} steps) is not healthy "
                f"({health.get('why')}). {advice}")
    return f"{text} Continue from the last checkpoint ({folder / 'last.ckpt'}, {last} steps): {command}"
