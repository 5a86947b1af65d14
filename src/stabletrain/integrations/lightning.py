"""stabletrain's tools in PyTorch Lightning: :class:`StabletrainCallback`.

``Trainer(callbacks=[StabletrainCallback(debug_args=...)])`` wraps ``training_step`` for the batch,
RNG states and loss, decides at ``on_before_optimizer_step`` (before clipping; raises on every
rank) and logs ``gradient_norm`` and, after the optimizer step, the mechanism signals
(``signals/...``) to the Trainer's loggers. See docs/integrations/lightning.md.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from stabletrain import ConfigError, NaNCaptureError
from stabletrain.integrations.common import Settings, StepTools, inner_optimizer, parse_tool_settings
from stabletrain.integrations.healing import parse_on_instability

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package has the same Callback API
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError:
        raise ImportError(
            "stabletrain.integrations.lightning needs PyTorch Lightning: pip install \"stabletrain[lightning]\" "
            "(or pip install lightning)"
        ) from None

__all__ = ["StabletrainCallback", "replay_step"]


def replay_step(model: nn.Module, batch: Any, *step_args: Any) -> Tensor:
    """The loss of ``model.training_step(batch, *step_args)`` (``step_args`` holds the captured
    ``batch_idx``), outside any Trainer: replay and diagnose call it for captures of
    :class:`StabletrainCallback`, found by name in the capture.

    ``self.log`` calls in ``training_step`` do nothing without a Trainer (Lightning's warning
    about it is silenced); a ``training_step`` that needs ``self.trainer`` cannot be replayed.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\)`? but the `self\.trainer` reference.*")
        try:
            out = model.training_step(batch, *step_args)  # type: ignore[operator]
        except RuntimeError as exc:
            if "not attached to a `Trainer`" in str(exc):
                raise NaNCaptureError(
                    f"{type(model).__name__}.training_step uses self.trainer, which a replay does not have ({exc}); "
                    "keep training_step free of self.trainer (use self.global_step or pass values through the batch), "
                    "or replay with step_fn=my_step_fn that computes the same loss"
                ) from None
            raise
    if isinstance(out, Mapping):
        out = out.get("loss")
    if not isinstance(out, Tensor):
        raise NaNCaptureError(
            f"{type(model).__name__}.training_step returned {type(out).__name__} during replay, not a loss tensor "
            "(or a dict with a 'loss' entry); a step it skips cannot be replayed"
        )
    return out


class StabletrainCallback(pl.Callback):
    """stabletrain's gradient norm, mechanism signals, underflow_overflow, nancapture and trend
    alerts in a Lightning ``Trainer``.

    Args:
        debug_args: The ``debug_args`` settings of ``stabletrain train`` (a dict or
            ``stabletrain.config.DebugArgs``): ``{"nancapture": {"enabled": True}}``,
            ``{"underflow_overflow": {"enabled": True, "trace_batch_nums": [3]}}``,
            ``{"mechanisms": {"enabled": False}}`` (the ``signals/...`` keys, on by default).
        trend_alerts: The ``trend_alerts`` settings (a dict or ``TrendAlertArgs``); on by default.
        gradient_norm_per_layer: Also log ``gradient_norm/<parameter>`` and
            ``gradient_norm/<module>`` on logging steps (one host read for all of them).
        out_dir: Where ``debug/`` goes (reports, captures); default ``Trainer(default_root_dir)``.
        warmup_steps: Loss and gradient-norm spikes before this step are tolerated.
        guard: After each optimizer step, check that the optimizer state is still finite, and
            raise ``NonFiniteStepError`` naming the entries if not (one process).
        on_instability: ``stabletrain train``'s ``on_instability`` settings (a dict): with
            ``{"policy": "skip_step"}`` the update of a non-finite or spiking step is not applied:
            decided in ``on_before_optimizer_step``, inside Lightning's ``optimizer.step(closure)``,
            so the parameters and optimizer state are copied there and put back after a bad step
            (memory: one copy of each). Each recovery is logged and kept in :attr:`recoveries`;
            past ``max_recoveries`` training stops with ``RecoveryLimitError``. Automatic
            optimization only; leave nancapture off with it (it stops first).

    Attributes:
        tools: The run's :class:`~stabletrain.integrations.common.StepTools` while training.
        alerts: Every trend alert of the run, as ``{"event": "trend_alert", ...}`` rows.
        recoveries: With ``on_instability`` skip_step, every skipped step as the
            ``{"event": "recovery", ...}`` rows of ``stabletrain train``.

    Example::

        trainer = Trainer(max_steps=1000, callbacks=[StabletrainCallback(debug_args={"nancapture": {"enabled": True}})])
        try:
            trainer.fit(model, loader)
        except stabletrain.NaNDetectedError as err:
            print(err.replay_command)
    """

    def __init__(
        self,
        *,
        debug_args: Settings = None,
        trend_alerts: Settings = None,
        gradient_norm_per_layer: bool = False,
        out_dir: Optional[Union[str, Path]] = None,
        warmup_steps: int = 0,
        guard: bool = True,
        on_instability: Settings = None,
    ):
        super().__init__()
        self.guard = guard
        # Validated now: a typo fails when the callback is made, not when training starts.
        self.debug_args, self.trend_alerts = parse_tool_settings(debug_args, trend_alerts)
        self.on_instability = parse_on_instability(on_instability)
        self.recoveries: list[dict[str, Any]] = []
        self.gradient_norm_per_layer = gradient_norm_per_layer
        self.out_dir = out_dir
        self.warmup_steps = warmup_steps
        self.tools: Optional[StepTools] = None
        self.alerts: list[dict[str, Any]] = []
        #: The last step's gradient norm, a device tensor (reading it is a host sync).
        self.last_gradient_norm: Optional[Tensor] = None
        self._module: Optional[nn.Module] = None
        self._batch_idx = 0
        self._resumed: dict[str, Any] = {}  # load_state_dict's, applied when training starts

    # ------------------------------------------------------------------ setup and teardown

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.on_instability.policy == "skip_step" and not pl_module.automatic_optimization:
            raise ConfigError(
                "on_instability.policy: skip_step needs automatic optimization, but "
                f"{type(pl_module).__name__}.automatic_optimization is False (its training_step steps the "
                "optimizer itself, before the callback can decide); skip in your training_step with "
                "stabletrain.InstabilityGuard instead (docs/self_healing.md)"
            )
        needs_replayable_steps = self.debug_args.nancapture.enabled or self.debug_args.underflow_overflow.enabled
        if needs_replayable_steps and not pl_module.automatic_optimization:
            raise ConfigError(
                "debug_args: nancapture and underflow_overflow need automatic optimization, but "
                f"{type(pl_module).__name__}.automatic_optimization is False (its training_step steps the "
                "optimizer itself, so the step cannot be decided before the update or replayed); use "
                "automatic optimization while debugging, or only gradient_norm and trend_alerts"
            )
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        lr = optimizer.param_groups[0].get("lr") if optimizer is not None else None
        self.tools = StepTools(
            pl_module,
            framework="lightning",
            out_dir=Path(self.out_dir if self.out_dir is not None else trainer.default_root_dir),
            debug_args=self.debug_args,
            trend_alerts=self.trend_alerts,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            precision=str(trainer.precision),
            gradient_accumulation_steps=trainer.accumulate_grad_batches,
            step_fn=replay_step,
            warmup_steps=self.warmup_steps,
            lr=float(lr) if isinstance(lr, (int, float)) else None,
            clipping=bool(trainer.gradient_clip_val),
            optimizer=inner_optimizer(optimizer) if optimizer is not None else None,
            guard=self.guard,
            on_instability=self.on_instability,
        )
        self.alerts = self.tools.alerts
        if self.tools.healing is not None and self._resumed:
            self.tools.healing.load_state_dict(self._resumed)
        self.recoveries = self.tools.healing.recoveries if self.tools.healing is not None else []
        self._wrap(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        """Lightning writes it into each checkpoint: with ``on_instability`` skip_step, the spike
        detector's recent steps and the recoveries so far, so that ``fit(ckpt_path=...)`` judges
        its first steps as the original run would have and counts on towards ``max_recoveries``."""
        if self.tools is not None and self.tools.healing is not None:
            return {"on_instability": self.tools.healing.state_dict()}
        return {"on_instability": self._resumed} if self._resumed else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict.get("on_instability") or {})

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.tools is not None:
            self.tools.finish()  # the last optimizer step's check, which no later step's read carries
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def _wrap(self, trainer: Any, pl_module: Any) -> None:
        """Put a wrapper around this instance's ``training_step``: the batch exactly as it
        receives it and the RNG states just before it runs, the loss it returns."""
        original = pl_module.training_step
        tools = self.tools
        assert tools is not None, "_wrap runs after setup() made the step tools"

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            if tools is None or tools.closed or not torch.is_grad_enabled():
                return original(*args, **kwargs)
            batch = args[0] if args else kwargs.get("batch")
            step_args = args[1:]
            self._batch_idx = int(step_args[0]) if step_args and isinstance(step_args[0], int) else 0
            if not tools.in_step:
                tools.begin_step(trainer.global_step, log_signals=_logging_step(trainer))
            tools.before_forward(batch, step_args=step_args)
            out = original(*args, **kwargs)
            tools.after_forward(out.get("loss") if isinstance(out, Mapping) else out)
            return out

        pl_module.training_step = training_step
        self._module = pl_module
        tools.add_cleanup(self._unwrap)

    def _unwrap(self) -> None:
        if self._module is not None:
            # The instance attribute goes; the class's training_step is visible again.
            self._module.__dict__.pop("training_step", None)
            self._module = None

    def _close(self) -> None:
        self._unwrap()
        if self.tools is not None:
            self.tools.close()

    # ------------------------------------------------------------------ the step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        # Before optimizer.step(closure): its step pre-hook (the mechanism signals keep the
        # weights there) runs before the closure runs training_step.
        tools = self.tools
        if tools is not None and not tools.closed and not tools.in_step:
            tools.begin_step(trainer.global_step, log_signals=_logging_step(trainer))

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Tensor) -> None:
        tools = self.tools
        if tools is None or not tools.in_step:
            return
        k = trainer.accumulate_grad_batches
        last = (self._batch_idx + 1) % k == 0 or self._batch_idx + 1 == trainer.num_training_batches
        if last:
            tools.before_last_backward()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        tools = self.tools
        if tools is None or not tools.in_step:
            return
        logging_step = _logging_step(trainer)
        values = tools.grads_final(optimizer, read=logging_step)
        if logging_step and values.gradient_norm is not None:
            # Host floats, straight to the loggers (as Lightning's LearningRateMonitor does):
            # self.log would turn them into tensors that Lightning reads back once more.
            metrics = {"gradient_norm": values.gradient_norm}
            if self.gradient_norm_per_layer:
                metrics.update(tools.layer_norms(values))
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        self.last_gradient_norm = values.grad_norm.total

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        tools = self.tools
        if tools is None or not tools.in_step or not tools.decided:
            return
        # After the optimizer step: the mechanism signals of a logged step, in one read, at the
        # step gradient_norm was logged at.
        signals = tools.read_signals()
        if signals:
            for logger in trainer.loggers:
                logger.log_metrics(signals, step=tools.step)
        if tools.end_step():
            trainer.should_stop = True


def _logging_step(trainer: Any) -> bool:
    """Whether Lightning logs this step: (step + 1) % log_every_n_steps == 0, step from 0."""
    return (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) == 0
