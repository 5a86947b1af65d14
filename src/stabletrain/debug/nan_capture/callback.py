"""The trainer's callback for ``debug_args.nancapture``: a :class:`NaNCaptureMonitor` per run.
See ``docs/nancapture.md``."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from stabletrain.debug.advice import resume_after_stop
from stabletrain.debug.grad_norm import GradNorm
from stabletrain.events import TrainerLike

from .commands import default_replay_command
from .errors import NaNDetectedError
from .monitor import NaNCaptureMonitor


class NaNCaptureCallback:
    """Wires :class:`NaNCaptureMonitor` into the trainer (``debug_args.nancapture``).

    The trainer calls ``on_microbatch`` after the batch is on the device and just before
    the forward pass, and ``on_after_backward`` with the gradient norm it computed after
    un-scaling and before clipping, which the check reuses.
    """

    def __init__(self, args: Any):
        self.args = args
        self.monitor: Optional[NaNCaptureMonitor] = None

    def on_train_start(self, trainer: TrainerLike) -> None:
        settings = trainer.resolved_settings()
        custom = settings.get("task") == "custom"
        folder = trainer.out / "debug" / "nan_capture"
        self.monitor = NaNCaptureMonitor(
            trainer.model,
            folder,
            rank=trainer.rank,
            world_size=trainer.world_size,
            scaler=trainer.scaler,
            max_skipped_steps=self.args.max_skipped_steps,
            precision=trainer.precision,
            gradient_accumulation_steps=trainer.settings.gradient_accumulation_steps,
            settings=settings,
            model_meta=dict(trainer.task.model_meta),
            any_rank=trainer.any_rank,
            # One process: its rank folder. Several: the folder of all ranks, replayed together.
            replay_command=default_replay_command(
                folder / f"rank{trainer.rank}" if trainer.world_size == 1 else folder,
                model=trainer.model,
                builtin=not custom,
            ),
        )
        self.monitor.advice = lambda step: self._advice(trainer, step)

    def on_step_start(self, trainer: TrainerLike, *, step: int) -> None:
        assert self.monitor is not None
        self.monitor.begin_step(step)

    def on_microbatch(self, trainer: TrainerLike, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        assert self.monitor is not None
        self.monitor.collect_batch(batch, indices)

    def on_after_microbatch(self, trainer: TrainerLike, *, step: int, micro_step: int, loss: Tensor) -> None:
        assert self.monitor is not None
        self.monitor.collect_loss(loss)

    def on_after_backward(self, trainer: TrainerLike, *, step: int, grad_norm: GradNorm) -> None:
        assert self.monitor is not None
        self.monitor.check_and_capture(grad_norm)

    def on_train_end(self, trainer: TrainerLike) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def on_exception(self, trainer: TrainerLike, *, exception: BaseException) -> None:
        if isinstance(exception, NaNDetectedError):
            # An event row in metrics.jsonl (and the other loggers), next to the last logged step.
            trainer.log_event({
                "event": "nan_detected",
                "step": exception.step,
                "reason": exception.reason,
                "nan_param_names": exception.nan_param_names,
                "capture": str(exception.capture_path),
            })
        if self.monitor is not None:
            self.monitor.close()

    def _advice(self, trainer: TrainerLike, step: int) -> str:
        """Where to continue: the trainer names the newest checkpoint recorded healthy (measured
        when written, see stabletrain.safety.checkpoint_health), with a command to paste."""
        bad_loss = self.monitor.loss_nonfinite if self.monitor is not None else None
        reason = self.monitor.last_reason if self.monitor is not None else ""
        text = resume_after_stop(trainer, step, loss_nonfinite=bad_loss, reason=reason)
        return "No non-finite value reached the optimizer or a checkpoint. " + text
