"""stabletrain's tools in a Hugging Face Accelerate loop: :class:`StepMonitor`.

:class:`StepMonitor` runs the gradient norm (pre-clip, unscaled without calling ``unscale_``),
nancapture, underflow_overflow and trend alerts in your own loop, in a few calls:
``begin_step``, ``collect_batch``, ``collect_loss``, ``check`` (before clipping; raises on every
rank) and ``end_step``; on the steps you log, ``signals()`` after the optimizer step gives the
mechanism signals. See docs/integrations/accelerate.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from stabletrain.integrations.common import Settings, StepTools, StepValues, inner_optimizer

try:
    import accelerate  # noqa: F401
except ImportError:
    raise ImportError(
        "stabletrain.integrations.accelerate needs accelerate: pip install \"stabletrain[accelerate]\""
    ) from None

__all__ = ["StepMonitor", "StepValues", "precision_of"]


def precision_of(accelerator: Any, model: nn.Module) -> str:
    """The Lightning Fabric name of what ``accelerator`` runs ``model`` in (replay uses it)."""
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    if mixed == "fp16" and accelerator.scaler is not None:
        return "16-mixed"
    if mixed == "bf16" and getattr(accelerator, "native_amp", False):
        return "bf16-mixed"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float64: "64-true"}.get(dtype, "32-true")


class StepMonitor:
    """stabletrain's tools in an Accelerate loop (see the module docstring for the loop).

    Args:
        accelerator: The ``accelerate.Accelerator``.
        model: The model as ``accelerator.prepare`` returned it, or unwrapped; reports use
            the unwrapped model's names.
        out_dir: Run folder: reports and captures go to ``out_dir/debug/``.
        debug_args: The ``debug_args`` settings of ``stabletrain train`` (a dict or
            ``stabletrain.config.DebugArgs``).
        trend_alerts: The ``trend_alerts`` settings; on by default.
        step_fn: ``step_fn(model, batch) -> loss``, the function your loop computes the loss
            with; replay needs it (by ``--step-fn file.py:name``) unless the model has
            ``training_step(batch)``.
        gradient_accumulation_steps: Microbatches per step, by which each loss is divided
            before backward; default ``accelerator.gradient_accumulation_steps`` (what
            ``accelerator.backward`` divides by).
        warmup_steps: Spikes before this step are tolerated by the trend alerts.
        lr: The learning rate, for concrete next actions.
        clipping: Whether the loop clips gradients (advice).
        optimizer: The (prepared) optimizer, for the mechanism signals' weight, update and Adam
            values and the guard; default: the one :meth:`check` is given first.
        guard: :meth:`end_step` checks that the optimizer state is still finite after the
            optimizer step, and raises ``NonFiniteStepError`` naming the
            entries if not; with several processes every rank raises, a step later, naming the step
            (see :meth:`end_step`).
        on_instability: ``stabletrain train``'s ``on_instability`` settings (a dict): with
            ``{"policy": "skip_step"}`` the update of a non-finite or spiking step is not applied
            (decided in :meth:`check`, your ``optimizer.step()`` then changes nothing), each
            recovery logged and kept in :attr:`recoveries` (handled in the next :meth:`end_step`);
            past ``max_recoveries`` :meth:`end_step` raises ``RecoveryLimitError``. Leave
            nancapture off with it (it stops first).

    Example::

        with StepMonitor(accelerator, model, out_dir="out/run", step_fn=step_fn) as monitor:
            ...
    """

    def __init__(
        self,
        accelerator: Any,
        model: nn.Module,
        *,
        out_dir: Union[str, Path],
        debug_args: Settings = None,
        trend_alerts: Settings = None,
        step_fn: Optional[Callable[..., Tensor]] = None,
        gradient_accumulation_steps: Optional[int] = None,
        warmup_steps: int = 0,
        lr: Optional[float] = None,
        clipping: bool = False,
        optimizer: Any = None,
        guard: bool = True,
        on_instability: Settings = None,
    ):
        self.accelerator = accelerator
        self.model = accelerator.unwrap_model(model)
        self.tools = StepTools(
            self.model,
            framework="accelerate",
            out_dir=out_dir,
            debug_args=debug_args,
            trend_alerts=trend_alerts,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            scaler=accelerator.scaler,
            precision=precision_of(accelerator, self.model),
            gradient_accumulation_steps=gradient_accumulation_steps or accelerator.gradient_accumulation_steps,
            step_fn=step_fn,
            warmup_steps=warmup_steps,
            lr=lr,
            clipping=clipping,
            optimizer=inner_optimizer(optimizer) if optimizer is not None else None,
            guard=guard,
            on_instability=on_instability,
        )
        #: Every trend alert of the run, as ``{"event": "trend_alert", ...}`` rows.
        self.alerts = self.tools.alerts
        #: With ``on_instability`` skip_step: every skipped step, as ``{"event": "recovery", ...}`` rows.
        self.recoveries: list[dict[str, Any]] = self.tools.healing.recoveries if self.tools.healing else []

    def begin_step(self, step: int, *, log: bool = False) -> None:
        """Optimizer step ``step`` (numbered from 0) begins: before its first forward pass.
        ``log``: you will log this step, so measure the mechanism signals (:meth:`signals`)."""
        self.tools.begin_step(step, log_signals=log)

    def collect_batch(self, batch: Any, indices: Any = None) -> None:
        """A microbatch as the model receives it (on the device), just before its forward
        pass. ``indices``: its samples' dataset indices, if you know them."""
        self.tools.before_forward(batch, indices)

    def collect_loss(self, loss: Tensor) -> None:
        """The loss of the last microbatch, before ``accelerator.backward``. On the step's
        last microbatch, underflow_overflow decides on the step's forward values here.

        Raises:
            UnderflowOverflowError: On every rank, when a forward value went non-finite on any rank.
            NonFiniteStepError: With several processes, on every rank, when the last optimizer
                step left a rank's optimizer state non-finite (underflow_overflow's read carries it).
        """
        self.tools.after_forward(loss)
        if self.accelerator.sync_gradients:
            self.tools.before_last_backward()

    def check(self, optimizer: Any = None, *, read: bool = False) -> StepValues:
        """After the step's last ``accelerator.backward``, before clipping and
        ``optimizer.step()``: the gradient norm (pre-clip, unscaled) and the decisions.

        Args:
            optimizer: The prepared optimizer (under fp16: tells whether its gradients were
                already unscaled this step).
            read: Bring the gradient norm and the loss to the host (a logging step) and run
                the trend alerts on them.

        Returns:
            :class:`~stabletrain.integrations.common.StepValues`: ``grad_norm`` (device
            tensors), ``gradient_norm`` and ``loss`` (host floats, when read), ``alerts``.

        Raises:
            NaNDetectedError, UnderflowOverflowError: On every rank, when any rank failed.
            NonFiniteStepError: With several processes and nancapture on, on every rank, when the
                last step's optimizer step left a rank's optimizer state non-finite (the verdict
                rides on this step's read; the error names that step). ``collect_loss()`` raises it
                too, with underflow_overflow on.
        """
        signals = self.tools.signals
        if optimizer is not None and signals is not None and signals.updates is None:
            self.tools.set_optimizer(optimizer)  # before its first step: its hooks see the update
        return self.tools.grads_final(optimizer, read=read)

    def signals(self) -> dict[str, float]:
        """After ``optimizer.step()`` of a step begun with ``log=True``: the mechanism signals
        (``signals/...``, docs/mechanisms.md) as host floats, one host read; {} on other steps.
        Log them with your metrics, e.g. ``accelerator.log(monitor.signals(), step=step)``."""
        return self.tools.read_signals()

    def layer_norms(self, values: StepValues) -> dict[str, float]:
        """``gradient_norm/<parameter>`` and ``gradient_norm/<module>`` of a checked step, as host
        floats (one read), in the unwrapped model's names: log them on your logging steps."""
        return self.tools.layer_norms(values)

    def end_step(self) -> bool:
        """The step is over (after ``optimizer.step()``). True when underflow_overflow's
        ``abort_after_batch_num`` asks to stop after it. Raises ``NonFiniteStepError`` when the
        optimizer step left an optimizer state entry non-finite (``guard``): in one process here;
        with several, on every rank a step later, naming this step: at the next step's first
        collective read (underflow_overflow's in ``collect_loss()``, nancapture's in ``check()``),
        else here."""
        return self.tools.end_step()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed loop continues from: with ``on_instability`` skip_step, the spike
        detector's recent steps and the recoveries so far ({} without it). For
        ``accelerator.register_for_checkpointing(monitor)``: ``save_state`` then writes it and
        ``load_state`` puts it back, so the resumed run judges its first steps as the original
        would have and counts on towards ``max_recoveries``."""
        return {"on_instability": self.tools.healing.state_dict()} if self.tools.healing is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (a state without ``on_instability`` changes nothing)."""
        saved = state.get("on_instability")
        if saved and self.tools.healing is not None:
            self.tools.healing.load_state_dict(saved)

    def close(self) -> None:
        """The loop is over: check the last optimizer step, which no later step's check carries
        (the guard: one host read; with several processes a collective, so every rank calls it),
        then remove every hook (idempotent). Leaving the ``with`` block calls it. While an
        exception is on its way out (a ``finally`` block, an ``except`` clause) only the hooks go:
        the other ranks may never get there.

        Raises:
            NonFiniteStepError: The last optimizer step left an optimizer state entry non-finite.
        """
        try:
            if sys.exc_info()[1] is None:
                self.tools.finish()
        finally:
            self.tools.close()

    def __enter__(self) -> "StepMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
