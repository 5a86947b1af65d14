"""Metric loggers. ``build_loggers`` creates the configured ones (rank 0 only).

Every logger receives the same metrics at the same steps (``gradient_norm``, ``loss``,
``lr``, ...) and the resolved settings as hyperparameters. TensorBoard, MLflow and W&B
are optional: each is imported only when configured, and a configured logger whose
library is missing is reported by :func:`check_loggers` before training starts, with the
pip command that installs it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from stabletrain.config import TrainSettings
from stabletrain.loggers.base import Logger
from stabletrain.loggers.jsonl import JsonlLogger

__all__ = ["Logger", "JsonlLogger", "build_loggers", "check_loggers", "OPTIONAL_LOGGERS"]

#: logger name -> (top-level module it needs, pip extra that installs it)
OPTIONAL_LOGGERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}


def library_available(module: str) -> bool:
    """True when ``module`` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_hint(name: str) -> str:
    module, extra = OPTIONAL_LOGGERS[name]
    return f'pip install "stabletrain[{extra}]" (or pip install {module})'


def _wanted(settings: TrainSettings, name: str) -> bool:
    """Whether logger ``name`` is on; tensorboard's "auto" means on when its library is installed."""
    enabled = getattr(settings.loggers, name).enabled
    if enabled == "auto":
        return library_available(OPTIONAL_LOGGERS[name][0])
    return bool(enabled)


def check_loggers(settings: TrainSettings) -> list[str]:
    """Problems with the logger settings (e.g. a missing optional library), one line each."""
    problems = []
    for name, (module, _) in OPTIONAL_LOGGERS.items():
        enabled = getattr(settings.loggers, name).enabled
        if enabled is True and not library_available(module):
            problems.append(
                f"loggers.{name}.enabled: true, but the {module} package is not installed; "
                f"run {install_hint(name)}, or set loggers.{name}.enabled=false"
            )
    return problems


def build_loggers(settings: TrainSettings, out: Path) -> list[Logger]:
    """The configured loggers, in a fixed order: jsonl, tensorboard, mlflow, wandb."""
    loggers: list[Logger] = []
    try:
        if settings.loggers.jsonl.enabled:
            loggers.append(JsonlLogger(out / "metrics.jsonl"))
        if _wanted(settings, "tensorboard"):
            from stabletrain.loggers.tensorboard import TensorBoardLogger

            loggers.append(TensorBoardLogger(out / "tensorboard"))
        if _wanted(settings, "mlflow"):
            from stabletrain.loggers.mlflow import MLflowLogger

            args = settings.loggers.mlflow
            loggers.append(
                MLflowLogger(
                    out,
                    experiment_name=args.experiment_name,
                    run_name=args.run_name,
                    tracking_uri=args.tracking_uri,
                    tags=args.tags,
                )
            )
        if _wanted(settings, "wandb"):
            from stabletrain.loggers.wandb import WandbLogger

            args = settings.loggers.wandb
            loggers.append(WandbLogger(out, project=args.project, name=args.name, mode=args.mode))
    except BaseException:
        for logger in loggers:
            logger.close()
        raise
    return loggers
