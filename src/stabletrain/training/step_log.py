"""One logged step: the step's values read back in one sync, turned into the metrics row.

The row's keys are listed in docs/training.md; the guard's verdict and the values callbacks add
in ``on_log_values`` (the ``signals/...`` keys, docs/mechanisms.md) ride on the same read.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stabletrain.debug.grad_norm import GradNorm, layer_grad_norms
from stabletrain.loggers.console import progress_line
from stabletrain.utils.amp import scale_tensor


@dataclass
class StepClock:
    """Wall time of the run and of the steps since the last logged one (for the rates)."""

    start: float = field(default_factory=time.perf_counter)
    last: float = 0.0
    steps_at_last: int = 0

    def __post_init__(self) -> None:
        self.last = self.last or self.start


def log_step(trainer: Any, step: int, losses: list[torch.Tensor], gn: GradNorm, lr: float) -> dict[str, float]:
    """Log ``step``'s metrics to the loggers and the progress line, and hand the guard its verdict.

    ``trainer`` is the :class:`~stabletrain.training.loop.Trainer`; returns the metrics row.
    """
    loss = torch.stack(losses).float().mean()
    task_names, task_values = training_metrics(trainer.model, loss.device)
    if trainer.world_size > 1:
        # Every rank saw as many samples: the mean over ranks is the metric over all of them.
        reduced = trainer.fabric.all_reduce(torch.cat([loss.reshape(1), task_values]), reduce_op="mean")
        loss, task_values = reduced[0], reduced[1:]
    values = [loss, gn.total.to(loss.device)]
    if trainer.scaler is not None:
        values.append(scale_tensor(trainer.scaler, loss.device))
        guard = trainer.safety.guard
        values.append(guard.skipped_total if guard is not None else torch.full((), math.nan))
    flat = torch.stack([v.float().reshape(()).to(loss.device) for v in values]).double()
    layer_names: list[str] = []
    if trainer.settings.gradient_norm_per_layer:
        layer_names, layer_norms = layer_grad_norms(gn)
        flat = torch.cat([flat, layer_norms.to(loss.device).double()])
    flat = torch.cat([flat, task_values.double()])
    extra_names, extra_values = callback_values(trainer, step, loss.device)
    flat = torch.cat([flat, extra_values])
    terms = trainer.safety.verdict_terms()
    n_flat = len(flat)
    if terms is not None:
        flat = torch.cat([flat, terms.to(loss.device)])
    host = flat.tolist()  # the step's one sync, the guard's verdict with it
    metrics = _row(trainer, step, host, lr)
    if layer_names:
        offset = len(values)
        metrics.update({f"gradient_norm/{n}": host[offset + i] for i, n in enumerate(layer_names)})
    n_task = n_flat - len(extra_names)
    metrics.update(zip(task_names, host[n_task - len(task_names) : n_task]))
    metrics.update(zip(extra_names, host[n_task:n_flat]))
    if trainer.fabric.device.type == "cuda":
        metrics["max_memory_gb"] = torch.cuda.max_memory_allocated(trainer.fabric.device) / 2**30
    trainer.last_metrics = metrics
    if trainer.is_rank_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step)
        trainer.console.progress(progress_line(step, trainer.settings.steps, metrics))
    trainer.safety.health.observe(step, metrics)
    trainer.callbacks("on_log", trainer, step=step, metrics=metrics)
    trainer.safety.absorb(host[n_flat:], stopped_at=step)
    return metrics


def _row(trainer: Any, step: int, host: list[float], lr: float) -> dict[str, float]:
    """Loss, norm, lr, progress and rates; ``host`` holds loss, norm (and scale, skips) first."""
    clock: StepClock = trainer.clock
    now = time.perf_counter()
    steps_since = max(1, step + 1 - clock.steps_at_last)
    dt = now - clock.last
    steps_per_s = steps_since / dt if dt > 0 else float("nan")
    s = trainer.settings
    metrics: dict[str, float] = {
        "loss": host[0],
        "gradient_norm": host[1],
        "lr": lr,
        "epoch": trainer.microbatches_consumed / trainer.sampler.batches_per_epoch,
        "samples": (step + 1) * s.batch_size,
        "elapsed_s": now - clock.start,
        "steps_per_s": steps_per_s,
        "samples_per_s": steps_per_s * s.batch_size,
        "eta_s": (s.steps - step - 1) / steps_per_s if steps_per_s > 0 else float("nan"),
    }
    if trainer.scaler is not None:
        metrics["loss_scale"] = host[2]
        if math.isfinite(host[3]):
            metrics["skipped_steps"] = host[3]
    clock.last, clock.steps_at_last = now, step + 1
    return metrics


def training_metrics(model: nn.Module, device: torch.device) -> tuple[list[str], torch.Tensor]:
    """The model's ``training_metrics()`` (see :mod:`stabletrain.tasks.base`) as names and one
    float32 device vector, read later with the step's other values."""
    read = getattr(model, "training_metrics", None)
    metrics = read() if callable(read) else {}
    values = [v.detach().float().reshape(()).to(device) for v in metrics.values()]
    return list(metrics), torch.stack(values) if values else torch.zeros(0, device=device)


def callback_values(trainer: Any, step: int, device: torch.device) -> tuple[list[str], torch.Tensor]:
    """The device scalars callbacks add in ``on_log_values`` (e.g. the ``signals/...`` keys), as
    names and one float64 vector on ``device``, read later with the step's other values."""
    values: dict[str, torch.Tensor] = {}
    trainer.callbacks("on_log_values", trainer, step=step, values=values)
    tensors = [v.detach().reshape(()).to(device, torch.float64) for v in values.values()]
    return list(values), torch.stack(tensors) if tensors else torch.zeros(0, device=device)
