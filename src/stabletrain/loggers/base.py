"""The logger interface every metric sink implements."""

from __future__ import annotations

import importlib
import json
from typing import Any


class Logger:
    """A metric sink. Only rank 0 creates loggers.

    ``log_metrics`` receives plain floats (already read from the device) at the steps set by
    ``log_every_num_steps``; every logger receives the same metrics at the same steps.
    """

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the resolved settings (nested dict of JSON-compatible values)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record one step's metrics."""

    def log_event(self, event: dict[str, Any]) -> None:
        """Record a non-metric event, e.g. a detected instability episode."""

    def close(self) -> None:
        """Flush and release resources; idempotent."""


def flatten_params(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as ``{"model_args.lr": 0.001, ...}``; lists and None become strings.

    Hyperparameter views (TensorBoard's HPARAMS tab, MLflow params) take flat scalar values.
    """
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_params(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def import_optional(module: str, logger: str) -> Any:
    """Import a logger's library, or raise ConfigError with the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        from stabletrain.errors import ConfigError
        from stabletrain.loggers import install_hint

        raise ConfigError(
            f"loggers.{logger}: cannot import {module} ({exc}); run {install_hint(logger)}, "
            f"or set loggers.{logger}.enabled=false"
        ) from None
