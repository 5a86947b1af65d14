"""The logger interface every metric sink implements."""

from __future__ import annotations

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
