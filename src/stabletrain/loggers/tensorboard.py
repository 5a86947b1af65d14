"""TensorBoard event files under ``out/tensorboard/``: ``tensorboard --logdir out/<run>``.

==========================  ============================================================
What                        Where in TensorBoard
==========================  ============================================================
every metric                SCALARS, tag = metric key (``gradient_norm``, ``loss``, ``lr``,
                            ``gradient_norm/<layer>`` grouped under ``gradient_norm``)
resolved settings           HPARAMS (flattened: ``model_args.lr``) and TEXT ``settings``
events (trend alerts, ...)  TEXT ``events``, at the event's step
==========================  ============================================================
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stabletrain.loggers.base import Logger, flatten_params, import_optional

#: Seconds between flushes to disk, so a live ``tensorboard`` sees recent steps.
FLUSH_SECS = 10


class TensorBoardLogger(Logger):
    """Writes scalars, hyperparameters and events with ``torch.utils.tensorboard``.

    Args:
        log_dir: Folder for the event files (the trainer uses ``out/tensorboard``).

    Example::

        logger = TensorBoardLogger("out/run/tensorboard")
        logger.log_metrics({"gradient_norm": 1.3, "loss": 2.1}, step=0)
        logger.close()
    """

    def __init__(self, log_dir: str | Path):
        tb = import_optional("torch.utils.tensorboard", "tensorboard")
        self.log_dir = Path(log_dir)
        self._writer = tb.SummaryWriter(log_dir=str(self.log_dir), flush_secs=FLUSH_SECS)
        self._closed = False

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        if self._closed:
            return
        from torch.utils.tensorboard.summary import hparams

        # In this run's own folder (SummaryWriter.add_hparams would start a second run), with
        # the two main metrics named so that the HPARAMS table shows their last values.
        for summary in hparams(flatten_params(params), {"loss": 0.0, "gradient_norm": 0.0}):
            self._writer.file_writer.add_summary(summary)
        text = json.dumps(params, indent=2, default=str)
        self._writer.add_text("settings", "```\n" + text + "\n```")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._closed:
            return
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def log_event(self, event: dict[str, Any]) -> None:
        if self._closed:
            return
        step = event.get("step")
        text = event.get("message") or json.dumps(event, default=str)
        self._writer.add_text("events", f"**{event.get('event', 'event')}**: {text}", global_step=step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()
