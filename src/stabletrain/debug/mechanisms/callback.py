"""The trainer callback :class:`MechanismSignals`: a :class:`MechanismMonitor` wired into
``stabletrain.train`` (on by default, ``debug_args.mechanisms``). See docs/mechanisms.md."""

from __future__ import annotations

from typing import Any, Optional

from stabletrain.config import MechanismArgs
from stabletrain.debug.mechanisms import keys
from stabletrain.debug.mechanisms.monitor import MechanismMonitor, Notice
from stabletrain.events import TrainerLike


class MechanismSignals:
    """Trainer callback: the ``signals/...`` keys on every logged step, read with the step's
    one host read (``on_log_values``), none on the other steps.

    The probes run during each microbatch's forward pass of a logged step (``on_microbatch``
    to ``on_before_backward``), the optimizer's step hooks take the update. Under
    ``torch.compile`` the forward passes of logged steps run eagerly
    (``torch.compiler.set_stance("force_eager")``), the probes' Python being what a compiled
    graph cannot run; the other steps run compiled. What cannot be measured is said once, on
    the console (``train.log``), and in ``metrics.jsonl``'s ``{"event": "mechanism_signals",
    ...}`` row of the first logged step, which also lists the attention modules found and the ``parameters`` that
    ``signals/update_rms_argmax`` counts. Under DDP the probes see this rank's microbatches and
    rank 0's values are logged; under FSDP2 the weight and update values are global.

    Args:
        settings: ``debug_args.mechanisms``; default: the trainer's.

    Attributes:
        monitor: The :class:`MechanismMonitor` while training.
        event: The ``mechanism_signals`` event row, once written.
    """

    def __init__(self, settings: Optional[MechanismArgs] = None):
        self._settings = settings
        self.monitor: Optional[MechanismMonitor] = None
        self.event: Optional[dict[str, Any]] = None
        self._trainer: Optional[TrainerLike] = None
        self._compiled = False
        self._eager = False  # torch.compile's stance is "force_eager" for the forward under way

    def on_train_start(self, trainer: TrainerLike) -> None:
        s = trainer.settings
        settings = self._settings or s.debug_args.mechanisms
        self._trainer = trainer
        task = getattr(trainer, "task", None)
        self.monitor = MechanismMonitor(trainer.model, probes=settings.probes, updates=settings.updates,
                                        report=self._report, model_name=getattr(task, "model_name", "") or None)
        if not settings.probes:
            self.monitor.notice(f"{keys.ATTENTION_KEYS}, {keys.OUTPUT_KEYS}",
                                "probes=False (debug_args.mechanisms.probes=false)")
        self._compiled = settings.probes and not s.torch_compile_args.disable
        self.monitor.set_optimizer(trainer.optimizer)

    def _report(self, notice: Notice) -> None:
        if self._trainer is not None:
            self._trainer.console.info(f"Signals: {notice.text}.")

    def on_step_start(self, trainer: TrainerLike, *, step: int) -> None:
        s = trainer.settings
        logged = step % s.log_every_num_steps == 0 or step + 1 == s.steps
        if self.monitor is not None:
            self.monitor.begin_step(log=logged, probe=False)

    def on_microbatch(self, trainer: TrainerLike, *, step: int, micro_step: int, batch: Any, indices: Any) -> None:
        if self.monitor is not None:
            if self._compiled and self.monitor.armed:
                import torch

                torch.compiler.set_stance("force_eager")  # this forward runs eagerly: the probes see its calls
                self._eager = True
            self.monitor.start_probe()

    def on_before_backward(self, trainer: TrainerLike, *, step: int, micro_step: int, loss: Any) -> None:
        if self.monitor is not None:
            self.monitor.stop_probe()
        self._restore_stance()

    def _restore_stance(self) -> None:
        if self._eager:
            import torch

            torch.compiler.set_stance("default")
            self._eager = False

    def on_after_optimizer_step(self, trainer: TrainerLike, *, step: int) -> None:
        if self.monitor is not None:
            self.monitor.after_step()

    def on_log_values(self, trainer: TrainerLike, *, step: int, values: dict[str, Any]) -> None:
        if self.monitor is None or not self.monitor.armed:
            return
        values.update(self.monitor.device_values())
        if self.event is None:
            self.event = {
                "event": "mechanism_signals",
                "step": step,
                "not_measured": [n.to_dict() for n in self.monitor.notices],
                "attention_modules": self.monitor.attention_modules,
                "parameters": self.monitor.parameter_names,
            }
            trainer.log_event(self.event)

    def on_log(self, trainer: TrainerLike, *, step: int, metrics: dict[str, float]) -> None:
        if self.monitor is not None:
            self.monitor.accept(metrics)

    def on_train_end(self, trainer: TrainerLike) -> None:
        self._close()

    def on_exception(self, trainer: TrainerLike, *, exception: BaseException) -> None:
        self._restore_stance()
        self._close()

    def _close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
