"""Setting a run up: the Fabric, the out folder, the debugging callbacks, settings.json and the
opening lines of train.log (see docs/training.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stabletrain import __version__
from stabletrain.config import TorchCompileArgs, TrainSettings
from stabletrain.errors import ConfigError
from stabletrain.tasks import resolve_task_name
from stabletrain.training import checks
from stabletrain.training.checks import resolve_precision, settings_warnings
from stabletrain.utils.io import atomic_write_text

#: Files and folders a run writes directly under ``out/``; ``overwrite=True`` removes these only.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "train.log",
    "settings.json",
    "checkpoints",
    "debug",
    "quarantine.json",
    "report",
    "tensorboard",
    "mlflow.db",
    "mlruns",
    "wandb",
)


def make_fabric(settings: TrainSettings) -> Any:
    """A ``lightning_fabric.Fabric`` for the settings; ConfigError when this machine or Fabric refuses."""
    from lightning_fabric import Fabric

    s = settings
    available = checks.available_accelerators()
    if s.accelerator not in available:
        # Fabric's own error for 'gpu' names no alternative; say what this machine has.
        raise ConfigError(
            f"accelerator: {s.accelerator!r} is not available on this machine; "
            f"available here: {', '.join(available)}"
        )
    strategy: Any = s.strategy
    precision: Any = resolve_precision(s.precision, s.accelerator)
    plugins: list[Any] = []
    if checks.is_fsdp(s):
        from stabletrain.distributed.fsdp import fabric_strategy

        strategy = fabric_strategy(s.strategy)
        if precision == "16-mixed":
            # ModelParallelStrategy refuses the precision string; the plugin object gives fp16 autocast with a
            # GradScaler, whose found-inf check of DTensor gradients is agreed over the mesh (docs/distributed.md).
            plugins, precision = [fp16_plugin(s.accelerator)], None
    try:
        return Fabric(
            accelerator=s.accelerator,
            devices=s.devices,
            num_nodes=s.num_nodes,
            strategy=strategy,
            precision=precision,
            plugins=plugins or None,
        )
    except (ValueError, RuntimeError, TypeError, ImportError) as exc:
        raise ConfigError(
            f"accelerator/devices/strategy/precision: Lightning Fabric refused "
            f"accelerator={s.accelerator!r}, devices={s.devices!r}, strategy={s.strategy!r}, "
            f"precision={s.precision!r}: {exc}"
        ) from None


def fp16_plugin(accelerator: str, init_scale: float = 2.0**16) -> Any:
    """Fabric's ``MixedPrecision("16-mixed")`` with a ``torch.amp.GradScaler`` on the device type of
    ``accelerator`` (``cuda`` for a GPU, ``cpu`` otherwise: fp16 autocast and loss scaling on the CPU too)."""
    from lightning_fabric.plugins import MixedPrecision

    gpu = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    device = "cuda" if gpu else "cpu"
    return MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, init_scale=init_scale))


def prepare_out_dir(settings: TrainSettings, out: Path) -> None:
    """Create ``out``; with ``overwrite`` (and no resume) first remove what an earlier run wrote."""
    resuming = settings.resume_interrupted or settings.resume_from is not None
    if settings.overwrite and not resuming and out.is_dir():
        for name in RUN_OUTPUTS:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def compile_module(module: nn.Module, args: TorchCompileArgs) -> nn.Module:
    """``module`` through ``torch.compile`` with ``torch_compile_args``, or as it is when disabled."""
    if args.disable:
        return module
    compiled = torch.compile(module, mode=args.mode, backend=args.backend, fullgraph=args.fullgraph,
                             dynamic=args.dynamic)
    return compiled  # type: ignore[return-value]


def build_debug_callbacks(trainer: Any) -> list[Any]:
    """The debugging tools turned on in the settings of ``trainer`` (a Trainer), as callbacks."""
    callbacks: list[Any] = []
    debug = trainer.settings.debug_args
    if debug.nancapture.enabled:
        from stabletrain.debug.nan_capture import NaNCaptureCallback

        callbacks.append(NaNCaptureCallback(debug.nancapture))
    if debug.underflow_overflow.enabled:
        from stabletrain.debug.underflow_overflow import UnderflowOverflowCallback

        callbacks.append(UnderflowOverflowCallback(debug.underflow_overflow))
    if trainer.settings.on_instability.policy != "stop":
        from stabletrain.safety.healing import Healer

        callbacks.append(Healer(trainer))
    if trainer.settings.trend_alerts.enabled:
        from stabletrain.debug.trends import TrendAlerts

        callbacks.append(TrendAlerts())
    if debug.mechanisms.enabled:
        from stabletrain.debug.mechanisms import MechanismSignals

        callbacks.append(MechanismSignals(debug.mechanisms))
        if debug.mechanisms.alerts:
            from stabletrain.debug.mechanisms.alerts import MechanismAlerts

            callbacks.append(MechanismAlerts(debug.mechanisms))
    return callbacks


def write_settings(trainer: Any) -> None:
    """settings.json, the loggers' hyperparameters, and the run's opening lines in train.log."""
    resolved = trainer.resolved_settings()
    resolved["model_meta"] = trainer.task.model_meta
    text = json.dumps(resolved, indent=2)
    atomic_write_text(text + "\n", trainer.out / "settings.json")
    for logger in trainer.loggers:
        logger.log_hyperparams(resolved)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    s, console = trainer.settings, trainer.console
    console.info(f"stabletrain {__version__} | torch {torch.__version__} | out: {trainer.out}")
    console.info(
        f"task {resolve_task_name(s)}: {trainer.task.model_name or type(trainer.model).__name__} "
        f"with {n_params:,} parameters, "
        f"{len(trainer.task.dataset):,} samples | device {trainer.fabric.device} x {trainer.world_size} | "
        f"precision {trainer.precision} | microbatch {trainer.microbatch_size} x "
        f"{s.gradient_accumulation_steps} accumulation x {trainer.world_size} devices"
    )
    for warning in [*settings_warnings(s), *trainer.task.warnings]:
        console.info(f"Warning: {warning}")
    console.log_only("resolved settings:\n" + text)
