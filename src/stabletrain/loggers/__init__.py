"""Metric loggers. ``build_loggers`` creates the configured ones (rank 0 only)."""

from __future__ import annotations

from pathlib import Path

from stabletrain.config import TrainSettings
from stabletrain.loggers.base import Logger
from stabletrain.loggers.jsonl import JsonlLogger

__all__ = ["Logger", "JsonlLogger", "build_loggers", "check_loggers"]


def check_loggers(settings: TrainSettings) -> list[str]:
    """Problems with the logger settings (e.g. a missing optional library), one line each."""
    problems = []
    for name in ("tensorboard", "mlflow", "wandb"):
        if getattr(settings.loggers, name).enabled:
            problems.append(f"loggers.{name}: not available in this version of stabletrain yet")
    return problems


def build_loggers(settings: TrainSettings, out: Path) -> list[Logger]:
    loggers: list[Logger] = []
    if settings.loggers.jsonl.enabled:
        loggers.append(JsonlLogger(out / "metrics.jsonl"))
    return loggers
