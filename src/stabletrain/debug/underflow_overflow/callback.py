"""``debug_args.underflow_overflow`` in ``stabletrain.train``: the callback that wires an
:class:`UnderflowOverflowMonitor` into the trainer and decides together with the other ranks,
and the check of its settings. See ``docs/underflow_overflow.md`` (Settings, Cost).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from stabletrain.config import TrainSettings, UnderflowOverflowArgs
from stabletrain.debug.advice import resume_after_stop
from stabletrain.events import TrainerLike
from stabletrain.utils.dist import ranks_with

from .errors import UnderflowOverflowError
from .monitor import UnderflowOverflowMonitor

__all__ = ["SCALER_PATIENCE", "UnderflowOverflowCallback", "check_settings"]

#: Under fp16 loss scaling, the SCALER_PATIENCE-th step in a row with a non-finite gradient is
#: an error (the GradScaler skips such steps and lowers the scale; a real fault keeps coming back).
SCALER_PATIENCE = 10


class UnderflowOverflowCallback:
    """Attaches an :class:`UnderflowOverflowMonitor` to ``trainer.model`` (the user's module, so
    names carry no wrapper prefixes) and decides at two points every rank reaches: before the
    backward of the step's last microbatch (every forward of the step) and after the last
    backward (before clipping and the optimizer step), one ``trainer.max_over_ranks`` each.

    At each decision every rank contributes a code (2: a forward value is non-finite, 1: only
    a gradient is, 0: all finite) and the ranks agree on the largest. When it is not 0, every
    rank writes its report and raises :class:`UnderflowOverflowError` at the same point, so none
    is left waiting in a collective; except under fp16 loss scaling, where a code of 1 is the
    GradScaler skipping a step, and only the ``SCALER_PATIENCE``-th such step in a row fails.
    """

    def __init__(self, args: UnderflowOverflowArgs):
        self.args = args
        self.monitor: Optional[UnderflowOverflowMonitor] = None
        self._skipped = 0  # steps in a row the GradScaler skipped
        self._loss: Optional[Tensor] = None  # the last microbatch's loss, read only if the step fails

    def _watching(self) -> UnderflowOverflowMonitor:
        assert self.monitor is not None, "on_train_start attaches the monitor"
        return self.monitor

    def on_train_start(self, trainer: TrainerLike) -> None:
        a = self.args
        self.monitor = UnderflowOverflowMonitor(
            trainer.model,
            out_dir=Path(trainer.out) / "debug",
            rank=trainer.rank,
            max_frames_to_save=a.max_frames_to_save,
            trace_batch_nums=a.trace_batch_nums,
            include_backward=a.include_backward,
            auto_check=False,
        )
        trainer.console.info(
            f"underflow_overflow: watching {self.monitor.num_watched_modules} modules"
            f"{' forward and backward' if a.include_backward else ' (forward only)'}; "
            f"report: {self.monitor.log_path}"
        )

    def on_step_start(self, trainer: TrainerLike, *, step: int) -> None:
        self._watching().set_step(step)

    def on_microbatch(self, trainer: TrainerLike, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        self._watching().micro_step = micro_step

    def on_before_backward(self, trainer: TrainerLike, *, step: int, micro_step: int, loss: Tensor) -> None:
        monitor = self._watching()
        monitor.record_loss(loss)
        self._loss = loss.detach()
        if micro_step == trainer.settings.gradient_accumulation_steps - 1 and not monitor.tracing:
            self._decide(trainer, "forward")

    def on_after_backward(self, trainer: TrainerLike, *, step: int, grad_norm: Any) -> None:
        monitor = self._watching()
        if monitor.tracing:
            if monitor.has_records:
                monitor.write_trace()
        elif monitor.include_backward:
            self._decide(trainer, "backward")

    def on_after_optimizer_step(self, trainer: TrainerLike, *, step: int) -> None:
        stop = self.args.abort_after_batch_num
        if stop is not None and step >= stop:
            monitor = self._watching()
            where = f"; traced steps are in {monitor.log_path}" if monitor.log_written else ""
            trainer.request_stop(f"debug_args.underflow_overflow.abort_after_batch_num={stop} reached{where}")

    def _decide(self, trainer: TrainerLike, phase: str) -> None:
        monitor = self._watching()
        code = monitor.nonfinite_code()
        worst = int(trainer.max_over_ranks(code))  # the one host sync of this decision
        if worst == 0:
            monitor.accept()
            if phase == "backward":
                self._skipped = 0
            return
        if worst == 1 and trainer.scaler is not None and self._scaler_skips(trainer, phase):
            return
        detected = ranks_with(code > 0, trainer.fabric)
        try:
            monitor.fail(detected_by=detected, phase="forward" if worst == 2 else "backward")
        except UnderflowOverflowError as exc:
            trainer.log_event({
                "event": "underflow_overflow", "step": exc.step, "phase": exc.phase or phase, "module": exc.module,
                "tensor": exc.tensor, "value": exc.value, "detected_by": exc.detected_by, "report": str(exc.log_path),
            })
            exc.add_advice(self._advice(trainer, exc.step, phase="forward" if worst == 2 else "backward"))
            raise

    def _advice(self, trainer: TrainerLike, step: int, phase: str) -> str:
        """What stopped where, and where to continue (the trainer's newest healthy checkpoint)."""
        loss = self._loss
        bad_loss = None if loss is None else not bool(torch.isfinite(loss).all())
        when = "before its backward pass" if phase == "forward" else "before its optimizer step"
        # Not "the weights are intact": earlier steps may have made them huge (finite); this step
        # did not update them.
        where = resume_after_stop(trainer, step, loss_nonfinite=bad_loss)
        return (f"Training stopped at step {step} {when}: this step did not update the weights, and no non-finite "
                f"value reached the optimizer or a checkpoint. {where}")

    def _scaler_skips(self, trainer: TrainerLike, phase: str) -> bool:
        """Only scaled gradients are non-finite: whether this is the GradScaler skipping the step
        (True, and the records are kept or forgotten) rather than the fault that keeps coming back."""
        if phase == "forward":
            # Gradients of earlier microbatches (gradient accumulation): keep their records for
            # the end of the step, which counts the skipped step once.
            return True
        self._skipped += 1
        if self._skipped >= SCALER_PATIENCE:
            return False
        self._watching().accept()
        trainer.log_event({"event": "underflow_overflow_scaler_skip", "step": trainer.step, "in_a_row": self._skipped})
        return True

    def _close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    def on_train_end(self, trainer: TrainerLike) -> None:
        self._close()

    def on_exception(self, trainer: TrainerLike, *, exception: BaseException) -> None:
        self._close()


def check_settings(settings: TrainSettings) -> list[str]:
    """Problems with ``debug_args.underflow_overflow`` given the other settings."""
    args = settings.debug_args.underflow_overflow
    problems = []
    if args.enabled and not settings.torch_compile_args.disable:
        problems.append(
            "debug_args.underflow_overflow.enabled: cannot be combined with torch_compile_args.disable=false: the "
            "monitor reads every module's inputs and outputs at every step, and a compiled graph has no module "
            "boundaries to read (fused kernels never materialise most of them; running every step eagerly would "
            "undo the compile). Set torch_compile_args.disable=true while debugging, or keep compiling with "
            "debug_args.nancapture.enabled=true: the failing step is captured, and stabletrain diagnose replays it "
            "eagerly and names the op and module where the first NaN/Inf appears"
        )
    return problems
