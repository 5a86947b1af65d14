"""Weights & Biases: one W&B run per training run, metrics under the same keys as metrics.jsonl.

Offline by default (``out/wandb/offline-run-*/``, uploaded later with ``wandb sync``); the resolved
settings go to the run's config and events to the summary key ``events``. See docs/loggers.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from stabletrain.loggers.base import Logger, import_optional


class WandbLogger(Logger):
    """Logs to a W&B run created with ``wandb.init``.

    Args:
        out: The run's output folder; W&B writes ``out/wandb/``.
        project: W&B project.
        name: Run name; default: the out folder's name.
        mode: ``online``, ``offline`` (no network) or ``disabled`` (nothing written).

    Example::

        logger = WandbLogger(Path("out/run"), project="stabletrain", mode="offline")
        logger.log_metrics({"gradient_norm": 1.3}, step=0)
        logger.close()
    """

    def __init__(self, out: Path, project: str = "stabletrain", name: Optional[str] = None, mode: str = "offline"):
        wandb = import_optional("wandb", "wandb")
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=name or out.resolve().name,
            mode=mode,
            dir=str(out),
            # A second stabletrain.train() in the same process (notebooks, tests) gets its own run.
            reinit="create_new",
        )
        self._events: list[dict[str, Any]] = []
        self._closed = False

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        if not self._closed:
            self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._closed:
            self.run.log(dict(metrics), step=step)

    def log_event(self, event: dict[str, Any]) -> None:
        if not self._closed:
            self._events.append(event)
            self.run.summary["events"] = list(self._events)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Called from the trainer's `finally`: an exception on its way out marks the run failed.
        self.run.finish(exit_code=0 if sys.exc_info()[1] is None else 1)
