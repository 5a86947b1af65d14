"""All settings of ``stabletrain train``, defined once (see docs/training.md).

The Python API and the command line (dotted ``key=value``) validate against the same pydantic
models; unknown keys get a suggestion and every problem is reported at once in one
:class:`~stabletrain.errors.ConfigError`. Importing the settings does not import torch.
"""

from stabletrain.config.command_line import PYTHON_ONLY, parse_cli_overrides, settings_help
from stabletrain.config.debugging import (
    DebugArgs,
    GuardArgs,
    MechanismArgs,
    NaNCaptureArgs,
    OnInstabilityArgs,
    TrendAlertArgs,
    UnderflowOverflowArgs,
)
from stabletrain.config.loading import RESOLVED_ONLY_KEYS, load_settings, partial_settings, settings_from_resolved
from stabletrain.config.logger_args import (
    JsonlLoggerArgs,
    LoggersArgs,
    MLflowLoggerArgs,
    TensorBoardLoggerArgs,
    WandbLoggerArgs,
)
from stabletrain.config.model_data import (
    IMAGE_MODEL_ARGS,
    LANGUAGE_MODEL_ARGS,
    DataArgs,
    ModelArgs,
    NormalizeArgs,
    TorchCompileArgs,
    TransformArgs,
)
from stabletrain.config.train import TrainSettings
from stabletrain.config.types import (
    COMMON_FABRIC_NAMES,
    PRECISIONS,
    Float,
    Int,
    Precision,
    SettingsGroup,
    fabric_choices,
)

__all__ = [
    "COMMON_FABRIC_NAMES",
    "IMAGE_MODEL_ARGS",
    "LANGUAGE_MODEL_ARGS",
    "PRECISIONS",
    "PYTHON_ONLY",
    "RESOLVED_ONLY_KEYS",
    "DataArgs",
    "DebugArgs",
    "Float",
    "GuardArgs",
    "Int",
    "JsonlLoggerArgs",
    "LoggersArgs",
    "MechanismArgs",
    "MLflowLoggerArgs",
    "ModelArgs",
    "NaNCaptureArgs",
    "NormalizeArgs",
    "OnInstabilityArgs",
    "Precision",
    "SettingsGroup",
    "TensorBoardLoggerArgs",
    "TorchCompileArgs",
    "TrainSettings",
    "TransformArgs",
    "TrendAlertArgs",
    "UnderflowOverflowArgs",
    "WandbLoggerArgs",
    "fabric_choices",
    "load_settings",
    "parse_cli_overrides",
    "partial_settings",
    "settings_from_resolved",
    "settings_help",
]
