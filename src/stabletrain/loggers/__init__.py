"""Metric loggers. ``build_loggers`` creates the configured ones (rank 0 only).

Every logger receives the same metrics at the same steps (``gradient_norm``, ``loss``,
``lr``, ...) and the resolved settings as hyperparameters. TensorBoard, MLflow and W&B
are optional: each is imported only when configured, and a configured logger whose
library is missing, or installed but failing to import, is reported by :func:`check_loggers`
before training starts, with the pip command that installs it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from stabletrain.config import TrainSettings
from stabletrain.loggers.base import LOGGER_IMPORTS, OPTIONAL_LOGGERS, Logger, install_hint
from stabletrain.loggers.jsonl import JsonlLogger
from stabletrain.utils.imports import is_importable

__all__ = ["Logger", "JsonlLogger", "build_loggers", "check_loggers", "OPTIONAL_LOGGERS", "install_hint"]


def _wanted(settings: TrainSettings, name: str) -> bool:
    """Whether logger ``name`` is on; tensorboard's "auto" means on when its library is installed."""
    enabled = getattr(settings.loggers, name).enabled
    if enabled == "auto":
        return is_importable(OPTIONAL_LOGGERS[name][0])
    return bool(enabled)


def check_loggers(settings: TrainSettings, try_import: bool = True) -> list[str]:
    """Problems with the logger settings, one line each: a configured library that is not
    installed, or (``try_import``) one that is installed but fails to import.

    Args:
        settings: The training settings.
        try_import: Import the library of every logger that will be on, so that a broken
            install is reported now rather than after ``out/`` is written. Only the rank that
            builds the loggers (rank 0) needs it.
    """
    problems = []
    for name, (module, _) in OPTIONAL_LOGGERS.items():
        enabled = getattr(settings.loggers, name).enabled
        if enabled is True and not is_importable(module):
            problems.append(
                f"loggers.{name}.enabled: true, but the {module} package is not installed; "
                f"run {install_hint(name)}, or set loggers.{name}.enabled=false"
            )
        elif try_import and _wanted(settings, name):
            problem = _import_problem(name, enabled)
            if problem:
                problems.append(problem)
    return problems


def _import_problem(name: str, enabled: object) -> str:
    module = LOGGER_IMPORTS[name]
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install fails in many ways (ImportError, protobuf TypeError, ...)
        value = "auto" if enabled == "auto" else "true"
        found = f", and the {OPTIONAL_LOGGERS[name][0]} package is installed" if enabled == "auto" else ""
        return (
            f"loggers.{name}.enabled: {value}{found}, but {module} fails to import "
            f"({type(exc).__name__}: {exc}); reinstall it: {install_hint(name)}, "
            f"or set loggers.{name}.enabled=false"
        )
    return ""


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

            wandb_args = settings.loggers.wandb
            loggers.append(WandbLogger(out, project=wandb_args.project, name=wandb_args.name, mode=wandb_args.mode))
    except BaseException:
        for logger in loggers:
            logger.close()
        raise
    return loggers
