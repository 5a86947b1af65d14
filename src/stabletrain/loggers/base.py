"""The logger interface every metric sink implements."""

from __future__ import annotations

import json
from typing import Any

from stabletrain.utils import imports

#: logger name -> (top-level module it needs, pip extra that installs it)
OPTIONAL_LOGGERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
#: logger name -> the module its logger imports (TensorBoard's writer lives in torch).
LOGGER_IMPORTS: dict[str, str] = {
    "tensorboard": "torch.utils.tensorboard",
    "mlflow": "mlflow",
    "wandb": "wandb",
}


def install_hint(name: str) -> str:
    """The pip command that installs logger ``name``'s library."""
    module, extra = OPTIONAL_LOGGERS[name]
    return f'pip install "stabletrain[{extra}]" (or pip install {module})'


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
    fix = f"run {install_hint(logger)}, or set loggers.{logger}.enabled=false"
    return imports.import_optional(module, f"loggers.{logger}", fix)
