"""Settings of the metric loggers: jsonl, TensorBoard, MLflow, Weights & Biases (see docs/loggers.md)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from stabletrain.config.types import SettingsGroup


class JsonlLoggerArgs(SettingsGroup):
    enabled: bool = Field(True, description="Write out/metrics.jsonl (the report and trend alerts read it).")


class TensorBoardLoggerArgs(SettingsGroup):
    enabled: Union[bool, Literal["auto"]] = Field(
        "auto",
        description=(
            "Write TensorBoard event files to out/tensorboard/ (view: tensorboard --logdir out/<run>); "
            "auto = on when the tensorboard package is installed."
        ),
    )


class MLflowLoggerArgs(SettingsGroup):
    enabled: bool = Field(False, description="Log to MLflow (pip install \"stabletrain[mlflow]\").")
    experiment_name: str = Field("stabletrain", description="MLflow experiment; created when missing.")
    run_name: Optional[str] = Field(None, description="MLflow run name; default: the out folder's name.")
    tracking_uri: Optional[str] = Field(
        None,
        description=(
            "MLflow tracking URI; default: sqlite:///<out>/mlflow.db, a local database "
            "(view: mlflow ui --backend-store-uri sqlite:///<out>/mlflow.db)."
        ),
    )
    tags: dict[str, str] = Field(default_factory=dict, description="Tags set on the run.")


class WandbLoggerArgs(SettingsGroup):
    enabled: bool = Field(False, description="Log to Weights & Biases (pip install \"stabletrain[wandb]\").")
    project: str = Field("stabletrain", description="W&B project.")
    name: Optional[str] = Field(None, description="W&B run name; default: the out folder's name.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "offline",
        description="online syncs live; offline writes out/wandb/ without network (upload later with wandb sync).",
    )


class LoggersArgs(SettingsGroup):
    """Metric loggers (``loggers.*``). Every logger receives the same metrics at the same steps."""

    jsonl: JsonlLoggerArgs = Field(default_factory=JsonlLoggerArgs)
    tensorboard: TensorBoardLoggerArgs = Field(default_factory=TensorBoardLoggerArgs)
    mlflow: MLflowLoggerArgs = Field(default_factory=MLflowLoggerArgs)
    wandb: WandbLoggerArgs = Field(default_factory=WandbLoggerArgs)

