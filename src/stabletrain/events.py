"""The named points of a training step where monitors, loggers and user callbacks attach.

A callback is any object; the trainer calls ``callback.on_<event>(trainer, **kwargs)`` only
on callbacks that define that method. What a callback may use of ``trainer`` is
:class:`TrainerLike`. The loop, as the trainer runs it::

    on_train_start(trainer)                       # after setup and resume, before step `start`
    for step in range(start, steps):
        on_step_start(trainer, step=step)
        for micro_step in range(gradient_accumulation_steps):
            batch, indices = next(data)           # batch already on the device
            on_microbatch(trainer, step=step, micro_step=micro_step, batch=batch, indices=indices)
            loss = model.training_step(batch)     # under the precision's autocast, through DDP
            on_before_backward(trainer, step=step, micro_step=micro_step, loss=loss)
            backward(loss / gradient_accumulation_steps)   # fp16: scaled by the GradScaler
            on_after_microbatch(trainer, step=step, micro_step=micro_step, loss=loss)
        unscale gradients (fp16 loss scaling only)
        grad_norm = compute_grad_norm(...)        # device tensors, no host sync
        on_after_backward(trainer, step=step, grad_norm=grad_norm)   # gradients final and unscaled
        guard: loss and grad_norm finite?         # on the device; stops here if already known
        clip gradients to gradient_clip_val (reusing grad_norm.total)
        on_before_optimizer_step(trainer, step=step)
        optimizer.step()
        guard: parameters and optimizer state finite?   # on the device
        optimizer.zero_grad()
        on_after_optimizer_step(trainer, step=step)
        if logging step:
            on_log_values(trainer, step=step, values=values)   # callbacks add device scalars to values
            metrics = {..., **values}             # host floats: one sync (the guard's verdict with it)
            on_log(trainer, step=step, metrics=metrics)
        stop on SIGINT/SIGTERM or a guard verdict  # ranks agree (one host all-reduce under DDP)
        if checkpoint step:
            on_checkpoint_save(trainer, step=step, state=state)   # may add entries to state
            verify finite on the device, record health; write checkpoints/last.ckpt
    on_train_end(trainer)                          # after the final checkpoint

    on_exception(trainer, exception=exc)          # any exception escaping the loop
    on_checkpoint_load(trainer, state=state)      # when resuming, before on_train_start

``loss`` and ``grad_norm`` are device tensors: reading them (``.item()``, ``float()``,
``bool()``) forces a host synchronisation, which is what makes debugging tools slow on a GPU.
Decide once per step, on the device where possible. A callback that wants values of its own in
the metrics row adds them in ``on_log_values`` as device scalars (``values["my/key"] = tensor``):
they ride on the logged step's one read and reach every logger, and ``on_log`` sees them as floats.

Distributed runs: every rank calls every event at the same point. A callback that wants to
stop training because of something only its rank saw must not simply raise (the other ranks
would wait forever in the next collective): it calls ``trainer.any_rank(flag)`` at a point all
ranks reach, and every rank raises together when any flag is set.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from stabletrain.config import TrainSettings
    from stabletrain.loggers.base import Logger
    from stabletrain.loggers.console import Console
    from stabletrain.tasks.base import Task

EVENTS = (
    "on_train_start",
    "on_step_start",
    "on_microbatch",
    "on_before_backward",
    "on_after_microbatch",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_after_optimizer_step",
    "on_log_values",
    "on_log",
    "on_checkpoint_save",
    "on_checkpoint_load",
    "on_train_end",
    "on_exception",
)


@runtime_checkable
class TrainerLike(Protocol):
    """What a callback may use of the trainer it is given; :class:`stabletrain.Trainer` is one.

    Attributes:
        fabric: The ``lightning_fabric.Fabric`` running the loop (device, collectives).
        settings: The validated settings.
        model: The user's module, unwrapped (no DDP or compile wrapper; your parameter names).
            Under ``strategy=fsdp`` its parameters and gradients are DTensor shards (``sharded``).
        optimizer: The optimizer.
        scaler: The fp16 ``torch.amp.GradScaler``, or None.
        precision: The resolved precision ("32-true", "bf16-mixed", ...).
        out: The run folder.
        rank, world_size: This process and the number of processes.
        step: The optimizer step running now (numbered from 0).
        task: The task (its ``name``, ``model_meta`` and dataset).
        console: Prints on rank 0 and writes ``train.log``.
        loggers: The metric loggers (rank 0 only; empty elsewhere).
        sharded: True under FSDP2 (``strategy=fsdp``): see docs/distributed.md.
    """

    fabric: Any
    settings: TrainSettings
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Optional[torch.amp.GradScaler]
    precision: str
    out: Path
    rank: int
    world_size: int
    step: int
    task: Task
    console: Console
    loggers: list[Logger]
    sharded: bool

    def any_rank(self, flag: bool | torch.Tensor) -> bool:
        """True on every rank when ``flag`` is true on any (every rank calls it at the same point)."""
        ...

    def max_over_ranks(self, value: float | torch.Tensor) -> float:
        """The largest ``value`` over the ranks, on every rank (every rank calls it at the same point)."""
        ...

    def request_stop(self, reason: str) -> None:
        """Finish the current step (log it, checkpoint it), then stop training."""
        ...

    def log_event(self, event: dict[str, Any]) -> None:
        """Give every logger an event row, e.g. ``{"event": "resume", "step": 100}`` (rank 0 only)."""
        ...

    def resolved_settings(self) -> dict[str, Any]:
        """The settings as run (JSON-compatible): resolved task, precision and world size."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """The resumable state between steps (collective when distributed)."""
        ...


class Callback:
    """Optional base class; subclassing it is not required. It only documents the signatures."""

    def on_train_start(self, trainer: TrainerLike) -> None: ...

    def on_step_start(self, trainer: TrainerLike, *, step: int) -> None: ...

    def on_microbatch(self, trainer: TrainerLike, *, step: int, micro_step: int, batch: Any, indices: Any) -> None: ...

    def on_before_backward(self, trainer: TrainerLike, *, step: int, micro_step: int, loss: Any) -> None: ...

    def on_after_microbatch(self, trainer: TrainerLike, *, step: int, micro_step: int, loss: Any) -> None: ...

    def on_after_backward(self, trainer: TrainerLike, *, step: int, grad_norm: Any) -> None: ...

    def on_before_optimizer_step(self, trainer: TrainerLike, *, step: int) -> None: ...

    def on_after_optimizer_step(self, trainer: TrainerLike, *, step: int) -> None: ...

    def on_log_values(self, trainer: TrainerLike, *, step: int, values: dict[str, Any]) -> None: ...

    def on_log(self, trainer: TrainerLike, *, step: int, metrics: dict[str, float]) -> None: ...

    def on_checkpoint_save(self, trainer: TrainerLike, *, step: int, state: dict[str, Any]) -> None: ...

    def on_checkpoint_load(self, trainer: TrainerLike, *, state: dict[str, Any]) -> None: ...

    def on_train_end(self, trainer: TrainerLike) -> None: ...

    def on_exception(self, trainer: TrainerLike, *, exception: BaseException) -> None: ...


class CallbackList:
    """Calls an event on every callback that defines it, in order.

    Handlers are looked up once, so an event no callback handles costs a dict lookup.
    """

    def __init__(self, callbacks: list[Any]):
        self.callbacks = list(callbacks)
        self._handlers: dict[str, list[Any]] = {}
        for name in EVENTS:
            handlers = []
            for cb in self.callbacks:
                fn = getattr(cb, name, None)
                # Callback's own no-op methods are skipped.
                if callable(fn) and getattr(type(cb), name, None) is not getattr(Callback, name):
                    handlers.append(fn)
            self._handlers[name] = handlers

    def has(self, event: str) -> bool:
        return bool(self._handlers[event])

    def __call__(self, event: str, trainer: TrainerLike, **kwargs: Any) -> None:
        for fn in self._handlers[event]:
            fn(trainer, **kwargs)
