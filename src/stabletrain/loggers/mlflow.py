"""MLflow: one run per training run, metrics under the same keys as metrics.jsonl.

:class:`MLflowLogger` logs metrics (asynchronously), the resolved settings as params and events
as the artifact ``events.jsonl``; by default to ``sqlite:///<out>/mlflow.db`` with artifacts in
``out/mlruns/``. See docs/loggers.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from stabletrain.loggers.base import Logger, flatten_params, import_optional

#: MLflow limits: params per log_batch call, characters per param value, metrics per call.
_MAX_PARAMS_PER_CALL = 100
_MAX_PARAM_CHARS = 6000
_MAX_METRICS_PER_CALL = 1000


def default_tracking_uri(out: Path) -> str:
    return f"sqlite:///{Path(out).resolve() / 'mlflow.db'}"


class MLflowLogger(Logger):
    """Logs to an MLflow run through ``MlflowClient``.

    Args:
        out: The run's output folder (default tracking database and artifact location).
        experiment_name: Experiment, created when missing.
        run_name: Run name; default: the out folder's name.
        tracking_uri: Default ``sqlite:///<out>/mlflow.db``.
        tags: Tags set on the run (besides ``stabletrain.out``).

    Example::

        logger = MLflowLogger(Path("out/run"), experiment_name="stabletrain")
        logger.log_metrics({"gradient_norm": 1.3}, step=0)
        logger.close()
        # MlflowClient("sqlite:///out/run/mlflow.db").get_metric_history(run_id, "gradient_norm")
    """

    def __init__(
        self,
        out: Path,
        experiment_name: str = "stabletrain",
        run_name: Optional[str] = None,
        tracking_uri: Optional[str] = None,
        tags: Optional[dict[str, str]] = None,
    ):
        import_optional("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        out = Path(out)
        self.tracking_uri = tracking_uri or default_tracking_uri(out)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self._client.get_experiment_by_name(experiment_name)
        if experiment is None:
            # A local database keeps its artifacts beside it in out/, not in the working directory.
            location = (out.resolve() / "mlruns").as_uri() if tracking_uri is None else None
            experiment_id = self._client.create_experiment(experiment_name, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        run_tags = {"stabletrain.out": str(out), **(tags or {})}
        self.run = self._client.create_run(experiment_id, run_name=run_name or out.resolve().name, tags=run_tags)
        self.run_id: str = self.run.info.run_id
        self.experiment_id = experiment_id
        self._events: list[dict[str, Any]] = []
        self._pending: list[Any] = []  # RunOperations of asynchronous log_batch calls
        self._closed = False

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        if self._closed:
            return
        from mlflow.entities import Param

        flat = [Param(k, str(v)[:_MAX_PARAM_CHARS]) for k, v in flatten_params(params).items()]
        for i in range(0, len(flat), _MAX_PARAMS_PER_CALL):
            self._client.log_batch(self.run_id, params=flat[i : i + _MAX_PARAMS_PER_CALL])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._closed:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), _MAX_METRICS_PER_CALL):
            op = self._client.log_batch(self.run_id, metrics=batch[i : i + _MAX_METRICS_PER_CALL], synchronous=False)
            self._pending.append(op)
        if len(self._pending) > 64:
            # Long done by now in practice; waiting on them surfaces errors and bounds the list.
            for op in self._pending[:-8]:
                op.wait()
            del self._pending[:-8]

    def log_event(self, event: dict[str, Any]) -> None:
        if self._closed:
            return
        # Events are rare: the artifact is rewritten whole, so it is complete at any time.
        self._events.append(event)
        text = "".join(json.dumps(e, default=str) + "\n" for e in self._events)
        self._client.log_text(self.run_id, text, "events.jsonl")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Wait on our own operations: mlflow.flush_async_logging() would open the default
        # tracking store (a mlflow.db in the working directory).
        for op in self._pending:
            op.wait()
        self._pending.clear()
        # Called from the trainer's `finally`: an exception on its way out marks the run failed.
        exc = sys.exc_info()[1]
        status = "FINISHED" if exc is None else ("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        self._client.set_terminated(self.run_id, status=status)
